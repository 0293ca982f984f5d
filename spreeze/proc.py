"""What every child process is: how it is started and stopped (``start_process``, ``stop_process``, the one place
for both, used by the supervisor, the window, ``--render`` and the autotune probe), its role, its entry skeleton
(``child_main``), what it does first, and how it notices that its parent is gone."""
from __future__ import annotations

import contextlib
import math
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


def _exit_with_parent(parent: ParentWatch, grace_s: float = 0.0) -> None:
    while not parent.gone():
        time.sleep(parent.check_every_s)
    time.sleep(grace_s)
    os._exit(143)


class _Interrupts(threading.local):
    """Deferral depth per thread. A signal handler runs in the main thread: only the main thread's stretches
    defer it, and only the main thread raises the interrupt noted meanwhile (another thread taking a shared
    lock in this process must neither hold Ctrl-C off nor take it from the main thread)."""
    depth = 0


_INTERRUPTS = _Interrupts()
_pending = False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def interrupt() -> None:
    """What a Ctrl-C or SIGTERM handler does: raise KeyboardInterrupt, or, inside a deferred stretch, note it
    for the stretch's end."""
    global _pending
    if _INTERRUPTS.depth:
        _pending = True
        return
    raise KeyboardInterrupt


def interrupt_if_pending() -> None:
    """Inside a deferred stretch, at a point where nothing is half done (a wait): a noted interrupt rises now."""
    global _pending
    if _pending and _in_main_thread():
        _pending = False
        raise KeyboardInterrupt


def hold_interrupts() -> None:
    """Begin a deferred stretch, ended by :func:`release_interrupts` (a shared lock's acquire and release)."""
    _INTERRUPTS.depth += 1


def release_interrupts(error: BaseException | None = None) -> None:
    """End a deferred stretch; at the outermost end a noted interrupt rises, with ``error`` (leaving the stretch)
    as its cause: the handler ignores the signals after the first, so the noted one must not be lost."""
    global _pending
    _INTERRUPTS.depth -= 1
    if _INTERRUPTS.depth == 0 and _pending and _in_main_thread() and not isinstance(error, KeyboardInterrupt):
        _pending = False
        if error is None:
            raise KeyboardInterrupt
        raise KeyboardInterrupt from error


