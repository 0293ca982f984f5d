"""The three schedules of one pipeline, sharing one budget, one run log and one observer loop.

* free-running (the default): sampler, learner and evaluator processes run as fast as the ratios allow;
* serial (``--serial``): the same objects interleaved in this process, for debugging;
* lock-step (``--deterministic``, :mod:`spreeze.lockstep`): the same objects in rounds, reproducibly.

``train`` is the entry: it resolves what is still automatic, writes the run's setup files, creates the shared
state, runs a schedule and always stops, joins and unlinks everything, whatever ended the run.
"""
from __future__ import annotations

import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from spreeze import evaluator as evaluator_mod
from spreeze import learner as learner_mod
from spreeze import lockstep
from spreeze import sampler as sampler_mod
from spreeze.config import Config, collect_ratio
from spreeze.defaults import learner_threads, resolve
from spreeze.envs import EnvInfo
from spreeze.files import RunDirBusy, hold_run_dir, remove_stale_temporaries
from spreeze.noise_scale import fed_sweep, first_capped
from spreeze.observers import Observer, RunContext
from spreeze.proc import (STOP_SIGNALS, FirstError, hangup_proof_resource_tracker, interrupt, stop_signals,
                          subnormals_flushed)
from spreeze.runlog import MEAN_OF, console, finite_or_none
from spreeze.shm import SharedMemoryFull, remove_stale_segments
from spreeze.supervisor import ChildFailed, Supervisor


@dataclass
class RunResult:
    run_dir: Path
    exit_code: int
    summary: dict
    evaluations: list = field(default_factory=list)


