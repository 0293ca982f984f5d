"""The runners: budgets, the best policy, and what a user stopping at the end gets."""
import csv
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMALL_SERIAL as BASE
from spreeze.checkpoint import load_policy
from spreeze.config import Config


def serial_train(tmp_path, **overrides):
    from spreeze.envs import check_env
    from launch.compose import train

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


def test_target_return_not_reached_leaves_the_other_budget_in_charge_in_a_worker_thread_too(tmp_path):
    """Run from a worker thread (a sweep in a thread pool): signal handlers may be set in the main thread only,
    and train() raised there after it had made the run's directory."""
    import threading

    done = {}
    worker = threading.Thread(target=lambda: done.update(
        result=serial_train(tmp_path, target_return=1e6, total_steps=1_000, minutes=2.0)[0]))
    worker.start()
    worker.join(timeout=120)
    result = done["result"]
    assert result.exit_code == 0
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
    assert summary["tests"] == len(evaluations)
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


def test_a_run_with_fewer_than_five_tests_keeps_its_latest_tested_policy_as_best(tmp_path):
    """A short run still leaves a best policy; the first mean of five replaces it whatever its value, as a mean
    of fewer tests is not comparable with it; from then on only a higher mean of five does."""
    from spreeze.algos import make_actor
    from spreeze.envs import check_env
    from spreeze.evaluator import actor_flat
    from spreeze.runlog import RunLog

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"))
    env_info = check_env(config.env_id)
    (tmp_path / "run").mkdir()
    runlog = RunLog(config, env_info, tmp_path / "run", log=lambda line: None)
    actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
    for version, test_return in enumerate([-100.0, -900.0, -800.0, -700.0, -600.0, -50.0, -900.0], start=1):
        runlog.record_evaluation({"time_s": float(version), "env_steps": 1000 * version, "updates": version,
                                  "policy_version": version, "test_return": test_return,
                                  "actor_flat": actor_flat(actor)})
        saved = torch.load(tmp_path / "run" / "best" / "actor.pt", weights_only=True)["best"]
        if version < 5:  # provisional: the latest tested policy, even when its test is worse than an earlier one
            expected = (version, version)
        else:  # means of five: -620 (the first, replaces), -610 (higher), -610 again (not higher: stays)
            expected = ({5: 5, 6: 6, 7: 6}[version], 5)
        assert (saved["policy_version"], saved["tests"]) == expected
    assert saved["test_return_mean5"] == pytest.approx(-610.0)
    resumed = RunLog(config, env_info, tmp_path / "run", log=lambda line: None, resumed=True)
    assert resumed.best["tests"] == 5 and resumed.best["policy_version"] == 6


def test_summary_json_stays_json_when_a_figure_is_not_a_number(tmp_path):
    """A run without updates has no fetch share (NaN), one whose last tests were NaN no final mean: written as
    bare NaN, summary.json was not JSON, and strict readers (JavaScript's) rejected the whole file."""
    from spreeze.envs import check_env
    from spreeze.runlog import RunLog

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    runlog = RunLog(config, check_env(config.env_id), tmp_path / "run", log=lambda line: None)
    runlog.finish({"fetch_share": math.nan, "cpu_usage_percent": math.nan, "updates": 0,
                   "per_sampler": [1.0, math.inf], "nested": {"rate": -math.inf}, "stopped_by": "total_steps"})

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=refuse)
    assert summary == {"fetch_share": None, "cpu_usage_percent": None, "updates": 0, "per_sampler": [1.0, None],
                       "nested": {"rate": None}, "stopped_by": "total_steps"}


def test_ctrl_c_while_a_new_best_is_saved_leaves_that_test_in_evaluations_csv(tmp_path, monkeypatch):
    """Saving the best policy is the slowest step of recording a test; the row was written after it, so Ctrl-C
    there left the test in the summary and the API's curve but not in the file a resume reads."""
    from spreeze.envs import check_env
    from spreeze.runlog import RunLog

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    runlog = RunLog(config, check_env(config.env_id), tmp_path / "run", log=lambda line: None)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runlog, "save_best", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runlog.record_evaluation({"time_s": 1.0, "env_steps": 1000, "updates": 1, "policy_version": 1,
                                  "test_return": -321.0, "actor_flat": np.zeros(3, np.float32)})
    rows = (tmp_path / "run" / "evaluations.csv").read_text().splitlines()
    assert len(rows) == 2 and "-321.0" in rows[1]


def test_observers_see_the_start_every_row_and_the_checkpoints_in_order(tmp_path):
    """Observers are plain objects handed to the runner: it calls their hooks in the main process."""
    from spreeze.envs import check_env
    from spreeze.observers import Observer
    from spreeze.runners import train

    class Recorder(Observer):
        def __init__(self):
            self.calls = []

        def on_start(self, run):
            self.calls.append(("start", run.run_dir))

        def on_metrics(self, row):
            self.calls.append(("metrics", row["env_steps"]))

        def on_evaluation(self, row):
            self.calls.append(("evaluation", row["test_return_mean5"]))

        def on_checkpoint(self, path):
            self.calls.append(("checkpoint", path))

        def close(self):
            self.calls.append(("close",))

    recorder = Recorder()
    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"), total_steps=1_000, log_interval_s=0.2)
    result = train(config, check_env(config.env_id), log=lambda line: None, observers=[recorder])
    kinds = [call[0] for call in recorder.calls]
    assert result.exit_code == 0 and kinds[0] == "start" and kinds[-1] == "close" and kinds.count("start") == 1
    assert kinds.count("evaluation") == len(rows(tmp_path / "run" / "evaluations.csv")) > 0
    assert kinds.count("metrics") == len(rows(tmp_path / "run" / "metrics.csv")) > 0
    assert ("checkpoint", tmp_path / "run" / "checkpoints" / "latest.pt") in recorder.calls
    assert not (tmp_path / "run" / "curve.png").exists()  # no curve observer given: the core draws nothing


