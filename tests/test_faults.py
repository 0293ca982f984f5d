"""Faults, kills and bad input: real runs in subprocesses, real signals, then checks for orphans,
/dev/shm leftovers, checkpoint integrity and resumed counters."""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from spreeze.shm import live_segments

from conftest import (PENDULUM_FAST, exit_and_stderr, proc_tree, read_csv, signal_group_and_check_clean_exit,
                      spreeze_children, start)

SMALL = [*PENDULUM_FAST, "--no-window", "--checkpoint-interval-s", "2", "--log-interval-s", "0.5"]  # rows to poll


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def updates_so_far(run_dir: Path) -> int:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return 0
    rows = read_csv(path)
    return int(rows[-1]["updates"]) if rows else 0


@pytest.mark.slow
def test_killed_sampler_is_restarted_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--samplers", "2", "--minutes", "5", "--total-steps", "5000", "--run-dir", str(run_dir)],
                 tmp_path)
    wait_for(lambda: updates_so_far(run_dir) > 100, 90, "training to start")
    victim = spreeze_children(proc.pid)["spreeze-sampler-1"]
    victim.kill()
    events_path = run_dir / "events.log"
    # the deadline is a hang guard; how fast the restart is, benchmarks.faults measures
    wait_for(lambda: events_path.exists() and "restarted" in events_path.read_text(), 60, "the restart event")
    replacement = wait_for(lambda: (p := spreeze_children(proc.pid).get("spreeze-sampler-1")) and p.pid != victim.pid and p,
                           30, "a new sampler-1 running")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    events = (run_dir / "events.log").read_text()
    assert "spreeze-sampler-1 was killed by SIGKILL; restarted" in events
    assert int(read_csv(run_dir / "metrics.csv")[-1]["env_steps"]) >= 5000
    assert not replacement.is_running() and live_segments(proc.pid) == []


@pytest.mark.slow
def test_sampler_whose_env_keeps_failing_is_stopped_and_the_others_go_on(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "--env", "tests.faulty_envs:CrashInSampler0Pendulum-v0", "--samplers", "2", "--total-steps", "2500",
            "--run-dir", str(run_dir)]
    proc = start(args, tmp_path)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    events = (run_dir / "events.log").read_text()
    assert "spreeze-sampler-0" in events and "failed 5 times in a row" in events and "not restarting" in events
    metrics = read_csv(run_dir / "metrics.csv")
    assert int(metrics[-1]["env_steps"]) >= 2500 and int(metrics[-1]["dropped_episodes"]) >= 5


def all_finite(state) -> bool:
    """Every tensor in a (nested) state dict is finite."""
    if isinstance(state, torch.Tensor):
        return bool(torch.isfinite(state).all()) if state.is_floating_point() else True
    if isinstance(state, dict):
        return all(all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(v) for v in state)
    return True


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_with_a_clear_message(tmp_path):
    """The env pays 1e30 rewards only after 750 good steps per env: training and checkpoints happen first,
    then the critic loss overflows. The run must stop with exit 1, say why, and keep the last good checkpoint."""
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--env", "tests.faulty_envs:LateHugeRewardPendulum-v0", "--samplers", "1",
                  "--envs-per-sampler", "4", "--checkpoint-interval-s", "1", "--total-steps", "20000", "--minutes", "3",
                  "--run-dir", str(run_dir)], tmp_path)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, out
    assert "non-finite" in out and "Traceback" not in out, out
    assert "reached --" not in out, out  # stopped by the bad loss, not by a budget
    failed_at = [line for line in out.splitlines() if "NonFiniteLoss" in line and "after update" in line]
    assert failed_at, out
    bad_update = int(failed_at[0].split("after update")[1].split(":")[0].split(";")[0])
    checkpoint = run_dir / "checkpoints" / "latest.pt"
    assert checkpoint.exists(), "no good checkpoint was written before the loss went bad"
    saved = torch.load(checkpoint, weights_only=True)  # loadable without unpickling code
    assert 0 < saved["counters"]["updates"] <= bad_update
    assert all_finite(saved["algo"]), "a non-finite checkpoint replaced the last good one"
    final = run_dir / "final" / "actor.pt"
    if final.exists():  # a final actor, if one is written on this path, must be a good one too
        assert all_finite(torch.load(final, weights_only=True)["actor"])
    # the samplers and the evaluator only ever acted with published weights: a NaN actor would have made
    # NaN test returns (Pendulum turns a NaN torque into NaN observations and rewards)
    evaluations = read_csv(run_dir / "evaluations.csv")
    assert evaluations and all(np.isfinite(float(e["test_return"])) for e in evaluations)
    assert live_segments(proc.pid) == []


