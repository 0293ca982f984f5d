"""The learner: its batch source (the prefetch thread used with GPU learners, tested on CPU), device
placement, and what a resumed run's learner restores."""
import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch

from spreeze.learner import BatchPrefetcher
from spreeze.replay import SharedReplay

CTX = mp.get_context("spawn")


@pytest.fixture
def filled_replay():
    replay = SharedReplay.create(3, 1, capacity=400, n_regions=4, mp_context=CTX)
    for region in range(4):
        codes = np.arange(50, dtype=np.float32) + 1000 * region
        replay.write(region, np.repeat(codes[:, None], 3, 1), np.zeros((50, 1), np.float32), codes,
                     np.repeat(codes[:, None], 3, 1), np.zeros(50, np.float32))
    yield replay
    replay.close()


def test_prefetched_batches_are_whole_rows_of_the_replay(filled_replay):
    prefetcher = BatchPrefetcher(filled_replay, 128, np.random.default_rng(0))
    try:
        seen = set()
        for _ in range(20):
            batch = prefetcher.next()
            assert batch.obs.shape == (128, 3) and np.all(np.isfinite(batch.obs))
            assert np.all(batch.obs == batch.rewards[:, None])
            seen.update(batch.rewards.tolist())
        assert len(seen) == 200  # every stored transition turns up
    finally:
        prefetcher.close()
    assert not any(t.name == "spreeze-prefetch" for t in threading.enumerate())


def test_a_failure_in_the_prefetch_thread_reaches_the_learner():
    class Broken:
        def sample(self, batch_size, rng):
            raise ValueError("cannot sample from an empty replay")

    prefetcher = BatchPrefetcher(Broken(), 8, np.random.default_rng(0))
    try:
        with pytest.raises(ValueError, match="empty replay"):
            prefetcher.next(timeout=5)
    finally:
        prefetcher.close()


# ----- device placement ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus, actor, critic, expected", [
    (0, "auto", "auto", ("cpu", "cpu")),
    (1, "auto", "auto", ("cuda:0", "cuda:0")),      # one GPU: both there
    (2, "auto", "auto", ("cuda:0", "cuda:1")),      # Spreeze 3.1: actor on the first, critics on the second
    (4, "auto", "auto", ("cuda:0", "cuda:1")),
    (2, "auto", "cpu", ("cuda:0", "cpu")),          # a device given by hand wins
    (1, "cpu", "auto", ("cpu", "cpu")),             # auto critics follow the actor without a second GPU
    (2, "cuda:1", "cuda:0", ("cuda:1", "cuda:0")),
])
def test_auto_device_placement(monkeypatch, gpus, actor, critic, expected):
    from spreeze.config import Config
    from spreeze.learner import resolve_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_devices(Config(actor_device=actor, critic_device=critic)) == expected


@pytest.mark.parametrize("gpus, actor, critic, bad", [
    (0, "cuda:0", "auto", "cuda:0"),
    (0, "cuda", "cpu", "cuda"),
    (1, "auto", "cuda:1", "cuda:1"),
    (2, "cuda:2", "cpu", "cuda:2"),
])
def test_a_cuda_device_the_machine_lacks_is_refused(monkeypatch, gpus, actor, critic, bad):
    from spreeze.config import Config
    from spreeze.learner import resolve_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ValueError, match=f"device {bad} requested but this machine has {gpus} CUDA GPU"):
        resolve_devices(Config(actor_device=actor, critic_device=critic))