def test_an_observer_that_raises_is_switched_off_and_the_run_goes_on(tmp_path):
    """A TensorBoard writer on a full disk, a W&B run that lost its network, a window that cannot restart: an
    observer that raises in a hook is logged with its traceback, closed and not called again; the others and the
    run go on, and the run ends as its budget says (exit 0)."""
    from spreeze.envs import check_env
    from spreeze.observers import Observer
    from spreeze.runners import train

    class Breaks(Observer):
        def __init__(self, hook):
            self.hook, self.calls, self.closed = hook, [], 0

        def _maybe(self, hook):
            self.calls.append(hook)
            if hook == self.hook:
                raise OSError(f"broken in {hook}")

        def on_start(self, run):
            self._maybe("on_start")

        def on_metrics(self, row):
            self._maybe("on_metrics")

        def on_evaluation(self, row):
            self._maybe("on_evaluation")

        def on_checkpoint(self, path):
            self._maybe("on_checkpoint")

        def poll(self):
            self._maybe("poll")

        def close(self):
            self.closed += 1
            if self.hook == "on_start":
                raise RuntimeError("half started")

    observers = {hook: Breaks(hook) for hook in ("on_start", "on_metrics", "on_evaluation", "on_checkpoint")}
    healthy = Breaks(None)
    lines = []
    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"), total_steps=1_000, log_interval_s=0.2)
    result = train(config, check_env(config.env_id), log=lines.append, observers=[*observers.values(), healthy])
    assert result.exit_code == 0 and result.summary["stopped_by"] == "total_steps"
    for hook, observer in observers.items():
        assert observer.calls.count(hook) == 1 and observer.closed == 1, (hook, observer.calls)
        assert observer.calls[observer.calls.index(hook) + 1:] == []  # not called again
        assert any(f"Breaks.{hook} raised; it is switched off" in line and f"OSError: broken in {hook}" in line
                   for line in lines), hook
    assert any("closing Breaks raised too (RuntimeError: half started)" in line for line in lines)
    assert {"on_metrics", "on_evaluation", "on_checkpoint"} <= set(healthy.calls) and healthy.closed == 1

    from types import SimpleNamespace

    from spreeze.runners import Run

    lines.clear()  # poll, which the process runners call between their steps (--serial does not)
    polling, healthy = Breaks("poll"), Breaks(None)
    runlog = SimpleNamespace(evaluations=[], metrics_rows=[], mark_start=lambda stats: None)
    run = Run(SimpleNamespace(config=config, runlog=runlog, log=lines.append, env_info=None, run_dir=tmp_path,
                              stats=None), [polling, healthy])
    run.start_observers()
    run._next_log = float("inf")  # no metrics row: this run log writes none
    run.poll()
    run.poll()
    assert polling.calls == ["on_start", "poll"] and polling.closed == 1
    assert healthy.calls == ["on_start", "poll", "poll"] and healthy.closed == 0
    assert any("Breaks.poll raised; it is switched off" in line for line in lines)


def test_a_serial_run_computes_with_subnormals_flushed_and_gives_the_caller_its_setting_back(tmp_path, monkeypatch):
    from spreeze import proc, runners

    seen = []
    serial = runners.run_serial

    def run_serial(run):
        seen.append(float(torch.tensor([1e-40]) * 1.0) == 0.0)
        serial(run)

    monkeypatch.setattr(runners, "run_serial", run_serial)
    was = proc.flush_denormals(False)
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")
    try:
        result, _ = serial_train(tmp_path, total_steps=400, minutes=2.0)
        assert result.exit_code == 0 and seen == [True]
        assert float(torch.tensor([1e-40]) * 1.0) != 0.0
    finally:
        proc.flush_denormals(was)


def test_a_serial_run_whose_loss_overflows_ends_with_exit_1_and_a_summary(tmp_path):
    """In --serial the learner runs in this process: a non-finite loss ends the run as in processes (exit 1, the
    reason in summary.json), not as a traceback without a summary."""
    result, lines = serial_train(tmp_path, env_id="tests.faulty_envs:HugeRewardPendulum-v0", total_steps=3000)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.exit_code == 1 and summary["exit_code"] == 1
    assert summary["stopped_by"].startswith("error: ") and "non-finite" in summary["stopped_by"]
    assert any("stopping:" in line and "non-finite" in line for line in lines)