def acquire_deferring(lock, timeout_s: float, slice_s: float = 0.1) -> bool:
    """``lock.acquire(timeout=timeout_s)`` that begins a deferred stretch (hold_interrupts) which the caller ends
    with release_interrupts after its release; False (no stretch left open) when it timed out. While it only
    waits nothing is held, so a Ctrl-C noted then rises within ``slice_s`` (unless an outer stretch defers it)."""
    hold_interrupts()
    deadline = time.monotonic() + timeout_s
    try:
        while not lock.acquire(timeout=max(0.0, min(slice_s, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            if _INTERRUPTS.depth == 1:
                interrupt_if_pending()  # the except below ends the stretch
        else:
            return True
    except BaseException as err:
        release_interrupts(err)
        raise
    release_interrupts()  # timed out: outside the try, so an interrupt it raises does not end the stretch twice
    return False


HOLDER_GRACE_S = 0.5
"""How long a recovery gives a lock held with no holder recorded to show a live one: between its acquire and the
write of its pid, and between clearing it and the release, a live holder descheduled on a loaded machine looks
like one that died there."""


def take_lock(lock, timeout_s: float, holder, at, pid: int) -> bool:
    """A shared lock held by this process: :func:`acquire_deferring`, then ``pid`` written at ``holder[at]``, so
    that whoever finds the lock held can tell a dead holder's from a live one's. A Ctrl-C until
    :func:`give_lock` rises after it; False (nothing held, no stretch open) when it timed out."""
    if not acquire_deferring(lock, timeout_s):
        return False
    holder[at] = pid
    return True


def give_lock(lock, holder, at) -> None:
    """The end of :func:`take_lock`'s hold: the holder cleared, the lock released, and the deferred stretch ended
    whatever happened (one left open would hold every later Ctrl-C off)."""
    try:
        holder[at] = 0
        lock.release()
    finally:
        release_interrupts()


@contextlib.contextmanager
def interrupts_deferred():
    """A Ctrl-C or SIGTERM during the block rises at its end: a repair of shared state taken over from a dead
    process (its region or weights lock held, its rows half replaced), or any hold of a shared lock, must not
    stop half done, or the learner would wait on a lock nobody releases."""
    hold_interrupts()
    try:
        yield
    except BaseException as err:
        release_interrupts(err)
        raise
    release_interrupts()


class FirstError:
    """Clean-up steps that must each run whatever the ones before them raised (a child or a window left running
    would hold the interpreter's exit, which joins it): each in ``with steps.step():``, then
    :meth:`raise_first` raises the first error, if any."""

    def __init__(self):
        self.error: Exception | None = None

    @contextlib.contextmanager
    def step(self):
        try:
            yield
        except Exception as err:
            if self.error is None:
                self.error = err

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def beating(beat, every_s: float = 1.0):
    """``beat()`` from a thread every ``every_s`` while the block runs: a step of one turn that may outlast the
    supervisor's silence limit (a large ``--save-replay`` on a slow disk) must not read as a hung child. Only
    around such a step: a thread beating through a real hang would hide it. ``beat`` None: nothing."""
    if beat is None:
        yield
        return
    done = threading.Event()

    def run():
        while not done.wait(every_s):
            beat()

    thread = threading.Thread(target=run, name="spreeze-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5.0)


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


# the signals that stop a run the way Ctrl-C does: SIGHUP is a closed terminal or a dropped ssh session, which the
# kernel sends to the whole foreground job (the children too); not on every platform
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def stop_signals() -> tuple:
    """:data:`STOP_SIGNALS` this process takes: not a SIGHUP it was started with ignored. That is all ``nohup``
    does (a run meant to outlive its terminal), unlike a SIGINT a background shell ignores for its own reasons."""
    hup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS if not (s == hup and signal.getsignal(s) == signal.SIG_IGN))


def hangup_proof_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (it unlinks what a dead process left) with SIGHUP ignored, which it
    keeps through exec. It ignores SIGINT and SIGTERM itself, but a closed terminal's SIGHUP reaches it with the
    rest of the job and killed it; relaunched empty, it printed a traceback for every segment the run then
    unregistered. Called before anything starts it; a tracker already running is left as it is."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGHUP) is None:  # a handler not installed from Python: it could not be put back
        return
    from multiprocessing import resource_tracker

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        if previous is not None:
            signal.signal(signal.SIGHUP, previous)


def leave_group_sigterm_to_parent() -> None:
    """A SIGTERM sent to the whole process group (``kill -TERM -<pgid>``, a service manager), or the SIGHUP of a
    closed terminal, reaches the children too: while the supervisor lives they ignore it and stop through its stop
    Event, so the learner still writes its final checkpoint; an orphaned child exits at once (143). The supervisor
    kills a child that does not stop in time (SIGKILL, after the join timeout)."""
    parent_pid = os.getppid()

    def handler(signum, frame):
        if os.getppid() != parent_pid:
            sys.exit(143)
    for signum in stop_signals():  # a SIGHUP inherited as ignored (a nohup'd run) stays ignored
        if signum != signal.SIGINT:  # ignored outright (start_process): Ctrl-C is the parent's to take
            signal.signal(signum, handler)


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


def pinned_cores() -> int:
    """Cores this process is pinned to (unlike os.cpu_count); all of them where affinity is unknown (not Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def usable_cores() -> int:
    """Cores this process may run on: those it is pinned to, and no more than a container's CPU quota allows
    (``docker --cpus 2`` on a 64-core host: 2), rounded up."""
    cores = pinned_cores()
    quota = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(quota - 1e-9))) if quota else cores


def read_text(path: str) -> str | None:
    """A small system file's text, or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_limit() -> float | None:
    """The CPUs this process's cgroup quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``, the tightest along the path to the hierarchy's root), or None without a quota or where
    the files cannot be read (not Linux)."""
    own, mounts = read_text("/proc/self/cgroup"), read_text("/proc/self/mounts")
    if own is None or mounts is None:
        return None
    return cpu_quota_from(own, mounts, read_text)


def cpu_quota_from(own_cgroups: str, mounts: str, read) -> float | None:
    """:func:`cgroup_cpu_limit` on given texts (``/proc/self/cgroup``, ``/proc/self/mounts``) and a file reader
    returning None for a missing file: a pure function, tested with fake hierarchies."""
    found = cpu_quota_where(own_cgroups, mounts, read)
    return found[0] if found else None


def cgroup_directories(own_cgroups: str, mounts: str, controller: str):
    """``(directory, is v2)`` of each cgroup on this process's path to its hierarchy's root, for ``controller``
    ("cpu", "memory") in v1 or the unified v2 hierarchy; inside a container the path may be the host's, so it is
    tried under the mount, then the mount itself."""
    for line in own_cgroups.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        if not v2 and controller not in controllers.split(","):
            continue
        for mount_line in mounts.splitlines():
            fields = mount_line.split()
            if len(fields) < 4:
                continue
            point, kind, options = fields[1], fields[2], fields[3].split(",")
            if (kind == "cgroup2") != v2 or (not v2 and (kind != "cgroup" or controller not in options)):
                continue
            for start in dict.fromkeys([path, "/"]):
                here = start.rstrip("/")
                while True:
                    yield point + here, v2
                    if not here:
                        break
                    here = here.rsplit("/", 1)[0]


def cpu_quota_where(own_cgroups: str, mounts: str, read) -> tuple[float, str, bool] | None:
    """The tightest quota as (CPUs, the cgroup directory that sets it, whether it is cgroup v2), or None."""
    limits: list[tuple[float, str, bool]] = []
    for directory, v2 in cgroup_directories(own_cgroups, mounts, "cpu"):
        if v2:
            text = read(f"{directory}/cpu.max")
            quota = _v2_quota(text) if text is not None else None
        else:
            q, period = read(f"{directory}/cpu.cfs_quota_us"), read(f"{directory}/cpu.cfs_period_us")
            quota = _v1_quota(q, period) if q is not None and period is not None else None
        if quota:
            limits.append((quota, directory, v2))
    return min(limits, key=lambda found: found[0]) if limits else None


def memory_available_from(own_cgroups: str, mounts: str, read) -> int | None:
    """Bytes this process's cgroup memory limits leave (the tightest along the path: v2 ``memory.max`` less
    ``memory.current``, v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``, each less the inactive page
    cache the kernel reclaims first, as ``docker stats`` counts it), or None without a limit or where the files
    cannot be read. A pure function of the texts, tested with fake hierarchies."""
    left: list[int] = []
    for directory, v2 in cgroup_directories(own_cgroups, mounts, "memory"):
        names = ("memory.max", "memory.current", "inactive_file") if v2 else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        limit, used = _bytes(read(f"{directory}/{names[0]}")), _bytes(read(f"{directory}/{names[1]}"))
        if limit is None or limit >= 1 << 60:  # "max", or v1's page-rounded 2**63 - 1: no limit
            continue
        inactive = 0
        for line in (read(f"{directory}/memory.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == names[2]:
                inactive = _bytes(value) or 0
        left.append(max(0, limit - max(0, (used or 0) - inactive)))
    return min(left) if left else None


def available_memory() -> int:
    """Bytes available to this process: the host's (psutil), or less where a container's memory limit leaves
    less (psutil reads /proc/meminfo, which shows the host's memory inside a container)."""
    host = int(psutil.virtual_memory().available)
    own, mounts = read_text("/proc/self/cgroup"), read_text("/proc/self/mounts")
    limit = memory_available_from(own, mounts, read_text) if own is not None and mounts is not None else None
    return min(host, limit) if limit is not None else host


def _bytes(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def cgroup_cpu_seconds(directory: str, v2: bool, read) -> float | None:
    """CPU seconds the cgroup at ``directory`` has used (v2 ``cpu.stat`` usage_usec; v1 ``cpuacct.usage``, there
    when cpuacct shares the cpu controller's mount, as Docker mounts it), or None where it cannot be read."""
    try:
        if v2:
            for line in (read(f"{directory}/cpu.stat") or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return None
        text = read(f"{directory}/cpuacct.usage")
        return int(text.strip()) / 1e9 if text is not None else None
    except ValueError:
        return None


class CpuUse:
    """Busy percent of the CPUs this run may use, between one call of :meth:`percent` and the next. Without a
    quota it is the host's (psutil); under a container's CPU quota it is the quota's cgroup's CPU time over the
    quota: the host-wide figure would count other tenants' load and spread this container's own over cores it may
    not use, so the governor would pause or resume samplers on load that is not the run's."""

    def __init__(self, read=read_text, clock=time.monotonic, pinned: int | None = None):
        """``pinned``: the CPUs this process may run on (default: its affinity); a quota above them (``docker
        --cpus 4 --cpuset-cpus 0,1``) can never be used in full, so the percent is of the smaller of the two."""
        self._read, self._clock = read, clock
        self._quota: tuple[float, str, bool] | None = None
        own, mounts = read("/proc/self/cgroup"), read("/proc/self/mounts")
        found = cpu_quota_where(own, mounts, read) if own is not None and mounts is not None else None
        if found is not None and cgroup_cpu_seconds(found[1], found[2], read) is not None:
            pinned = pinned_cores() if pinned is None else pinned
            self._quota = (min(found[0], float(pinned)), found[1], found[2])
        self._last: tuple[float, float] | None = None
        self.prime()

    @property
    def quota_cpus(self) -> float | None:
        """The CPUs the percent is of under a quota (no more than are pinned), else None (the host's CPUs)."""
        return self._quota[0] if self._quota else None

    def prime(self) -> None:
        """Start the next interval now (psutil's first reading covers no interval and is 0)."""
        if self._quota is None:
            psutil.cpu_percent()
        else:
            seconds = cgroup_cpu_seconds(self._quota[1], self._quota[2], self._read)
            self._last = None if seconds is None else (self._clock(), seconds)

    def percent(self) -> float:
        """Percent since the last call (or :meth:`prime`); NaN where the cgroup could not be read."""
        if self._quota is None:
            return psutil.cpu_percent()
        limit, directory, v2 = self._quota
        seconds, now = cgroup_cpu_seconds(directory, v2, self._read), self._clock()
        last, self._last = self._last, (None if seconds is None else (now, seconds))
        if seconds is None or last is None or now <= last[0]:
            return math.nan
        return 100.0 * (seconds - last[1]) / ((now - last[0]) * limit)


def _v2_quota(text: str) -> float | None:
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = float(fields[0]), float(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota_text: str, period_text: str) -> float | None:
    try:
        quota, period = float(quota_text.strip()), float(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


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


MESSAGES_FLUSH_S = 5.0  # a child that ends writes what it still had for the supervisor for at most this long
# an orphan still running this long after its parent died is stuck (an env step that never returns asks nothing):
# it is ended as its supervisor would have killed it (which gives the learner 20 s for its final checkpoint)
ORPHAN_GRACE_S = 30.0


class StopFlag:
    """The run's one stop signal, shared by every process: a byte in shared memory, written and read without a
    lock. ``multiprocessing.Event.is_set()`` takes a lock (its condition's) with no timeout: a child SIGKILLed
    inside it left that lock held, and every other process's next ``is_set()`` waited forever (samplers without
    heartbeats, the learner still). ``set``, ``is_set`` and ``wait`` as an Event's; passed to children at spawn."""

    def __init__(self, ctx=None):
        self._flag = (ctx or mp.get_context("spawn")).RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def wait(self, timeout: float | None = None, poll_s: float = 0.02) -> bool:
        """True once set, False after ``timeout`` seconds (None: no limit; polled, nothing to block on)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
        return True


@dataclass(frozen=True)
class ChildLink:
    """What every child gets from the supervisor besides its role's shared state: ``messages`` is its own
    spreeze.messages.Outbox (None for a child that reports nothing)."""
    messages: object
    stop_event: object
    parent_pid: int
    orphan_grace_s: float = ORPHAN_GRACE_S


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
    # the last resort: a child stops itself through should_stop when its parent dies, unless it is stuck; nobody
    # would kill it then (its shared memory and pipes would stay held until the next launch found them)
    threading.Thread(target=_exit_with_parent, args=(ParentWatch(link.parent_pid), link.orphan_grace_s),
                     name="orphan-watch", daemon=True).start()
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
        orphaned = child.parent.gone()
        if orphaned:
            link.stop_event.set()  # every child stops without its supervisor; a queue replay then skips its flush
        try:
            if worker is not None:
                worker.close()
            del worker
            child.close()
        finally:  # what is still queued for the supervisor (a GaveUp before a failing env's close raised), unless
            if link.messages is not None:  # nobody reads it any more
                link.messages.close(timeout=0.0 if orphaned else MESSAGES_FLUSH_S)
