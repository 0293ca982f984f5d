"""The run's files, written only from the main process: every CSV (``metrics.csv``, ``evaluations.csv``,
``rounds.csv``), ``events.log``, ``summary.json``, ``config.json``/``autotune.json`` and the best policy."""
from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spreeze.algos import make_actor
from spreeze.checkpoint import BEST_DIR, FINAL_ACTOR_NAME, read_best, save_actor
from spreeze.files import atomic_write
from spreeze.settings import config_record
from spreeze.gpu import gpu_utilization
from spreeze.proc import CpuUse
from spreeze.weights import load_flat

METRICS_FIELDS = ["time_s", "env_steps", "updates", "policy_version", "test_return", "train_return",
                  "sampling_hz", "update_hz", "update_frame_rate", "batch_size", "collect_per_update", "actor_per_critic_update", "active_samplers", "dropped_episodes",
                  "fetch_share", "cpu_percent", "gpu_percent", "critic_loss", "actor_loss", "alpha", "noise_scale",
                  # --ray: local and remote samplers apart, and what the ingest process moved
                  "local_sampling_hz", "remote_sampling_hz", "ingest_rows_hz", "ingest_mb_s", "remote_alive",
                  "remote_lost_blocks"]
REMOTE_COUNTERS = ("local_env_steps", "remote_env_steps", "ingest_rows", "ingest_bytes")
EVAL_FIELDS = ["time_s", "env_steps", "updates", "policy_version", "test_return", "test_return_std",
               "episode_length", "test_return_mean5"]
ROUND_FIELDS = ["round", "env_steps", "updates", "actor_updates", "policy_version", "critic_loss", "actor_loss",
                "alpha", "train_return", "episodes"]
MEAN_OF = 5  # tests averaged for the best policy and --target-return (one test is one policy's luck)


def console(text: str) -> None:
    """The default log: flushed at once, so progress shows up even when stdout is a file or a pipe. A stdout that
    went away (``| tee`` killed by the same Ctrl-C, a hung-up terminal) is let go: the run still stops cleanly,
    writes its files and exits with its own code, not with a BrokenPipeError in its clean-up."""
    try:
        print(text, flush=True)
    except OSError as err:
        if not (isinstance(err, BrokenPipeError) or err.errno in (errno.EIO, errno.ENXIO)):
            return  # a passing error (EAGAIN on a shared non-blocking pipe): this line is lost, the next tries again
        try:  # later lines (and the interpreter's last flush) go nowhere instead of raising again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


class _Rates:
    """Rates between two snapshots of the counters."""

    def __init__(self):
        self.last = None

    def update(self, now: float, env_steps: int, updates: int, rows: int = 0) -> tuple[float, float, float]:
        """Env steps, updates and sampled rows per second since the last call."""
        if self.last is None:
            self.last = (now, env_steps, updates, rows)
            return 0.0, 0.0, 0.0
        t0, s0, u0, r0 = self.last
        dt = max(now - t0, 1e-9)
        self.last = (now, env_steps, updates, rows)
        return (env_steps - s0) / dt, (updates - u0) / dt, (rows - r0) / dt


PREVIOUS_SUMMARY = "summary.previous.json"  # a resumed run's earlier session's summary, until this one ends


