"""Real runs of run.py in subprocesses, on small budgets."""
import os
import signal
import time

import numpy as np
import pytest

from conftest import PENDULUM_FAST, assert_clean, read_csv, signal_group_and_check_clean_exit, spreeze_children, start

@pytest.mark.slow
def test_pendulum_two_samplers_with_normalize_obs_learns_and_leaves_nothing(tmp_path):
    """The one learning run in real processes (two samplers, evaluator, window): it learns, leaves nothing
    behind, and with --normalize-obs the learner's observation statistics reach the samplers and the evaluator
    through the shared weights (their tests improve on the normalised policy) and every saved policy carries
    them. One run for both keeps the suite short; the update rules without the statistics learn in the serial
    tests of test_algos (scalar critics with n-step returns, C51 with 1-step), and test_lockstep shows the
    processes compute what the serial loop does."""
    import torch

    run_dir = tmp_path / "run"
    proc = start([*PENDULUM_FAST, "--samplers", "2", "--normalize-obs", "--total-steps", "9000",
                  "--target-return", "-250", "--run-dir", str(run_dir)], tmp_path)
    roles, children = {}, []
    deadline = time.monotonic() + 60
    required = {"spreeze-sampler-0", "spreeze-sampler-1", "spreeze-learner", "spreeze-evaluator", "spreeze-window"}
    while time.monotonic() < deadline and proc.poll() is None and not required <= set(roles):
        roles = spreeze_children(proc.pid)
        time.sleep(0.2)
    children = list(roles.values())
    assert required <= set(roles), roles
    assert not any(name.startswith("spreeze-sampler-2") for name in roles)  # --spare-samplers 0
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert_clean(proc.pid, children)

    evaluations = read_csv(run_dir / "evaluations.csv")
    returns = [float(e["test_return"]) for e in evaluations]
    assert len(returns) >= 5
    # it stops once its mean of 5 reaches -250 (--target-return), else at 9,000 steps: either way its last tests
    # are what the test asserts on
    assert float(np.mean(returns[-3:])) >= -300, f"test returns {returns}"
    assert returns[0] < -600  # the untrained policy is bad: the test above measures learning
    metrics = read_csv(run_dir / "metrics.csv")
    assert int(metrics[-1]["updates"]) > 1000
    assert {"sampling_hz", "update_hz", "update_frame_rate", "cpu_percent", "test_return"} <= set(metrics[0])
    assert (run_dir / "checkpoints" / "latest.pt").exists() and (run_dir / "config.json").exists()
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "update frame rate" in out and "sampling frame rate" in out

    saved = torch.load(run_dir / "final" / "actor.pt", weights_only=True)
    count = float(saved["actor"]["obs_norm.count"])
    assert count > 10_000  # rows sampled by the learner, not env steps
    mean, var = saved["actor"]["obs_norm.mean"].numpy(), saved["actor"]["obs_norm.var"].numpy()
    assert np.all(np.abs(mean[:2]) <= 1.0) and not np.allclose(var, 1.0)  # cos, sin in [-1, 1]; not the init

    import gymnasium as gym
    import spreeze

    policy = spreeze.load_policy(run_dir)
    assert policy.actor.obs_norm.count == count and policy(np.zeros(3, np.float32)).shape == (1,)
    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=123)
    total, done = 0.0, False
    while not done:
        obs, reward, terminated, truncated, _ = env.step(policy(obs))
        total += reward
        done = terminated or truncated
    assert total > -600


@pytest.mark.slow
def test_a_run_without_a_budget_trains_until_ctrl_c_and_stops_cleanly_with_a_final_checkpoint(tmp_path):
    """Without --total-steps or --minutes nothing stops the run but the user: here the group's SIGINT, which
    every process hears as a terminal's Ctrl-C sends it (one run for both properties: each launch costs seconds)."""
    import json

    import torch

    run_dir = tmp_path / "run"
    proc = start([*PENDULUM_FAST, "--samplers", "2", "--eval-interval-s", "0.5", "--log-interval-s", "0.5",
                  "--run-dir", str(run_dir)], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate(timeout=30)[0]  # still training: no budget ended it
            metrics, evaluations = run_dir / "metrics.csv", run_dir / "evaluations.csv"
            if (metrics.exists() and int(read_csv(metrics)[-1]["updates"]) > 0 and evaluations.exists()
                    and len(read_csv(evaluations)) >= 6):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("no update and 6 tests within 120 s")
        roles = spreeze_children(proc.pid)
        assert {"spreeze-sampler-0", "spreeze-sampler-1", "spreeze-learner", "spreeze-evaluator"} <= set(roles)
        out = signal_group_and_check_clean_exit(proc, signal.SIGINT)  # Ctrl-C reaches every process of the group
    finally:
        if proc.poll() is None:  # a failed check: leave no process of the group behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert "interrupted" in out
    assert (run_dir / "checkpoints" / "latest.pt").exists() and (run_dir / "final" / "actor.pt").exists()
    checkpoint = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert checkpoint["counters"]["updates"] > 0 and checkpoint["config"]["env_id"] == "Pendulum-v1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"].startswith("interrupted") and summary["best_policy"] is not None
    assert (run_dir / "best" / "actor.pt").is_file()


