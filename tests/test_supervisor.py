"""Budgets and the best policy: what ends a run, and what a user stopping at the end gets."""
import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from conftest import ROOT
from spreeze.checkpoint import load_policy
from spreeze.config import Config
from spreeze.shm import live_segments

BASE = Config(env_id="Pendulum-v1", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=1,
              learning_starts=300, batch_size=32, buffer_size=10_000, hidden_size=16, collect_per_update=8.0,
              eval_interval_s=0.05, log_interval_s=60.0, checkpoint_interval_s=600.0, actor_device="cpu",
              critic_device="cpu", window=False)


def serial_train(tmp_path, **overrides):
    from spreeze.envs import check_env
    from spreeze.supervisor import train

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"), **overrides)
    config.validate()
    lines = []
    return train(config, check_env(config.env_id), log=lines.append), lines


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_no_budget_is_a_valid_configuration_and_the_default():
    config = Config()
    assert config.total_steps == 0 and config.minutes == 0 and config.target_return is None
    config.validate()


def test_target_return_stops_on_the_mean_of_the_last_five_tests(tmp_path):
    result, lines = serial_train(tmp_path, target_return=-1e6, total_steps=200_000, minutes=2.0)
    assert result.exit_code == 0
    assert result.summary["stopped_by"] == "target_return"
    assert any("reached --target-return" in line for line in lines)
    evaluations = rows(tmp_path / "run" / "evaluations.csv")
    assert len(evaluations) == 5  # not before five tests, at once after them
    assert result.summary["env_steps"] < 200_000
    assert any(line.startswith("[spreeze] stopped by: target_return") for line in lines)


def test_target_return_not_reached_leaves_the_other_budget_in_charge(tmp_path):
    result, _ = serial_train(tmp_path, target_return=1e6, total_steps=1_000, minutes=2.0)
    assert result.summary["stopped_by"] == "total_steps" and result.summary["env_steps"] >= 1_000