class RunLog:
    """What a run leaves on disk besides checkpoints; a resumed run's rows are read back and carried on."""

    def __init__(self, config, env_info, run_dir: Path, log=console, started_at: float | None = None,
                 resumed: bool = False, resumed_at_s: float | None = None, resumed_updates: int = 0):
        """``resumed_at_s``: the run time of the checkpoint a resumed run continues from; rows an earlier session
        logged after it (a learner killed between checkpoints) are cut, so the curves do not step back.
        ``resumed_updates``: its update count, past which this session's learning starts (the summary's rates
        are this session's, from its first update, not from while the replay refilled)."""
        self.config = config
        self.env_info = env_info
        self.run_dir = Path(run_dir)
        self.log = log
        self.started_at = time.time() if started_at is None else started_at
        self.evaluations: list[dict] = []
        self.metrics_rows: list[dict] = []
        self.best: dict | None = None             # the best mean of MEAN_OF tests so far and its policy
        self._rates = _Rates()
        self._remote_last: tuple | None = None    # (time, REMOTE_COUNTERS) of the last metrics row
        self.cpu = CpuUse()  # the CPUs this run may use (a container's quota, else the host's)
        # CPU and GPU readings per metrics row, (learning had begun, value): the summary averages those from the
        # start of learning, as its rates, since the warm-up's idle learner would pull both down
        self._cpu_samples: list[tuple[bool, float]] = []
        self._gpu_samples: list[tuple[bool, float]] = []
        self._train_started: tuple | None = None
        self._last_row_counts: tuple | None = None  # the previous metrics row's clock and counters
        self._session_counts: tuple | None = None   # the clock and counters as this session's schedule started
        self._resumed_updates = int(resumed_updates)
        self._rounds = None
        if resumed:
            earlier = self.run_dir / "summary.json"
            if earlier.exists():  # an earlier session's: a hard kill of this one must not leave it standing as the run's
                earlier.replace(self.run_dir / PREVIOUS_SUMMARY)
                self.event(f"resumed: the earlier session's summary.json moved to {PREVIOUS_SUMMARY}; this "
                           "session writes its own when it ends")
            if resumed_at_s is not None:
                for name in ("evaluations.csv", "metrics.csv"):
                    cut = _cut_rows_after(self.run_dir / name, resumed_at_s)
                    if cut:
                        self.event(f"resumed: {cut} row(s) of {name} logged after the checkpoint dropped")
            self.evaluations = _read_rows(self.run_dir / "evaluations.csv")
            self.metrics_rows = _read_rows(self.run_dir / "metrics.csv")
            for i, row in enumerate(self.evaluations):  # a run from before this column: the means from its tests
                if not math.isfinite(row.get("test_return_mean5", math.nan)):
                    row["test_return_mean5"] = float(np.mean([e["test_return"]
                                                              for e in self.evaluations[max(0, i - MEAN_OF + 1): i + 1]]))
            _upgrade_csv(self.run_dir / "evaluations.csv", EVAL_FIELDS, self.evaluations)
            _upgrade_csv(self.run_dir / "metrics.csv", METRICS_FIELDS, self.metrics_rows)
            self.best = read_best(self.run_dir)  # a resumed run replaces its best only with a better one

    def write_setup(self, profile: dict | None, sources: dict | None = None) -> None:
        """``config.json`` (the settings and where each came from) and ``autotune.json``; atomically, as every
        resume rewrites them and a resume reads ``config.json`` back (a kill mid-write must not leave half)."""
        _write_json(self.run_dir / "config.json", config_record(self.config, sources))
        if profile is not None:
            _write_json(self.run_dir / "autotune.json", profile)

    def event(self, text: str) -> None:
        line = f"{time.time() - self.started_at:.1f}s {text}"
        try:  # the file first: a console that fails loses no line; a file that fails loses not the console's
            with open(self.run_dir / "events.log", "a") as f:
                f.write(line + "\n")
        finally:
            self.log(f"[spreeze] {text}")

    # ----- test evaluations ------------------------------------------------------------------------------
    def record_evaluation(self, result: dict) -> dict:
        """Append a test result; a new best mean of the last ``MEAN_OF`` tests saves the tested policy as
        ``best/actor.pt`` (atomically, as SB3's EvalCallback keeps its best model). Before the ``MEAN_OF``-th
        test each test's policy is kept as a provisional best, so a short run still leaves one; the first full
        mean replaces it, as a mean of fewer tests is not comparable with it."""
        flat = result.pop("actor_flat", None)
        self.evaluations.append(result)
        recent = [e["test_return"] for e in self.evaluations[-MEAN_OF:]]
        result["test_return_mean5"] = float(np.mean(recent))
        # the row first: Ctrl-C during the slower save below must not leave a test the summary counts (and
        # a resume would not) out of the file
        _append_row(self.run_dir / "evaluations.csv", EVAL_FIELDS, {k: result.get(k) for k in EVAL_FIELDS})
        if flat is not None and self._is_new_best(result["test_return_mean5"], len(recent)):
            self.save_best(flat, result, len(recent))
        return result

    def _is_new_best(self, mean: float, tests: int) -> bool:
        """A mean over more tests supersedes one over fewer (a best from before this field: ``MEAN_OF``). A NaN
        mean (a test whose env returned NaN) is never a best: it would compare below everything after it."""
        if not math.isfinite(mean):
            return False
        if self.best is None or not math.isfinite(self.best["test_return_mean5"]):
            return True
        best_tests = int(self.best.get("tests", MEAN_OF))
        return tests > best_tests or (tests == best_tests and mean > self.best["test_return_mean5"])

    def save_best(self, flat: np.ndarray, result: dict, tests: int = MEAN_OF) -> None:
        c = self.config
        with torch.random.fork_rng(devices=[]):  # a serial learner draws from this process's generator
            actor = make_actor(c, self.env_info.obs_dim, self.env_info.act_dim)
        load_flat(actor, flat)
        best = {k: result[k] for k in ("test_return_mean5", "test_return", "policy_version", "env_steps", "time_s")}
        best["tests"] = tests  # how many tests the mean covers: fewer than MEAN_OF only early in a run
        try:
            save_actor(self.run_dir, actor, c.to_dict(), self.env_info, BEST_DIR, extra={"best": best})
        except OSError as err:
            self.event(f"warning: best policy not saved ({type(err).__name__}: {err})")
            return
        self.best = best

    def mean_of_last_tests(self) -> float | None:
        """The mean of the last ``MEAN_OF`` tests once there are that many (for --target-return)."""
        if len(self.evaluations) < MEAN_OF:
            return None
        return self.evaluations[-1]["test_return_mean5"]

    # ----- metrics -----------------------------------------------------------------------------------------
    def mark_start(self, stats) -> None:
        """The counters as the schedule starts: where the rates begin if learning is under way by the first row.
        The first call (as the shared state is made, before a saved replay is restored or observers start) also
        fixes the session's start, from which a session that never learns reports its rates."""
        now, snap = time.time(), stats.snapshot()
        self._last_row_counts = _counts(now, snap)
        if self._session_counts is None:
            self._session_counts = self._last_row_counts
        # the first row's rates from here too: without a baseline they came out 0 (a 0 Hz point in every
        # session's curves, and the only rates of a run that ends before its second row)
        self._rates.last = (now, snap["env_steps"], snap["updates"], snap["sampled_rows"])
        self._remote_last = (now, tuple(snap[k] for k in REMOTE_COUNTERS))

    def write_metrics(self, stats) -> dict:
        now = time.time()
        snap = stats.snapshot()
        sampling_hz, update_hz, rows_hz = self._rates.update(now, snap["env_steps"], snap["updates"],
                                                             snap["sampled_rows"])
        counts = _counts(now, snap)
        if self._train_started is None and snap["updates"] > self._resumed_updates:
            # from the last row before learning began, which holds its first updates: from this row, the rates of
            # a run whose only row with updates is its last (a budget reached between two rows) came out 0
            self._train_started = self._last_row_counts or counts
        self._last_row_counts = counts
        cpu = self.cpu.percent()
        gpu = gpu_utilization()
        learning = self._train_started is not None
        if math.isfinite(cpu):
            self._cpu_samples.append((learning, cpu))
        if gpu is not None:
            self._gpu_samples.append((learning, gpu))
        busy = snap["fetch_s"] + snap["update_s"]
        batch = snap["batch_size"] or self.config.batch_size  # the learner's, which --batch-rule noise may change
        test_return = self.evaluations[-1]["test_return"] if self.evaluations else float("nan")
        row = {"time_s": now - self.started_at, "env_steps": snap["env_steps"], "updates": snap["updates"],
               "policy_version": snap["policy_version"], "test_return": test_return,
               "train_return": snap["train_return"], "sampling_hz": sampling_hz, "update_hz": update_hz,
               "update_frame_rate": rows_hz, "batch_size": batch,
               "collect_per_update": (sampling_hz / update_hz) if update_hz > 0 else float("nan"),
               "actor_per_critic_update": snap["actor_updates"] / snap["updates"] if snap["updates"] else float("nan"),
               "active_samplers": snap["active_samplers"], "dropped_episodes": snap["dropped_episodes"],
               "fetch_share": snap["fetch_s"] / busy if busy > 0 else float("nan"),
               "cpu_percent": cpu, "gpu_percent": gpu if gpu is not None else "",
               "critic_loss": snap["critic_loss"], "actor_loss": snap["actor_loss"], "alpha": snap["alpha"],
               "noise_scale": snap["noise_scale"], **self._remote_rates(now, snap)}
        # the clock at full precision: 6 digits are whole seconds past a day, and a resume cuts rows by it
        _append_row(self.run_dir / "metrics.csv", METRICS_FIELDS,
                    {k: _cell(v, short=k != "time_s") for k, v in row.items()})
        self.metrics_rows.append(row)
        return row

    def _remote_rates(self, now: float, snap: dict) -> dict:
        """Local and remote sampling Hz and the ingest's rows/s and MB/s since the last row."""
        counts = tuple(snap[k] for k in REMOTE_COUNTERS)
        last, self._remote_last = self._remote_last, (now, counts)
        if last is None:
            rates = (0.0,) * len(counts)
        else:
            dt = max(now - last[0], 1e-9)
            rates = tuple((c - c0) / dt for c, c0 in zip(counts, last[1]))
        return {"local_sampling_hz": rates[0], "remote_sampling_hz": rates[1], "ingest_rows_hz": rates[2],
                "ingest_mb_s": rates[3] / 1e6, "remote_alive": snap["remote_alive"],
                "remote_lost_blocks": snap["remote_lost_blocks"]}

    @staticmethod
    def progress_line(row: dict) -> str:
        remote = (f" (remote {row['remote_sampling_hz']:.0f} Hz from {row['remote_alive']})"
                  if row.get("remote_alive") or row.get("remote_sampling_hz") else "")
        return (f"[spreeze] {row['time_s']:7.1f}s  steps {row['env_steps']:>9,}  updates {row['updates']:>8,}  "
                f"test {row['test_return']:8.1f}  sample {row['sampling_hz']:7.0f} Hz{remote}  "
                f"update {row['update_hz']:6.1f} Hz ({row['update_frame_rate']:,.0f} frames/s)  cpu {row['cpu_percent']:.0f}%")

    # ----- lock-step rounds --------------------------------------------------------------------------------
    def open_rounds(self) -> None:
        """``rounds.csv``: one row per round with no wall-clock field, so two runs can be compared with ``diff``."""
        self._rounds = open(self.run_dir / "rounds.csv", "w", newline="")
        self._round_writer = csv.DictWriter(self._rounds, fieldnames=ROUND_FIELDS)
        self._round_writer.writeheader()

    def write_round(self, row: dict) -> None:
        self._round_writer.writerow({k: _cell(v) for k, v in row.items()})
        self._rounds.flush()

    def close(self) -> None:
        if self._rounds is not None:
            self._rounds.close()
            self._rounds = None

    # ----- the end ---------------------------------------------------------------------------------------
    def summary(self, stats, stopped_by: str | None, batch_rule: str) -> dict:
        """Spreeze Table 1 figures for this run, averaged from the start of learning to the end."""
        snap = stats.snapshot()
        now = time.time()
        # from the start of learning; in a session that never learned, from its start (a resumed one's restored
        # counts are the earlier sessions', not its own)
        t0, s0, u0, r0, rs0, ir0, ib0 = (self._train_started or self._session_counts
                                         or (self.started_at, 0, 0, 0, 0, 0, 0))
        span = max(now - t0, 1e-9)
        busy = snap["fetch_s"] + snap["update_s"]
        evals = self.evaluations
        return {
            "env_id": self.config.env_id, "algo": self.config.algo, "samplers": self.config.samplers,
            "envs_per_sampler": self.config.envs_per_sampler, "batch_size": snap["batch_size"] or self.config.batch_size,
            "batch_rule": batch_rule, "bf16": bool(self.config.bf16), "hidden_size": self.config.hidden_size,
            "started_at_unix": self.started_at,
            "wall_time_s": now - self.started_at, "env_steps": snap["env_steps"], "updates": snap["updates"],
            "cpu_usage_percent": _mean_from_learning(self._cpu_samples, float("nan")),
            "sampling_frame_rate_hz": (snap["env_steps"] - s0) / span,
            "gpu_usage_percent": _mean_from_learning(self._gpu_samples, None),
            "update_frame_rate_hz": (snap["sampled_rows"] - r0) / span,
            "update_frequency_hz": (snap["updates"] - u0) / span,
            "fetch_share": snap["fetch_s"] / busy if busy > 0 else float("nan"),
            "final_test_return": evals[-1]["test_return"] if evals else None,
            "tests": len(evals),  # the "mean of 5" figures below cover fewer in a run with fewer tests
            "best_test_return": (max(finite) if (finite := [e["test_return"] for e in evals
                                                             if math.isfinite(e["test_return"])]) else None),
            f"final_mean{MEAN_OF}_test_return": (float(np.mean([e["test_return"] for e in evals[-MEAN_OF:]]))
                                                if evals else None),
            f"best_mean{MEAN_OF}_test_return": (self.best["test_return_mean5"]
                                               if self.best and self.best.get("tests", MEAN_OF) == MEAN_OF else None),
            "best_policy": ({"path": str(self.run_dir / BEST_DIR / FINAL_ACTOR_NAME), **self.best}
                            if self.best else None),
            "stopped_by": stopped_by,
            "critic_noise_scale": snap["noise_scale"] if math.isfinite(snap["noise_scale"]) else None,
            # behind that estimate, with a resumed run's earlier ones when its estimate went on
            "critic_noise_measurements": snap["noise_measurements"],
            # --ray: the sampling frame rate split into this machine's samplers and the cluster's
            "remote_samplers": self.config.remote_samplers,
            "local_sampling_frame_rate_hz": (snap["env_steps"] - s0 - (snap["remote_env_steps"] - rs0)) / span,
            "remote_sampling_frame_rate_hz": (snap["remote_env_steps"] - rs0) / span,
            "ingest_rows_per_s": (snap["ingest_rows"] - ir0) / span,
            "ingest_mb_per_s": (snap["ingest_bytes"] - ib0) / span / 1e6,
            "remote_lost_blocks": snap["remote_lost_blocks"], "remote_restarts": snap["remote_restarts"],
            "remote_policy_version": snap["remote_policy_version"],  # -1: no remote block arrived
        }

    def finish(self, summary: dict) -> None:
        """``summary.json`` and the closing lines on the console."""
        log = self.log
        _write_json(self.run_dir / "summary.json", finite_or_none(summary))
        if summary.get("update_frequency_hz") is not None:
            print_table(summary, log)
        if summary.get("stopped_by"):
            log(f"[spreeze] stopped by: {summary['stopped_by']}")
        if summary.get("final_test_return") is not None:
            best = summary.get("best_policy")
            log(f"[spreeze] test return: final {summary['final_test_return']:.1f}, mean of the last "
                f"{min(summary.get('tests', MEAN_OF), MEAN_OF)} "
                f"{summary[f'final_mean{MEAN_OF}_test_return']:.1f}"
                + (f"; best mean of {best.get('tests', MEAN_OF)} {best['test_return_mean5']:.1f} at "
                   f"{best['env_steps']:,} steps, "
                   f"policy in {best['path']}" if best else ""))
        log(f"[spreeze] finished: {self.run_dir}")