def test_non_finite_update_is_never_published_nor_checkpointed(tmp_path):
    """The learner itself: good updates are published and checkpointed; after the replay fills with 1e30
    rewards the update overflows, and neither the shared weights nor the checkpoint on disk change."""
    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.learner import Learner, NonFiniteLoss
    from spreeze.replay import SharedReplay
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    ctx = mp.get_context("spawn")
    config = Config(env_id="Pendulum-v1", batch_size=32, hidden_size=16, learning_starts=0, collect_per_update=0,
                    publish_interval_s=1e-9)  # publish after every update
    info = check_env("Pendulum-v1")
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 256, 1, ctx)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), ctx)
    stats = SharedStats.create(1)
    learner = Learner(config, info, replay, weights, stats, tmp_path, time.time(), prefetch=False)
    rng = np.random.default_rng(0)

    def fill(reward: float) -> None:
        n = 256
        obs = rng.uniform(-1, 1, (n, info.obs_dim)).astype(np.float32)
        replay.write(0, obs, rng.uniform(-1, 1, (n, info.act_dim)).astype(np.float32), np.full(n, reward, np.float32),
                     obs, np.zeros(n, np.float32))

    try:
        fill(-1.0)
        for _ in range(20):
            learner.step()
        learner.checkpoint()
        good_flat, good_version = weights.read()
        assert good_version == 20 and np.all(np.isfinite(good_flat))
        good_checkpoint = (tmp_path / "checkpoints" / "latest.pt").read_bytes()

        fill(1e30)  # the whole ring: every batch from now on overflows the critic loss
        with pytest.raises(NonFiniteLoss):
            for _ in range(3):
                learner.step()
        assert not (all(np.isfinite(float(v)) for v in learner.last_losses.values())
                    and learner.algo.parameters_finite()), "the update did not go bad: the test proves nothing"
        flat, version = weights.read()
        assert version == good_version and np.array_equal(flat, good_flat), "bad weights were published"
        # the overflowing update leaves the weights finite (Adam's step is 0 when its second moment is inf) but
        # the critic optimizer's state inf: a checkpoint now would carry that into every resume
        try:
            learner.checkpoint()
        except NonFiniteLoss:
            pass
        else:
            finite = {k: all_finite(v) for k, v in learner.algo.state_dict().items()}
            raise AssertionError(f"Learner.checkpoint() wrote a checkpoint after a non-finite update: {finite}")
        assert (tmp_path / "checkpoints" / "latest.pt").read_bytes() == good_checkpoint
        saved = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=True)
        assert all_finite(saved["algo"]) and saved["counters"]["updates"] == 20
    finally:
        learner.close()
        del learner
        for shared in (replay, weights, stats):
            shared.close()