def test_serial_mode_td3_with_explicit_devices(tmp_path):
    from spreeze.config import Config
    from spreeze.envs import check_env
    from launch.compose import train

    config = Config(env_id="Pendulum-v1", algo="td3", serial=True, samplers=2, envs_per_sampler=2, total_steps=1500,
                    minutes=2.0, learning_starts=500, batch_size=64, hidden_size=32, actor_device="cpu",
                    critic_device="cpu", eval_interval_s=0.5, run_dir=str(tmp_path / "run"))
    lines = []
    result = train(config, check_env("Pendulum-v1"), log=lines.append)
    assert result.exit_code == 0, lines
    assert "[spreeze] reached --total-steps 1500" in lines, lines  # not the --minutes cap
    assert result.summary["env_steps"] >= 1500 and result.summary["updates"] > 0
    assert result.evaluations and (tmp_path / "run" / "final" / "actor.pt").exists()


@pytest.mark.slow
def test_a_profiling_launch_writes_summary_and_autotune_json(tmp_path):
    """run.py with samplers and batch size left automatic: the first launch profiles the machine (real probe,
    kept short by a small buffer, which bounds the batch sweep), caches it in --cache-dir, and the run
    directory gets autotune.json (what was measured and chosen) and summary.json (the run's figures)."""
    import json

    run_dir, cache = tmp_path / "run", tmp_path / "profile-cache"
    proc = start(["--env", "Pendulum-v1", "--hidden-size", "32", "--buffer-size", "4096", "--learning-starts", "500",
                  "--total-steps", "2500", "--minutes", "3", "--spare-samplers", "0", "--no-window",
                  "--eval-interval-s", "1", "--log-interval-s", "1", "--cache-dir", str(cache),
                  "--run-dir", str(run_dir)], tmp_path)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "machine profile" in out and "reached --total-steps 2500" in out, out

    profile = json.loads((run_dir / "autotune.json").read_text())
    assert profile["source"] == "measured"
    chosen = profile["chosen"]
    assert chosen["samplers"]["by"] == chosen["batch_size"]["by"] == "profile"
    assert chosen["samplers"]["reason"] and chosen["batch_size"]["reason"]
    measured = profile["measurements"]
    assert measured["sampler"]["env_step_s"] > 0 and measured["cpu"]["logical"] >= 1
    sweep = measured["learner"]["sweep"]
    assert sweep and all(p["updates_per_s"] > 0 for p in sweep)
    assert chosen["batch_size"]["value"] in [p["batch"] for p in sweep]
    cached = list(cache.glob("*.json"))
    assert [str(p) for p in cached] == [profile["cache_path"]]  # saved where --cache-dir said

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["env_id"] == "Pendulum-v1"
    assert summary["samplers"] == chosen["samplers"]["value"]
    assert summary["batch_size"] == chosen["batch_size"]["value"]
    assert summary["env_steps"] >= 2500 and summary["updates"] > 0 and summary["wall_time_s"] > 0
    assert summary["cpu_usage_percent"] >= 0
    for figure in ("sampling_frame_rate_hz", "update_frame_rate_hz", "update_frequency_hz"):
        assert summary[figure] > 0, figure  # Spreeze's Table 1 columns (rates since learning began)
    assert summary["final_test_return"] is not None
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["samplers"], config["batch_size"]) == (summary["samplers"], summary["batch_size"])
    assert config["bf16"] is chosen["bf16"]["value"] and chosen["bf16"]["by"] == "profile"  # resolved, not left unset
    assert (summary["bf16"], summary["hidden_size"]) == (config["bf16"], config["hidden_size"])  # as the run trained