def test_an_unexpected_error_still_leaves_a_summary_then_rises(tmp_path, monkeypatch):
    """A bug or a full disk in the supervisor's own process: summary.json records it, then the error rises as
    it is (with its traceback)."""
    from spreeze.runlog import RunLog

    def boom(self, result):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(RunLog, "record_evaluation", boom)
    with pytest.raises(RuntimeError, match="disk gone"):
        serial_train(tmp_path, total_steps=3000)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "error: RuntimeError: disk gone" and summary["exit_code"] == 1
    # before the shared state exists (/dev/shm full): the summary still says why
    from spreeze.supervisor import Supervisor

    monkeypatch.setattr(Supervisor, "create_shared", lambda self: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(OSError):
        serial_train(tmp_path / "early", total_steps=3000)
    summary = json.loads((tmp_path / "early" / "run" / "summary.json").read_text())
    assert summary["stopped_by"].startswith("error: OSError") and summary["exit_code"] == 1


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_ctrl_c_while_a_failed_run_stops_still_leaves_a_summary_and_the_callers_handlers(tmp_path, monkeypatch,
                                                                                         signame):
    """A child's failure starts the stop; a first Ctrl-C or SIGTERM arriving while it is handled (the messages
    drained, the best policy saved) must neither skip summary.json nor leave Ctrl-C ignored for the caller."""
    import os
    import signal

    from spreeze import runners
    from spreeze.supervisor import ChildFailed, Supervisor

    def failed(run):
        raise ChildFailed("spreeze-sampler-0 failed (simulated)")

    drain = Supervisor.drain_messages

    def drain_and_signal(self, *args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signame))  # delivered here, in the main thread
        return drain(self, *args, **kwargs)

    def caller_handler(signum, frame):
        raise AssertionError("the caller's handler ran: the run should have ignored the signal while stopping")

    monkeypatch.setattr(runners, "run_serial", failed)
    monkeypatch.setattr(Supervisor, "drain_messages", drain_and_signal)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGINT, caller_handler)
        signal.signal(signal.SIGTERM, caller_handler)
        try:
            result, _ = serial_train(tmp_path, total_steps=3000)
        except KeyboardInterrupt:  # caught here: escaping, it would stop pytest itself
            pytest.fail("the signal rose through the stop: the clean-up after it and summary.json were skipped")
        assert signal.getsignal(signal.SIGINT) is caller_handler and signal.getsignal(signal.SIGTERM) is caller_handler
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.exit_code == 1 and summary["exit_code"] == 1 and "simulated" in summary["stopped_by"]


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    import spreeze.runners
    from spreeze.runners import make_run_dir

    class Frozen:  # one second for all three
        @staticmethod
        def now():
            return __import__("datetime").datetime(2026, 11, 27, 12, 0, 0)

    monkeypatch.setattr(spreeze.runners, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    dirs = [make_run_dir(Config(env_id="Pendulum-v1")) for _ in range(3)]
    assert [d.name for d in dirs] == ["Pendulum-v1-sac-20261127-120000", "Pendulum-v1-sac-20261127-120000-2",
                                      "Pendulum-v1-sac-20261127-120000-3"]
    assert all((tmp_path / d).is_dir() for d in dirs)
    assert make_run_dir(Config(run_dir=str(dirs[0]))) == dirs[0]  # a given directory is used as it is


def test_a_run_dir_holding_a_run_is_refused_without_resume(tmp_path):
    """A second run there would append to the first one's CSV files and replace its checkpoints. One that ended
    before its first checkpoint cannot be resumed either: the refusal sent the user to --resume, which sent them
    back; it says what to do instead."""
    from launch.compose import SetupError, resolve
    from spreeze.checkpoint import CHECKPOINT_NAME

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    with pytest.raises(SetupError, match="ended before its first checkpoint, so --resume cannot continue it: remove"):
        resolve(dataclasses.replace(BASE, run_dir=str(run)), {"run_dir"}, log=lambda line: None)
    with pytest.raises(SetupError, match="not a spreeze run with a checkpoint"):
        resolve(dataclasses.replace(BASE, resume=str(run)), {"resume"}, log=lambda line: None)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / CHECKPOINT_NAME).write_bytes(b"a checkpoint")
    with pytest.raises(SetupError, match="holds a run already: --resume"):
        resolve(dataclasses.replace(BASE, run_dir=str(run)), {"run_dir"}, log=lambda line: None)


def test_a_run_dir_taken_while_this_launch_profiled_ends_it_with_one_line(tmp_path, monkeypatch, capsys,
                                                                          keep_signal_handlers):
    """Two launches into one --run-dir both find it free before they profile; the second to start its run found it
    held and ended in a traceback. One line and exit 2, as when it was held before."""
    import contextlib
    import os

    import launch.compose as compose
    from spreeze.files import hold_run_dir

    run = tmp_path / "run"
    real_resolve = compose.resolve
    with contextlib.ExitStack() as other_launch:
        def resolve_then_taken(*args, **kwargs):
            resolved = real_resolve(*args, **kwargs)
            run.mkdir(exist_ok=True)
            other_launch.enter_context(hold_run_dir(run))  # the other launch starts its run now
            return resolved

        monkeypatch.setattr(compose, "resolve", resolve_then_taken)
        code = compose.main(["--env", "Pendulum-v1", "--samplers", "1", "--batch-size", "64", "--no-window",
                             "--run-dir", str(run), "--total-steps", "100"])
    err = capsys.readouterr().err
    assert code == 2 and f"{run} is in use by another spreeze process (pid {os.getpid()})" in err, err
    assert "Traceback" not in err