@pytest.mark.skipif(torch.cuda.device_count() > 9, reason="the machine has a cuda:9")
@pytest.mark.parametrize("given", [[], ["--samplers", "1", "--batch-size", "64"]], ids=["profiled", "all-given"])
def test_run_py_with_a_missing_cuda_device_exits_2_in_one_line(tmp_path, given):
    """Whether or not the profile runs (it does not when samplers and batch size are given), a bad device is
    a bad value: one line, exit code 2, nothing written, nothing started."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--env", "Pendulum-v1", "--actor-device", "cuda:9",
                           "--total-steps", "1000", "--run-dir", str(run_dir), *given], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPREEZE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "run.py: error: device cuda:9 requested but this machine has "
        f"{torch.cuda.device_count()} CUDA GPU(s)"]
    assert not (run_dir.exists() and any(run_dir.iterdir())), "files written for a run that cannot start"


# ----- resume ----------------------------------------------------------------------------------------------
def assert_same_state(restored, saved, where="algo") -> None:
    """Equal nested state: tensors bit for bit, numbers and strings equal, the same keys."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(restored, torch.Tensor) and torch.equal(restored.cpu(), saved.cpu()), where
    elif isinstance(saved, dict):
        assert set(restored) == set(saved), f"{where}: keys {sorted(map(str, restored))} != {sorted(map(str, saved))}"
        for key in saved:
            assert_same_state(restored[key], saved[key], f"{where}.{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(restored) == len(saved), where
        for i, (a, b) in enumerate(zip(restored, saved)):
            assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert restored == saved, f"{where}: {restored!r} != {saved!r}"


def test_resume_restores_weights_optimizers_and_temperature(tmp_path):
    """A short run, then the learner of its resumed run: actor, critics, targets, all three optimizers (Adam's
    moments and step counts) and SAC's entropy temperature are the checkpoint's, not a fresh start; a resumed
    run then continues the optimizers' step counts."""
    import math
    import time

    from spreeze.algos import make_actor
    from spreeze.checkpoint import resume_config
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.learner import Learner
    from spreeze.stats import SharedStats
    from launch.compose import train
    from spreeze.weights import SharedWeights

    info = check_env("Pendulum-v1")
    run_dir = tmp_path / "run"
    first = Config(env_id="Pendulum-v1", algo="sac", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=2,
                   total_steps=1000, minutes=2.0, learning_starts=300, batch_size=64, hidden_size=32,
                   collect_per_update=2.0, actor_device="cpu", critic_device="cpu", eval_interval_s=60.0,
                   window=False, run_dir=str(run_dir))
    lines = []
    assert train(first, info, log=lines.append).exit_code == 0, lines
    assert "[spreeze] reached --total-steps 1000" in lines, lines  # not the --minutes cap
    checkpoint = run_dir / "checkpoints" / "latest.pt"
    saved = torch.load(checkpoint, weights_only=True)["algo"]
    # it trained: the saved state is far from what a fresh learner starts with
    assert saved["updates"] >= 300 and saved["actor_updates"] == saved["updates"]
    assert abs(float(saved["log_alpha"]) - math.log(first.initial_alpha)) > 0.05
    for name in ("actor_optimizer", "critic_optimizer", "alpha_optimizer"):
        assert saved[name]["state"], f"{name} has no moments to restore"

    config = resume_config(Config(resume=str(run_dir), total_steps=1600), {"resume", "total_steps"})
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 1000, 1, CTX)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(1)
    learners = []
    try:
        for cfg in (config, first):  # the resumed run's learner, and a fresh one of the same settings
            learners.append(Learner(cfg, info, replay, weights, stats, tmp_path / "unused", time.time(),
                                    prefetch=False))
        resumed, fresh = (learner.algo.state_dict() for learner in learners)
        assert_same_state(resumed, saved)
        assert not torch.equal(fresh["log_alpha"], saved["log_alpha"])  # so the comparison above means something
        assert not fresh["critic_optimizer"]["state"]
        assert learners[0].policy_version > 0
    finally:
        for learner in learners:
            learner.close()
        del learners
        for shared in (replay, weights, stats):
            shared.close()

    lines = []
    assert train(config, info, log=lines.append).exit_code == 0, lines
    assert "[spreeze] reached --total-steps 1600" in lines, lines
    after = torch.load(checkpoint, weights_only=True)["algo"]
    assert after["updates"] > saved["updates"]
    # Adam counted every update of the whole run, not only those since the resume
    critic_steps = [float(s["step"]) for s in after["critic_optimizer"]["state"].values()]
    actor_steps = [float(s["step"]) for s in after["actor_optimizer"]["state"].values()]
    assert critic_steps and all(step == after["updates"] for step in critic_steps)
    assert actor_steps and all(step == after["actor_updates"] for step in actor_steps)


