"""The benchmark commands, end to end in reduced form: they must produce their tables and CSV from
measured numbers (speed targets live in the benchmarks themselves, never in tests)."""
import csv
import json
import math
from pathlib import Path

import pytest

from benchmarks import faults, race, throughput, transfer

FAST_PENDULUM = "--samplers 1 --envs-per-sampler 2 --batch-size 64 --learning-starts 300 --hidden-size 64"


@pytest.mark.slow
def test_throughput_reports_measured_ratios(tmp_path, capsys):
    assert throughput.main(["--env", "Pendulum-v1", "--seconds", "9", "--side-seconds", "1", "--samplers", "1",
                            "--batch-sizes", "64", "--envs-per-sampler", "2", "--learning-starts", "500",
                            "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "throughput-Pendulum-v1.csv")))
    assert len(rows) == 1
    assert "raw_env_hz" not in rows[0] and rows[0]["policy_replay_reproduced"] == "True"
    assert rows[0]["bf16"] in ("True", "False")  # the precision the row ran in (tuned, or float32 when given)
    row = {k: float(v) for k, v in rows[0].items() if k not in ("env", "gpu_usage_percent", "policy_replay_reproduced",
                                                                 "replay_mirror", "bf16")}
    assert row["raw_env_hz_random"] > 1000 and row["raw_env_hz_policy"] > 1000
    # a 9 s run on a loaded 2-core machine may end before the learner process is past its start-up: the checks
    # below hold on what the run recorded either way (the learner's training is tested in test_end_to_end)
    assert row["sampling_hz"] > 0 and row["update_frame_rate"] >= 0
    # the efficiency is against the bare env stepping the trained policy's actions; random actions for comparison
    assert row["sampling_efficiency"] == pytest.approx(
        row["sampling_hz"] / (row["samplers"] * row["raw_env_hz_policy"]), rel=1e-6)
    assert row["sampling_efficiency_vs_random"] == pytest.approx(
        row["sampling_hz"] / (row["samplers"] * row["raw_env_hz_random"]), rel=1e-6)
    assert row["learner_efficiency"] == pytest.approx(row["update_frame_rate"] / row["isolated_update_frame_rate"],
                                                      rel=1e-6)
    assert 0 <= row["fetch_share"] < 1 or (row["update_frame_rate"] == 0 and math.isnan(row["fetch_share"]))
    assert "sampling_efficiency:" in out and "learner_efficiency:" in out and "| env |" in out
    assert "raw_env_hz_random:" in out and "raw_env_hz_policy:" in out
    assert (tmp_path / "throughput-Pendulum-v1.png").stat().st_size > 10_000


def test_policy_rollout_is_recorded_with_exploration_and_replayed_on_the_same_trajectory():
    import dataclasses

    import numpy as np
    import torch

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import ActionScaler, make_env

    actor = make_actor(Config(env_id="Pendulum-v1", hidden_size=32), 3, 1)
    scale = ActionScaler([-2.0], [2.0])
    rec = throughput.record_rollout("Pendulum-v1", throughput.exploring_policy(actor, scale, 0.2, seed=3),
                                    seed=11, steps=450)
    assert rec.actions.shape == (450, 1) and rec.observations.shape == (450, 3)
    assert rec.episode_ends == 2  # Pendulum's 200-step limit, twice: resets are part of the trajectory
    # the actions are the actor's with its exploration, its noise drawn from the given seed: the same policy
    # fed the recorded observations acts the same, and its deterministic actions differ
    env, first_obs = make_env("Pendulum-v1", 11)
    env.close()
    inputs = np.vstack([first_obs[None], rec.observations[:-1]]).astype(np.float32)
    again = throughput.exploring_policy(actor, scale, 0.2, seed=3)
    assert np.allclose([again(o) for o in inputs], rec.actions, atol=1e-6)
    greedy = scale(actor.act(torch.from_numpy(inputs), deterministic=True).numpy())
    assert not np.allclose(greedy, rec.actions, atol=1e-3)
    # replaying those actions from the same reset seed steps exactly the recorded trajectory ...
    assert np.array_equal(throughput.replay_observations(rec), rec.observations)
    timed = throughput.replay_env_hz(rec, 0.2)
    assert timed["passes"] >= 1 and timed["steps"] >= len(rec.actions) and timed["reproduced"] and timed["hz"] > 0
    # ... and from another seed it does not, so the check above is not trivial
    other = dataclasses.replace(rec, seed=12)
    assert not np.array_equal(throughput.replay_observations(other), rec.observations)
    assert not throughput.replay_env_hz(other, 0.01)["reproduced"]


@pytest.mark.slow
def test_faults_drill_kills_a_sampler_holding_the_weights_lock_and_the_run_goes_on(tmp_path):
    from spreeze.weights import LOCK_TIMEOUT_S

    row = faults.weights_lock_drill(tmp_path, minutes=0.3)
    what = row["what happened"]
    assert "killed inside the lock" in what and "supervisor freed the lock" in what, what
    assert "learner published again" in what and "no weights-lock timeout" in what and what.endswith("exit 0"), what
    # freed at the sampler's restart (recover_lock waits 1 s for a live holder first), long before the
    # learner's blocked publish would have timed out and ended the run
    assert 0 < row["noticed/restarted (s)"] < LOCK_TIMEOUT_S
    assert (tmp_path / "weights-lock.marker.claim").exists()


def test_weights_lock_env_is_plain_pendulum_outside_sampler_processes(tmp_path, monkeypatch):
    import gymnasium as gym

    marker = tmp_path / "marker"
    monkeypatch.setenv(faults.LOCK_MARKER_VAR, str(marker))
    env = gym.make(f"benchmarks.faults:{faults.WEIGHTS_LOCK_ENV}")
    env.reset(seed=0)
    for _ in range(5):
        env.step(env.action_space.sample())
    env.close()
    assert not marker.exists() and not (tmp_path / "marker.claim").exists()


def test_faults_only_rows_replace_the_same_faults_in_the_full_table(tmp_path):
    from benchmarks.common import write_csv

    keys = ("fault", "what happened")
    write_csv(tmp_path / "faults.csv", [dict(zip(keys, ("a", "old"))), dict(zip(keys, ("b", "old")))])
    merged = faults.merge_rows(tmp_path / "faults.csv", [dict(zip(keys, ("b", "new"))), dict(zip(keys, ("c", "new")))])
    assert [(r["fault"], r["what happened"]) for r in merged] == [("a", "old"), ("b", "new"), ("c", "new")]
    assert faults.merge_rows(tmp_path / "missing.csv", merged[:1]) == merged[:1]


def test_first_reach_single_test_and_rolling_mean():
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    returns = [-900, -150, -800, -190, -180]
    assert race.first_reach(times, returns, -200) == 2.0
    assert race.first_reach(times, returns, -200, window=2) == 5.0  # -150 alone is not a trend
    assert race.first_reach(times, returns, -500, window=2) == 3.0
    assert race.first_reach(times, returns, -200, window=3) is None
    assert race.first_reach(times, returns, -400, window=3) == 4.0
    assert race.first_reach([], [], 0.0) is None


def _read(path):
    return list(csv.DictReader(open(path)))


@pytest.mark.slow
def test_race_runs_both_frameworks_and_reports_measured_times(tmp_path, capsys, monkeypatch):
    pytest.importorskip("stable_baselines3")
    monkeypatch.setenv("SPREEZE_CACHE_DIR", str(tmp_path / "cache"))
    assert race.main(["--env", "Pendulum-v1", "--seconds", "10", "--eval-interval-s", "1", "--levels", "-1500", "-200",
                      "--project-args", FAST_PENDULUM, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    curves = _read(tmp_path / "race-Pendulum-v1.csv")
    summary = {row["framework"]: row for row in _read(tmp_path / "race-Pendulum-v1-summary.csv")}
    assert set(summary) == {"spreeze", "stable-baselines3"}
    assert json.loads((tmp_path / "race-Pendulum-v1-machine.json").read_text())["cpu_model"]
    for name, row in summary.items():
        curve = [p for p in curves if p["framework"] == name]
        assert len(curve) >= 3, name  # a test about every second of a 10 s budget
        times = [float(p["time_s"]) for p in curve]
        returns = [float(p["test_return"]) for p in curve]
        assert times == sorted(times) and 0 < times[0] and times[-1] <= 10
        assert float(row["final_test_return"]) == pytest.approx(returns[-1])
        reached = race.first_reach(times, returns, -1500)
        assert (row["first_test_-1500_s"] or None) == (None if reached is None else str(reached))
        assert int(row["env_steps"]) > 0
    assert int(summary["stable-baselines3"]["updates"]) > 0
    assert float(summary["spreeze"]["startup_s"]) > 0
    ours = [p for p in curves if p["framework"] == "spreeze"]  # the counts within the budget, not to the run's stop
    within = json.loads((tmp_path / "race-Pendulum-v1-spreeze-summary.json").read_text())["within_budget"]
    assert (within["env_steps"], within["updates"]) == (int(ours[-1]["env_steps"]), int(ours[-1]["updates"]))
    assert (tmp_path / "race-Pendulum-v1.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "race-Pendulum-v1-sb3-summary.json").read_text())["hyperparameters"]["learning_rate"] == "0.001"
    assert "spreeze_final_test_return:" in out and "sb3_first_test_-200_s:" in out and "| framework |" in out
    reused, reused_summary = race.load_sb3("Pendulum-v1", tmp_path)  # --reuse-sb3 reads back the same curve
    sb3_rows = [p for p in curves if p["framework"] == "stable-baselines3"]
    assert [r["test_return"] for r in reused] == [float(p["test_return"]) for p in sb3_rows]
    assert reused_summary["reused_from"] == str(tmp_path)


@pytest.mark.slow
def test_transfer_compares_shared_memory_with_queues_on_measured_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPREEZE_CACHE_DIR", str(tmp_path / "cache"))
    assert transfer.main(["--env", "Pendulum-v1", "--seconds", "7", "--queue-sizes", "2", "--eval-interval-s", "1",
                          "--project-args", FAST_PENDULUM, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {row["transport"]: row for row in _read(tmp_path / "transfer-Pendulum-v1.csv")}
    assert set(rows) == {"shm", "queue-2"}
    curves = _read(tmp_path / "transfer-Pendulum-v1-curves.csv")
    # How far a 7 s run gets depends on the machine's load (children still starting when the budget ends step
    # no env and do no update): the checks are on what each run recorded and on the report's structure.
    for name, row in rows.items():
        steps, updates = int(row["env_steps"]), int(row["updates"])
        assert float(row["transfer_mb_s"]) == pytest.approx(float(row["sampling_hz"]) * 4 * (2 * 3 + 1 + 2) / 1e6,
                                                            rel=1e-6)
        fetch_share, update_hz = float(row["fetch_share"]), float(row["update_frequency_hz"])
        if updates > 0:  # after the warm-up (--learning-starts 300), with its fetches and updates timed
            assert steps >= 300 and 0 < fetch_share < 1
        else:
            assert steps >= 0 and math.isnan(fetch_share) and update_hz == 0
        per_update = 1000 * fetch_share / update_hz if update_hz > 0 else math.nan
        assert float(row["fetch_ms_per_update"]) == pytest.approx(per_update, rel=1e-6, nan_ok=True)
        returns = [float(c["test_return"]) for c in curves if c["transport"] == name]
        assert all(float(c["time_s"]) <= 7 for c in curves if c["transport"] == name)  # the same wall time
        if returns:
            assert float(row["best_test_return"]) == max(returns)
        else:
            assert math.isnan(float(row["best_test_return"]))
    assert {c["transport"] for c in curves} <= set(rows)
    assert (tmp_path / "transfer-Pendulum-v1.png").stat().st_size > 10_000
    assert "shm_fetch_share:" in out and "queue2_fetch_share:" in out
    assert "shm_lower_fetch_share_than_every_queue:" in out


def test_race_helpers_zoo_schedule_and_medians_over_seeds():
    from benchmarks.sb3_sac import hyperparameters, learning_rate

    schedule = learning_rate(hyperparameters("Walker2DBulletEnv-v0")["learning_rate"])
    assert schedule(1.0) == pytest.approx(7.3e-4) and schedule(0.5) == pytest.approx(3.65e-4)
    assert learning_rate(hyperparameters("HalfCheetahBulletEnv-v0")["learning_rate"]) == pytest.approx(7.3e-4)
    assert hyperparameters("Walker2DBulletEnv-v0", "sb3-crossq")["policy_kwargs"] == {"use_expln": True,
                                                                                      "log_std_init": -3}
    # the MuJoCo stand-ins take the zoo's MuJoCo anchor (a 10k-step warm-up for SAC), not SB3's bare defaults
    assert hyperparameters("Walker2d-v5") == {"n_timesteps": 1_000_000, "learning_starts": 10_000}
    assert hyperparameters("Swimmer-v4")["gamma"] == 0.9999 and hyperparameters("Humanoid-v5")["n_timesteps"] == 2e6
    assert hyperparameters("Hopper-v5", "sb3-crossq")["policy_delay"] == 3
    assert hyperparameters("Reacher-v5") == {}  # an env the zoo does not tune for SAC: the library's defaults
    rows = [{"framework": "x", "seed": s, "final": f, "first_test_100_s": t, "startup_s": u} for s, f, t, u in
            ((1, 10.0, 5.0, None), (2, 30.0, None, None), (3, 20.0, 7.0, None))]
    median = race.aggregate("x", rows)
    assert median["final"] == 20.0 and median["final_range"] == "10..30"
    assert median["first_test_100_s"] == 7.0 and median["first_test_100_s_range"] == "5..7 +never"  # never: latest
    assert median["startup_s"] is None and median["startup_s_range"] == ""  # not measured is not "never"
    rows[0]["first_test_100_s"] = None
    assert race.aggregate("x", rows)["first_test_100_s"] is None  # two of three never reached it


def test_sb3_opponent_trains_snapshots_and_leaves_no_log_folder_in_tempdir(tmp_path, monkeypatch):
    """SB3's default logger makes an empty tempdir/SB3-<time> folder on every learn(); a race must not leave one."""
    pytest.importorskip("stable_baselines3")
    import tempfile
    import time

    import torch
    import torch._dynamo  # noqa: F401  its import makes <tempdir>/torchinductor_<user> (torch's, not SB3's):
    # imported here, as earlier tests of the suite do, so the check below sees only what training leaves

    from benchmarks.sb3_sac import train

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    summary = train("Pendulum-v1", seconds=3.0, launched_at=time.time(), snapshot_interval_s=0.5, seed=1,
                    out=tmp_path)
    assert summary["env_steps"] > 0 and summary["stopped_by"] == "seconds"
    saved = torch.load(tmp_path / "sb3_snapshots.pt", weights_only=False)
    assert len(saved["snapshots"]) >= 2 and saved["summary"]["env_steps"] == summary["env_steps"]
    assert list(scratch.iterdir()) == []


def test_reused_opponent_curves_must_fit_the_race(tmp_path, capsys, monkeypatch):
    """--reuse-sb3 reads another race's opponent curves: only from this machine, of this opponent, with a
    curve per seed when several are raced, from a run at least as long as this race (cut at its budget)."""
    from benchmarks.common import machine, write_csv

    env = "HopperBulletEnv-v0"
    seeded = [p for s in (1, 2) for p in _curve("stable-baselines3", s, range(10, 210, 10), range(20))]
    write_csv(tmp_path / f"race-{env}.csv", seeded)
    for s in (1, 2):
        (tmp_path / f"race-{env}-seed{s}-sb3-summary.json").write_text(json.dumps({"seed": s}))
    curve, summary = race.load_sb3(env, tmp_path, 2, seconds=100, opponent="sb3-sac", several=True)
    assert [p["time_s"] for p in curve] == [float(t) for t in range(10, 110, 10)]  # cut at the race's 100 s
    # what these files do not record cannot be checked: listed in the summary (and printed by the race)
    assert summary == {"seed": 2, "reused_from": str(tmp_path),
                       "reuse_unchecked": ["its budget", "the zoo settings it trained with"]}
    refusals = [(dict(seconds=300), "shorter"), (dict(opponent="sb3-crossq"), "not sb3-crossq")]
    for kwargs, words in refusals:
        with pytest.raises(ValueError, match=words):
            race.load_sb3(env, tmp_path, 1, **kwargs)
    # a run its own race's clock stopped earlier, or tested at another interval or with more episodes: refused
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps(
        {"seed": 1, "stopped_by": "seconds", "wall_time_s": 150.5, "eval_interval_s": 10.0, "eval_episodes": 1}))
    assert race.load_sb3(env, tmp_path, 1, seconds=150, eval_interval_s=10, eval_episodes=1)[0]
    for kwargs, words in ((dict(seconds=160), "stopped by its clock at 150 s"),
                          (dict(seconds=100, eval_interval_s=5), "--eval-interval-s 10, this race with 5"),
                          (dict(seconds=100, eval_episodes=3), "--eval-episodes 1, this race with 3")):
        with pytest.raises(ValueError, match=words):
            race.load_sb3(env, tmp_path, 1, **kwargs)
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps(  # stopped by the zoo's length: ran whole
        {"seed": 1, "stopped_by": "n_timesteps", "wall_time_s": 150.5}))
    assert race.load_sb3(env, tmp_path, 1, seconds=160)[0]
    assert race.load_sb3(env, tmp_path, 1, seconds=900)[0]  # its curve ends long before this race's budget: whole
    # trained with the zoo's settings of this race: kept; with others (here a constant rate, not lin_7.3e-4): refused
    from benchmarks.sb3_sac import hyperparameters

    from spreeze.evaluator import EVAL_SEED_SCHEME

    zoo = {k: str(v) for k, v in hyperparameters(env).items()}
    for settings, refused in (({**zoo, "learning_rate": "0.00073"}, True), (zoo, False)):
        (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps({"seed": 1, "hyperparameters": settings}))
        if refused:
            with pytest.raises(ValueError, match="other settings than the zoo's .*learning_rate"):
                race.load_sb3(env, tmp_path, 1, seconds=100)
        else:
            assert race.load_sb3(env, tmp_path, 1, seconds=100)[0]
    # a shorter budget than this race's is refused; a summary that records everything leaves nothing unchecked
    recorded = {"seed": 1, "hyperparameters": zoo, "budget_s": 150.0, "eval_interval_s": 10.0, "eval_episodes": 1}
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match="budget of 150 s: shorter than this race's 160 s"):
        race.load_sb3(env, tmp_path, 1, seconds=160, eval_interval_s=10, eval_episodes=1)
    ended = {**recorded, "stopped_by": "n_timesteps", "wall_time_s": 148.0}  # its zoo's length ran whole: kept
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps(ended))
    assert race.load_sb3(env, tmp_path, 1, seconds=160, eval_interval_s=10, eval_episodes=1)[0]
    # what an earlier reuse could not check is not carried over to one that checked it all
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps({**recorded, "reuse_unchecked": ["x"]}))
    assert "reuse_unchecked" not in race.load_sb3(env, tmp_path, 1, seconds=100, eval_interval_s=10,
                                                  eval_episodes=1)[1]
    # several episodes a test: only from curves tested from this version's start states
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps({**recorded, "eval_episodes": 3}))
    with pytest.raises(ValueError, match="start states of an earlier version"):
        race.load_sb3(env, tmp_path, 1, seconds=100, eval_interval_s=10, eval_episodes=3)
    (tmp_path / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps(
        {**recorded, "eval_episodes": 3, "eval_seed_scheme": EVAL_SEED_SCHEME}))
    assert race.load_sb3(env, tmp_path, 1, seconds=100, eval_interval_s=10, eval_episodes=3)[0]
    for name in (f"race-{env}-seed1-sb3-summary.json", f"race-{env}-sb3-summary.json"):  # nothing recorded
        (tmp_path / name).write_text(json.dumps({"seed": 1}))
    write_csv(tmp_path / f"race-{env}.csv", [{k: v for k, v in p.items() if k != "seed"} for p in seeded[:20]])
    # one curve without seeds serves a one-seed race, its seed said to be unchecked
    unchecked = race.load_sb3(env, tmp_path, 1, seconds=200)[1]["reuse_unchecked"]
    assert unchecked[0] == "the curve's seed (this race's is 1)" and "its budget" in unchecked
    assert "the run's own summary" in race.load_sb3(env, tmp_path, 3, seconds=200)[1]["reuse_unchecked"][1]
    with pytest.raises(ValueError, match="without seeds"):
        race.load_sb3(env, tmp_path, 1, seconds=200, several=True)
    # another machine's curves: refused before anything runs
    (tmp_path / f"race-{env}-machine.json").write_text(json.dumps({**machine(), "cpu_model": "another CPU"}))
    with pytest.raises(SystemExit):
        race.main(["--env", env, "--seconds", "100", "--levels", "300", "--reuse-sb3", str(tmp_path),
                   "--out", str(tmp_path / "o")])
    assert "another machine" in capsys.readouterr().err
    # every seed's reused curve is checked before any spreeze run (which would otherwise be lost to the refusal)
    here = machine()  # one timing of the CPU's speed: a second on a loaded runner could differ by more than allowed
    monkeypatch.setattr(race, "machine", lambda: here)
    (tmp_path / f"race-{env}-machine.json").write_text(json.dumps(here))
    ran = []
    monkeypatch.setattr(race, "run_spreeze", lambda *a, **k: ran.append(a) or ([], {}))
    with pytest.raises(SystemExit):
        race.main(["--env", env, "--seconds", "100", "--levels", "300", "--seeds", "2", "--reuse-sb3", str(tmp_path),
                   "--out", str(tmp_path / "o")])
    assert "without seeds" in capsys.readouterr().err and ran == []
    with pytest.raises(SystemExit):  # flags the race sets for both sides
        race.main(["--env", env, "--seconds", "100", "--levels", "300", "--project-args", "--seed 3",
                   "--out", str(tmp_path / "o")])
    assert "may not set --seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the long spelling of --env, and a value after "="
        race.main(["--env", env, "--seconds", "100", "--levels", "300", "--project-args=--env-id=Pendulum-v1",
                   "--out", str(tmp_path / "o")])
    assert "may not set --env-id" in capsys.readouterr().err
    unfair_flags = (("--deterministic", "every --eval-every-steps env steps"), ("--eval-every-steps=500", "lock-step"),
                    ("--config=s.yaml", "settings file"), ("--config-file s.yaml", "settings file"))
    for unfair, words in unfair_flags:
        with pytest.raises(SystemExit):  # spreeze's side only: its tests on another schedule, or any setting
            race.main(["--env", env, "--seconds", "100", "--levels", "300", f"--project-args={unfair}",
                       "--out", str(tmp_path / "o")])
        assert words in capsys.readouterr().err


def test_reused_curves_must_come_from_a_cpu_of_the_same_part_and_speed(tmp_path):
    """The same model name ("AMD EPYC") on a host with half the speed: the opponent's curves would run twice as
    long there, so they are refused; an older race that recorded no speed passes with a warning."""
    env, here = "HopperBulletEnv-v0", {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "usable_cores": 2,
                                       "gpus": "none", "cpu_id": "family 25 model 17 stepping 1", "cpu_gflops": 80.0}
    path = tmp_path / f"race-{env}-machine.json"
    for then, words in (({"cpu_gflops": 160.0}, "another speed"), ({"cpu_gflops": 40.0}, "another speed"),
                        ({"cpu_id": "family 25 model 1 stepping 1"}, "cpu_id")):
        path.write_text(json.dumps({**here, **then}))
        with pytest.raises(ValueError, match=words):
            race.check_same_machine(env, tmp_path, here)
    path.write_text(json.dumps({**here, "cpu_gflops": 95.0}))  # timing noise between runs
    assert race.check_same_machine(env, tmp_path, here) is None
    path.write_text(json.dumps({k: v for k, v in here.items() if k not in ("cpu_id", "cpu_gflops")}))
    assert "recorded for the opponent's curves" in race.check_same_machine(env, tmp_path, here)
    path.write_text(json.dumps(here))
    assert "recorded for this machine" in race.check_same_machine(env, tmp_path, {**here, "cpu_gflops": None})
    # a race that reused curves records the machine they came from: reusing that race's checks against it
    path.write_text(json.dumps({**here, "cpu_gflops": 40.0, "opponent_machine": {**here, "cpu_gflops": 160.0}}))
    with pytest.raises(ValueError, match="160 GFLOP/s there"):
        race.check_same_machine(env, tmp_path, {**here, "cpu_gflops": 40.0})


def test_a_race_on_curves_of_unrecorded_speed_warns_and_passes_their_origin_on(tmp_path, capsys, monkeypatch):
    from benchmarks.common import write_csv

    env, here = "HopperBulletEnv-v0", {"cpu_model": "a CPU", "cpu_flags": [], "usable_cores": 2, "gpus": "none",
                                       "cpu_id": None, "cpu_gflops": 80.0}
    old = tmp_path / "old"
    old.mkdir()
    write_csv(old / f"race-{env}.csv", _curve("stable-baselines3", 1, range(10, 110, 10), range(10)))
    (old / f"race-{env}-seed1-sb3-summary.json").write_text(json.dumps({"seed": 1}))
    origin = {k: v for k, v in here.items() if k != "cpu_gflops"}  # recorded before speeds were
    (old / f"race-{env}-machine.json").write_text(json.dumps(origin))
    monkeypatch.setattr(race, "machine", lambda: here)
    monkeypatch.setattr(race, "run_spreeze", lambda *a, **k: (_curve("spreeze", 1, range(10, 110, 10), range(10)),
                                                              {"seed": 1}))
    out = tmp_path / "new"
    assert race.main(["--env", env, "--seconds", "100", "--levels", "5", "--reuse-sb3", str(old),
                      "--out", str(out)]) == 0
    assert "[race] warning: no CPU speed (cpu_gflops) recorded for the opponent's curves" in capsys.readouterr().out
    assert "no CPU speed" in json.loads((out / f"race-{env}-seed1-sb3-summary.json").read_text())["machine_warning"]
    recorded = json.loads((out / f"race-{env}-machine.json").read_text())
    assert recorded["cpu_gflops"] == 80.0 and recorded["opponent_machine"] == origin
    assert "no CPU speed" in race.check_same_machine(env, out, here)  # still unverified when reused again


def test_machine_records_the_cpu_part_and_its_speed():
    from benchmarks.common import cpu_gflops, machine

    recorded = machine()
    assert recorded["cpu_gflops"] > 0 and "cpu_id" in recorded
    if Path("/proc/cpuinfo").exists() and "cpu family" in Path("/proc/cpuinfo").read_text():
        assert recorded["cpu_id"].startswith("family ")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        cpu_gflops(seconds=0.03)
        assert torch.get_num_threads() == 3  # timed on one thread, the caller's setting given back
    finally:
        torch.set_num_threads(before)


def test_race_alternates_which_side_runs_first(tmp_path, monkeypatch):
    """By default the side that runs first alternates over seeds: a slow drift of the machine (heat, caches) does
    not always land on the same side."""
    ran = []

    def fake(name):
        def run(env_id, seconds, interval, episodes, seed, *rest):
            ran.append((seed, name))
            return _curve(name, seed, range(10, 110, 10), range(10)), {"seed": seed}
        return run

    monkeypatch.setattr(race, "run_spreeze", fake("spreeze"))
    monkeypatch.setattr(race, "run_sb3", fake("stable-baselines3"))
    assert race.main(["--env", "HopperBulletEnv-v0", "--seconds", "100", "--levels", "5", "--seeds", "3",
                      "--out", str(tmp_path)]) == 0
    assert ran == [(1, "spreeze"), (1, "stable-baselines3"), (2, "stable-baselines3"), (2, "spreeze"),
                   (3, "spreeze"), (3, "stable-baselines3")]


def _curve(name, seed, times, returns):
    return [{"framework": name, "seed": seed, "time_s": float(t), "env_steps": 100 * i, "updates": 10 * i,
             "test_return": float(r)} for i, (t, r) in enumerate(zip(times, returns))]


def test_race_versus_reads_the_issue_targets_and_from_csv_reports_again(tmp_path, capsys):
    from benchmarks.common import write_csv

    sb3 = [100, 200, 300, 400, 500, 500, 500, 300, 300, 300]  # best mean of 5: 440, first at the 7th test (70 s)
    curves = {"spreeze": {1: _curve("spreeze", 1, range(5, 55, 5), [400, 500, 500, 500, 500, 500, 500, 500, 500, 100]),
                          2: _curve("spreeze", 2, range(10, 110, 10), [100] * 10),
                          3: _curve("spreeze", 3, range(10, 110, 10), [100] * 10)},
              "stable-baselines3": {1: _curve("stable-baselines3", 1, range(10, 110, 10), sb3),
                                    2: _curve("stable-baselines3", 2, range(10, 110, 10), sb3),
                                    3: _curve("stable-baselines3", 3, range(10, 110, 10), [50] * 10)}}
    rows = race.versus(curves, "stable-baselines3")
    first, second, third, median, spread = rows
    assert first["opponent_best_mean5"] == pytest.approx(440) and first["opponent_best_mean5_s"] == 70.0
    assert first["reach_opponent_best_s"] == 25.0 and first["reach_ratio"] == pytest.approx(25 / 70)
    assert first["spreeze_final_mean_last5"] == pytest.approx(420) and first["spreeze_ends_higher"] is True
    assert first["spreeze_last5_of_best"] == pytest.approx(420 / 500)
    assert first["opponent_last5_of_best"] == pytest.approx(380 / 440)
    assert second["reach_opponent_best_s"] is None and second["reach_ratio"] is None  # never: no ratio
    assert second["spreeze_ends_higher"] is False and second["spreeze_last5_of_best"] == pytest.approx(1.0)
    assert third["opponent_best_mean5_s"] == 50.0 and third["reach_opponent_best_s"] == 50.0  # its own opponent
    assert third["reach_ratio"] == 1.0 and third["spreeze_ends_higher"] is True
    assert median["seed"] == "median of 3" and median["spreeze_ends_higher"] == "2 of 3"
    assert median["reach_ratio"] == 1.0 and spread["reach_ratio"] == f"{25 / 70:.4g}..1 +never"
    assert race.held(-100.0, -50.0) != race.held(-100.0, -50.0)  # no "kept" ratio of negative returns (nan)
    undefined = race.aggregate("x", [{"framework": "x", "seed": s, "last5_of_best": v} for s, v in
                                     ((1, 0.9), (2, float("nan")), (3, 0.8))])
    # the median of the seeds that have the figure, and the range says how many those were
    assert undefined["last5_of_best"] == pytest.approx(0.85)
    assert undefined["last5_of_best_range"] == "0.8..0.9 (2 of 3 seeds)"

    write_csv(tmp_path / "race-HopperBulletEnv-v0.csv", [p for side in curves.values() for c in side.values() for p in c])
    (tmp_path / "race-HopperBulletEnv-v0-seed1-spreeze-summary.json").write_text(json.dumps({"startup_s": 4.5}))
    out = tmp_path / "again"
    assert race.main(["--env", "HopperBulletEnv-v0", "--seconds", "100", "--levels", "300", "--out", str(out),
                      "--from-csv", str(tmp_path / "race-HopperBulletEnv-v0.csv")]) == 0
    assert "reach_ratio_to_opponent_best_mean5: 1.0" in capsys.readouterr().out  # the median of 3
    versus_rows = _read(out / "race-HopperBulletEnv-v0-versus.csv")
    assert [r["seed"] for r in versus_rows] == ["1", "2", "3", "median of 3", "range"]
    assert float(versus_rows[0]["reach_ratio"]) == pytest.approx(25 / 70)
    summary = {(r["framework"], r["seed"]): r for r in _read(out / "race-HopperBulletEnv-v0-summary.csv")}
    assert summary[("spreeze", "1")]["startup_s"] == "4.5" and summary[("spreeze", "2")]["startup_s"] == ""
    assert summary[("spreeze", "1")]["first_test_300_s"] == "5.0"
    assert summary[("spreeze", "1")]["env_steps"] == "900"
    assert not (out / "race-HopperBulletEnv-v0.csv").exists()  # the curves are not written twice
    # reported again at a shorter budget: every figure from the tests up to it (as a race of that budget cuts)
    assert race.main(["--env", "HopperBulletEnv-v0", "--seconds", "40", "--levels", "300", "--out",
                      str(tmp_path / "short"), "--from-csv", str(tmp_path / "race-HopperBulletEnv-v0.csv")]) == 0
    short = {(r["framework"], r["seed"]): r for r in _read(tmp_path / "short" / "race-HopperBulletEnv-v0-summary.csv")}
    assert short[("spreeze", "1")]["tests"] == "8" and short[("stable-baselines3", "1")]["tests"] == "4"
    assert short[("stable-baselines3", "1")]["final_mean_last5"] == "nan"  # under 5 tests: no mean of the last 5
    write_csv(tmp_path / "race-HopperBulletEnv-v0.csv",  # the opponent raced other seeds: refused
              [p for name, side in curves.items() for seed, c in side.items() for p in c
               if name == "spreeze" or seed != 3])
    for refused in (["--env", "HopperBulletEnv-v0"], ["--env", "Walker2DBulletEnv-v0"],  # seeds; another env's name
                    ["--env", "HopperBulletEnv-v0", "--out", str(tmp_path)]):  # over the race's own files
        with pytest.raises(SystemExit):
            race.main(refused + ["--seconds", "100", "--levels", "300",
                                 "--from-csv", str(tmp_path / "race-HopperBulletEnv-v0.csv")])


@pytest.mark.slow
def test_compare_runs_each_setting_and_reports_medians(tmp_path, capsys):
    from benchmarks import compare

    assert compare.main(["--env", "Pendulum-v1", "--seconds", "7", "--seeds", "1", "--eval-interval-s", "1",
                         "--levels", "-1500", "--setting", f"one={FAST_PENDULUM}",
                         "--setting", f"three={FAST_PENDULUM} --n-step 3", "--out", str(tmp_path),
                         "--keep-runs"]) == 0
    out = capsys.readouterr().out
    rows = _read(tmp_path / "compare-Pendulum-v1-summary.csv")
    assert {r["framework"] for r in rows} == {"one", "three"}
    curves = _read(tmp_path / "compare-Pendulum-v1.csv")
    for row in rows:
        mine = [float(c["test_return"]) for c in curves if c["framework"] == row["framework"]]
        assert mine and float(row["final_test_return"]) == pytest.approx(mine[-1])
    assert json.loads((tmp_path / "compare-Pendulum-v1-settings.json").read_text())["three"].endswith("--n-step 3")
    machine = json.loads((tmp_path / "compare-Pendulum-v1-machine.json").read_text())  # which CPU ran it
    assert machine["cpu_model"] and isinstance(machine["cpu_flags"], list) and machine["usable_cores"] >= 1
    assert "one_best_mean5_median:" in out and (tmp_path / "compare-Pendulum-v1.png").stat().st_size > 10_000
    kept = tmp_path / "compare-Pendulum-v1-three-seed1"  # --keep-runs: what the run decided, not its checkpoints
    assert json.loads((kept / "config.json").read_text())["n_step"] == 3
    assert "batch_size" in json.loads((kept / "autotune.json").read_text())["chosen"]
    assert _read(kept / "evaluations.csv") and "[spreeze]" in (kept / "spreeze.log").read_text()
    assert not list(kept.glob("*.pt")) and not (tmp_path / "compare-Pendulum-v1-one-seed1" / "checkpoints").exists()
    with pytest.raises(SystemExit):
        compare.main(["--env", "Pendulum-v1", "--seconds", "1", "--levels", "0", "--setting", "no-equals-sign"])


def test_a_compare_setting_may_not_change_what_the_comparison_holds_equal():
    from benchmarks import compare

    assert compare.parse_setting("lin=--deterministic --total-steps 500 --eval-every-steps 100 --n-step 3") == \
        ("lin", ["--deterministic", "--total-steps", "500", "--eval-every-steps", "100", "--n-step", "3"])
    for flags, named in (("--seed 3", "--seed"), ("--eval-interval-s=1", "--eval-interval-s"),
                         ("--env-id Pendulum-v1", "--env-id"), ("--config s.yaml", "--config-file"),
                         ("--minutes 1 --eval-episodes 2", "--eval-episodes, --minutes")):
        with pytest.raises(ValueError, match=f"may not set {named}"):
            compare.parse_setting(f"x={flags}")
    with pytest.raises(ValueError, match="do not parse"):  # run.py's parser's exit becomes the benchmark's error
        compare.parse_setting("x=--n-step abc")


def test_a_run_that_ends_on_its_best_kept_all_of_it():
    """The last 5 tests' mean and the best mean of 5 come from one computation: a run ending on its best kept 1.0
    of it, not 1.0000000000000002 (float sums in another order)."""
    returns = [2594.0557709788186, 2698.475992483635, 2708.914398845625, 2693.322874163666, 2742.444347963895]
    curve = [{"time_s": float(i), "env_steps": i, "updates": i, "test_return": r} for i, r in enumerate(returns)]
    row = race.summarize("spreeze", curve, [])
    assert row["final_mean_last5"] == row["best_mean5"] and row["last5_of_best"] == 1.0
    assert race.judged_final(returns) == row["best_mean5"]


def test_race_versus_skips_a_nan_test_and_leaves_an_undefined_seed_out_instead_of_counting_it_never():
    nan = float("nan")
    sb3 = [100, 200, nan, 400, 500, 500, 500, 500, 500, 300]  # windows with the NaN skipped: best mean 500 at 90 s
    curves = {"spreeze": {1: _curve("spreeze", 1, range(10, 110, 10), [600] * 10),
                          2: _curve("spreeze", 2, range(10, 110, 10), [600] * 10),
                          3: _curve("spreeze", 3, range(10, 110, 10), [100] * 10)},
              "stable-baselines3": {1: _curve("stable-baselines3", 1, range(10, 110, 10), sb3),
                                    2: _curve("stable-baselines3", 2, range(10, 50, 10), [50] * 4),  # no mean of 5
                                    3: _curve("stable-baselines3", 3, range(10, 110, 10), [50] * 10)}}
    assert race.best_mean(sb3) == pytest.approx(500) and race.best_mean(sb3, 1) == 500
    first, second, third, median, spread = race.versus(curves, "stable-baselines3")
    assert first["opponent_best_mean5"] == pytest.approx(500) and first["opponent_best_mean5_s"] == 90.0
    assert first["reach_opponent_best_s"] == 50.0 and first["reach_ratio"] == pytest.approx(50 / 90)
    # seed 2: the opponent has no mean of 5, so there is nothing to reach and no end to compare: undefined
    assert second["reach_ratio"] != second["reach_ratio"] and second["spreeze_ends_higher"] is None
    assert third["reach_ratio"] == 1.0 and third["spreeze_ends_higher"] is True
    assert median["spreeze_ends_higher"] == "2 of 2"
    assert median["reach_ratio"] == pytest.approx((50 / 90 + 1) / 2)
    assert spread["reach_ratio"] == f"{50 / 90:.4g}..1 (2 of 3 seeds)"
    # spreeze without its own last 5 (a failed run) still loses "ends higher"; undefined everywhere is NaN, not never
    curves["spreeze"][3] = _curve("spreeze", 3, range(10, 40, 10), [100] * 3)
    assert race.versus(curves, "stable-baselines3")[2]["spreeze_ends_higher"] is False
    short = {"spreeze": {s: _curve("spreeze", s, range(10, 110, 10), [600] * 10) for s in (1, 2)},
             "stable-baselines3": {s: _curve("stable-baselines3", s, range(10, 40, 10), [50] * 3) for s in (1, 2)}}
    median, spread = race.versus(short, "stable-baselines3")[2:]
    assert median["reach_ratio"] != median["reach_ratio"] and spread["reach_ratio"] == "undefined (0 of 2 seeds)"
    assert median["spreeze_ends_higher"] == "0 of 0"


def test_a_nan_test_among_the_last_five_is_a_collapse_for_either_side_and_time_ratios_pair_seeds():
    """A policy that diverged (a NaN test in its last 5) kept nothing of its best: as NaN it dropped out of the
    no-collapse median; and it loses "ends higher" on either side, not only on spreeze's."""
    nan = float("nan")
    good = [100, 200, 300, 400, 500, 500, 500, 500, 500, 500]
    curves = {"spreeze": {1: _curve("spreeze", 1, range(10, 110, 10), good[:-1] + [nan]),
                          2: _curve("spreeze", 2, range(10, 110, 10), good)},
              "stable-baselines3": {1: _curve("stable-baselines3", 1, range(10, 110, 10), [50] * 10),
                                    2: _curve("stable-baselines3", 2, range(10, 110, 10), [50] * 9 + [nan])}}
    first, second, median, _ = race.versus(curves, "stable-baselines3")
    assert first["spreeze_last5_of_best"] == 0.0 and first["spreeze_ends_higher"] is False
    assert second["opponent_last5_of_best"] == 0.0 and second["spreeze_ends_higher"] is True
    assert median["spreeze_last5_of_best"] == pytest.approx(0.5)  # (0 + 1) / 2: the collapsed seed counts
    assert race.summarize("x", curves["spreeze"][1], [])["last5_of_best"] == 0.0
    # the printed time ratio: the median of each seed's own ratio, a level never reached infinitely late
    assert race.median_time_ratio([(10.0, 20.0), (30.0, 20.0), (None, 40.0)]) == (1.5, 3)
    assert race.median_time_ratio([(None, 20.0), (None, 20.0), (5.0, 20.0)]) == (None, 3)  # "never"
    assert race.median_time_ratio([(10.0, None), (5.0, 10.0)]) == (0.5, 1)  # the opponent never: left out
    assert race.median_time_ratio([(10.0, None)]) == (None, 0)


def test_compare_on_the_steps_axis_warns_of_a_run_its_clock_stopped(tmp_path, capsys, monkeypatch):
    """--axis steps assumes curves that depend on the seed alone: a run stopped by the clock before its
    --total-steps (a loaded machine) has a shorter curve, and its step figures must not pass unremarked."""
    from benchmarks import compare

    stops = iter(["total_steps", "minutes"])
    monkeypatch.setattr(compare, "run_spreeze", lambda *a, **k: (
        _curve("spreeze", 1, range(10, 60, 10), range(5)), {"startup_s": 1.0, "stopped_by": next(stops)}))
    assert compare.main(["--env", "Pendulum-v1", "--seconds", "100", "--seeds", "2", "--levels", "3", "--axis",
                         "steps", "--setting", "a=--deterministic --total-steps 500", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "a seed 2 was stopped by minutes, not its --total-steps" in err and "seed 1 was stopped" not in err


def test_summarize_times_levels_in_env_steps_with_axis_steps():
    from benchmarks.race import summarize

    curve = [{"time_s": 10.0 * i, "env_steps": 1000 * i, "updates": 100 * i, "test_return": float(r)}
             for i, r in enumerate([0, 50, 150, 80, 200], start=1)]
    by_steps = summarize("a", curve, [100], seed=1, axis="steps")
    by_seconds = summarize("a", curve, [100], seed=1)
    assert by_steps["first_test_100_steps"] == 3000 and by_seconds["first_test_100_s"] == 30.0
    assert "first_test_100_s" not in by_steps


def test_compare_from_csv_merges_earlier_curves_without_running(tmp_path, capsys):
    """--from-csv: two invocations' curve CSVs give one summary with each setting's seeds, timed on --axis."""
    from benchmarks import compare

    for name, label, returns in (("a", "base", [0, 40, 120]), ("b", "new", [0, 150, 90])):
        rows = [{"framework": label, "time_s": 5.0 * i, "env_steps": 1000 * i, "updates": 100 * i,
                 "test_return": float(r), "seed": seed} for seed in (1, 2) for i, r in enumerate(returns)]
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    assert compare.main(["--env", "Pendulum-v1", "--seconds", "1", "--levels", "100", "--axis", "steps",
                         "--name", "merged", "--out", str(tmp_path), "--from-csv",
                         str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    rows = _read(tmp_path / "merged-Pendulum-v1-summary.csv")
    assert [(r["framework"], r["seed"]) for r in rows] == [("base", "1"), ("base", "2"), ("new", "1"), ("new", "2")]
    assert {r["framework"]: float(r["first_test_100_steps"]) for r in rows} == {"base": 2000.0, "new": 1000.0}
    assert (tmp_path / "merged-Pendulum-v1.png").exists() and "base (median of 2)" in capsys.readouterr().out
    # on the seconds axis the curves are cut at --seconds, as the runs themselves were
    assert compare.main(["--env", "Pendulum-v1", "--seconds", "5", "--levels", "100", "--name", "cut",
                         "--out", str(tmp_path), "--from-csv", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    cut = {(r["framework"], r["seed"]): r for r in _read(tmp_path / "cut-Pendulum-v1-summary.csv")}
    assert cut[("new", "1")]["tests"] == "2" and cut[("new", "1")]["first_test_100_s"] == "5.0"
    assert cut[("base", "1")]["first_test_100_s"] == ""  # its 120 came at 10 s, after the cut
    assert "before the 5 s budget" not in capsys.readouterr().err  # each curve reaches 10 s
    with pytest.raises(SystemExit, match="base seed 1"):  # the same setting and seed twice would join two curves
        compare.main(["--env", "Pendulum-v1", "--seconds", "1", "--levels", "100", "--out", str(tmp_path),
                      "--from-csv", str(tmp_path / "a.csv"), str(tmp_path / "a.csv")])