@pytest.mark.slow
def test_main_killed_children_exit_and_resume_continues_the_run(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "latest.pt"
    # no periodic checkpoint during the test: the one found after the kill is the learner's, written after
    # its parent died
    proc = start([*SMALL, "--checkpoint-interval-s", "600", "--samplers", "2", "--minutes", "5", "--total-steps", "0",
                  "--run-dir", str(run_dir)], tmp_path)
    wait_for(lambda: updates_so_far(run_dir) > 300, 120, "training to start")
    assert not checkpoint.exists()
    updates_seen = updates_so_far(run_dir)
    named = spreeze_children(proc.pid)
    children = list(named.values())
    assert len(children) >= 4
    # the learner holds the directory for itself too: it outlives its killed supervisor by its final checkpoint
    from spreeze.files import LEARNER_LOCK_NAME

    assert (run_dir / LEARNER_LOCK_NAME).read_text().strip() == str(named["spreeze-learner"].pid)
    everyone = proc_tree(proc.pid)  # the resource tracker too
    killed_at = time.time()
    proc.kill()
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(everyone, timeout=30)  # a hang guard: benchmarks.faults measures the speed
    assert not alive, f"orphans: {alive}"
    assert checkpoint.exists(), "the learner wrote no checkpoint after its parent died"
    assert checkpoint.stat().st_mtime >= killed_at
    before = torch.load(checkpoint, weights_only=True)["counters"]
    assert before["updates"] >= updates_seen
    evaluations_before = len(read_csv(run_dir / "evaluations.csv"))

    resumed = start(["--resume", str(run_dir), "--total-steps", str(before["env_steps"] + 1500), "--minutes", "0",
                     "--no-window"], tmp_path)
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out
    assert live_segments(proc.pid) == []  # unlinked by the dead run's resource tracker or by this launch
    after = torch.load(checkpoint, weights_only=True)["counters"]
    assert after["updates"] > before["updates"] and after["env_steps"] >= before["env_steps"] + 1500
    assert after["policy_version"] > before["policy_version"] and after["time_s"] > before["time_s"]
    evaluations = read_csv(run_dir / "evaluations.csv")
    assert len(evaluations) > evaluations_before
    resumed_rows = evaluations[evaluations_before:]
    assert all(int(e["env_steps"]) >= before["env_steps"] for e in resumed_rows)
    assert float(resumed_rows[0]["time_s"]) >= before["time_s"]


def test_a_segment_whose_fill_is_interrupted_is_unlinked_at_once(monkeypatch):
    """A Ctrl-C while a new (large) replay segment is being filled comes before anyone owns it: it must not stay in
    /dev/shm until the resource tracker's exit-time warning."""
    from spreeze.shm import ArraySpec, SharedArrays

    class Interrupted:  # stands in for an array whose fill the Ctrl-C lands in
        def fill(self, value):
            raise KeyboardInterrupt

    original_init = SharedArrays.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.arrays = {name: Interrupted() for name in self.arrays}

    before = set(live_segments(os.getpid()))
    monkeypatch.setattr(SharedArrays, "__init__", init)
    with pytest.raises(KeyboardInterrupt):
        SharedArrays.create((ArraySpec("x", (1024,), "float32", fill=float("nan")),), tag="fill")
    assert set(live_segments(os.getpid())) == before


def test_a_segment_that_finds_dev_shm_full_is_an_error_that_says_so(monkeypatch):
    """Two launches filling their replays at once in a container's small /dev/shm both passed the free-space check;
    the later one died of SIGBUS in the fill (exit 135, no word). The pages are reserved first: a full tmpfs is
    an error naming --shm-size, and the segment is gone."""
    import errno

    from spreeze.shm import ArraySpec, SharedArrays, SharedMemoryFull

    reserved = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, size: reserved.append(size) or real(fd, offset, size))
    made = SharedArrays.create((ArraySpec("x", (1024,), "float32", fill=1.0),), tag="room")
    try:
        assert reserved == [4096] and made["x"].sum() == 1024  # a segment with room is reserved, then filled
    finally:
        made.close()

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(live_segments(os.getpid()))
    with pytest.raises(SharedMemoryFull, match="--shm-size"):
        SharedArrays.create((ArraySpec("x", (1024,), "float32", fill=0.0),), tag="full")
    assert set(live_segments(os.getpid())) == before