def test_free_running_lr_schedule_follows_the_budget_used(filled_replay, tmp_path):
    """--lr-schedule linear in the free-running learner: its first update runs at the rate for the env steps
    counted so far, or the wall-clock share of --minutes when that is further on."""
    import time

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import EnvInfo
    from spreeze.learner import Learner
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    info = EnvInfo("Pendulum-v1", obs_dim=3, act_dim=1, action_low=(-1.0,), action_high=(1.0,),
                   max_episode_steps=200)
    config = Config(env_id="Pendulum-v1", lr_schedule="linear", total_steps=1000, minutes=10.0, batch_size=32,
                    hidden_size=16, learning_starts=100, actor_device="cpu", critic_device="cpu",
                    noise_scale_interval=0)
    weights = SharedWeights.create(make_actor(config, 3, 1), CTX)
    stats = SharedStats.create(1)
    try:
        stats.env_steps[0] = 250
        learner = Learner(config, info, filled_replay, weights, stats, tmp_path, time.time(), prefetch=False)
        learner.step()
        assert learner.algo.critic_optimizer.param_groups[0]["lr"] == pytest.approx(7.3e-4 * 0.75, rel=1e-3)
        learner.started_at = time.time() - 6 * 60.0  # 60 % of --minutes: further on than 25 % of the steps
        for _ in range(64):
            learner.step()
        assert 7.3e-4 * 0.35 < learner.algo.actor_optimizer.param_groups[0]["lr"] <= 7.3e-4 * 0.4  # the clock ran on
        learner.close()
        # as a resume brings them back: updates between two schedule steps, the optimizers at a saved rate
        resumed = Learner(config, info, filled_replay, weights, stats, tmp_path, time.time(), prefetch=False)
        resumed.algo.updates = 1001
        for group in resumed.algo.critic_optimizer.param_groups:
            group["lr"] = 1.0
        resumed.step()  # its first update already runs at the schedule's rate, not the saved one
        assert resumed.algo.critic_optimizer.param_groups[0]["lr"] == pytest.approx(7.3e-4 * 0.75, rel=1e-3)
        resumed.close()
    finally:
        weights.close()
        stats.close()


def test_a_learner_that_fails_keeps_its_training_in_a_checkpoint_and_drops_an_earlier_final_actor(filled_replay,
                                                                                                    tmp_path):
    """A lock or a prefetch that timed out ended the learner without a checkpoint (up to --checkpoint-interval-s of
    training lost, though the weights were fine), and an earlier session's final/actor.pt stayed to pass for this
    one's. The error still ends the learner (a fatal child)."""
    import os
    import time
    import types

    from spreeze import learner as learner_mod
    from spreeze.algos import make_actor
    from spreeze.checkpoint import FINAL_ACTOR_NAME, FINAL_DIR
    from spreeze.config import Config
    from spreeze.envs import EnvInfo
    from spreeze.replay import LockTimeout
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    info = EnvInfo("Pendulum-v1", obs_dim=3, act_dim=1, action_low=(-1.0,), action_high=(1.0,),
                   max_episode_steps=200)
    config = Config(env_id="Pendulum-v1", batch_size=32, hidden_size=16, learning_starts=100, collect_per_update=0,
                    actor_device="cpu", critic_device="cpu", noise_scale_interval=0)
    weights = SharedWeights.create(make_actor(config, 3, 1), CTX)
    stats = SharedStats.create(1)
    final = tmp_path / FINAL_DIR / FINAL_ACTOR_NAME
    final.parent.mkdir(parents=True)
    final.write_bytes(b"an earlier session's")
    os.utime(final, (time.time() - 60, time.time() - 60))
    said = []
    try:
        learner = learner_mod.Learner(config, info, filled_replay, weights, stats, tmp_path, time.time(),
                                      prefetch=False)
        step = learner.step

        def failing_step():
            if learner.algo.updates >= 7:
                raise LockTimeout("region 2 stayed locked for 5 s")
            step()

        learner.step = failing_step
        child = types.SimpleNamespace(should_stop=lambda: False, role=types.SimpleNamespace(heartbeat=0),
                                      messages=types.SimpleNamespace(put=lambda m, timeout=None: said.append(m)))
        with pytest.raises(LockTimeout):
            learner_mod.loop(learner, child)
        saved = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=True)
        assert saved["counters"]["updates"] == 7 and not final.exists()
        assert any("up to update 7 is in the checkpoint" in getattr(m, "text", "") for m in said)
        learner.close()
    finally:
        weights.close()
        stats.close()


def test_a_prefetcher_stuck_in_a_read_says_so_when_closed():
    """A batch change closes the prefetcher and starts another: one still inside a replay read must not get a
    second reader beside it (the GPU mirror's staging buffers serve one thread at a time)."""
    release = threading.Event()

    class Stuck:
        def sample(self, n, rng):
            release.wait(30)
            raise RuntimeError("released")

    prefetcher = BatchPrefetcher(Stuck(), 8, np.random.default_rng(0))
    try:
        assert prefetcher.close(timeout=0.2) is False
    finally:
        release.set()
    assert prefetcher.close(timeout=10) is True


