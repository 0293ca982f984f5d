"""What every child process does first, and how it notices that its parent is gone."""
from __future__ import annotations

import os
import signal
import sys
import time

import psutil


def child_setup(role: str, torch_threads: int) -> None:
    """Name the process, leave Ctrl-C and a group SIGTERM to the supervisor (it stops the children through
    the stop Event) and cap threads.

    Thread caps matter on small machines: processes with default torch threads oversubscribe the cores and
    run orders of magnitude slower (docs/pitfalls.md).
    """
    try:
        import setproctitle

        setproctitle.setproctitle(role)
    except ImportError:  # the name is cosmetic; never fail a run over it
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_group_sigterm_to_parent()
    os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    import torch

    torch.set_num_threads(torch_threads)


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
