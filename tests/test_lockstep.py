"""Reproducible mode: lock-step rounds give the same curves whatever the number of sampler processes."""
import csv
import dataclasses
import multiprocessing as mp

import numpy as np
import pytest

from spreeze.config import Config, ConfigError
from spreeze.lockstep import RoundPlan, sample_window
from spreeze.replay import SharedReplay

CTX = mp.get_context("spawn")


def test_round_plan_numbers():
    plan = RoundPlan(num_envs=4, samplers=3, steps_per_round=8, region_capacity=40, learning_starts=100,
                     learning_begins_at=100, collect_ratio=4.0, eval_every_steps=64)
    assert plan.round_env_steps == 32 and plan.env_steps_after(2) == 96
    assert [plan.sampler_envs(i) for i in range(3)] == [[0, 1], [2], [3]]
    assert plan.random_actions(3, 0) and not plan.random_actions(3, 1)  # 96 then 100 steps before it
    # learner round k reads rounds < k: 96 < 100 steps at k=3; from k=4 one update per 4 steps beyond 100
    assert [plan.updates_after(k) for k in (3, 4, 5)] == [0, 15, 23]
    assert [plan.window(k) for k in (0, 2, 5, 10)] == [(0, 0), (0, 16), (8, 40), (48, 80)]
    assert [plan.eval_due(k) for k in range(4)] == [False, True, False, True]


