"""The benchmark commands, end to end in reduced form: they must produce their tables and CSV from
measured numbers (speed targets live in the benchmarks themselves, never in tests)."""
import csv
import json

import pytest

from benchmarks import race, throughput, transfer

FAST_PENDULUM = "--samplers 1 --envs-per-sampler 2 --batch-size 64 --learning-starts 300 --hidden-size 64"


@pytest.mark.slow
def test_throughput_reports_measured_ratios(tmp_path, capsys):
    assert throughput.main(["--env", "Pendulum-v1", "--seconds", "9", "--samplers", "1", "--batch-sizes", "64",
                            "--envs-per-sampler", "2", "--learning-starts", "500", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "throughput-Pendulum-v1.csv")))
    assert len(rows) == 1
    row = {k: float(v) for k, v in rows[0].items() if k not in ("env", "gpu_usage_percent")}
    assert row["raw_env_hz"] > 1000 and row["sampling_hz"] > 0 and row["update_frame_rate"] > 0
    assert row["sampling_efficiency"] == pytest.approx(row["sampling_hz"] / row["raw_env_hz"], rel=1e-6)
    assert row["learner_efficiency"] == pytest.approx(row["update_frame_rate"] / row["isolated_update_frame_rate"],
                                                      rel=1e-6)
    assert 0 <= row["fetch_share"] < 1
    assert "sampling_efficiency:" in out and "learner_efficiency:" in out and "| env |" in out


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
    assert transfer.main(["--env", "Pendulum-v1", "--seconds", "10", "--queue-sizes", "2", "--eval-interval-s", "1",
                          "--project-args", FAST_PENDULUM, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {row["transport"]: row for row in _read(tmp_path / "transfer-Pendulum-v1.csv")}
    assert set(rows) == {"shm", "queue-2"}
    for row in rows.values():
        assert int(row["updates"]) > 0 and float(row["sampling_hz"]) > 0  # the queue path really trains
        assert 0 < float(row["fetch_share"]) < 1
        assert float(row["transfer_mb_s"]) == pytest.approx(float(row["sampling_hz"]) * 4 * (2 * 3 + 1 + 2) / 1e6,
                                                            rel=1e-6)
    curves = _read(tmp_path / "transfer-Pendulum-v1-curves.csv")
    assert {c["transport"] for c in curves} == {"shm", "queue-2"}
    assert (tmp_path / "transfer-Pendulum-v1.png").stat().st_size > 10_000
    assert "shm_fetch_share:" in out and "queue2_fetch_share:" in out
    assert "shm_lower_fetch_share_than_every_queue:" in out
