"""The one place that starts and stops processes.

``train(config)`` creates the shared replay, weights and counters, spawns the samplers, the learner and
the evaluator (``spawn`` context always: a fork after torch ran a parallel op hangs the child, and CUDA
cannot start in a forked child — docs/pitfalls.md), then supervises: it writes ``metrics.csv``
and ``evaluations.csv``, prints progress, enforces the budget and watches heartbeats. Its ``finally``
sets the stop Event, joins with timeouts, kills what is left (children ignore SIGTERM while it lives)
and unlinks every segment.
"""
from __future__ import annotations

import csv
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil
import torch

from spreeze import evaluator as evaluator_mod
from spreeze import learner as learner_mod
from spreeze import sampler as sampler_mod
from spreeze.algos import make_actor
from spreeze.checkpoint import BEST_DIR, CHECKPOINT_NAME, FINAL_ACTOR_NAME, load_checkpoint, read_best, save_actor
from spreeze.config import DETERMINISTIC_BATCH_SIZE, Config
from spreeze.envs import EnvInfo
from spreeze.gpu import gpu_utilization
from spreeze.proc import usable_cores
from spreeze.replay import REPLAY_FILE, QueueReplay, ReplayFileError, SharedReplay, load_replay
from spreeze.shm import remove_stale_segments
from spreeze.stats import EVALUATOR_ROLE, LEARNER_DONE, LEARNER_ROLE, SharedStats, sampler_role
from spreeze.weights import SharedWeights, load_flat

METRICS_FIELDS = ["time_s", "env_steps", "updates", "policy_version", "test_return", "train_return",
                  "sampling_hz", "update_hz", "update_frame_rate", "batch_size", "collect_per_update", "actor_per_critic_update", "active_samplers", "dropped_episodes",
                  "fetch_share", "cpu_percent", "gpu_percent", "critic_loss", "actor_loss", "alpha", "noise_scale"]
EVAL_FIELDS = ["time_s", "env_steps", "updates", "policy_version", "test_return", "test_return_std",
               "episode_length", "test_return_mean5"]
MEAN_OF = 5  # tests averaged for the best policy and --target-return (one test is one policy's luck)
SILENT_AFTER_S = 30.0
JOIN_TIMEOUT_S = 5.0
INCARNATIONS_PER_RESUME = 1 << 20  # sampler seed streams: one block of restart numbers per resume
LEARNER_JOIN_TIMEOUT_S = 20.0


def console(text: str) -> None:
    """The default log: flushed at once, so progress shows up even when stdout is a file or a pipe."""
    print(text, flush=True)


def default_samplers(cores: int) -> int:
    """Without a profile: one sampler per core left after the learner, at least one."""
    return max(1, cores - 1)


def default_batch_size(actor_device: str) -> int:
    return 256 if actor_device == "cpu" else 4096


def resolve(config: Config) -> Config:
    """Fill the automatic settings (samplers, batch size) with plain defaults for this machine."""
    actor_device, _ = learner_mod.resolve_devices(config)
    updates = {}
    if config.samplers == 0:
        updates["samplers"] = default_samplers(usable_cores())
    if config.batch_size == 0:
        batch = DETERMINISTIC_BATCH_SIZE if config.deterministic else default_batch_size(actor_device)
        updates["batch_size"] = min(batch, config.buffer_size)
    return replace(config, **updates)


def make_run_dir(config: Config) -> Path:
    if config.run_dir:
        run_dir = Path(config.run_dir)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{config.env_id}-{config.algo}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


@dataclass
class RunResult:
    run_dir: Path
    exit_code: int
    summary: dict
    evaluations: list = field(default_factory=list)


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