def test_learner_with_overlap_updates_and_stops_its_actor_thread(filled_replay, tmp_path):
    """--learner-overlap in the learner's own loop: updates run (the actor's in its thread) and close() ends it."""
    import threading
    import time

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import EnvInfo
    from spreeze.learner import Learner
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    def actor_threads():
        return [t for t in threading.enumerate() if t.name.startswith("spreeze-actor-update")]

    info = EnvInfo("Pendulum-v1", obs_dim=3, act_dim=1, action_low=(-1.0,), action_high=(1.0,),
                   max_episode_steps=200)
    config = Config(env_id="Pendulum-v1", learner_overlap=True, batch_size=32, hidden_size=16, learning_starts=100,
                    actor_device="cpu", critic_device="cpu", noise_scale_interval=0)
    weights = SharedWeights.create(make_actor(config, 3, 1), CTX)
    stats = SharedStats.create(1)
    try:
        learner = Learner(config, info, filled_replay, weights, stats, tmp_path, time.time(), prefetch=False)
        before = [p.detach().clone() for p in learner.algo.actor.parameters()]
        for _ in range(5):
            learner.step()
        assert learner.algo.updates == learner.algo.actor_updates == 5 and len(actor_threads()) == 1
        assert any(not torch.equal(b, p) for b, p in zip(before, learner.algo.actor.parameters()))
        learner.close()
        assert not actor_threads()
    finally:
        weights.close()
        stats.close()


def test_learner_threads_left_by_the_samplers_are_halved_with_overlap(monkeypatch):
    """Without --learner-threads the learner takes the cores the samplers leave; with --learner-overlap its two
    threads each run that many torch threads, so each gets half."""
    from spreeze import defaults
    from spreeze.config import Config

    monkeypatch.setattr(defaults, "usable_cores", lambda: 8)
    assert defaults.learner_threads(Config(samplers=4)) == 4
    assert defaults.learner_threads(Config(samplers=4, learner_overlap=True)) == 2
    assert defaults.learner_threads(Config(samplers=7, learner_overlap=True)) == 1
    assert defaults.learner_threads(Config(samplers=4, learner_overlap=True, learner_threads=3)) == 3  # by hand


def test_a_mean_q_near_an_end_of_the_c51_support_is_warned_about_once(filled_replay, tmp_path):
    """Returns beyond the support are clipped: the learner says so (once a run) when the critics' mean Q of the
    actor's actions nears an end, and stays quiet while it is well inside."""
    import time

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import EnvInfo
    from spreeze.learner import Learner
    from spreeze.messages import Warn
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    class Heard:
        def __init__(self):
            self.said = []

        def put(self, message, timeout=None):
            self.said.append(message)

    info = EnvInfo("Pendulum-v1", obs_dim=3, act_dim=1, action_low=(-1.0,), action_high=(1.0,),
                   max_episode_steps=200)
    config = Config(env_id="Pendulum-v1", critic_atoms=11, q_range="-10,30", batch_size=32, hidden_size=16,
                    learning_starts=100, actor_device="cpu", critic_device="cpu", noise_scale_interval=0)
    weights = SharedWeights.create(make_actor(config, 3, 1), CTX)
    stats = SharedStats.create(1)
    heard = Heard()
    try:
        learner = Learner(config, info, filled_replay, weights, stats, tmp_path, time.time(), prefetch=False,
                          messages=heard)
        warnings = lambda: [m.text for m in heard.said if isinstance(m, Warn)]
        for q_value in (10.0, 24.0, 0.0):  # centre 10, half-width 20: inside three quarters of it
            learner.last_losses["q_value"] = torch.tensor(q_value)
            learner.publish()
        assert warnings() == []
        learner.last_losses["q_value"] = torch.tensor(26.0)
        learner.publish()
        learner.last_losses["q_value"] = torch.tensor(-8.0)
        learner.publish()
        assert len(warnings()) == 1 and "C51 support [-10, 30]" in warnings()[0]
        # lock-step rounds publish what train_until returns: the last update's mean Q is among it
        means = learner.train_until(2, lambda n, rng: filled_replay.sample(n, rng))
        assert -10.0 <= means["q_value"] <= 30.0
        # and count the rows they sample, as step() does: the frame rate and a resume's collect:update read them
        rows = learner.rows
        learner.train_until(5, lambda n, rng: filled_replay.sample(n, rng))
        assert learner.rows - rows == 3 * 32 and stats.snapshot()["sampled_rows"] == learner.rows > 0
        learner.close()
    finally:
        weights.close()
        stats.close()