def print_table(summary: dict, log=console) -> None:
    gpu = summary["gpu_usage_percent"]
    log("[spreeze] | CPU usage | sampling frame rate | GPU usage | update frame rate | update frequency |")
    log("[spreeze] |---|---|---|---|---|")
    log(f"[spreeze] | {summary['cpu_usage_percent']:.0f}% | {summary['sampling_frame_rate_hz']:,.0f} Hz | "
        f"{'none' if gpu is None else f'{gpu:.0f}%'} | {summary['update_frame_rate_hz']:,.0f} Hz | "
        f"{summary['update_frequency_hz']:.1f} Hz |")


def finite_or_none(value):
    """NaN and infinities as None (null in JSON): bare ``NaN`` is not JSON, and strict readers (JavaScript's)
    reject a file holding it. For the summary; ``config.json`` keeps an infinite setting (``--minutes inf``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def _write_json(path: Path, value) -> None:
    text = json.dumps(value, indent=2, default=str).encode()
    atomic_write(path, lambda f: f.write(text))


def _append_row(path: Path, fields: list[str], row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow(row)


def _mean_from_learning(samples: list[tuple[bool, float]], none):
    """The mean of the readings from the start of learning; of all of them in a run that never learned."""
    values = [v for learning, v in samples if learning] or [v for _, v in samples]
    return float(np.mean(values)) if values else none


def _counts(now: float, snap: dict) -> tuple:
    return (now, snap["env_steps"], snap["updates"], snap["sampled_rows"], snap["remote_env_steps"],
            snap["ingest_rows"], snap["ingest_bytes"])


def _read_rows(path: Path) -> list[dict]:
    """Rows of an earlier session's CSV, numbers as floats (empty cells as NaN), for a resumed run's curves. A
    row with cells missing or over, or a cell that is no number (one torn by a full disk or a kill mid-append:
    ``-`` of ``-123.4``), is skipped: it would break every later resume. Every column of these files is a number."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)
                if None not in row and None not in row.values()]
    return [row for row in rows if not any(isinstance(v, str) for v in row.values())]