def test_stale_segments_of_dead_owners_are_removed_and_live_ones_kept():
    """What a launch does about a SIGKILLed run's leftovers (there the resource tracker usually got to them
    first, so the end-to-end test above rarely exercises it): real /dev/shm segments named after a dead owner
    go, and so do those named after a pid that a later process has taken (its start differs); those of a
    live owner (not this process) stay, named with or without its start."""
    from multiprocessing import resource_tracker, shared_memory

    from spreeze.shm import PREFIX, ArraySpec, SharedArrays, pid_namespace, remove_stale_segments, start_ticks

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    assert not psutil.pid_exists(dead.pid)
    live = os.getppid()
    ours = SharedArrays.create((ArraySpec("x", (1,), "int64"),), tag="own")
    space = pid_namespace()
    assert ours.handle.segment_name.startswith(f"{PREFIX}{os.getpid()}_t{start_ticks(os.getpid())}_ns{space}_own")
    names = {"dead": f"{PREFIX}{dead.pid}_", "reused": f"{PREFIX}{live}_t{start_ticks(live) - 1}_",
             "dead here": f"{PREFIX}{dead.pid}_t1_ns{space}_",
             "live": f"{PREFIX}{live}_", "live with start": f"{PREFIX}{live}_t{start_ticks(live)}_",
             # a pid of another PID namespace (a container sharing /dev/shm) says nothing here: kept
             "other namespace": f"{PREFIX}{dead.pid}_t1_ns{space + 1}_"}
    made = {}
    try:
        for tag, prefix in names.items():
            name = f"{prefix}test{tag.replace(' ', '')}{os.getpid()}"
            shm = shared_memory.SharedMemory(name=name, create=True, size=4096)
            resource_tracker.unregister(shm._name, "shared_memory")  # this process must not unlink it at exit
            shm.buf[:4] = b"data"
            shm.close()
            made[tag] = name
        assert set(made.values()) <= set(os.listdir("/dev/shm"))
        removed = remove_stale_segments()
        for tag in ("dead", "reused", "dead here"):
            assert made[tag] in removed and made[tag] not in os.listdir("/dev/shm"), tag
        for tag in ("live", "live with start", "other namespace"):
            assert made[tag] not in removed and made[tag] in os.listdir("/dev/shm"), tag
        assert ours.handle.segment_name not in removed
        assert made["live"] in live_segments(live) and made["dead"] not in live_segments(dead.pid)
        kept = shared_memory.SharedMemory(name=made["live"])  # still a usable segment
        resource_tracker.unregister(kept._name, "shared_memory")
        assert bytes(kept.buf[:4]) == b"data"
        kept.close()
    finally:
        ours.close()
        for name in made.values():
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_stops_cleanly(tmp_path, signame):
    """`kill -TERM -<pgid>` (a service manager stopping the group), or the SIGHUP of a closed terminal or a dropped
    ssh session, reaches every process, children included: the run stops as on Ctrl-C. A SIGHUP killed them all
    at once (no final checkpoint, no summary, the segments left to the next launch)."""
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--samplers", "1", "--minutes", "5", "--total-steps", "0", "--run-dir", str(run_dir)], tmp_path)
    wait_for(lambda: updates_so_far(run_dir) > 0, 90, "training to start")
    assert {"spreeze-sampler-0", "spreeze-learner", "spreeze-evaluator"} <= set(spreeze_children(proc.pid))
    out = signal_group_and_check_clean_exit(proc, getattr(signal, signame))
    final = run_dir / "final" / "actor.pt"
    # children get the signal too; the learner must still write its final checkpoint and actor
    assert final.exists(), f"no final actor after {signame} to the whole process group:\n{out}"
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"].startswith("interrupted")
    assert all(torch.isfinite(t).all() for t in torch.load(final, weights_only=True)["actor"].values())
    checkpoint = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert checkpoint["counters"]["updates"] > 0


@pytest.mark.slow
def test_a_nohup_run_outlives_its_terminal_s_sighup(tmp_path):
    """`nohup python run.py ... &` ignores SIGHUP so that the run outlives the terminal: the run (and its children,
    which inherit the disposition) must keep it ignored, not take it as a stop as from a terminal it runs in."""
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--samplers", "1", "--minutes", "5", "--total-steps", "0", "--run-dir", str(run_dir)], tmp_path,
                 hangup="ignore")
    wait_for(lambda: updates_so_far(run_dir) > 0, 90, "training to start")
    children = spreeze_children(proc.pid)
    os.killpg(proc.pid, signal.SIGHUP)
    time.sleep(2.0)
    assert proc.poll() is None and all(p.is_running() for p in children.values())
    signal_group_and_check_clean_exit(proc, signal.SIGTERM)
    assert (run_dir / "final" / "actor.pt").exists()


