"""Reproducible mode: lock-step rounds give the same curves whatever the number of sampler processes."""
import csv
import dataclasses

import numpy as np
import pytest

from spreeze.config import Config, ConfigError


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


def deterministic_run(tmp_path, name: str, samplers: int, seed: int = 0, serial: bool = False, **overrides):
    from spreeze.envs import check_env
    from launch.compose import train

    run_dir = tmp_path / name
    config = Config(env_id="Pendulum-v1", deterministic=True, serial=serial, samplers=samplers, num_envs=4,
                    steps_per_round=32, total_steps=3000, minutes=3.0, learning_starts=500, batch_size=64,
                    hidden_size=32,
                    collect_per_update=2.0, eval_every_steps=1000, seed=seed, actor_device="cpu",
                    critic_device="cpu", window=False, log_interval_s=1.0, run_dir=str(run_dir))
    config = dataclasses.replace(config, **overrides)
    config.validate()
    lines = []
    result = train(config, check_env(config.env_id), log=lines.append)
    assert result.exit_code == 0, lines
    assert f"[spreeze] reached --total-steps {config.total_steps}" in lines, lines  # not the --minutes cap
    with open(run_dir / "evaluations.csv") as f:
        returns = [(int(r["env_steps"]), int(r["updates"]), float(r["test_return"])) for r in csv.DictReader(f)]
    return (run_dir / "rounds.csv").read_text(), returns, run_dir


@pytest.fixture(scope="module")
def serial_reference(tmp_path_factory):
    """The in-process rounds of the default deterministic Pendulum run: the reference every layout must match
    (run once for the module's tests)."""
    return deterministic_run(tmp_path_factory.mktemp("lockstep"), "serial", samplers=1, serial=True)