def test_a_run_dir_another_launch_made_and_finished_while_this_one_profiled_is_not_written_into(
        tmp_path, monkeypatch, capsys, keep_signal_handlers):
    """The other launch started and ended while this one profiled: the directory was free again, and this one
    rewrote its config.json and summary, replaced its checkpoints and appended rows from 0 steps to its CSV files."""
    import launch.compose as compose

    run = tmp_path / "run"
    real_resolve = compose.resolve

    def resolve_then_finished(*args, **kwargs):
        resolved = real_resolve(*args, **kwargs)
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text('{"the other run": 1}')  # it ran and ended meanwhile
        (run / "checkpoints" / "latest.pt").write_bytes(b"its checkpoint")
        return resolved

    monkeypatch.setattr(compose, "resolve", resolve_then_finished)
    code = compose.main(["--env", "Pendulum-v1", "--samplers", "1", "--batch-size", "64", "--no-window",
                         "--run-dir", str(run), "--total-steps", "100"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a run another launch made while this one profiled" in err, err
    assert (run / "config.json").read_text() == '{"the other run": 1}' and not (run / "metrics.csv").exists()


def test_a_ctrl_c_in_a_serial_run_s_clean_up_after_its_budget_does_not_cut_it_short(tmp_path, monkeypatch):
    """A budget's stop left the run's Ctrl-C handler live through --serial's own clean-up: a Ctrl-C during the
    final checkpoint skipped it (an earlier final actor standing for this one's) and the summary said
    "interrupted" with exit 130."""
    import signal

    import spreeze.learner as learner_mod

    real_finish = learner_mod.Learner.finish

    def finish_under_a_ctrl_c(self, messages=None):
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # the run's own: a Ctrl-C arriving now
            handler(signal.SIGINT, None)
        return real_finish(self, messages)

    monkeypatch.setattr(learner_mod.Learner, "finish", finish_under_a_ctrl_c)
    result, _ = serial_train(tmp_path, total_steps=600)
    assert result.exit_code == 0 and result.summary["stopped_by"] == "total_steps"
    assert (tmp_path / "run" / "final" / "actor.pt").exists()


def test_a_resumed_session_stopped_before_its_observers_start_reports_its_own_rates(tmp_path, monkeypatch):
    """The session's starting counts were taken only once its observers had started: a Ctrl-C before (while a saved
    replay is restored, or W&B starts) reported the restored steps and updates over the whole run's time."""
    from spreeze.runners import Run

    first, _ = serial_train(tmp_path, total_steps=1_000)
    assert first.exit_code == 0 and first.summary["updates"] > 0

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Run, "start_observers", interrupted)
    again, _ = serial_train(tmp_path, total_steps=2_000, resume=str(tmp_path / "run"))
    assert again.exit_code == 130 and again.summary["updates"] == first.summary["updates"]
    assert again.summary["update_frequency_hz"] == 0 and again.summary["sampling_frame_rate_hz"] == 0


def test_a_stall_gives_one_metrics_row_not_one_per_interval_missed():
    """After a stall (a --serial test, a saved replay) every interval missed gave a row at once, milliseconds
    apart, with rates and CPU readings over those milliseconds."""
    import types

    from spreeze.runners import Run

    run = types.SimpleNamespace(config=types.SimpleNamespace(log_interval_s=1.0), _next_log=time.monotonic() - 10.0)
    assert [Run.metrics_due(run) for _ in range(5)] == [True, False, False, False, False]
    assert run._next_log > time.monotonic() + 0.5


def test_the_latest_checkpoint_s_policy_acts_in_the_wrapped_env_s_bounds(tmp_path):
    """load_policy(run, "latest") builds the env as the run did (--env-kwargs, --wrapper), as the final and best
    policies (which store the bounds) and viz.play do: a wrapper that rescales actions changes the bounds."""
    from spreeze.algos import make_actor
    from spreeze.checkpoint import atomic_save

    config = Config(env_id="Pendulum-v1", wrapper=("tests.env_wrappers:unit_actions",), hidden_size=16)
    actor = make_actor(config, 3, 1)
    atomic_save({"algo": {"actor": actor.state_dict()}, "config": config.to_dict(), "counters": {}},
                tmp_path / "latest.pt")
    policy = load_policy(tmp_path / "latest.pt")
    assert (policy.scale.low.tolist(), policy.scale.high.tolist()) == ([-1.0], [1.0])


def test_the_final_actor_is_written_before_the_replay(tmp_path, monkeypatch):
    """--save-replay writes hundreds of MB beside the final checkpoint: the final actor goes first, so a slow disk
    that outlasts the supervisor's wait costs the replay file, not the policy."""
    import spreeze.learner as learner_mod

    real, final_there = learner_mod.save_replay, []

    def save_replay(replay, path, meta):
        final_there.append((path.parent.parent / "final" / "actor.pt").exists())
        return real(replay, path, meta)

    monkeypatch.setattr(learner_mod, "save_replay", save_replay)
    result, _ = serial_train(tmp_path, total_steps=1500, save_replay=True)
    assert result.exit_code == 0 and final_there and final_there[-1]


def test_a_resume_drops_the_rows_logged_after_its_checkpoint(tmp_path):
    """A learner killed between checkpoints: the earlier session logged tests and metrics past the checkpoint the
    run resumes from. Those rows are dropped (else the curves step back in env steps and time, and the mean of 5
    mixes in tests of a discarded stretch); the rows kept keep their text."""
    import csv as csv_mod

    from spreeze.envs import check_env
    from spreeze.runlog import EVAL_FIELDS, METRICS_FIELDS, RunLog

    run = tmp_path / "run"
    run.mkdir()
    for name, fields in (("evaluations.csv", EVAL_FIELDS), ("metrics.csv", METRICS_FIELDS)):
        with open(run / name, "w", newline="") as f:
            writer = csv_mod.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for t, steps in ((10.0, 1_234_567), (20.0, 2_345_678), (30.0, 3_456_789), (40.0, 4_567_890)):
                writer.writerow({"time_s": t, "env_steps": steps, "test_return": -t})
    config = Config(env_id="Pendulum-v1")
    resumed = RunLog(config, check_env("Pendulum-v1"), run, log=lambda line: None, resumed=True, resumed_at_s=25.0)
    assert [e["time_s"] for e in resumed.evaluations] == [10.0, 20.0]
    assert [m["env_steps"] for m in resumed.metrics_rows] == [1_234_567, 2_345_678]
    for name in ("evaluations.csv", "metrics.csv"):
        text = (run / name).read_text()
        assert "2345678" in text and "3456789" not in text and "e+06" not in text
    assert "2 row(s) of evaluations.csv logged after the checkpoint dropped" in (run / "events.log").read_text()


def test_a_resume_skips_a_torn_row_instead_of_failing_on_it(tmp_path):
    """A row cut short by a full disk (its time_s whole, later cells missing) made every later resume fail with a
    TypeError in RunLog; it is skipped, and the run's other rows are read."""
    from spreeze.envs import check_env
    from spreeze.runlog import EVAL_FIELDS, RunLog

    run = tmp_path / "run"
    run.mkdir()
    whole = {"time_s": 10.0, "env_steps": 1000, "updates": 10, "test_return": -900.0}
    lines = [",".join(EVAL_FIELDS), ",".join(str(whole.get(k, "")) for k in EVAL_FIELDS), "20,2000"]
    (run / "evaluations.csv").write_text("\n".join(lines) + "\n")
    resumed = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lambda line: None,
                     resumed=True, resumed_at_s=25.0)
    assert [e["time_s"] for e in resumed.evaluations] == [10.0]
    assert resumed.evaluations[0]["test_return_mean5"] == -900.0
    # torn before its line end: this session's first row went onto the torn line, and both were lost
    from spreeze.runlog import _append_row, _read_rows

    (run / "evaluations.csv").write_text("\n".join(lines))
    RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lambda line: None, resumed=True,
           resumed_at_s=25.0)
    _append_row(run / "evaluations.csv", EVAL_FIELDS, {**whole, "time_s": 30.0})
    assert [e["time_s"] for e in _read_rows(run / "evaluations.csv")] == [10.0, 30.0]
    # torn inside its last cell, every cell there: "-" of "-123.4" failed every resume (a TypeError), "-1" read as
    # a test of -1 (and --target-return could stop on it); a last line without its line end is dropped
    for cut in ("-", "-1"):
        torn = {**whole, "time_s": 12.0, "test_return_mean5": cut}
        (run / "evaluations.csv").write_text("\n".join([lines[0], lines[1], ",".join(str(torn.get(k, ""))
                                                                                     for k in EVAL_FIELDS)]))
        again = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lambda line: None,
                       resumed=True, resumed_at_s=25.0)
        assert [e["time_s"] for e in again.evaluations] == [10.0], cut
    (run / "evaluations.csv").write_text("\n".join([lines[0], lines[1], "11,1100,11,,-,,,-5"]) + "\n")
    assert [e["time_s"] for e in _read_rows(run / "evaluations.csv")] == [10.0]  # a cell that is no number


