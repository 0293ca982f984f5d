"""What every child process is: how it is started and stopped (``start_process``, ``stop_process``, the one place
for both, used by the supervisor, the window, ``--render`` and the autotune probe), its role, its entry skeleton
(``child_main``), what it does first, and how it notices that its parent is gone."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import psutil


def start_process(target, *args, name: str, daemon: bool = True, watch_parent: bool = False) -> mp.Process:
    """Start ``target(*args)`` in a child process named ``name``, with the ``spawn`` start method only
    (docs/pitfalls.md: a fork after torch ran a parallel op hangs). Before ``target`` runs the child takes its
    title, ignores Ctrl-C and leaves a group SIGTERM to this process (:func:`leave_group_sigterm_to_parent`):
    its parent stops it, through a flag it watches or with :func:`stop_process`. A child that does not watch
    its parent itself (:class:`ParentWatch`) is started with ``watch_parent``: it then exits within a second of
    its parent's death. ``daemon``: multiprocessing kills it when this process exits first (the supervisor's
    children are not daemons: they stop themselves when it dies, the learner after its final checkpoint)."""
    process = mp.get_context("spawn").Process(target=_enter, name=name, daemon=daemon,
                                              args=(name, watch_parent, target, args))
    process.start()
    return process


def _enter(name: str, watch_parent: bool, target, args: tuple) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(name)
    except ImportError:  # the name is cosmetic; never fail a run over it
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_group_sigterm_to_parent()
    if watch_parent:
        threading.Thread(target=_exit_with_parent, args=(ParentWatch(os.getppid()),), daemon=True).start()
    target(*args)


def _exit_with_parent(parent: ParentWatch) -> None:
    while not parent.gone():
        time.sleep(parent.check_every_s)
    os._exit(143)


def stop_process(process: mp.Process, timeout_s: float) -> bool:
    """Join ``process`` for up to ``timeout_s``; kill it if it is still running (SIGKILL: a child started by
    :func:`start_process` ignores SIGTERM while we live). True when it had to be killed."""
    process.join(timeout=timeout_s)
    if process.exitcode is not None:
        return False
    process.kill()
    process.join(timeout=2.0)
    return True


def child_setup(torch_threads: int) -> None:
    """Cap threads and flush subnormal floats. Thread caps matter on small machines: processes with default
    torch threads oversubscribe the cores and run orders of magnitude slower (docs/pitfalls.md)."""
    os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    import torch

    flush_denormals(True)  # before the thread pool starts, so that its threads inherit it
    torch.set_num_threads(torch_threads)


def flush_denormals(on: bool) -> bool:
    """Treat subnormal floats as zero in this thread (and threads it starts later), or stop; returns whether
    they were flushed before. Adam's moments of units whose gradient stays zero (dead ReLUs) decay through the
    subnormal range, where many x86 cores take a slow path for operations on them: unflushed, a CPU
    learner's Adam step becomes several times slower as training goes on (docs/pitfalls.md). Numbers below
    1e-38 change nothing a network learns. Does nothing where the CPU has no such mode."""
    import torch

    was = float(torch.tensor([1e-40]) * 1.0) == 0.0
    torch.set_flush_denormal(on)
    return was


@contextlib.contextmanager
def subnormals_flushed():
    """:func:`flush_denormals` for a block (or a decorated function) run in a caller's process: this thread
    gets its setting back afterwards. Threads started inside keep the flush, and torch's pool threads started
    before keep theirs: a caller's multi-threaded CPU work there may run unflushed."""
    was = flush_denormals(True)
    try:
        yield
    finally:
        flush_denormals(was)


def leave_group_sigterm_to_parent() -> None:
    """A SIGTERM sent to the whole process group (``kill -TERM -<pgid>``, a service manager) reaches the
    children too: while the supervisor lives they ignore it and stop through its stop Event, so the learner
    still writes its final checkpoint; an orphaned child exits at once (143). The supervisor kills a child
    that does not stop in time (SIGKILL, after the join timeout)."""
    parent_pid = os.getppid()

    def handler(signum, frame):
        if os.getppid() != parent_pid:
            sys.exit(143)
    signal.signal(signal.SIGTERM, handler)