class Supervisor:
    def __init__(self, config: Config, env_info: EnvInfo, run_dir: Path, log=console, batch_sweep: list | None = None):
        """``batch_sweep``: the profile's ``(batch, updates_per_s)`` when the batch is the tuner's to choose."""
        self.config = config
        self.batch_sweep = batch_sweep if config.batch_rule == "noise" and not config.deterministic else None
        self.env_info = env_info
        self.run_dir = run_dir
        self.log = log
        self.ctx = mp.get_context("spawn")
        self.resumed = None
        self.resumes = 0                          # how many times this run was resumed, this time included
        self.started_at = time.time()
        if config.resume:
            self.resumed = load_checkpoint(Path(config.resume) / "checkpoints" / CHECKPOINT_NAME)
            self.started_at -= float(self.resumed["counters"]["time_s"])  # curves continue in wall time
            self.resumes = int(self.resumed["counters"].get("resumes", 0)) + 1
        self.replay = self.weights = self.stats = None
        self.processes: dict[str, mp.Process] = {}
        self.view = None          # viz.live.LiveView: the reward-curve window, never fatal to training
        self.render_process = None  # --render: plays the newest policy, never fatal to training
        self.stop_event = self.ctx.Event()
        self.messages = self.ctx.Queue(maxsize=1000)
        self.evaluations: list[dict] = []
        self.metrics_rows: list[dict] = []
        self.error: str | None = None
        self.specs: dict = {}
        self.restarts: dict[str, list[float]] = {}
        self.restart_totals: dict[str, int] = {}
        self.retired: set[str] = set()           # children stopped for good (too many failures)
        self.sampler_failures: dict[str, str] = {}  # samplers that gave up on their env, with the reason
        self.stopped_by: str | None = None        # what ended the run, for the summary
        self.best: dict | None = None             # the best mean of MEAN_OF tests so far and its policy
        self._rates = _Rates()
        self._cpu_samples: list[float] = []
        self._gpu_samples: list[float] = []
        self._train_started: tuple[float, int, int, int] | None = None
        if self.resumed is not None:
            self.evaluations = _read_rows(run_dir / "evaluations.csv")
            self.metrics_rows = _read_rows(run_dir / "metrics.csv")
            for i, row in enumerate(self.evaluations):  # a run from before this column: the means from its tests
                if not math.isfinite(row.get("test_return_mean5", math.nan)):
                    row["test_return_mean5"] = float(np.mean([e["test_return"]
                                                              for e in self.evaluations[max(0, i - MEAN_OF + 1): i + 1]]))
            _upgrade_csv(run_dir / "evaluations.csv", EVAL_FIELDS, self.evaluations)
            _upgrade_csv(run_dir / "metrics.csv", METRICS_FIELDS, self.metrics_rows)
            self.best = read_best(run_dir)  # a resumed run replaces its best only with a better one

    # ----- set-up and tear-down -------------------------------------------------------------------
    def create_shared(self) -> None:
        c = self.config
        n_envs = c.total_envs
        if c.experience_transport == "queue":
            self.replay = QueueReplay.create(self.env_info.obs_dim, self.env_info.act_dim, c.buffer_size,
                                             c.queue_size, self.ctx)
        else:
            self.replay = SharedReplay.create(self.env_info.obs_dim, self.env_info.act_dim, c.buffer_size, n_envs,
                                              self.ctx, active_regions=c.active_envs)
        torch.manual_seed(c.seed)  # same seed as the learner, so version 0 is the learner's initial actor
        actor = make_actor(c, self.env_info.obs_dim, self.env_info.act_dim)
        self.stats = SharedStats.create(c.sampler_processes)
        self.stats.paused[c.samplers:] = 1  # spares start paused; the CPU governor may resume them
        if self.resumed is not None:
            # samplers act with the restored policy from their first step; the run's step count carries on
            actor.load_state_dict(self.resumed["algo"]["actor"])
            self.stats.env_steps[0] = int(self.resumed["counters"]["env_steps"])
        self.weights = SharedWeights.create(actor, self.ctx)
        if self.resumed is not None:
            self.weights.publish(actor, int(self.resumed["counters"]["policy_version"]))
            self.restore_replay()

    def restore_replay(self) -> None:
        """A resumed run continues with the replay saved beside its checkpoint (--save-replay), if any; a
        bad or truncated file is a warning and the replay refills as without one."""
        path = Path(self.config.resume) / "checkpoints" / REPLAY_FILE
        if not path.exists() or not isinstance(self.replay, SharedReplay):
            return
        try:
            rows = load_replay(self.replay, path, expect=learner_mod.replay_meta(self.config))
        except ReplayFileError as err:
            self.event(f"warning: saved replay not used ({err}); refilling it with the restored policy")
            return
        self.event(f"restored {rows:,} transitions of the replay from {path}")

    def start_children(self) -> None:
        c, pid = self.config, os.getpid()
        learner_threads = c.learner_threads or max(1, usable_cores() - c.samplers)
        specs = {"spreeze-learner": (learner_mod.run, (c, self.env_info, self.replay.handle, self.weights.handle,
                                                         self.stats.handle, self.messages, self.stop_event, pid,
                                                         str(self.run_dir), c.batch_size, learner_threads,
                                                         self.started_at, self.batch_sweep)),
                 "spreeze-evaluator": (evaluator_mod.run, (c, self.env_info, self.weights.handle, self.stats.handle,
                                                             self.messages, self.stop_event, pid, self.started_at))}
        for i in range(c.sampler_processes):
            specs[f"spreeze-sampler-{i}"] = (sampler_mod.run, (i, c, self.env_info, self.replay.handle,
                                                               self.weights.handle, self.stats.handle,
                                                               self.stop_event, pid, self.messages))
        self.specs = specs
        self.stats.heartbeats[:] = time.time()  # a child is "silent" only once it had time to start
        for name in specs:
            self.spawn(name)

    def spawn(self, name: str) -> None:
        target, args = self.specs[name]
        kwargs = {}
        if name.startswith("spreeze-sampler"):
            kwargs["incarnation"] = self.incarnation(name)
        elif name == "spreeze-evaluator":
            kwargs["first_index"] = len(self.evaluations)  # test i keeps its seeded start states after a restart
        process = self.ctx.Process(target=target, args=args, kwargs=kwargs, name=name, daemon=False)
        process.start()
        self.processes[name] = process

    def incarnation(self, name: str) -> int:
        """A restarted sampler, or one of a resumed run, must not replay the random streams of the first."""
        return self.resumes * INCARNATIONS_PER_RESUME + self.restart_totals.get(name, 0)

    def stop_children(self) -> None:
        self.stop_event.set()
        deadline = {name: (LEARNER_JOIN_TIMEOUT_S if name == "spreeze-learner" else JOIN_TIMEOUT_S)
                    for name in self.processes}
        begun = time.monotonic()
        for name, process in self.processes.items():
            process.join(timeout=max(0.1, deadline[name] - (time.monotonic() - begun)))
        for name, process in self.processes.items():
            if process.is_alive():
                # children ignore SIGTERM while we live (proc.leave_group_sigterm_to_parent): kill
                self.log(f"[spreeze] {name} did not stop in time; killing it")
                process.kill()
                process.join(timeout=2)
        self.drain_messages()

    def close_shared(self) -> None:
        for shared in (self.replay, self.weights, self.stats):
            if shared is not None:
                shared.close()
        self.messages.close()
        self.messages.join_thread()

    # ----- supervision ----------------------------------------------------------------------------
    def drain_messages(self) -> None:
        while True:
            try:
                message = self.messages.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            kind = message[0]
            if kind == "eval":
                self.record_evaluation(message[1])
            elif kind == "error":
                self.error = f"{message[1]}: {message[2]}"
                self.log(f"[spreeze] error in {message[1]}: {message[2]}")
            elif kind == "warning":
                self.event(f"warning from {message[1]}: {message[2]}")
            elif kind == "event":
                self.event(f"{message[1]}: {message[2]}")
            elif kind == "sampler_failed":
                self.sampler_failures[message[1]] = message[2]
            elif kind == "info":
                self.log(f"[spreeze] {message[1]}: {message[2]}")

    def start_viz(self) -> None:
        """Window and render processes: outside ``processes`` because their failures must not end the run."""
        from viz.live import LiveView

        c = self.config
        title = f"{c.env_id} · {c.algo.upper()} · {self.run_dir.name}"
        self.view = LiveView(self.ctx, self.run_dir, title, window=c.window, log=self.log)
        self.view.start()
        for kind, rows in (("eval", self.evaluations), ("metrics", self.metrics_rows)):  # a resumed run's past
            for row in rows:
                self.view.feed(kind, row)
        if c.render:
            from viz.render import start_render

            self.render_process = start_render(self.ctx, c, self.env_info, self.weights.handle, self.stats.handle,
                                               self.run_dir, self.stop_event, os.getpid())

    def stop_viz(self) -> None:
        if self.render_process is not None:
            self.render_process.join(timeout=JOIN_TIMEOUT_S)
            if self.render_process.is_alive():  # it ignores SIGTERM while we live
                self.render_process.kill()
                self.render_process.join(timeout=2)
        if self.view is not None:
            self.view.close(final=True)
        else:
            from viz.figure import write_curve_png

            c = self.config
            write_curve_png(self.run_dir / "curve.png", f"{c.env_id} · {c.algo.upper()} · {self.run_dir.name}",
                            self.evaluations, self.metrics_rows)

    def record_evaluation(self, result: dict) -> None:
        """Append a test result; a new best mean of the last ``MEAN_OF`` tests saves the tested policy as
        ``best/actor.pt`` (atomically, as SB3's EvalCallback keeps its best model)."""
        flat = result.pop("actor_flat", None)
        self.evaluations.append(result)
        recent = [e["test_return"] for e in self.evaluations[-MEAN_OF:]]
        result["test_return_mean5"] = float(np.mean(recent))
        if (flat is not None and len(recent) == MEAN_OF
                and (self.best is None or result["test_return_mean5"] > self.best["test_return_mean5"])):
            self.save_best(flat, result)
        if self.view is not None:
            self.view.feed("eval", result)
        path = self.run_dir / "evaluations.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=EVAL_FIELDS)
            if new:
                writer.writeheader()
            writer.writerow({k: result.get(k) for k in EVAL_FIELDS})

    def save_best(self, flat: np.ndarray, result: dict) -> None:
        c = self.config
        with torch.random.fork_rng(devices=[]):  # a serial learner draws from this process's generator
            actor = make_actor(c, self.env_info.obs_dim, self.env_info.act_dim)
        load_flat(actor, flat)
        best = {k: result[k] for k in ("test_return_mean5", "test_return", "policy_version", "env_steps", "time_s")}
        try:
            save_actor(self.run_dir, actor, c.to_dict(), self.env_info, BEST_DIR, extra={"best": best})
        except OSError as err:
            self.event(f"warning: best policy not saved ({type(err).__name__}: {err})")
            return
        self.best = best

    def budget_reached(self) -> str | None:
        """Why the run should stop now, or None; remembered as ``stopped_by`` for the summary."""
        c = self.config
        reason = None
        if c.total_steps and self.stats.total_env_steps() >= c.total_steps:
            self.stopped_by, reason = "total_steps", f"reached --total-steps {c.total_steps}"
        elif c.minutes and time.time() - self.started_at >= c.minutes * 60:
            self.stopped_by, reason = "minutes", f"reached --minutes {c.minutes}"
        elif (c.target_return is not None and len(self.evaluations) >= MEAN_OF
              and self.evaluations[-1]["test_return_mean5"] >= c.target_return):
            self.stopped_by = "target_return"
            reason = (f"reached --target-return {c.target_return:g}: the mean of the last {MEAN_OF} tests is "
                      f"{self.evaluations[-1]['test_return_mean5']:.1f}")
        return reason

    def check_children(self) -> None:
        """Restart a dead or silent sampler/evaluator (bounded per minute); a failed learner ends the run."""
        now = time.time()
        for name, process in list(self.processes.items()):
            if name in self.retired:
                continue
            role = self.role_of(name)
            silent = now - self.stats.heartbeats[role]
            if process.exitcode is None and silent <= SILENT_AFTER_S:
                continue
            if name == "spreeze-learner":
                if process.exitcode == 0 and self.stats.learner[LEARNER_DONE]:
                    continue
                cause = (f"exited with code {process.exitcode}" if process.exitcode is not None
                         else f"sent no heartbeat for {silent:.0f} s")
                raise ChildFailed(f"spreeze-learner {cause}" + (f" ({self.error})" if self.error else ""))
            if process.exitcode is None:
                process.kill()  # silent: a hung child is replaced like a dead one
                process.join(timeout=2)
                cause = f"sent no heartbeat for {silent:.0f} s"
            else:
                cause = describe_exit(process.exitcode)
            self.restart(name, cause)

    def role_of(self, name: str) -> int:
        if name == "spreeze-learner":
            return LEARNER_ROLE
        if name == "spreeze-evaluator":
            return EVALUATOR_ROLE
        return sampler_role(int(name.rsplit("-", 1)[1]))

    def restart(self, name: str, cause: str) -> None:
        """Replace a dead child, at most ``--max-restarts-per-minute`` times; a sampler's regions are repaired
        first (its lock freed if it died holding it, half-written rows replaced), so what it already wrote
        stays valid and the learner never freezes on its lock."""
        now = time.monotonic()
        # first, whether or not it comes back: a dead child may hold a region or the weights lock
        if name.startswith("spreeze-sampler"):
            index = int(name.rsplit("-", 1)[1])
            per = self.config.envs_per_sampler
            freed = [r for r in range(index * per, (index + 1) * per) if self.replay.recover_region(r)]
            if freed:
                self.event(f"freed replay region lock(s) {freed} left held by {name}")
        self.recover_weights_lock(name, self.processes[name].pid)
        recent = [t for t in self.restarts.get(name, []) if now - t < 60.0]
        failure = self.sampler_failures.pop(name, None)
        if failure is not None or len(recent) >= self.config.max_restarts_per_minute:
            why = failure or f"{len(recent)} restarts in the last minute"
            self.retired.add(name)
            self.event(f"{name} {cause}; not restarting it: {why}")
            if name.startswith("spreeze-sampler") and all(
                    n in self.retired for n in self.processes if n.startswith("spreeze-sampler")):
                raise ChildFailed("every sampler has failed; see events.log")
            return
        self.stats.heartbeats[self.role_of(name)] = time.time()
        self.restart_totals[name] = self.restart_totals.get(name, 0) + 1
        self.spawn(name)
        self.restarts[name] = recent + [now]
        self.event(f"{name} {cause}; restarted ({len(recent) + 1} in the last minute)")

    def recover_weights_lock(self, name: str, pid: int | None) -> None:
        """A reader killed while it copied the weights leaves their lock held, and the learner's next publish
        would time out and end the run: free it before anything else waits on it."""
        if self.weights.recover_lock(dead_pid=pid):
            self.event(f"freed the weights lock left held by {name}")

    def check_render(self) -> None:
        """The --render process is not restarted, but one that died inside a weights copy is recovered from."""
        process = self.render_process
        if process is not None and process.exitcode is not None:
            self.render_process = None
            self.recover_weights_lock("spreeze-render", process.pid)

    def write_metrics(self) -> dict:
        now = time.time()
        snap = self.stats.snapshot()
        sampling_hz, update_hz, rows_hz = self._rates.update(now, snap["env_steps"], snap["updates"],
                                                             snap["sampled_rows"])
        if self._train_started is None and snap["updates"] > 0:
            self._train_started = (now, snap["env_steps"], snap["updates"], snap["sampled_rows"])
        cpu = psutil.cpu_percent()
        gpu = gpu_utilization()
        self._cpu_samples.append(cpu)
        if gpu is not None:
            self._gpu_samples.append(gpu)
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
               "noise_scale": snap["noise_scale"]}
        path = self.run_dir / "metrics.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=METRICS_FIELDS)
            if new:
                writer.writeheader()
            writer.writerow({k: _fmt(v) for k, v in row.items()})
        self.metrics_rows.append(row)
        if self.view is not None:
            self.view.feed("metrics", row)
        return row

    def govern(self, governor, cpu_percent: float) -> None:
        """Pause or resume samplers so CPU use returns toward its target; log every change with its reason."""
        active = int((self.stats.paused == 0).sum())
        wanted, reason = governor.decide(time.monotonic(), cpu_percent, active)
        if wanted == active or reason is None:
            return
        if wanted < self.config.samplers and self.replay.size() < self.config.learning_begins_at:
            # warm-up (a resumed run's refill too): the idle learner makes the CPU look free, and the replay is
            # sized for `samplers` active ones: pausing them now could leave the warm-up unreachable
            wanted, reason = self.config.samplers, f"{reason}; but not below --samplers during the warm-up"
            governor.reset()
            if wanted == active:
                return
        self.stats.paused[:wanted] = 0
        self.stats.paused[wanted:] = 1
        self.event(f"samplers active {active} -> {wanted}: {reason}")

    def event(self, text: str) -> None:
        line = f"{time.time() - self.started_at:.1f}s {text}"
        self.log(f"[spreeze] {text}")
        with open(self.run_dir / "events.log", "a") as f:
            f.write(line + "\n")

    def progress_line(self, row: dict) -> str:
        return (f"[spreeze] {row['time_s']:7.1f}s  steps {row['env_steps']:>9,}  updates {row['updates']:>8,}  "
                f"test {row['test_return']:8.1f}  sample {row['sampling_hz']:7.0f} Hz  "
                f"update {row['update_hz']:6.1f} Hz ({row['update_frame_rate']:,.0f} frames/s)  cpu {row['cpu_percent']:.0f}%")

    def summary(self) -> dict:
        """Spreeze Table 1 figures for this run, averaged from the start of learning to the end."""
        snap = self.stats.snapshot()
        now = time.time()
        t0, s0, u0, r0 = self._train_started or (self.started_at, 0, 0, 0)
        span = max(now - t0, 1e-9)
        update_hz = (snap["updates"] - u0) / span
        busy = snap["fetch_s"] + snap["update_s"]
        return {
            "env_id": self.config.env_id, "algo": self.config.algo, "samplers": self.config.samplers,
            "envs_per_sampler": self.config.envs_per_sampler, "batch_size": snap["batch_size"] or self.config.batch_size,
            "batch_rule": self.config.batch_rule if self.batch_sweep else "fixed",
            "started_at_unix": self.started_at,
            "wall_time_s": now - self.started_at, "env_steps": snap["env_steps"], "updates": snap["updates"],
            "cpu_usage_percent": float(np.mean(self._cpu_samples)) if self._cpu_samples else float("nan"),
            "sampling_frame_rate_hz": (snap["env_steps"] - s0) / span,
            "gpu_usage_percent": float(np.mean(self._gpu_samples)) if self._gpu_samples else None,
            "update_frame_rate_hz": (snap["sampled_rows"] - r0) / span,
            "update_frequency_hz": update_hz,
            "fetch_share": snap["fetch_s"] / busy if busy > 0 else float("nan"),
            "final_test_return": self.evaluations[-1]["test_return"] if self.evaluations else None,
            "best_test_return": max(e["test_return"] for e in self.evaluations) if self.evaluations else None,
            f"final_mean{MEAN_OF}_test_return": (float(np.mean([e["test_return"] for e in self.evaluations[-MEAN_OF:]]))
                                                if self.evaluations else None),
            f"best_mean{MEAN_OF}_test_return": self.best["test_return_mean5"] if self.best else None,
            "best_policy": ({"path": str(self.run_dir / BEST_DIR / FINAL_ACTOR_NAME), **self.best}
                            if self.best else None),
            "stopped_by": self.stopped_by,
            "critic_noise_scale": snap["noise_scale"] if math.isfinite(snap["noise_scale"]) else None,
        }


