"""Process lifecycle: the shared state children attach to, and spawning, watching, restarting and stopping them.

Every child is started with the ``spawn`` context (docs/pitfalls.md: a fork after torch ran a parallel op hangs).
``stop_children`` sets the stop Event, joins with timeouts and kills what is left (children ignore SIGTERM
while the supervisor lives); ``close_shared`` unlinks every segment.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from spreeze import evaluator as evaluator_mod
from spreeze import learner as learner_mod
from spreeze import sampler as sampler_mod
from spreeze.algos import make_actor
from spreeze.checkpoint import CHECKPOINT_NAME, load_checkpoint
from spreeze.config import Config
from spreeze.defaults import learner_threads
from spreeze.envs import EnvInfo
from spreeze.messages import Checkpointed, Error, Evaluation, Event, GaveUp, Inbox, Info, Warn
from spreeze.proc import (ChildLink, FirstError, Role, StopFlag, child_main, interrupts_deferred, start_process,
                         stop_process)
from spreeze.replay import REPLAY_FILE, ReplayFileError, SharedReplay, load_replay
from spreeze.transport import QueueReplay
from spreeze.runlog import RunLog, console
from spreeze.stats import INGEST_ALIVE, INGEST_IN_FLIGHT, INGEST_LOST_BLOCKS, LEARNER_DONE, SharedStats
from spreeze.weights import SharedWeights

SILENT_AFTER_S = 30.0
WATCHER_STALL_S = 5.0  # a gap this long between two checks means the watcher itself did not run (see check_children)
JOIN_TIMEOUT_S = 5.0
INCARNATIONS_PER_RESUME = 1 << 20  # sampler seed streams: one block of restart numbers per resume
LEARNER_JOIN_TIMEOUT_S = 20.0
STOP_SLICE_S = 0.1  # children are joined this long at a time, the messages they send read in between


class ChildFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child: ``child_main(role, build(child, **fresh()), loop)``; ``fresh`` runs here at each
    (re)start, for what a replacement must not share with its predecessor. A ``fatal`` child is never restarted:
    its end ends the run (a learner that finished its work excepted); one silent for ``silent_after_s`` is hung."""
    build: Callable
    loop: Callable
    threads: int = 1
    fatal: bool = False
    fresh: Callable[[], dict] = dict
    silent_after_s: float = SILENT_AFTER_S


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
        self.runlog = RunLog(config, env_info, run_dir, log, self.started_at, resumed=self.resumed is not None,
                             resumed_at_s=float(self.resumed["counters"]["time_s"]) if self.resumed else None,
                             resumed_updates=int(self.resumed["counters"]["updates"]) if self.resumed else 0)
        self.event = self.runlog.event
        self.on_evaluation = self.runlog.record_evaluation  # the runner adds its observers
        self.on_checkpoint = lambda path: None
        self.replay = self.weights = self.stats = None
        self.processes: dict[str, mp.Process] = {}
        self.stop_event = StopFlag(self.ctx)  # lock-free: a child killed while reading it blocks nobody
        self.inbox = Inbox(self.ctx)  # a pipe per child, read without blocking (spreeze/messages.py)
        self.error: str | None = None
        self._last_check: float | None = None  # check_children's last call, and the start of silence it counts
        self._silence_from = -math.inf
        self.specs: dict = {}
        self.restarts: dict[str, list[float]] = {}
        self.restart_totals: dict[str, int] = {}
        self.retired: set[str] = set()           # children stopped for good (too many failures)
        self.sampler_failures: dict[str, str] = {}  # samplers that gave up on their env, with the reason
        self.roles = {role.name: role for role in (Role("learner"), Role("evaluator"),
                                                    *(Role("sampler", i) for i in range(config.sampler_processes)),
                                                    *((Role("ingest"),) if config.ray else ()))}
        self.handlers = {
            Evaluation: lambda m: self.on_evaluation(m.result),
            Error: self._child_error,
            Warn: lambda m: self.event(f"warning from {m.source}: {m.text}"),
            Event: lambda m: self.event(f"{m.source}: {m.text}"),
            GaveUp: lambda m: self.sampler_failures.__setitem__(m.source, m.text),
            Info: lambda m: self.log(f"[spreeze] {m.source}: {m.text}"),
            Checkpointed: lambda m: self.on_checkpoint(m.text),
        }

    # ----- shared state -----------------------------------------------------------------------------------
    def create_shared(self) -> None:
        c = self.config
        if c.experience_transport == "queue":
            self.replay = QueueReplay.create(self.env_info.obs_dim, self.env_info.act_dim, c.buffer_size,
                                             c.queue_size, self.ctx, c.total_envs)
        else:
            self.replay = SharedReplay.create(self.env_info.obs_dim, self.env_info.act_dim, c.buffer_size,
                                              c.total_envs, self.ctx, active_regions=c.active_envs)
        torch.manual_seed(c.seed)  # same seed as the learner, so version 0 is the learner's initial actor
        actor = make_actor(c, self.env_info.obs_dim, self.env_info.act_dim)
        self.stats = SharedStats.create(c.sampler_processes, c.remote_samplers)
        self.stats.paused[c.samplers:] = 1  # spares start paused; the CPU governor may resume them
        if self.resumed is not None:
            # samplers act with the restored policy from their first step; the run's step count carries on
            actor.load_state_dict(self.resumed["algo"]["actor"])
            self.stats.resumed_env_steps[0] = int(self.resumed["counters"]["env_steps"])
            self.stats.restore_learner(self.resumed["counters"], self.resumed["algo"].get("actor_updates", 0),
                                       c.batch_size)
        self.runlog.mark_start(self.stats)  # this session's counts, before a saved replay's restore can be cut short
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

    def close_shared(self) -> None:
        for shared in (self.replay, self.weights, self.stats):
            if shared is not None:
                shared.close()
        self.inbox.close()

    # ----- spawning and stopping --------------------------------------------------------------------------
    def start_children(self) -> None:
        """The free-running processes: the learner, the evaluator and every sampler (spares paused)."""
        c, info = self.config, self.env_info
        shared = (self.weights.handle, self.stats.handle)
        specs = {"spreeze-learner": ChildSpec(partial(learner_mod.build, c, info, self.replay.handle, *shared,
                                                      str(self.run_dir), self.started_at, self.batch_sweep),
                                              learner_mod.loop, threads=learner_threads(c), fatal=True),
                 # test i keeps its seeded start states after a restart
                 "spreeze-evaluator": ChildSpec(partial(evaluator_mod.build, c, info, *shared, self.started_at),
                                                evaluator_mod.loop,
                                                fresh=lambda: {"first_index": len(self.runlog.evaluations)})}
        for i in range(c.sampler_processes):
            name = f"spreeze-sampler-{i}"
            specs[name] = ChildSpec(partial(sampler_mod.build, i, c, info, self.replay.handle, *shared),
                                    sampler_mod.loop, fresh=lambda name=name: {"incarnation": self.incarnation(name)})
        if c.ray:  # the one Ray driver of the run; nothing of Ray is imported without --ray
            from spreeze import remote

            specs["spreeze-ingest"] = ChildSpec(partial(remote.build, c, info, self.replay.handle, *shared),
                                                remote.loop, fresh=lambda: {"incarnation": self.incarnation("spreeze-ingest")})
        self.start(specs)

    def start(self, specs: dict[str, ChildSpec]) -> None:
        """Spawn every child of ``specs``; each is watched by its heartbeat from now on."""
        self.specs.update(specs)
        self.stats.heartbeats[:] = time.monotonic()  # a child is "silent" only once it had time to start
        for name in specs:
            self.spawn(name)

    def spawn(self, name: str) -> None:
        spec, role = self.specs[name], self.roles[name]
        outbox = self.inbox.open(name)  # a restarted child gets a new pipe: its predecessor's may be torn
        link = ChildLink(outbox, self.stop_event, os.getpid())
        try:
            # the predecessor's last whole messages, read from its retired pipe, are handled before fresh() reads
            # the run's state: a restarted evaluator would otherwise repeat the number of a test not yet counted
            self.drain_messages()
            self.processes[name] = start_process(child_main, role, partial(spec.build, **spec.fresh()), spec.loop,
                                                 link, spec.threads, spec.fatal, name=name, daemon=False)
        finally:
            outbox.release()  # the child has its own copy of the pipe's end

    def incarnation(self, name: str) -> int:
        """A restarted sampler, or one of a resumed run, must not replay the random streams of the first."""
        return self.resumes * INCARNATIONS_PER_RESUME + self.restart_totals.get(name, 0)

    def stop_children(self) -> None:
        """Every child stopped (or killed at its deadline), even when handling their last messages raises (an
        observer's full disk): a child left running would hold the interpreter's exit, which joins it. The first
        such error rises after."""
        self.stop_event.set()
        deadline = {name: (LEARNER_JOIN_TIMEOUT_S if name == "spreeze-learner" else JOIN_TIMEOUT_S)
                    for name in self.processes}
        begun = time.monotonic()
        errors = FirstError()
        for name, process in self.processes.items():
            # joined in slices with the messages read between them: a child's last messages (the evaluator's
            # last test, with its weights) need the supervisor reading to get through the pipe
            while process.exitcode is None and time.monotonic() - begun < deadline[name] - STOP_SLICE_S:
                process.join(STOP_SLICE_S)
                with errors.step():
                    self.drain_messages()
            if stop_process(process, max(0.1, deadline[name] - (time.monotonic() - begun))):
                self.log(f"[spreeze] {name} did not stop in time; killed it")
        with errors.step():
            self.drain_messages()
        errors.raise_first()

    # ----- watching ---------------------------------------------------------------------------------------
    def watch(self) -> None:
        """Between two steps of a schedule: route the children's messages, end the run on a reported error,
        restart or give up on the children that died or hung."""
        self.drain_messages()
        if self.error:
            raise ChildFailed(self.error)
        self.check_children()

    def drain_messages(self) -> None:
        self.inbox.collect()
        while (message := self.inbox.take()) is not None:
            self.handlers[type(message)](message)

    def _child_error(self, message: Error) -> None:
        self.error = f"{message.source}: {message.text}"
        self.log(f"[spreeze] error in {message.source}: {message.text}")

    def check_children(self) -> None:
        """Restart a dead or silent sampler/evaluator (bounded per minute); a failed fatal child (the learner;
        every lock-step child) ends the run."""
        now = time.monotonic()  # as the beats (SharedStats.beat): a step of the wall clock silences no one
        if self._last_check is not None and now - self._last_check > WATCHER_STALL_S:
            # the watcher did not run either: the job was stopped (Ctrl-Z then fg, docker pause, a suspended VM),
            # and the monotonic clock went on meanwhile. Its children were stopped too: silence counts from now
            self._silence_from = now
        self._last_check = now
        for name, process in list(self.processes.items()):
            if name in self.retired:
                continue
            role, spec = self.roles[name], self.specs[name]
            silent = now - max(self.stats.heartbeats[role.heartbeat], self._silence_from)
            if process.exitcode is None and silent <= spec.silent_after_s:
                continue
            if spec.fatal:
                if role.kind == "learner" and process.exitcode == 0 and self.stats.learner[LEARNER_DONE]:
                    continue
                cause = (f"exited with code {process.exitcode}" if process.exitcode is not None
                         else f"sent no heartbeat for {silent:.0f} s")
                raise ChildFailed(f"{name} {cause}" + (f" ({self.error})" if self.error else ""))
            if process.exitcode is None:
                stop_process(process, 0)  # silent: a hung child is replaced like a dead one
                cause = f"sent no heartbeat for {silent:.0f} s"
            else:
                cause = describe_exit(process.exitcode)
            self.restart(name, cause)

    def restart(self, name: str, cause: str) -> None:
        """Replace a dead child, at most ``--max-restarts-per-minute`` times; a sampler's regions are repaired
        first (its lock freed if it died holding it, half-written rows replaced), so what it already wrote
        stays valid and the learner never freezes on its lock."""
        now, role = time.monotonic(), self.roles[name]
        # first, whether or not it comes back: a dead child may hold a region or the weights lock; a Ctrl-C rises
        # after the repairs, not between them (one left held would stall the learner's final steps), unless a
        # region's recovery is only waiting for a live holder
        with interrupts_deferred():
            if role.kind in ("sampler", "ingest"):
                index, per = role.index, self.config.envs_per_sampler
                first, last = ((index * per, (index + 1) * per) if role.kind == "sampler"
                               else (self.config.sampler_processes * per, self.config.total_envs))  # remote regions
                dead = self.processes[name].pid
                freed = [r for r in range(first, last) if self.replay.recover_region(r, dead_pid=dead)]
                if freed:
                    self.event(f"freed replay region lock(s) {freed} left held by {name}")
            self.recover_weights_lock(name, self.processes[name].pid)
        # its last whole messages first: a GaveUp sent just before it exited decides that it is not restarted
        self.drain_messages()
        if role.kind == "ingest":  # its remote samplers went with it (a restarted ingest counts its own again)
            self.stats.ingest[INGEST_ALIVE] = 0
            # and the blocks it had asked for: lost with it (one that raised counted its own and left 0 here)
            self.stats.ingest[INGEST_LOST_BLOCKS] += self.stats.ingest[INGEST_IN_FLIGHT]
            self.stats.ingest[INGEST_IN_FLIGHT] = 0
        recent = [t for t in self.restarts.get(name, []) if now - t < 60.0]
        failure = self.sampler_failures.pop(name, None)
        if failure is not None or len(recent) >= self.config.max_restarts_per_minute:
            why = failure or f"{len(recent)} restarts in the last minute"
            self.retired.add(name)
            if role.kind == "sampler":  # no longer counted among the active ones (active_samplers in metrics.csv)
                self.stats.paused[role.index] = 1
            self.event(f"{name} {cause}; not restarting it: {why}")
            if role.kind == "evaluator":  # what the user loses with it, said where they look
                self.event("no more tests in this run: the test curve and best/actor.pt stay as they are"
                           + (", and --target-return cannot stop it" if self.config.target_return is not None else "")
                           + "; training goes on to its other budgets")
            # the ingest stands for the remote samplers: with local ones left (or remote ones) the run goes on
            if role.kind in ("sampler", "ingest") and all(
                    n in self.retired for n in self.processes if self.roles[n].kind in ("sampler", "ingest")):
                raise ChildFailed("every sampler has failed" + (" (--remote-only: no local sampler to go on with)"
                                                                if self.config.remote_only else "") + "; see events.log")
            return
        self.stats.heartbeats[role.heartbeat] = time.monotonic()
        self.restart_totals[name] = self.restart_totals.get(name, 0) + 1
        self.spawn(name)
        self.restarts[name] = recent + [now]
        self.event(f"{name} {cause}; restarted ({len(recent) + 1} in the last minute)")

    def recover_weights_lock(self, name: str, pid: int | None) -> None:
        """A reader killed while it copied the weights leaves their lock held, and the learner's next publish
        would time out and end the run: free it before anything else waits on it."""
        if self.weights.recover_lock(dead_pid=pid):
            self.event(f"freed the weights lock left held by {name}")

    def govern(self, governor, cpu_percent: float) -> None:
        """Pause or resume samplers so CPU use returns toward its target; log every change with its reason. A
        sampler stopped for good counts neither way: the governor pausing the last one that works would stall the
        run."""
        live = [r.index for name, r in self.roles.items() if r.kind == "sampler" and name not in self.retired]
        active = int((self.stats.paused[live] == 0).sum())
        wanted, reason = governor.decide(time.monotonic(), cpu_percent, active)
        wanted = min(wanted, len(live))
        floor = min(self.config.samplers, len(live))
        if wanted < floor and self.replay.size() < self.config.learning_begins_at:
            # warm-up (a resumed run's refill too): the idle learner makes the CPU look free, and the replay is
            # sized for `samplers` active ones: pausing them now, or leaving a spare paused when one of them has
            # stopped for good, could leave the warm-up unreachable (the run would never learn)
            reason = (f"{reason}; but not below --samplers during the warm-up" if reason is not None else
                      "a sampler stopped for good during the warm-up, and the replay is sized for --samplers "
                      "active ones")
            wanted = floor
            governor.reset()
        if wanted == active or reason is None:
            return
        self.stats.paused[live[:wanted]] = 0
        self.stats.paused[live[wanted:]] = 1
        self.event(f"samplers active {active} -> {wanted}: {reason}")


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