def test_a_resume_moves_the_earlier_sessions_summary_aside(tmp_path):
    """A resumed session killed hard (no summary of its own) must not leave the earlier session's summary.json
    standing as the run's: it is moved to summary.previous.json when the session starts, and said so."""
    import json

    from spreeze.envs import check_env
    from spreeze.runlog import PREVIOUS_SUMMARY, RunLog

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stopped_by": "minutes", "updates": 123}))
    lines = []
    RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lines.append, resumed=True)
    assert not (run / "summary.json").exists()
    assert json.loads((run / PREVIOUS_SUMMARY).read_text())["updates"] == 123
    assert any(PREVIOUS_SUMMARY in line for line in lines) and PREVIOUS_SUMMARY in (run / "events.log").read_text()
    RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lines.append, resumed=True)
    assert json.loads((run / PREVIOUS_SUMMARY).read_text())["updates"] == 123  # no summary this time: kept


def test_a_nan_test_return_neither_becomes_nor_freezes_the_best(tmp_path):
    """An env that returns NaN makes a NaN test: a mean of 5 with it is no best, and the best goes on being
    replaced by higher means once it has left the window (a NaN best compared below everything after it)."""
    from spreeze.algos import make_actor
    from spreeze.envs import check_env
    from spreeze.evaluator import actor_flat
    from spreeze.runlog import RunLog

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"))
    env_info = check_env(config.env_id)
    (tmp_path / "run").mkdir()
    runlog = RunLog(config, env_info, tmp_path / "run", log=lambda line: None)
    actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
    best = []
    for version, test_return in enumerate([float("nan"), -900.0, -800.0, -700.0, -600.0, -500.0, -100.0], start=1):
        runlog.record_evaluation({"time_s": float(version), "env_steps": 1000 * version, "updates": version,
                                  "policy_version": version, "test_return": test_return,
                                  "actor_flat": actor_flat(actor)})
        best.append(runlog.best["policy_version"] if runlog.best else None)
    assert best == [None, None, None, None, None, 6, 7]  # from the first mean without the NaN test on
    assert runlog.best["test_return_mean5"] == pytest.approx(-540.0)


