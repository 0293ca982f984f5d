"""The benchmark commands, end to end in reduced form: they must produce their tables and CSV from
measured numbers (speed targets live in the benchmarks themselves, never in tests)."""
import csv

import pytest

from benchmarks import throughput


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