def test_best_policy_is_the_best_mean_of_five_and_loads(tmp_path):
    result, lines = serial_train(tmp_path, total_steps=2_500, minutes=2.0)
    run = tmp_path / "run"
    evaluations = rows(run / "evaluations.csv")
    assert len(evaluations) >= 6
    returns = np.array([float(e["test_return"]) for e in evaluations])
    rolling = np.array([returns[max(0, i - 4): i + 1].mean() for i in range(len(returns))])
    assert np.allclose([float(e["test_return_mean5"]) for e in evaluations], rolling, rtol=1e-5)
    best_index = 4 + int(np.argmax(rolling[4:]))  # a best needs five tests; the first time it was reached
    saved = torch.load(run / "best" / "actor.pt", weights_only=True)
    assert saved["best"]["test_return_mean5"] == pytest.approx(rolling[best_index], rel=1e-6)
    assert saved["best"]["policy_version"] == int(evaluations[best_index]["policy_version"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_mean5_test_return"] == pytest.approx(rolling[4:].max(), rel=1e-6)
    assert summary["final_mean5_test_return"] == pytest.approx(rolling[-1], rel=1e-6)
    assert summary["best_policy"]["path"].endswith("best/actor.pt") and summary["stopped_by"] == "total_steps"
    best, final = load_policy(run, checkpoint="best"), load_policy(run)
    obs = np.zeros(3, np.float32)
    assert best(obs).shape == final(obs).shape == (1,)
    assert load_policy(run, checkpoint="latest")(obs).shape == (1,)  # the actor of the final checkpoint
    with pytest.raises(FileNotFoundError):
        load_policy(run, checkpoint="no-such-checkpoint.pt")
    from viz.play import load as play_load
    _, env_id, name = play_load(run, __import__("pathlib").Path("best"))
    assert (env_id, name) == ("Pendulum-v1", "best")


@pytest.mark.slow
def test_default_budget_trains_until_ctrl_c(tmp_path):
    """Without --total-steps or --minutes nothing stops the run but the user (here: the group's SIGINT)."""
    cmd = [sys.executable, str(ROOT / "run.py"), "--env", "Pendulum-v1", "--samplers", "1", "--spare-samplers", "0",
           "--batch-size", "64", "--hidden-size", "16", "--learning-starts", "500", "--eval-interval-s", "0.5",
           "--log-interval-s", "1", "--no-window", "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        evaluations = tmp_path / "run" / "evaluations.csv"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not evaluations.exists() or len(rows(evaluations)) < 6):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        assert evaluations.exists() and len(rows(evaluations)) >= 6, "no tests within 120 s"
        assert proc.poll() is None  # still training: no budget ended it
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"].startswith("interrupted") and summary["best_policy"] is not None
    assert (tmp_path / "run" / "best" / "actor.pt").is_file()
    assert not live_segments(proc.pid)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "run") in " ".join(p.info["cmdline"] or [])]


def test_governor_does_not_pause_the_samplers_the_replay_is_sized_for_during_warm_up(tmp_path):
    """The replay's regions are sized for --samplers active envs; while the replay holds less than the
    warm-up, the CPU looks idle and a pause below --samplers could leave it unreachable (audit point 1)."""
    from spreeze.envs import EnvInfo
    from spreeze.supervisor import Supervisor

    class WantsOne:
        resets = 0

        def decide(self, now, cpu, active):
            return 1, "CPU above target"

        def reset(self):
            WantsOne.resets += 1

    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    config = dataclasses.replace(BASE, serial=False, samplers=2, spare_samplers=1, envs_per_sampler=1)
    sup = Supervisor(config, info, tmp_path, log=lambda line: None)
    sup.create_shared()
    try:
        sup.stats.paused[:] = [0, 0, 1]
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1] and WantsOne.resets == 1
        sup.stats.paused[:] = [0, 0, 0]  # above --samplers: it may come down to them, not below
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1]
        assert "not below --samplers during the warm-up" in (tmp_path / "events.log").read_text()
        rows = np.zeros((config.learning_begins_at, 3), np.float32)  # the warm-up is over
        for region in range(2):
            for start in range(0, len(rows), 100):
                block = rows[start:start + 100]
                sup.replay.write(region, block, block[:, :1], block[:, 0], block, block[:, 0])
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 1, 1]
        assert "samplers active 2 -> 1" in (tmp_path / "events.log").read_text()
    finally:
        sup.close_shared()


def test_a_retired_sampler_still_frees_the_locks_it_died_holding(tmp_path):
    """A child that is not restarted (restart cap) may have died inside a region write or a weights copy:
    its locks are freed all the same, or the learner would time out on them."""
    import types

    from spreeze.envs import EnvInfo
    from spreeze.supervisor import ChildFailed, Supervisor

    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    config = dataclasses.replace(BASE, serial=False, samplers=1, spare_samplers=0, envs_per_sampler=2,
                                 max_restarts_per_minute=1)
    sup = Supervisor(config, info, tmp_path, log=lambda line: None)
    sup.create_shared()
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        sup.processes["spreeze-sampler-0"] = types.SimpleNamespace(pid=dead.pid)
        sup.restarts["spreeze-sampler-0"] = [time.monotonic()]  # the cap is reached: it will be retired
        sup.replay.locks[1].acquire()
        sup.weights.lock.acquire()
        sup.weights.holder[0] = dead.pid
        with pytest.raises(ChildFailed, match="every sampler has failed"):
            sup.restart("spreeze-sampler-0", "was killed by SIGKILL")
        events = (tmp_path / "events.log").read_text()
        assert "freed replay region lock(s) [1]" in events and "freed the weights lock" in events
        assert sup.replay.locks[1].acquire(timeout=1) and sup.weights.lock.acquire(timeout=1)
        sup.replay.locks[1].release()
        sup.weights.lock.release()
    finally:
        sup.close_shared()