def test_resuming_a_run_from_before_a_column_keeps_every_digit(tmp_path):
    """An earlier session's CSV without a column added since is rewritten with the new header: its values as they
    were (env steps 1,234,567 used to come back as 1.23457e+06), the new column filled in."""
    import csv as csv_mod

    from spreeze.envs import check_env
    from spreeze.runlog import EVAL_FIELDS, RunLog

    run = tmp_path / "run"
    run.mkdir()
    old = [f for f in EVAL_FIELDS if f != "test_return_mean5"]
    with open(run / "evaluations.csv", "w", newline="") as f:
        writer = csv_mod.DictWriter(f, fieldnames=old)
        writer.writeheader()
        writer.writerow({"time_s": 10.25, "env_steps": 1_234_567, "test_return": -123.456789})
    RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), run, log=lambda line: None, resumed=True)
    with open(run / "evaluations.csv", newline="") as f:
        rows = list(csv_mod.DictReader(f))
    assert list(rows[0]) == EVAL_FIELDS
    assert (rows[0]["time_s"], rows[0]["env_steps"], rows[0]["test_return"]) == ("10.25", "1234567", "-123.456789")
    assert float(rows[0]["test_return_mean5"]) == pytest.approx(-123.456789)


def test_a_resume_goes_on_from_its_counts_and_says_how_to_train_on_when_its_budget_was_used_up(tmp_path):
    """Budgets count the whole run. A resume whose budget the checkpoint had used up stops at once, saying what
    trains it on; one with more budget goes on from the checkpoint's counts: no test or metrics row of the new
    session reads 0 updates (the learner restores them only once it has loaded the checkpoint), and the
    summary's update rate is the session's own."""
    run = tmp_path / "run"
    first, _ = serial_train(tmp_path, total_steps=1_000, minutes=2.0)
    assert first.exit_code == 0 and first.summary["updates"] > 0
    done, lines = serial_train(tmp_path, total_steps=1_000, minutes=2.0, resume=str(run))
    assert done.exit_code == 0 and done.summary["stopped_by"] == "total_steps"
    assert any("before this session" in line and "a larger --total-steps, or 0 for no step limit" in line
               for line in lines), lines
    assert (json.loads((run / "summary.json").read_text())["stopped_by"] == "total_steps")  # written whole
    tests_before = len(rows(run / "evaluations.csv"))
    metrics_before = len(rows(run / "metrics.csv"))
    more, lines = serial_train(tmp_path, total_steps=2_000, minutes=2.0, resume=str(run))
    assert more.exit_code == 0 and not any("before this session" in line for line in lines)
    new_tests = rows(run / "evaluations.csv")[tests_before:]
    new_metrics = rows(run / "metrics.csv")[metrics_before:]
    assert new_tests and new_metrics
    assert min(int(r["updates"]) for r in new_tests + new_metrics) >= first.summary["updates"]
    assert more.summary["updates"] > first.summary["updates"]


def test_a_resumed_session_s_rates_start_at_its_first_update_not_at_the_restored_count(tmp_path):
    from spreeze import stats as S
    from spreeze.envs import check_env
    from spreeze.runlog import RunLog
    from spreeze.stats import SharedStats

    stats = SharedStats.create(1)
    try:
        log = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path, log=lambda line: None,
                     resumed=True, resumed_updates=5_000)
        stats.learner[S.UPDATES] = 5_000  # restored, while the replay refills: no learning of this session yet
        log.write_metrics(stats)
        assert log._train_started is None
        stats.learner[S.UPDATES] = 5_040
        log.write_metrics(stats)
        # from the row before, which the first 40 updates came after; not from this one, which left 0 updates/s
        # for a run whose only row with updates was its last
        assert log._train_started is not None and log._train_started[2] == 5_000
        summary = log.summary(stats, "minutes", "noise")
        assert summary["update_frequency_hz"] > 0 and summary["update_frame_rate_hz"] >= 0
        # a session that stops before its first update (its budget used up) made none: its rates are 0, not the
        # restored counts over the whole run's time
        idle = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path, log=lambda line: None,
                      resumed=True, resumed_updates=5_000, started_at=time.time() - 600)
        stats.learner[S.UPDATES] = 5_000
        idle.mark_start(stats)
        idle.write_metrics(stats)
        summary = idle.summary(stats, "total_steps", "noise")
        assert summary["update_frequency_hz"] == 0 and summary["sampling_frame_rate_hz"] == 0
    finally:
        stats.close()