def make_run_dir(config: Config) -> Path:
    """``--run-dir``, or a new ``runs/<env>-<algo>-<time>``; two runs started in the same second (a loop over
    seeds with ``&``) get ``-2``, ``-3``, ... instead of writing into one directory."""
    if config.run_dir:
        run_dir = Path(config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{config.env_id}-{config.algo}-{stamp}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise OSError(f"no free run directory name beside {base}")


def profile_batch_sweep(profile: dict | None, config: Config) -> list | None:
    """``(batch, updates_per_s)`` of the profile's learner sweep when the profile chose the batch (not a hand,
    a config or the reproducible mode): only then may the learner re-decide it. Each rate is capped at what the
    run's samplers can feed at that batch's collect:update ratio (:func:`fed_sweep`: the profile's steps/s of one
    sampler times the local and remote samplers; a remote one is assumed as fast as a local one)."""
    if not profile or (profile.get("chosen", {}).get("batch_size") or {}).get("by") != "profile":
        return None
    measurements = profile.get("measurements") or {}
    sweep = [(int(p["batch"]), float(p["updates_per_s"])) for p in (measurements.get("learner") or {}).get("sweep") or []]
    if not sweep:
        return None
    env_step_s = (measurements.get("sampler") or {}).get("env_step_s")
    if not env_step_s:
        return sweep
    ratios = [collect_ratio(config.collect_per_update, b, config.replay_ratio) for b, _ in sweep]
    return fed_sweep(sweep, (config.samplers + config.remote_samplers) / float(env_step_s), ratios)


def capped_note(profile: dict, fed: list) -> str | None:
    """Which batches the learner sees at a lower rate than the profile timed (the samplers could not feed them)."""
    timed = [(p["batch"], p["updates_per_s"]) for p in profile["measurements"]["learner"]["sweep"]]
    if (capped := first_capped(timed, fed)) is None:
        return None
    b, probed, u = capped
    return (f"from batch {b} on, update rates capped at what the samplers can collect ({probed:.0f} -> {u:.0f} "
            f"updates/s at {b}): the learner will not grow its batch past what they feed")


class Run:
    """What every schedule shares: the supervisor, the run log, the observers and the budget."""

    def __init__(self, sup: Supervisor, observers=()):
        self.sup = sup
        self.config = sup.config
        self.runlog = sup.runlog
        self.observers: list[Observer] = list(observers)
        self.stopped_by: str | None = None        # what ended the run, for the summary
        self._started: list[Observer] = []
        self._next_log = 0.0
        sup.on_evaluation = self.evaluated
        sup.on_checkpoint = self.checkpointed

    def start_observers(self) -> None:
        """Once the schedule's workers are up."""
        sup = self.sup
        run = RunContext(self.config, sup.env_info, sup.run_dir, sup.log, sup,
                         list(self.runlog.evaluations), list(self.runlog.metrics_rows))
        for observer in self.observers:
            try:
                observer.on_start(run)
            except Exception:
                self._switch_off(observer, "on_start")
            else:
                self._started.append(observer)
        self._next_log = time.monotonic() + self.config.log_interval_s  # the first row one interval from now
        self.runlog.mark_start(sup.stats)


    def close_observers(self) -> None:
        """Last started, first closed (the render process before the window's final PNG). Each is closed even when
        one before it raised (a window left open would hold the interpreter's exit, which joins its process); the
        first error rises after."""
        errors = FirstError()
        while self._started:
            with errors.step():
                self._started.pop().close()
        errors.raise_first()

    def _notify(self, hook: str, *args) -> None:
        """``hook`` of every started observer. One that raises is switched off and training goes on: a window, an
        event file or an upload (TensorBoard, W&B) watches the run, and must not end it."""
        for observer in list(self._started):
            try:
                getattr(observer, hook)(*args)
            except Exception:
                self._switch_off(observer, hook)

    def _switch_off(self, observer: Observer, hook: str) -> None:
        """Say why (with the traceback), stop calling it, and close it (best effort: it may be half started)."""
        name = type(observer).__name__
        self.sup.log(f"[spreeze] warning: {name}.{hook} raised; it is switched off and training goes on:\n"
                     + traceback.format_exc().rstrip())
        if observer in self._started:
            self._started.remove(observer)
        try:
            observer.close()
        except Exception as err:
            self.sup.log(f"[spreeze] warning: closing {name} raised too ({type(err).__name__}: {err})")

    def evaluated(self, result: dict) -> dict:
        row = self.runlog.record_evaluation(result)
        self._notify("on_evaluation", row)
        return row

    def checkpointed(self, path) -> None:
        self._notify("on_checkpoint", Path(path))

    def poll(self) -> None:
        """Between two steps of a schedule: the observers' poll and, every ``--log-interval-s``, a metrics row."""
        self._notify("poll")
        if self.metrics_due():
            self.metrics()

    def metrics(self, progress: bool = True) -> dict:
        row = self.runlog.write_metrics(self.sup.stats)
        if progress:
            self.sup.log(self.runlog.progress_line(row))
        self._notify("on_metrics", row)
        return row

    def metrics_due(self) -> bool:
        """True once every ``--log-interval-s`` (the schedule then writes a row); after a stall (a --serial test, a
        saved replay) one row, not one per interval missed, each of them with rates over a few milliseconds."""
        now = time.monotonic()
        if now < self._next_log:
            return False
        self._next_log += self.config.log_interval_s
        if self._next_log <= now:
            self._next_log = now + self.config.log_interval_s
        return True

    def budget_reached(self) -> str | None:
        """Why the run should stop now, or None; remembered as ``stopped_by`` for the summary."""
        c = self.config
        reason, mean = None, self.runlog.mean_of_last_tests()
        resumed = self.sup.resumed is not None
        # a budget the resumed checkpoint had already used up stops the run at once: say how to train it on
        saved = self.sup.resumed["counters"] if resumed else {}
        if c.total_steps and self.sup.stats.total_env_steps() >= c.total_steps:
            self.stopped_by, reason = "total_steps", f"reached --total-steps {c.total_steps}"
            if int(saved.get("env_steps", 0)) >= c.total_steps:
                reason += (f" before this session (the run had {int(saved['env_steps']):,} steps; a resumed run "
                           "counts them all): a larger --total-steps, or 0 for no step limit, trains it on")
        elif c.minutes and time.time() - self.sup.started_at >= c.minutes * 60:
            self.stopped_by, reason = "minutes", f"reached --minutes {c.minutes}"
            if float(saved.get("time_s", 0.0)) >= c.minutes * 60:
                reason += (f" before this session (the run had trained {float(saved['time_s']) / 60:.1f} minutes; a "
                           "resumed run counts them all): a larger --minutes, or 0 for no time limit, trains it on")
        elif c.target_return is not None and mean is not None and mean >= c.target_return:
            self.stopped_by = "target_return"
            reason = (f"reached --target-return {c.target_return:g}: the mean of the last {MEAN_OF} tests is "
                      f"{mean:.1f}" + ("; a resumed run keeps its target: --target-return none (or a higher one) "
                                       "trains it on" if resumed else ""))
        if reason:
            # stopping from here: a Ctrl-C during --serial's or lock-step's own clean-up (flushes, the final
            # checkpoint, the last tests) would cut it short and call a budget's stop an interruption
            _ignore_stop_signals()
        return reason

    def stop_if_budget_reached(self) -> bool:
        reason = self.budget_reached()
        if reason:
            self.sup.log(f"[spreeze] {reason}")
            self.metrics(progress=False)
        return bool(reason)


def _set_handler(signum: int, handler):
    """``signal.signal`` in the main thread; elsewhere (``spreeze.train`` from a worker thread) nothing, as only
    the main thread may install handlers (Ctrl-C then reaches the caller's main thread, not the run). Returns the
    handler replaced, or None."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None  # None: a handler not installed from Python, which cannot be put back
    return signal.signal(signum, handler)


def train(config: Config, env_info: EnvInfo, log=console, profile: dict | None = None, observers=(),
          sources: dict | None = None) -> RunResult:
    """Run one training job; ``observers`` (built by ``launch/``) watch it from this process.

    ``sources``: where each setting came from (flag, preset, ...), recorded in ``config.json``.
    ``profile``: the autotuner's record of what it measured and chose, saved as ``autotune.json``; with
    ``--batch-rule noise`` its learner sweep lets the learner re-decide the batch during the run.
    """
    config = resolve(config)
    removed = remove_stale_segments()
    if removed:
        log(f"[spreeze] removed {len(removed)} shared-memory segment(s) left by dead earlier runs")
    run_dir = make_run_dir(config)
    with hold_run_dir(run_dir):  # one process at a time in a run directory (its CSV files, its checkpoints)
        if not config.resume and (run_dir / "config.json").exists():
            # a launch into the same --run-dir that started and ended while this one profiled (both found it free)
            raise RunDirBusy(f"{run_dir} holds a run another launch made while this one profiled: --resume "
                             f"{run_dir} continues it; choose another directory for this run")
        stale = remove_stale_temporaries(run_dir)
        if stale:
            log(f"[spreeze] removed {len(stale)} unfinished temporary file(s) of an earlier session killed while "
                f"writing ({', '.join(p.name for p in stale)})")
        return _train_in(run_dir, config, env_info, log, profile, observers, sources)


def _train_in(run_dir: Path, config: Config, env_info: EnvInfo, log, profile: dict | None, observers,
              sources: dict | None) -> RunResult:
    spares = config.spares
    sup = Supervisor(config, env_info, run_dir, log, batch_sweep=profile_batch_sweep(profile, config))
    sup.runlog.write_setup(profile, sources)
    if sup.batch_sweep and (capped := capped_note(profile, sup.batch_sweep)):
        log(f"[spreeze] batch rule: {capped}")
    log(f"[spreeze] run directory {run_dir}; {config.samplers} sampler(s) (+{spares} paused spare) "
        f"x {config.envs_per_sampler} env(s), batch {config.batch_size}, collect:update {config.collect_ratio:g}, "
        f"algo {config.algo}")
    run = Run(sup, observers)
    hangup_proof_resource_tracker()  # an API caller's run: before the supervisor's segments start it
    # a shell starting us in the background may have set SIGINT to "ignore", which Python then keeps;
    # kill -INT must stop a run like Ctrl-C does, and so must SIGTERM and a closed terminal's SIGHUP
    previous = {signum: _set_handler(signum, _raise_interrupt) for signum in stop_signals()}
    exit_code = 0
    summary: dict = {}
    unexpected: Exception | None = None
    try:
        sup.create_shared()
        schedule = lockstep.run_lockstep if config.deterministic else run_serial if config.serial else run_free
        with subnormals_flushed():  # --serial and --deterministic compute here: as the children do
            schedule(run)
    except KeyboardInterrupt:
        run.stopped_by, exit_code = "interrupted (Ctrl-C, SIGTERM or SIGHUP)", 130
        log("[spreeze] interrupted: stopping, writing the final checkpoint")
    except (ChildFailed, learner_mod.NonFiniteLoss) as err:  # the latter from --serial's learner, in this process
        _ignore_stop_signals()  # stopping already: a first Ctrl-C here would skip summary.json and the clean-up
        sup.drain_messages()
        log(f"[spreeze] stopping: {err}")
        run.stopped_by = f"error: {err}"
        exit_code = 1
    except SharedMemoryFull as err:  # a tmpfs that filled while the launch checked it: said in one line
        _ignore_stop_signals()
        log(f"[spreeze] stopping: {err.strerror}")
        run.stopped_by, exit_code = f"error: {err.strerror}", 1
    except Exception as err:  # a bug, a full disk: summary.json still says so, then it rises
        _ignore_stop_signals()
        run.stopped_by = f"error: {type(err).__name__}: {err}"
        exit_code = 1
        unexpected = err
    finally:
        _ignore_stop_signals()  # a second Ctrl-C or SIGTERM must not cut the clean-up short
        stopping = FirstError()  # each step below runs even when one before it raised
        try:
            with stopping.step():
                if not config.serial:
                    sup.stop_children()
                else:
                    sup.drain_messages()  # the learner's last checkpoint, for the observers
            with stopping.step():
                if sup.stats is not None:
                    summary = sup.runlog.summary(sup.stats, run.stopped_by,
                                                 config.batch_rule if sup.batch_sweep else "fixed")
            with stopping.step():
                run.close_observers()
        finally:
            sup.runlog.close()
            sup.close_shared()
    try:  # still under ignored signals: a Ctrl-C here would lose summary.json
        if stopping.error is not None and unexpected is None:
            exit_code, unexpected = 1, stopping.error
            summary["stopped_by"] = (f"{run.stopped_by + '; then ' if run.stopped_by else ''}an error while "
                                     f"stopping: {type(stopping.error).__name__}: {stopping.error}")
        if sup.error and exit_code == 0:
            exit_code = 1
            summary["stopped_by"] = f"error: {sup.error}"
        summary.setdefault("stopped_by", run.stopped_by)  # a run that failed before its shared state existed
        summary["exit_code"] = exit_code
        sup.runlog.finish(summary)
    finally:  # the caller's handlers back (an API caller's own, or Python's)
        for signum, handler in previous.items():
            _set_handler(signum, handler)
    if unexpected is not None:
        raise unexpected
    return RunResult(run_dir, exit_code, finite_or_none(summary), sup.runlog.evaluations)  # as summary.json


def _ignore_stop_signals() -> None:
    """Ctrl-C and SIGTERM ignored from here on: the run is stopping, and one arriving now would rise through the
    clean-up (the children left running, no summary.json). A signal that lands before this call, in the few
    bytecodes since the exception was caught, is the one gap left."""
    for signum in STOP_SIGNALS:
        _set_handler(signum, signal.SIG_IGN)


def _raise_interrupt(signum, frame):
    """The first Ctrl-C or SIGTERM stops the run; the ones after it are ignored from here on, so that they cannot
    cut short the clean-up the first one starts (--serial's and lock-step's begins in their own ``finally``,
    before the runner's)."""
    _ignore_stop_signals()
    interrupt()  # at the end of a repair of shared state, if one is under way (spreeze/proc.py)


def run_free(run: Run) -> None:
    """Free-running processes, watched ten times a second."""
    sup = run.sup
    sup.start_children()
    run.start_observers()  # after the children: a window process starting first would slow their start-up
    run.runlog.cpu.prime()  # CPU use from here (psutil's first reading is 0)
    while True:
        time.sleep(0.1)
        sup.watch()
        run.poll()
        if run.stop_if_budget_reached():
            return


def run_serial(run: Run) -> None:
    """All roles in this process, interleaved: for debugging and for deterministic tests."""
    sup, c = run.sup, run.config
    torch.set_num_threads(learner_threads(c))
    samplers = [sampler_mod.Sampler(i, c, sup.env_info, sup.replay, sup.weights, sup.stats,
                                    incarnation=sup.incarnation(f"spreeze-sampler-{i}")) for i in range(c.samplers)]
    # serial mode is for debugging: one thread, batches gathered when they are used
    learner = learner_mod.Learner(c, sup.env_info, sup.replay, sup.weights, sup.stats, sup.run_dir,
                                  sup.started_at, prefetch=False, batch_sweep=sup.batch_sweep,
                                  messages=sup.inbox.local)
    evaluator = evaluator_mod.Evaluator(c, sup.env_info, sup.weights, sup.stats, sup.started_at,
                                        first_index=len(run.runlog.evaluations))
    run.start_observers()
    run.runlog.cpu.prime()
    next_eval = time.monotonic()
    try:
        while True:
            for s in samplers:
                if s.may_collect():
                    s.step()
            learner.maybe_checkpoint()
            while learner.ready() and learner.may_update():
                learner.step()
                if c.collect_ratio <= 0 or all(s.may_collect() for s in samplers):
                    break
            if time.monotonic() >= next_eval:
                run.evaluated(evaluator.evaluate())
                next_eval = time.monotonic() + c.eval_interval_s
            if run.metrics_due():
                sup.drain_messages()
                run.metrics()
            if run.stop_if_budget_reached():
                break
    finally:
        for s in samplers:
            s.flush()
            s.close()
        try:
            learner.finish()
        finally:
            learner.close()
        evaluator.close()
        del samplers, learner, evaluator