class ChildFailed(RuntimeError):
    pass


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _read_rows(path: Path) -> list[dict]:
    """Rows of an earlier session's CSV, numbers as floats (empty cells as NaN), for a resumed run's curves."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _upgrade_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Rewrite an earlier session's CSV whose header lacks columns added since, so that appended rows line up."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header == fields:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k, math.nan)) for k in fields})
    os.replace(tmp, path)


def _number(text: str):
    try:
        return float(text) if text != "" else float("nan")
    except (TypeError, ValueError):
        return text


def _fmt(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def print_table(summary: dict, log=console) -> None:
    gpu = summary["gpu_usage_percent"]
    log("[spreeze] | CPU usage | sampling frame rate | GPU usage | update frame rate | update frequency |")
    log("[spreeze] |---|---|---|---|---|")
    log(f"[spreeze] | {summary['cpu_usage_percent']:.0f}% | {summary['sampling_frame_rate_hz']:,.0f} Hz | "
        f"{'none' if gpu is None else f'{gpu:.0f}%'} | {summary['update_frame_rate_hz']:,.0f} Hz | "
        f"{summary['update_frequency_hz']:.1f} Hz |")


def profile_batch_sweep(profile: dict | None) -> list | None:
    """``(batch, updates_per_s)`` of the profile's learner sweep when the profile chose the batch (not a hand,
    a config or the reproducible mode): only then may the learner re-decide it."""
    if not profile or (profile.get("chosen", {}).get("batch_size") or {}).get("by") != "profile":
        return None
    sweep = ((profile.get("measurements") or {}).get("learner") or {}).get("sweep") or []
    return [(int(p["batch"]), float(p["updates_per_s"])) for p in sweep] or None


def train(config: Config, env_info: EnvInfo, log=console, profile: dict | None = None) -> RunResult:
    """Run one training job with real processes (or all roles in this process with ``--serial``).

    ``profile``: the autotuner's record of what it measured and chose, saved as ``autotune.json``; with
    ``--batch-rule noise`` its learner sweep lets the learner re-decide the batch during the run.
    """
    config = resolve(config)
    removed = remove_stale_segments()
    if removed:
        log(f"[spreeze] removed {len(removed)} shared-memory segment(s) left by dead earlier runs")
    run_dir = make_run_dir(config)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    if profile is not None:
        (run_dir / "autotune.json").write_text(json.dumps(profile, indent=2, default=str))
    spares = config.sampler_processes - config.samplers
    log(f"[spreeze] run directory {run_dir}; {config.samplers} sampler(s) (+{spares} paused spare) "
        f"x {config.envs_per_sampler} env(s), batch {config.batch_size}, collect:update {config.collect_ratio:g}, "
        f"algo {config.algo}")
    sup = Supervisor(config, env_info, run_dir, log, batch_sweep=profile_batch_sweep(profile))
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    # a shell starting us in the background may have set SIGINT to "ignore", which Python then keeps;
    # kill -INT must stop a run like Ctrl-C does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    exit_code = 0
    try:
        sup.create_shared()
        if config.deterministic:
            from spreeze.lockstep import run_lockstep  # imported here: lockstep imports this module

            run_lockstep(sup)
        elif config.serial:
            _run_serial(sup)
        else:
            _run_processes(sup)
    except KeyboardInterrupt:
        sup.stopped_by = "interrupted (Ctrl-C or SIGTERM)"
        log("[spreeze] interrupted: stopping, writing the final checkpoint")
        exit_code = 130
    except ChildFailed as err:
        sup.drain_messages()
        log(f"[spreeze] stopping: {err}")
        sup.stopped_by = f"error: {err}"
        exit_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            if not config.serial:
                sup.stop_children()
            summary = sup.summary() if sup.stats is not None else {}
            sup.stop_viz()
        finally:
            sup.close_shared()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous_sigterm)
    if sup.error and exit_code == 0:
        exit_code = 1
        summary["stopped_by"] = f"error: {sup.error}"
    summary["exit_code"] = exit_code
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary.get("update_frequency_hz") is not None:
        print_table(summary, log)
    if summary.get("stopped_by"):
        log(f"[spreeze] stopped by: {summary['stopped_by']}")
    if summary.get("final_test_return") is not None:
        best = summary.get("best_policy")
        log(f"[spreeze] test return: final {summary['final_test_return']:.1f}, mean of the last {MEAN_OF} "
            f"{summary[f'final_mean{MEAN_OF}_test_return']:.1f}"
            + (f"; best mean of {MEAN_OF} {best['test_return_mean5']:.1f} at {best['env_steps']:,} steps, "
               f"policy in {best['path']}" if best else ""))
    log(f"[spreeze] finished: {run_dir}")
    return RunResult(run_dir, exit_code, summary, sup.evaluations)


def _run_processes(sup: Supervisor) -> None:
    from autotune.governor import CpuGovernor

    c = sup.config
    governor = CpuGovernor(target_percent=c.cpu_target_percent, min_active=1, max_active=c.sampler_processes)
    sup.start_children()
    sup.start_viz()
    psutil.cpu_percent()  # prime the counter (its first call returns 0)
    next_log = time.monotonic() + sup.config.log_interval_s
    while True:
        time.sleep(0.1)
        sup.drain_messages()
        if sup.error:
            raise ChildFailed(sup.error)
        sup.check_children()
        sup.check_render()
        sup.view.poll()
        if time.monotonic() >= next_log:
            row = sup.write_metrics()
            sup.log(sup.progress_line(row))
            sup.govern(governor, row["cpu_percent"])
            next_log += sup.config.log_interval_s
        reason = sup.budget_reached()
        if reason:
            sup.log(f"[spreeze] {reason}")
            sup.write_metrics()
            return


def _run_serial(sup: Supervisor) -> None:
    """All roles in this process, interleaved: for debugging and for deterministic tests."""
    c = sup.config
    learner_threads = c.learner_threads or 1
    torch.set_num_threads(learner_threads)
    samplers = [sampler_mod.Sampler(i, c, sup.env_info, sup.replay, sup.weights, sup.stats,
                                    incarnation=sup.incarnation(f"spreeze-sampler-{i}")) for i in range(c.samplers)]
    # serial mode is for debugging: one thread, batches gathered when they are used
    learner = learner_mod.Learner(c, sup.env_info, sup.replay, sup.weights, sup.stats, sup.run_dir,
                                  c.batch_size, sup.started_at, prefetch=False, batch_sweep=sup.batch_sweep,
                                  messages=sup.messages)
    evaluator = evaluator_mod.Evaluator(c, sup.env_info, sup.weights, sup.stats, sup.started_at,
                                        first_index=len(sup.evaluations))
    psutil.cpu_percent()
    next_log = time.monotonic() + c.log_interval_s
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
                sup.record_evaluation(evaluator.evaluate())
                next_eval = time.monotonic() + c.eval_interval_s
            if time.monotonic() >= next_log:
                sup.drain_messages()
                sup.log(sup.progress_line(sup.write_metrics()))
                next_log += c.log_interval_s
            reason = sup.budget_reached()
            if reason:
                sup.log(f"[spreeze] {reason}")
                sup.write_metrics()
                break
    finally:
        for s in samplers:
            s.flush()
            s.close()
        learner.finish()
        evaluator.close()
        del samplers, learner, evaluator