@pytest.mark.slow
def test_killed_evaluator_is_restarted_up_to_the_cap_then_left_stopped(tmp_path):
    """--max-restarts-per-minute 2: two SIGKILLed evaluators are replaced, the third is not; training goes on."""
    run_dir = tmp_path / "run"
    events = run_dir / "events.log"
    proc = start([*SMALL, "--samplers", "1", "--max-restarts-per-minute", "2", "--minutes", "3", "--total-steps", "0",
                  "--run-dir", str(run_dir)], tmp_path)
    killed: list[int] = []
    for n in range(1, 4):
        victim = wait_for(lambda: (p := spreeze_children(proc.pid).get("spreeze-evaluator")) and p.pid not in killed
                          and p, 90, f"evaluator #{n} running")
        victim.kill()
        killed.append(victim.pid)
        expected = (f"spreeze-evaluator was killed by SIGKILL; restarted ({n} in the last minute)" if n < 3 else
                    "spreeze-evaluator was killed by SIGKILL; not restarting it: 2 restarts in the last minute")
        wait_for(lambda: events.exists() and expected in events.read_text(), 60, expected)
    time.sleep(1)  # the supervisor checks its children every 0.1 s: a replacement would be there by now
    assert "spreeze-evaluator" not in spreeze_children(proc.pid)
    updates = updates_so_far(run_dir)
    wait_for(lambda: updates_so_far(run_dir) > updates, 60, "training to go on without an evaluator")
    assert proc.poll() is None
    out = signal_group_and_check_clean_exit(proc, signal.SIGINT)
    assert events.read_text().count("spreeze-evaluator was killed by SIGKILL") == 3, out
    assert "no more tests in this run" in out  # on the console too, not only in events.log


@pytest.mark.slow
def test_every_sampler_failing_ends_the_run_with_exit_1(tmp_path):
    """Both samplers' envs keep raising: each gives up (five failures in a row), neither is restarted, and the
    run stops with exit code 1 instead of waiting for data that never comes."""
    from spreeze.config import Config
    from spreeze.envs import check_env
    from launch.compose import train

    env_id = "tests.faulty_envs:CrashInEverySamplerPendulum-v0"
    config = Config(env_id=env_id, samplers=2, spare_samplers=0, envs_per_sampler=1, total_steps=100_000,
                    minutes=2.0, learning_starts=1000, batch_size=64, hidden_size=32, log_interval_s=1.0,
                    eval_interval_s=60.0, learner_threads=1, actor_device="cpu", critic_device="cpu", window=False,
                    run_dir=str(tmp_path / "run"))
    config.validate()
    lines = []
    result = train(config, check_env(env_id), log=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 1, text
    assert "every sampler has failed" in text and "reached --" not in text
    events = (tmp_path / "run" / "events.log").read_text()
    for name in ("spreeze-sampler-0", "spreeze-sampler-1"):
        assert f"{name} exited with code 3; not restarting it" in events, events
    assert "failed 5 times in a row" in events


@pytest.mark.parametrize("args, fragment, in_process", [
    (["--resume", "/nonexistent/run"], "not a spreeze run", True),  # the entry point in this process: no torch import
    (["--run-dir", "/proc/spreeze-cannot-write-here"], "cannot create the run directory", False),
])
def test_bad_run_paths_exit_2(tmp_path, monkeypatch, capfd, keep_signal_handlers, args, fragment, in_process):
    monkeypatch.setenv("SPREEZE_CACHE_DIR", str(tmp_path / "cache"))
    code, stderr = exit_and_stderr(["--env", "Pendulum-v1", "--samplers", "1", "--batch-size", "64", *args], tmp_path,
                                   in_process, monkeypatch, capfd)
    assert code == 2, stderr
    assert fragment in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_resume_with_another_env_is_refused(tmp_path):
    from spreeze.checkpoint import resume_config, save_checkpoint
    from spreeze.config import Config, ConfigError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = Config(env_id="Pendulum-v1", batch_size=64)
    import json

    (run_dir / "config.json").write_text(json.dumps(saved.to_dict()))
    save_checkpoint(run_dir, {"actor": {}}, {"env_steps": 1}, saved.to_dict())
    with pytest.raises(ConfigError, match="made with --env Pendulum-v1, not --env HopperBulletEnv-v0"):
        resume_config(Config(env_id="HopperBulletEnv-v0", resume=str(run_dir)), {"env_id", "resume"})
    # what shaped the checkpoint's tensors (or is held in them) could not change: the learner died loading them,
    # after config.json had taken the new value, so even a plain --resume then failed
    for name, value, words in (("critic_atoms", 101, "--critic-atoms 0, not --critic-atoms 101"),
                               ("critic_hidden_size", 128, "--critic-hidden-size 0, not --critic-hidden-size 128"),
                               ("critic_layer_norm", True, "--no-critic-layer-norm, not --critic-layer-norm"),
                               ("normalize_obs", True, "--no-normalize-obs, not --normalize-obs"),
                               ("q_range", "-10,10", "--q-range auto, not --q-range -10,10")):
        with pytest.raises(ConfigError, match=words):
            resume_config(Config(resume=str(run_dir), **{name: value}), {"resume", name})
    # --run-dir elsewhere would have continued the run in place, not in that directory
    with pytest.raises(ConfigError, match="in its own directory"):
        resume_config(Config(resume=str(run_dir), run_dir=str(tmp_path / "fork")), {"resume", "run_dir"})
    resumed = resume_config(Config(resume=str(run_dir), run_dir=str(run_dir), minutes=3),
                            {"resume", "run_dir", "minutes"})
    assert resumed.env_id == "Pendulum-v1" and resumed.batch_size == 64 and resumed.minutes == 3


def test_env_faults_drop_episodes_and_repeated_failure_gives_up(tmp_path):
    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.replay import SharedReplay
    from spreeze.sampler import Sampler, SamplerGaveUp
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    ctx = mp.get_context("spawn")
    for env_id, expect_give_up in (("tests.faulty_envs:NanEveryPendulum-v0", False),
                                   ("tests.faulty_envs:AlwaysNanPendulum-v0", True),
                                   ("tests.faulty_envs:FlakyResetPendulum-v0", False),
                                   ("tests.faulty_envs:NanResetPendulum-v0", False)):
        config = Config(env_id=env_id, samplers=1, envs_per_sampler=1, learning_starts=10**6, write_block=8)
        info = check_env(env_id)
        replay = SharedReplay.create(info.obs_dim, info.act_dim, 2000, 2, ctx)
        weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), ctx)
        stats = SharedStats.create(2)
        sampler = Sampler(0, config, info, replay, weights, stats)
        try:
            if expect_give_up:
                with pytest.raises(SamplerGaveUp, match="5 times in a row"):
                    for _ in range(10):
                        sampler.step()
            else:
                for _ in range(1000):  # NaN at steps 250, 500, 750, 1000; 200-step episodes complete between
                    sampler.step()
                sampler.flush()
                n = replay.size()
                if "Reset" in env_id:  # a reset failing at each of the 5 episodes' ends: the episodes are whole
                    assert stats.dropped_episodes[0] == 5 and n == 1000 and stats.episodes[0] == 5
                else:
                    assert stats.dropped_episodes[0] == 4 and 600 < n < 1000
                assert np.all(np.isfinite(replay.obs[:n])) and np.all(np.isfinite(replay.next_obs[:n]))
        finally:
            sampler.close()
            del sampler
            for shared in (replay, weights, stats):
                shared.close()