def test_window_never_reaches_the_round_being_written():
    """Each region's ring keeps one round free: what round k writes lies outside learner round k's window."""
    plan = RoundPlan(num_envs=3, samplers=1, steps_per_round=4, region_capacity=10, learning_starts=0,
                     learning_begins_at=1, collect_ratio=1.0, eval_every_steps=100)
    replay = SharedReplay.create(1, 1, 30, 3, CTX)
    try:
        rng = np.random.default_rng(0)
        for k in range(8):
            for region in range(3):  # round k in flight: entries [4k, 4k + 4) of every region
                first = plan.steps_per_round * k
                entries = np.arange(first, first + plan.steps_per_round, dtype=np.float32)
                replay.write(region, entries[:, None], np.full((4, 1), region, np.float32), entries, entries[:, None],
                             np.zeros(4, np.float32))
            if k == 0:
                continue
            start, end = plan.window(k)
            batch = sample_window(replay, plan, k, 512, rng)
            assert np.all((batch.obs[:, 0] >= start) & (batch.obs[:, 0] < end)), (k, start, end)
            assert set(np.unique(batch.actions[:, 0])) == {0.0, 1.0, 2.0}
    finally:
        replay.close()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"num_envs": 4}, "--num-envs needs --deterministic"),
    ({"deterministic": True, "collect_per_update": 0}, "collect:update"),
    ({"deterministic": True, "num_envs": 8, "buffer_size": 100, "learning_starts": 10, "batch_size": 8},
     "--buffer-size"),
    ({"deterministic": True, "resume": "runs/x"}, "--resume"),
])
def test_deterministic_settings_that_cannot_work(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Config(**kwargs).validate()


def deterministic_run(tmp_path, name: str, samplers: int, seed: int = 0, serial: bool = False):
    from spreeze.envs import check_env
    from launch.compose import train

    run_dir = tmp_path / name
    config = Config(env_id="Pendulum-v1", deterministic=True, serial=serial, samplers=samplers, num_envs=4,
                    steps_per_round=32, total_steps=3000, minutes=3.0, learning_starts=500, batch_size=64,
                    hidden_size=32,
                    collect_per_update=2.0, eval_every_steps=1000, seed=seed, actor_device="cpu",
                    critic_device="cpu", window=False, log_interval_s=1.0, run_dir=str(run_dir))
    config.validate()
    lines = []
    result = train(config, check_env("Pendulum-v1"), log=lines.append)
    assert result.exit_code == 0, lines
    assert f"[spreeze] reached --total-steps {config.total_steps}" in lines, lines  # not the --minutes cap
    with open(run_dir / "evaluations.csv") as f:
        returns = [(int(r["env_steps"]), int(r["updates"]), float(r["test_return"])) for r in csv.DictReader(f)]
    return (run_dir / "rounds.csv").read_text(), returns, run_dir


@pytest.mark.slow
def test_one_and_two_samplers_give_identical_runs_and_the_seed_matters(tmp_path):
    rounds_1, evals_1, dir_1 = deterministic_run(tmp_path, "one", samplers=1)
    rounds_2, evals_2, _ = deterministic_run(tmp_path, "two", samplers=2)
    rounds_serial, evals_serial, _ = deterministic_run(tmp_path, "serial", samplers=1, serial=True)

    rows = list(csv.DictReader(rounds_1.splitlines()))
    assert len(rows) == 24 and int(rows[-1]["env_steps"]) == 3072  # whole rounds of 4 envs x 32 steps
    assert int(rows[-1]["updates"]) == (3072 - 500) // 2
    assert all(np.isfinite(float(r["critic_loss"])) for r in rows[4:])  # learner round 4 reads 512 >= 500 steps
    assert [e[0] for e in evals_1] == [0, 1024, 2048, 3072]
    assert rounds_2 == rounds_1, "losses per round differ between 1 and 2 samplers"
    assert evals_2 == evals_1, "test returns differ between 1 and 2 samplers"
    assert rounds_serial == rounds_1 and evals_serial == evals_1  # the in-process reference agrees

    with open(dir_1 / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert float(metrics[-1]["actor_per_critic_update"]) == 1.0  # SAC: one actor update per critic update
    assert (dir_1 / "final" / "actor.pt").exists()

    rounds_seed, evals_seed, _ = deterministic_run(tmp_path, "seed1", samplers=1, seed=1, serial=True)
    assert rounds_seed != rounds_1
    assert [e[2] for e in evals_seed] != [e[2] for e in evals_1]


def _fake_machine(cores: int, update_rows_per_s: float, env_step_s: float):
    """A machine inventory and a probe result for tune(): different machines, different speeds."""
    inventory = {"cpu_model": f"fake {cores}-core", "logical": cores, "physical": cores, "memory_total": 64 * 2**30,
                 "memory_available": 60 * 2**30, "gpus": [], "nvml": "fake", "platform": "x86_64"}

    def probe(config, env_info, settings, learner_threads, on_event):
        sweep = [{"batch": b, "updates_per_s": 1.0 / (2e-3 + b / update_rows_per_s), "gpu_util": None}
                 for b in (256, 512, 1024, 2048, 4096)]
        return {"sampler": {"env_step_s": env_step_s, "steps_per_s": 1 / env_step_s, "rss_bytes": 2**28,
                            "uss_bytes": 2**27, "envs": 4},
                "learner": {"on_gpu": False, "threads": learner_threads, "devices": ["cpu"], "sweep": sweep,
                            "stopped": "fake"}}
    return inventory, probe


@pytest.mark.slow
def test_audit_4_deterministic_curves_do_not_depend_on_the_machine_profile(tmp_path, monkeypatch):
    """Audit point 4: with --deterministic, the env count and the batch had hardware-dependent defaults
    (samplers x envs-per-sampler, the tuner's batch), so one command gave other curves on another machine.
    The tuner may now pick only the sampler count."""
    from autotune import ProbeSettings, probe as probe_mod, tune
    from spreeze.envs import check_env
    from launch.compose import train

    info = check_env("Pendulum-v1")
    command = Config(env_id="Pendulum-v1", deterministic=True, serial=True, total_steps=1536, minutes=3.0,
                     learning_starts=512, hidden_size=32, collect_per_update=4.0, eval_every_steps=768,
                     steps_per_round=32, actor_device="cpu", critic_device="cpu", window=False, log_interval_s=1.0)
    rounds, chosen = [], []
    for name, (cores, rows_per_s, step_s) in {"laptop": (2, 40e3, 4e-4), "workstation": (32, 900e3, 2e-3)}.items():
        inventory, fake_probe = _fake_machine(cores, rows_per_s, step_s)
        monkeypatch.setattr(probe_mod, "machine_inventory", lambda inventory=inventory: dict(inventory))
        monkeypatch.setattr(probe_mod, "cpu_load", lambda seconds: {"per_core_percent": [], "background_cores": 0.0})
        tuned, profile = tune(command, info, set(), cache_dir=str(tmp_path / f"cache-{name}"), log=lambda s: None,
                              settings=ProbeSettings(load_seconds=0.05), progress=False, probe=fake_probe)
        tuned = dataclasses.replace(tuned, run_dir=str(tmp_path / name))
        tuned.validate()
        chosen.append((tuned.samplers, tuned.total_envs, tuned.batch_size))
        assert profile["chosen"]["batch_size"]["by"] == "deterministic"
        result = train(tuned, info, log=lambda s: None)
        assert result.exit_code == 0 and result.summary["env_steps"] == 1536  # the step budget, not the minutes
        rounds.append((tmp_path / name / "rounds.csv").read_bytes())
    assert chosen[0][0] != chosen[1][0], chosen  # the machines did get different sampler counts ...
    assert chosen[0][1:] == chosen[1][1:] == (8, 256)  # ... but the same envs and batch
    assert rounds[0] == rounds[1]