def test_a_stdout_that_went_away_is_let_go_and_later_lines_go_nowhere(tmp_path, monkeypatch):
    """`run.py ... | tee log` and Ctrl-C: the same signal ends tee, the next console line raised BrokenPipeError in
    the run's clean-up (exit 1, no summary, a traceback) instead of the run stopping with 130."""
    import os
    import sys

    from spreeze.runlog import console

    target = tmp_path / "stdout"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)

    class GoneStdout:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return fd

    class BusyStdout(GoneStdout):  # EAGAIN on a non-blocking pipe: passing, so only that line is lost
        def write(self, text):
            raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(sys, "stdout", BusyStdout())
    try:
        console("[spreeze] a line that meets a full pipe")  # does not raise
        os.write(fd, b"kept")  # the descriptor still leads to the file
        assert target.read_bytes() == b"kept"
        monkeypatch.setattr(sys, "stdout", GoneStdout())
        console("[spreeze] interrupted: stopping, writing the final checkpoint")  # does not raise
        os.write(fd, b"later line")  # the descriptor now leads to /dev/null
        assert target.read_bytes() == b"kept"
    finally:
        os.close(fd)


def test_the_first_metrics_row_has_rates_from_the_session_start(tmp_path):
    """The first row of every session reported 0 Hz (its rates had no baseline): a 0 point in every curve, and
    the only rates of a run that ends before its second row."""
    from spreeze import stats as S
    from spreeze.envs import check_env
    from spreeze.runlog import RunLog
    from spreeze.stats import SharedStats

    stats = SharedStats.create(1)
    try:
        log = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path, log=lambda line: None)
        log.mark_start(stats)
        time.sleep(0.05)
        stats.env_steps[0] = 1_000
        stats.learner[S.UPDATES] = 50
        row = log.write_metrics(stats)
        assert row["sampling_hz"] > 0 and row["update_hz"] > 0 and row["local_sampling_hz"] > 0
        assert row["collect_per_update"] == pytest.approx(20.0)
    finally:
        stats.close()


def test_the_summary_s_cpu_and_gpu_use_are_averaged_from_the_start_of_learning_as_its_rates(tmp_path, monkeypatch):
    """The warm-up's readings (the learner idle) pulled the summary's CPU and GPU figures down, while its rates
    run from the start of learning; a run that never learned still gets a figure."""
    import spreeze.runlog as runlog
    from spreeze import stats as S
    from spreeze.envs import check_env
    from spreeze.stats import SharedStats

    readings = iter([20.0, 30.0, 90.0, 100.0, 10.0])
    gpu_readings = iter([5.0, 15.0, 60.0, 80.0, 40.0])
    monkeypatch.setattr(runlog, "gpu_utilization", lambda: next(gpu_readings))
    stats = SharedStats.create(1)
    try:
        for learned, expected, gpu in ((True, 95.0, 70.0), (False, 10.0, 40.0)):
            (tmp_path / str(learned)).mkdir()
            log = runlog.RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path / str(learned),
                                log=lambda line: None)
            log.cpu.percent = lambda: next(readings)
            stats.learner[S.UPDATES] = 0
            log.write_metrics(stats)
            if learned:
                log.write_metrics(stats)  # warm-up: 20 %, 30 %
                stats.learner[S.UPDATES] = 40
                log.write_metrics(stats)  # the row learning began in (its rates count from the row before)
                log.write_metrics(stats)
            summary = log.summary(stats, "minutes", "noise")
            assert summary["cpu_usage_percent"] == pytest.approx(expected)
            assert summary["gpu_usage_percent"] == pytest.approx(gpu)
    finally:
        stats.close()


def test_one_process_at_a_time_works_in_a_run_directory(tmp_path):
    """A resume of a run still going (in another terminal) would append to its CSV files and replace its
    checkpoints: the run holds its directory while it works, a resume of it is refused before anything is
    read or written, and the directory is free again when the run ends (or its process dies)."""
    import os
    import subprocess
    import sys

    from launch.compose import SetupError, resolve
    from spreeze.envs import check_env
    from spreeze.files import hold_run_dir, run_dir_busy
    from spreeze.observers import Observer
    from spreeze.runners import train

    run = tmp_path / "run"
    seen = []

    class WhileRunning(Observer):
        def on_evaluation(self, row):
            seen.append(run_dir_busy(run))

    config = dataclasses.replace(BASE, run_dir=str(run), total_steps=600)
    assert train(config, check_env(config.env_id), log=lambda line: None, observers=[WhileRunning()]).exit_code == 0
    assert seen and all(f"in use by another spreeze process (pid {os.getpid()})" in text for text in seen)
    assert run_dir_busy(run) is None  # free again
    with hold_run_dir(run):  # as a run in another terminal holds it
        with pytest.raises(SetupError, match="in use by another spreeze process"):
            resolve(dataclasses.replace(BASE, resume=str(run), total_steps=1_200), {"resume", "total_steps"})
        probe = "import sys; from spreeze.files import run_dir_busy; print(run_dir_busy(sys.argv[1]))"
        other = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True, timeout=60,
                               cwd=str(Path(__file__).resolve().parents[1]))
        assert f"(pid {os.getpid()})" in other.stdout, other.stdout + other.stderr
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from spreeze.files import hold_run_dir\n"
                             "with hold_run_dir(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
                             str(run)], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[1]))
    try:
        assert held.stdout.readline().strip() == "held"
        assert f"(pid {held.pid})" in run_dir_busy(run)
    finally:
        held.kill()
        held.wait(timeout=30)
    assert run_dir_busy(run) is None  # a killed holder leaves it free