def test_checkpoint_is_complete_or_absent(tmp_path, monkeypatch):
    from spreeze import checkpoint as ckpt

    path = tmp_path / "latest.pt"
    ckpt.atomic_save({"version": 1}, path)

    def torn_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    with pytest.raises(OSError):
        ckpt.atomic_save({"version": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]


def test_unwritable_checkpoint_warns_and_training_goes_on(tmp_path):
    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.learner import Learner
    from spreeze.messages import Warn
    from spreeze.replay import SharedReplay
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    ctx = mp.get_context("spawn")
    config = Config(env_id="Pendulum-v1", batch_size=32, hidden_size=16)
    info = check_env("Pendulum-v1")
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 1000, 1, ctx)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), ctx)
    stats = SharedStats.create(1)
    (tmp_path / "checkpoints").write_text("a file where the checkpoint folder should be")
    learner = Learner(config, info, replay, weights, stats, tmp_path, time.time())

    class Messages:
        def __init__(self):
            self.items = []

        def put(self, item, timeout=None):
            self.items.append(item)

    messages = Messages()
    try:
        assert learner.try_checkpoint(messages) is None
        assert messages.items and isinstance(messages.items[0], Warn) and "training goes on" in messages.items[0].text
    finally:
        del learner
        for shared in (replay, weights, stats):
            shared.close()