def _cut_rows_after(path: Path, time_s: float) -> int:
    """Drop the rows of ``path`` whose ``time_s`` is past ``time_s``, keeping the others' text as it was
    (atomically); how many were dropped. A file whose last row was torn before its line end is rewritten too:
    this session's first row would have been appended onto that line, and both lost."""
    if not path.exists():
        return 0
    with open(path, newline="") as f:
        raw = f.read()
    lines = list(csv.reader(io.StringIO(raw, newline="")))
    if not lines or "time_s" not in lines[0]:
        return 0
    column = lines[0].index("time_s")
    def after(row) -> bool:
        value = _number(row[column]) if len(row) > column else math.nan
        return isinstance(value, float) and value > time_s

    # every row is appended with its line end: a last one without is torn, though its cells may all be there
    # (``-1`` of ``-123.4`` in the last column reads as a test of -1)
    torn = len(lines) > 1 and not raw.endswith("\n")
    kept = [lines[0]] + [r for r in (lines[1:-1] if torn else lines[1:]) if not after(r)]
    if len(kept) == len(lines) and raw.endswith("\n"):
        return 0
    text = io.StringIO(newline="")
    csv.writer(text).writerows(kept)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))
    return len(lines) - len(kept)


def _upgrade_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Rewrite an earlier session's CSV whose header lacks columns added since, so that appended rows line up."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header == fields:
        return
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k, math.nan)) for k in fields})
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def _number(text: str):
    try:
        return float(text) if text != "" else float("nan")
    except (TypeError, ValueError):
        return text


def _cell(value, short: bool = False):
    """A CSV cell: NaN empty, integral floats as integers (``.6g`` would turn env steps 1,234,567 into
    1.23457e+06), other floats to 6 significant digits when ``short`` (metrics rows), else in full precision
    (``rounds.csv`` is compared bit for bit; a row read back is written again without losing a digit)."""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if value.is_integer() and abs(value) < 2 ** 53:
            return str(int(value))
        return f"{value:.6g}" if short else repr(value)
    return value