def test_a_learner_still_writing_after_its_supervisor_died_keeps_the_run_directory(tmp_path):
    """The run directory's lock is the supervisor's alone: killed (SIGKILL), it frees the directory while its learner
    still writes the final checkpoint, and a resume started then would read one checkpoint in its supervisor and the
    next in its learner. The learner's own lock keeps the directory busy until that learner ends."""
    import subprocess
    import sys

    from spreeze.files import RunDirBusy, hold_learner_lock, hold_run_dir, run_dir_busy

    run = tmp_path / "run"
    run.mkdir()
    learner = subprocess.Popen([sys.executable, "-c", "import sys, time; from spreeze.files import hold_learner_lock\n"
                                "lock = hold_learner_lock(sys.argv[1])\nprint('held', flush=True); time.sleep(60)",
                                str(run)], stdout=subprocess.PIPE, text=True,
                               cwd=str(Path(__file__).resolve().parents[1]))
    try:
        assert learner.stdout.readline().strip() == "held"
        assert f"learner of an earlier session (pid {learner.pid})" in (run_dir_busy(run) or "")
        with pytest.raises(RunDirBusy, match="learner"):
            with hold_run_dir(run):
                pass
        with pytest.raises(RunDirBusy, match=f"another learner \\(pid {learner.pid}\\)"):
            hold_learner_lock(run)
    finally:
        learner.kill()
        learner.wait(timeout=30)
    assert run_dir_busy(run) is None  # its end (the OS drops the lock) frees the directory
    lock = hold_learner_lock(run)
    lock.close()


def test_metrics_rows_keep_the_clock_to_the_millisecond_on_a_long_run(tmp_path):
    """A resume cuts rows by this clock: six significant digits would round it to whole seconds past a day."""
    import time

    from spreeze.envs import check_env
    from spreeze.runlog import RunLog
    from spreeze.stats import SharedStats

    stats = SharedStats.create(1)
    try:
        log = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path, log=lambda line: None,
                     started_at=time.time() - 123_456.789)
        log.write_metrics(stats)
    finally:
        stats.close()
    written = rows(tmp_path / "metrics.csv")[0]["time_s"]
    assert abs(float(written) - 123_456.789) < 0.5 and "." in written and "e" not in written


def test_config_autotune_and_summary_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Every resume rewrites config.json and reads it back: a kill mid-write must not leave half of it."""
    from spreeze import runlog as runlog_mod
    from spreeze.envs import check_env
    from spreeze.runlog import RunLog

    written = []
    atomic = runlog_mod.atomic_write
    monkeypatch.setattr(runlog_mod, "atomic_write", lambda path, write: written.append(path.name) or atomic(path, write))
    log = RunLog(Config(env_id="Pendulum-v1"), check_env("Pendulum-v1"), tmp_path, log=lambda line: None)
    log.write_setup({"chosen": {}}, {})
    log.finish({"stopped_by": "minutes"})
    assert written == ["config.json", "autotune.json", "summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "minutes"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_an_observer_failing_on_close_still_gets_a_summary_and_the_others_closed(tmp_path):
    """An error while stopping (an observer's close raising) ends the run with exit code 1 and the error raised,
    after summary.json says so and every other observer was closed."""
    import json

    from spreeze.envs import check_env
    from spreeze.observers import Observer
    from spreeze.runners import train

    closed = []

    class Closing(Observer):
        def __init__(self, fails):
            self.fails = fails

        def close(self):
            closed.append(self.fails)
            if self.fails:
                raise OSError("No space left on device")

    run = tmp_path / "run"
    config = dataclasses.replace(BASE, run_dir=str(run), total_steps=400)
    with pytest.raises(OSError, match="No space left"):
        train(config, check_env(config.env_id), log=lambda line: None, observers=[Closing(False), Closing(True)])
    assert closed == [True, False]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 1
    assert summary["stopped_by"].startswith("total_steps; then an error while stopping: OSError")


def test_the_first_interrupt_ignores_the_ones_after_it():
    """--serial and lock-step start their clean-up in their own ``finally`` (the final checkpoint, closing the
    envs), before the runner's: a second Ctrl-C must not cut it short."""
    import signal

    from spreeze.runners import _raise_interrupt

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGINT, _raise_interrupt)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        with pytest.raises(KeyboardInterrupt):
            _raise_interrupt(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_a_session_removes_the_temporary_files_a_killed_writer_left(tmp_path):
    """A learner killed in the middle of its final checkpoint or --save-replay leaves atomic_write's temporary
    file (hundreds of MB for a replay); the next session in the directory removes those of dead writers, keeps a
    live writer's and everything else, and says so."""
    import os
    import subprocess
    import sys

    from spreeze.envs import check_env
    from spreeze.runners import train

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    stale = [run / f".replay.npz.{dead.pid}.tmp", run / "checkpoints" / f".latest.pt.{dead.pid}.tmp"]
    live = run / f".summary.json.{os.getppid()}.tmp"
    other = run / "notes.tmp"
    for path in (*stale, live, other):
        path.write_bytes(b"x")
    lines = []
    config = dataclasses.replace(BASE, run_dir=str(run), total_steps=400)
    assert train(config, check_env(config.env_id), log=lines.append).exit_code == 0
    assert not any(p.exists() for p in stale) and live.exists() and other.exists()
    assert any("removed 2 unfinished temporary file(s)" in line for line in lines), lines
