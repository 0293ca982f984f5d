"""The ``spreeze`` command: subcommands, help, typos, --version, and ``spreeze bench``."""
import sys

import pytest

import spreeze
from conftest import exit_and_stderr
from launch.cli import COMMANDS, benchmarks, main


def run_main(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_subcommand_and_benchmark(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert out.startswith("usage: spreeze <command>")
    for name in ("train", "play", "plot", "bench"):
        assert f"\n  {name} " in out
    assert "compare, faults, race" in out


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, err = run_main([], capsys)
    assert code == 2 and "commands:" in err and out == ""


@pytest.mark.parametrize("argv, wanted", [
    (["trian"], "did you mean 'train'?"),
    (["plto"], "did you mean 'plot'?"),
    (["benchmark"], "did you mean 'bench'?"),
    (["frobnicate"], "choose from train, play, plot, bench"),
    (["bench", "racee"], "did you mean 'race'?"),
    (["bench", "thruput"], "did you mean 'throughput'?"),
])
def test_a_typo_gets_the_closest_name_in_one_line_and_exit_2(argv, wanted, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and wanted in err and "error: unknown" in err


def test_a_flag_before_the_command_is_refused_in_one_line(capsys):
    code, _, err = run_main(["--env", "Pendulum-v1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "spreeze train --env" in err


def test_version(capsys):
    for flag in ("--version", "-V"):
        code, out, _ = run_main([flag], capsys)
        assert code == 0 and out == f"spreeze {spreeze.__version__}\n"


def test_bench_lists_the_modules_with_a_main():
    names = benchmarks()
    assert {"compare", "race", "throughput", "faults", "transfer", "updates"} <= set(names)
    assert "common" not in names  # helpers, no main
    assert names["race"].startswith("Time-to-return race")


def test_bench_help_and_a_benchmark_s_own_help(capsys):
    code, out, _ = run_main(["bench", "--help"], capsys)
    assert code == 0 and "usage: spreeze bench NAME" in out
    for name in benchmarks():
        assert f"\n  {name} " in out
    code, out, _ = run_main(["bench", "updates", "--help"], capsys)  # the module's main, with the rest of argv
    assert code == 0 and out.startswith("usage: spreeze bench updates")
    assert sys.argv[0] != "spreeze bench updates"  # restored


def test_train_help_is_run_py_s_grouped_help(capsys):
    code, out, _ = run_main(["train", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: spreeze train [--env ENV_ID] [options]")
    assert "\nbudget:\n" in out and "--algo {sac,td3,crossq}" in out
    code, out, _ = run_main(["help", "train"], capsys)
    assert code == 0 and out.startswith("usage: spreeze train")


def test_play_and_plot_name_themselves(tmp_path, capsys):
    code, _, err = run_main(["plot", str(tmp_path / "missing")], capsys)
    assert code == 2 and err.startswith("spreeze plot: error:")
    code, _, err = run_main(["play", str(tmp_path / "missing")], capsys)
    assert code == 2 and err.startswith("spreeze play: error:")


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        code, out, _ = run_main([name, "--help"], capsys)
        assert code == 0 and out.startswith(f"usage: spreeze {name}")


@pytest.mark.parametrize("args, fragment, in_process", [
    # one real `python -m launch`; the rest call the same entry point in this process (a torch import saved each)
    (["--algo", "ppo"], "invalid choice: 'ppo'", False),
    (["--env", "Pendulum-v9"], "Pendulum-v1", True),
    (["--minuts", "1"], "--minuts", True),
])
def test_train_bad_input_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capfd, keep_signal_handlers, args,
                                                         fragment, in_process):
    """As run.py: one line naming the problem, exit 2, nothing written (here through ``python -m launch``)."""
    code, stderr = exit_and_stderr(["train", *args], tmp_path, in_process, monkeypatch, capfd, entry="launch")
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("argv[0]")]
    assert len(lines) == 1 and lines[0].startswith("spreeze train: error:") and fragment in lines[0], stderr
    assert list(tmp_path.iterdir()) == []