class ParentWatch:
    """True from :meth:`gone` once the process that started us has died (we were re-parented)."""

    def __init__(self, parent_pid: int, check_every_s: float = 0.5):
        self.parent_pid = parent_pid
        self.check_every_s = check_every_s
        self._next_check = 0.0
        self._gone = False

    def gone(self) -> bool:
        if self._gone:
            return True  # latched: callers may ask again between checks
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        self._gone = os.getppid() != self.parent_pid or not psutil.pid_exists(self.parent_pid)
        return self._gone


def usable_cores() -> int:
    """Cores this process may run on (respects pinning, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def role_processes(pid: int) -> dict[str, psutil.Process]:
    """The spreeze children of process ``pid`` by role title (``spreeze-sampler-0``, ``spreeze-learner``, ...)."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if title.startswith("spreeze-"):
            found[title.split()[0]] = child
    return found


@dataclass(frozen=True)
class Role:
    """Who a child is: set by the supervisor when it plans the run, never read back from a process title."""
    kind: str        # "sampler", "learner", "evaluator" or "ingest" (--ray)
    index: int = 0   # samplers only

    @property
    def name(self) -> str:
        """The process title (``ps``, ``setproctitle``)."""
        return f"spreeze-sampler-{self.index}" if self.kind == "sampler" else f"spreeze-{self.kind}"

    @property
    def source(self) -> str:
        """How its messages sign."""
        return "learner" if self.kind == "learner" else self.name

    @property
    def heartbeat(self) -> int:
        from spreeze.stats import EVALUATOR_ROLE, INGEST_ROLE, LEARNER_ROLE, sampler_role

        if self.kind == "sampler":
            return sampler_role(self.index)
        return {"learner": LEARNER_ROLE, "ingest": INGEST_ROLE}.get(self.kind, EVALUATOR_ROLE)


@dataclass(frozen=True)
class ChildLink:
    """What every child gets from the supervisor besides its role's shared state."""
    messages: object
    stop_event: object
    parent_pid: int


class Child:
    """A child's side of the link, handed to its role's ``build`` and ``loop``: the stop test (which beats the
    heartbeat), messages, and the shared state it attached, closed after the worker."""

    def __init__(self, role: Role, link: ChildLink):
        self.role = role
        self.messages = link.messages
        self.stop_event = link.stop_event
        self.parent = ParentWatch(link.parent_pid)
        self.stats = None   # SharedStats, once attached: should_stop beats the role's heartbeat
        self._kept: list = []

    def keep(self, shared):
        """Close ``shared`` when the child ends (after its worker, which may still hold views of it)."""
        self._kept.append(shared)
        return shared

    def should_stop(self) -> bool:
        if self.stats is not None:
            self.stats.beat(self.role.heartbeat)
        return self.stop_event.is_set() or self.parent.gone()

    def send(self, message) -> None:
        self.messages.put(message, timeout=5)

    def close(self) -> None:
        while self._kept:
            self._kept.pop(0).close()
        self.stats = None


def child_main(role: Role, build, loop, link: ChildLink, threads: int = 1, fatal: bool = False) -> None:
    """The one process entry of every spreeze child: setup, ``worker = build(child)``, ``loop(worker, child)``,
    then close everything, also when the parent died. ``fatal``: any exception is reported as an error that
    ends the run (a restartable child just dies and is replaced)."""
    from spreeze.messages import Error

    child_setup(threads)
    child = Child(role, link)
    worker = None
    try:
        worker = build(child)
        loop(worker, child)
    except Exception as err:
        if fatal:
            child.send(Error(role.source, f"{type(err).__name__}: {err}"))
        raise
    finally:
        if child.parent.gone():
            link.stop_event.set()  # every child stops without its supervisor; a queue replay then skips its flush
            if link.messages is not None:
                link.messages.cancel_join_thread()  # nobody reads the queue any more: do not block exit on it
        if worker is not None:
            worker.close()
        del worker
        child.close()