@pytest.mark.slow
def test_two_samplers_give_the_in_process_run_and_the_seed_matters(tmp_path, serial_reference):
    """Two sampler processes compute the in-process rounds byte for byte (one process: the PyBullet test below)."""
    rounds_2, evals_2, dir_2 = deterministic_run(tmp_path, "two", samplers=2)
    rounds_serial, evals_serial, _ = serial_reference

    rows = list(csv.DictReader(rounds_2.splitlines()))
    assert len(rows) == 24 and int(rows[-1]["env_steps"]) == 3072  # whole rounds of 4 envs x 32 steps
    assert int(rows[-1]["updates"]) == (3072 - 500) // 2
    assert all(np.isfinite(float(r["critic_loss"])) for r in rows[4:])  # learner round 4 reads 512 >= 500 steps
    assert [e[0] for e in evals_2] == [0, 1024, 2048, 3072]
    assert rounds_serial == rounds_2, "losses per round differ between the in-process run and 2 samplers"
    assert evals_serial == evals_2, "test returns differ between the in-process run and 2 samplers"

    with open(dir_2 / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert float(metrics[-1]["actor_per_critic_update"]) == 1.0  # SAC: one actor update per critic update
    assert (dir_2 / "final" / "actor.pt").exists()

    rounds_seed, evals_seed, _ = deterministic_run(tmp_path, "seed1", samplers=1, seed=1, serial=True)
    assert rounds_seed != rounds_2
    assert [e[2] for e in evals_seed] != [e[2] for e in evals_2]


@pytest.mark.slow
def test_four_samplers_and_a_pybullet_env_give_identical_runs(tmp_path, serial_reference):
    """Byte-identical rounds.csv for 4 sampler processes on Pendulum (the in-process rounds as the reference), and
    for 1 and 2 on a PyBullet env."""
    rounds_serial, evals_serial, _ = serial_reference
    rounds_4, evals_4, _ = deterministic_run(tmp_path, "four", samplers=4)
    assert rounds_4 == rounds_serial and evals_4 == evals_serial
    hopper = dict(env_id="HopperBulletEnv-v0", steps_per_round=16, total_steps=1600, learning_starts=400,
                  collect_per_update=4.0, eval_every_steps=800)
    runs = [deterministic_run(tmp_path, f"hopper-{n}", samplers=n, **hopper) for n in (1, 2)]
    assert len(runs[0][0].splitlines()) == 1 + 25 and [e[0] for e in runs[0][1]] == [0, 832, 1600]  # rounds of 64
    assert runs[1][0] == runs[0][0] and runs[1][1] == runs[0][1]


@pytest.mark.slow
def test_deterministic_mode_has_the_samplers_env_fault_handling(tmp_path):
    """An env returning NaN drops that episode's rows of the round and is reset, as in free-running mode; the
    step is made up, so every region still gets whole rounds and the runs stay identical across layouts."""
    faulty = dict(env_id="tests.faulty_envs:NanEveryPendulum-v0")
    rounds_serial, evals_serial, serial_dir = deterministic_run(tmp_path, "serial", samplers=1, serial=True, **faulty)
    rounds_2, evals_2, _ = deterministic_run(tmp_path, "two", samplers=2, **faulty)
    # the evaluator's own env NaNs too (tests have no fault handling): NaN test returns must match as well
    assert rounds_2 == rounds_serial and np.array_equal(evals_2, evals_serial, equal_nan=True)
    rows = list(csv.DictReader(rounds_serial.splitlines()))
    assert int(rows[-1]["env_steps"]) == 3072 and all(np.isfinite(float(r["critic_loss"])) for r in rows[4:])
    with open(serial_dir / "metrics.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["dropped_episodes"]) >= 4  # 3072 steps / 4 envs: each NaN'd thrice


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
        assert result.summary["update_frame_rate_hz"] > 0  # lock-step's updates count their rows too
        rounds.append((tmp_path / name / "rounds.csv").read_bytes())
    assert chosen[0][0] != chosen[1][0], chosen  # the machines did get different sampler counts ...
    assert chosen[0][1:] == chosen[1][1:] == (8, 256)  # ... but the same envs and batch
    assert rounds[0] == rounds[1]


def test_deterministic_lr_schedule_follows_the_rounds_env_steps(tmp_path):
    """--lr-schedule linear in lock-step: the learner's rates in round k are the configured ones x
    (1 - k x round env steps / --total-steps), whatever the clock (--minutes is set too); --critic-layer-norm's
    gains reach the checkpoint."""
    from spreeze.checkpoint import CHECKPOINT_NAME, load_checkpoint

    _, evals, run_dir = deterministic_run(tmp_path, "linear", samplers=1, serial=True, lr_schedule="linear",
                                          critic_layer_norm=True, total_steps=1200)
    state = load_checkpoint(run_dir / "checkpoints" / CHECKPOINT_NAME)["algo"]
    last_round = 1280 // 128 - 1  # 10 rounds of 4 envs x 32 steps; round 9 trained last
    scale = 1 - last_round * 128 / 1200
    for name in ("actor_optimizer", "critic_optimizer", "alpha_optimizer"):
        assert state[name]["param_groups"][0]["lr"] == pytest.approx(7.3e-4 * scale, rel=1e-9)
    assert "norms.0.weight" in state["critic"] and np.isfinite([e[2] for e in evals]).all()


def test_a_serial_lock_step_run_writes_its_checkpoints_as_it_goes(tmp_path):
    """--deterministic --serial wrote only its final checkpoint, whatever --checkpoint-interval-s said: a run
    killed there left no checkpoint to resume or load. It checkpoints after its rounds, as the learner process
    does."""
    from spreeze import runners
    from spreeze.envs import check_env
    from spreeze.observers import Observer

    seen, at = [], []

    class Checkpoints(Observer):
        def on_start(self, run):
            self.stats = run.supervisor.stats

        def on_checkpoint(self, path):
            seen.append(path)
            at.append(self.stats.total_env_steps())

    config = Config(env_id="Pendulum-v1", deterministic=True, serial=True, samplers=1, num_envs=4,
                    steps_per_round=32, total_steps=1500, learning_starts=500, batch_size=64, hidden_size=32,
                    collect_per_update=2.0, eval_every_steps=1000, actor_device="cpu", critic_device="cpu",
                    window=False, checkpoint_interval_s=0.05, run_dir=str(tmp_path / "run"))
    config.validate()
    result = runners.train(config, check_env(config.env_id), log=lambda line: None, observers=[Checkpoints()])
    assert result.exit_code == 0
    assert len(seen) >= 3, seen  # periodic ones (one per round at most) and the final one
    assert at[0] < 1500 and at == sorted(at), at  # each told as it is written, not all at the end


def test_the_final_wait_for_queued_tests_runs_from_the_last_one_that_arrived(monkeypatch):
    """Tests slower than the rounds queue up: a fixed wait for the whole queue dropped the last of them (the final
    policy's among them), depending on timing. The wait runs from the last test that arrived."""
    import time
    import types

    from spreeze import lockstep

    monkeypatch.setattr(lockstep, "FINAL_EVAL_TIMEOUT_S", 0.5)
    monkeypatch.setattr(lockstep, "WAIT_S", 0.05)
    evaluations, lines, began = [], [], time.monotonic()

    def drain_messages():  # a test every 0.3 s, five in all: 1.5 s, longer than the 0.5 s wait
        due = int((time.monotonic() - began) / 0.3)
        while len(evaluations) < min(due, 5):
            evaluations.append({"test_return": -1.0})

    evaluator = types.SimpleNamespace(is_alive=lambda: len(evaluations) < 5, join=lambda timeout: time.sleep(timeout))
    rounds = lockstep.Rounds.__new__(lockstep.Rounds)
    rounds.serial, rounds.evaluate = False, lambda request: None
    rounds.sup = types.SimpleNamespace(processes={"spreeze-evaluator": evaluator}, drain_messages=drain_messages,
                                       log=lines.append)
    rounds.run = types.SimpleNamespace(runlog=types.SimpleNamespace(evaluations=evaluations))
    rounds.finish()
    assert len(evaluations) == 5 and lines == []


@pytest.mark.slow
def test_lock_step_processes_read_their_tests_as_they_come_and_stop_on_the_target(tmp_path):
    """The coordinator read its children's messages only when a round waited WAIT_S: with rounds faster than that
    (here warm-up rounds, with a GPU learner every round), tests were read at the end only, so --target-return
    never stopped a run, and neither best/actor.pt nor the live curve followed it."""
    import json

    from launch.compose import train
    from spreeze.envs import check_env

    total = 300_000
    config = Config(env_id="Pendulum-v1", deterministic=True, samplers=1, num_envs=4, steps_per_round=32,
                    total_steps=total, minutes=2.0, learning_starts=total, batch_size=64, hidden_size=32,
                    collect_per_update=2.0, eval_every_steps=2048, target_return=-1e9, actor_device="cpu",
                    critic_device="cpu", window=False, log_interval_s=1.0, run_dir=str(tmp_path / "run"))
    config.validate()
    lines = []
    result = train(config, check_env(config.env_id), log=lines.append)
    assert result.exit_code == 0, lines
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "target_return", lines
    assert summary["env_steps"] < total // 2 and summary["tests"] >= 5
    assert (tmp_path / "run" / "best" / "actor.pt").exists()
