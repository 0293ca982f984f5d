"""Faults, kills and bad input: real runs in subprocesses, real signals, then checks for orphans,
/dev/shm leftovers, checkpoint integrity and resumed counters."""
import csv
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

from conftest import ROOT
from test_end_to_end import PENDULUM_FAST, read_csv, spreeze_children, start

SMALL = [*PENDULUM_FAST, "--no-window", "--checkpoint-interval-s", "2"]


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
    proc = start([*SMALL, "--samplers", "2", "--minutes", "5", "--total-steps", "7000", "--run-dir", str(run_dir)],
                 tmp_path)
    wait_for(lambda: updates_so_far(run_dir) > 100, 90, "training to start")
    victim = spreeze_children(proc.pid)["spreeze-sampler-1"]
    killed_at = time.monotonic()
    victim.kill()
    events_path = run_dir / "events.log"
    wait_for(lambda: events_path.exists() and "restarted" in events_path.read_text(), 10, "the restart event")
    noticed_s = time.monotonic() - killed_at
    assert noticed_s < 2.0, f"restart took {noticed_s:.2f} s"
    replacement = wait_for(lambda: (p := spreeze_children(proc.pid).get("spreeze-sampler-1")) and p.pid != victim.pid and p,
                           30, "a new sampler-1 running")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    events = (run_dir / "events.log").read_text()
    assert "spreeze-sampler-1 was killed by SIGKILL; restarted" in events
    assert int(read_csv(run_dir / "metrics.csv")[-1]["env_steps"]) >= 7000
    assert not replacement.is_running() and live_segments(proc.pid) == []


@pytest.mark.slow
def test_sampler_whose_env_keeps_failing_is_stopped_and_the_others_go_on(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "--env", "tests.faulty_envs:CrashInSampler0Pendulum-v0", "--samplers", "2", "--total-steps", "4000",
            "--run-dir", str(run_dir)]
    proc = start(args, tmp_path)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    events = (run_dir / "events.log").read_text()
    assert "spreeze-sampler-0" in events and "failed 5 times in a row" in events and "not restarting" in events
    metrics = read_csv(run_dir / "metrics.csv")
    assert int(metrics[-1]["env_steps"]) >= 4000 and int(metrics[-1]["dropped_episodes"]) >= 5


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--env", "tests.faulty_envs:HugeRewardPendulum-v0", "--samplers", "1", "--total-steps", "20000",
                  "--run-dir", str(run_dir)], tmp_path)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out
    assert "non-finite" in out
    checkpoint = run_dir / "checkpoints" / "latest.pt"
    if checkpoint.exists():  # whatever was saved is a good one
        state = torch.load(checkpoint, weights_only=False)["algo"]["actor"]
        assert all(torch.isfinite(t).all() for t in state.values())
    assert live_segments(proc.pid) == []


@pytest.mark.slow
def test_main_killed_children_exit_and_resume_continues_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--samplers", "2", "--minutes", "5", "--total-steps", "0", "--run-dir", str(run_dir)], tmp_path)
    wait_for(lambda: (run_dir / "checkpoints" / "latest.pt").exists() and updates_so_far(run_dir) > 300, 120,
             "a checkpoint")
    children = list(spreeze_children(proc.pid).values())
    assert len(children) >= 4
    proc.kill()
    proc.wait(timeout=10)
    killed_at = time.monotonic()
    _, alive = psutil.wait_procs(children, timeout=8)
    assert not alive, f"orphans: {alive}"
    orphan_exit_s = time.monotonic() - killed_at
    left = live_segments(proc.pid)  # the SIGKILLed owner could not unlink
    before = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)["counters"]
    evaluations_before = len(read_csv(run_dir / "evaluations.csv"))

    resumed = start(["--resume", str(run_dir), "--total-steps", str(before["env_steps"] + 1500), "--minutes", "0",
                     "--no-window"], tmp_path)
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out
    for name in left:
        assert name not in os.listdir("/dev/shm"), "the next launch must remove a dead run's segments"
    if left:
        assert "removed" in out
    after = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)["counters"]
    assert after["updates"] > before["updates"] and after["env_steps"] >= before["env_steps"] + 1500
    assert after["policy_version"] > before["policy_version"] and after["time_s"] > before["time_s"]
    evaluations = read_csv(run_dir / "evaluations.csv")
    assert len(evaluations) > evaluations_before
    resumed_rows = evaluations[evaluations_before:]
    assert all(int(e["env_steps"]) >= before["env_steps"] for e in resumed_rows)
    assert float(resumed_rows[0]["time_s"]) >= before["time_s"]
    assert orphan_exit_s < 8


@pytest.mark.slow
def test_sigterm_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*SMALL, "--samplers", "1", "--minutes", "5", "--total-steps", "0", "--run-dir", str(run_dir)], tmp_path)
    wait_for(lambda: updates_so_far(run_dir) > 0, 90, "training to start")
    children = list(spreeze_children(proc.pid).values())
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 130, out
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive and live_segments(proc.pid) == []
    assert (run_dir / "final" / "actor.pt").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--resume", "/nonexistent/run"], "not a spreeze run"),
    (["--run-dir", "/proc/spreeze-cannot-write-here"], "cannot create the run directory"),
])
def test_bad_run_paths_exit_2(tmp_path, args, fragment):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--env", "Pendulum-v1", "--samplers", "1",
                           "--batch-size", "64", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPREEZE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
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
    with pytest.raises(ConfigError, match="env-id"):
        resume_config(Config(env_id="HopperBulletEnv-v0", resume=str(run_dir)), {"env_id", "resume"})
    resumed = resume_config(Config(resume=str(run_dir), minutes=3), {"resume", "minutes"})
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
                                   ("tests.faulty_envs:AlwaysNanPendulum-v0", True)):
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
    assert torch.load(path, weights_only=False) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]


def test_unwritable_checkpoint_warns_and_training_goes_on(tmp_path):
    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.learner import Learner
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
    learner = Learner(config, info, replay, weights, stats, tmp_path, 32, time.time())

    class Messages:
        def __init__(self):
            self.items = []

        def put(self, item, timeout=None):
            self.items.append(item)

    messages = Messages()
    try:
        assert learner.try_checkpoint(messages) is None
        assert messages.items and messages.items[0][0] == "warning" and "training goes on" in messages.items[0][2]
    finally:
        del learner
        for shared in (replay, weights, stats):
            shared.close()
