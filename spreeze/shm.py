"""Named shared-memory segments holding several numpy arrays, owned by one process.

Segments are named ``spreeze_<owner pid>_t<owner start>_<tag><random>`` (``_t<owner start>`` where /proc
tells it) so leaks are easy to find, and so a new launch can remove the segments of an earlier run whose
process exited (and only those): see :func:`remove_stale_segments`.
Pitfalls handled (docs/pitfalls.md): closing a segment under live numpy views segfaults later, so
:meth:`SharedArrays.close` drops every view first; only the owner unlinks.
"""
from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import psutil

PREFIX = "spreeze_"
SHM_DIR = Path("/dev/shm")
_ALIGN = 64


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    fill: float = 0.0


@dataclass(frozen=True)
class SegmentHandle:
    """Picklable description of a segment, enough for another process to attach."""
    segment_name: str
    specs: tuple[ArraySpec, ...]
    offsets: tuple[int, ...]
    nbytes: int


def layout(specs: tuple[ArraySpec, ...]) -> tuple[tuple[int, ...], int]:
    offsets, cursor = [], 0
    for spec in specs:
        cursor = (cursor + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(cursor)
        cursor += int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    return tuple(offsets), max(cursor, 1)


def segment_nbytes(specs: tuple[ArraySpec, ...]) -> int:
    return layout(specs)[1]


class SharedMemoryFull(OSError):
    """/dev/shm has no room for a segment being made: taken while this launch checked it (another run filling its
    replay at the same time), or smaller than it reported."""


def _reserve(shm: shared_memory.SharedMemory, nbytes: int) -> None:
    """Every page of the segment taken now: a tmpfs hands pages out as they are first written, and one that runs
    out while the arrays are filled kills the process with SIGBUS (exit 135, no word). Reserved up front, a full
    /dev/shm is an error that says so. Where the platform cannot reserve (no fd, no posix_fallocate), nothing."""
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate") or not nbytes:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFull(err.errno, f"/dev/shm has no room for {nbytes / 2**20:,.0f} MiB of shared memory "
                                   "(another run filling its replay at the same time?): lower --buffer-size, or "
                                   "raise the container's --shm-size") from None
        # EINVAL/EOPNOTSUPP: a file system that cannot reserve; the fill takes the pages as before


class SharedArrays:
    """A set of numpy arrays in one shared-memory segment; ``create`` in the owner, ``attach`` elsewhere."""

    def __init__(self, shm: shared_memory.SharedMemory, handle: SegmentHandle, owner: bool):
        self._shm = shm
        self.handle = handle
        self.owner = owner
        self.arrays: dict[str, np.ndarray] = {}
        for spec, offset in zip(handle.specs, handle.offsets):
            self.arrays[spec.name] = np.ndarray(spec.shape, dtype=spec.dtype, buffer=shm.buf, offset=offset)

    @classmethod
    def create(cls, specs: tuple[ArraySpec, ...], tag: str = "") -> "SharedArrays":
        offsets, nbytes = layout(specs)
        ticks, space = start_ticks(os.getpid()), pid_namespace()
        name = (f"{PREFIX}{os.getpid()}_{'' if ticks is None else f't{ticks}_'}"
                f"{'' if space is None else f'ns{space}_'}{tag}{secrets.token_hex(4)}")
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        try:
            _reserve(shm, nbytes)
            handle = SegmentHandle(segment_name=name, specs=specs, offsets=offsets, nbytes=nbytes)
            arrays = cls(shm, handle, owner=True)
            for spec in specs:  # a large replay takes a while to fill: a Ctrl-C here comes before anyone owns it
                arrays.arrays[spec.name].fill(spec.fill)
        except BaseException:
            arrays = None  # the views go before the mapping can close
            try:
                shm.close()
            except BufferError:  # a view still held by the traceback: the mapping goes with the process
                pass
            shm.unlink()
            raise
        return arrays

    @classmethod
    def attach(cls, handle: SegmentHandle) -> "SharedArrays":
        shm = shared_memory.SharedMemory(name=handle.segment_name, create=False)
        return cls(shm, handle, owner=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def close(self) -> None:
        """Drop the views, close the mapping and, in the owner, unlink the segment."""
        if self._shm is None:
            return
        self.arrays.clear()
        shm, self._shm = self._shm, None
        try:
            shm.close()
        except BufferError:
            # A view still exported elsewhere in this process; the mapping goes away with the process.
            pass
        if self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``), or None where there is no
    /proc or no such process. With the pid it names one process for good: a pid alone is reused, and a start
    time in wall-clock seconds (psutil's) moves when the system clock is set."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name in () may hold spaces
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> int | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), or None where it cannot be read. Containers
    that share /dev/shm (``docker run --ipc=host``) but not their pids see each other's segments, and a pid in a
    segment's name means nothing in another namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def owner_gone(pid: int, ticks: int | None, space: int | None = None) -> bool:
    """Whether the process that made a segment named after ``pid`` (and ``ticks``, its start) has exited: no
    process has the pid, or the one that has it started at another time (the pid was reused). Never for a
    segment made in another PID namespace (``space``), whose pids cannot be looked up from here: it may be a live
    run's in another container."""
    if pid == os.getpid():
        return False
    if space is not None and space != pid_namespace():
        return False
    if ticks is not None:
        now = start_ticks(pid)
        if now is not None:
            return now != ticks
    return not psutil.pid_exists(pid)


def segment_owner(name: str) -> tuple[int, int | None, int | None] | None:
    """``(pid, start ticks or None, PID namespace or None)`` from a segment's name, or None for a name not of this
    project's form (names made before the namespace was recorded have none, and are judged as before)."""
    if not name.startswith(PREFIX):
        return None
    pid, _, rest = name[len(PREFIX):].partition("_")
    if not pid.isdigit():
        return None
    ticks, space = "", ""
    if rest.startswith("t"):
        ticks, _, after = rest[1:].partition("_")
        if after.startswith("ns"):
            space = after[2:].partition("_")[0]
    return (int(pid), int(ticks) if ticks.isdigit() else None, int(space) if space.isdigit() else None)


def remove_stale_segments() -> list[str]:
    """Unlink /dev/shm segments of this project whose owner process has exited; return their names."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        owner = segment_owner(path.name)
        if owner is not None and owner_gone(*owner):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed


def remove_segments_of(pid: int) -> list[str]:
    """Unlink the segments of a child this process killed (it could not close them) and take them off the
    resource tracker the child shared with this process, which would otherwise name them as leaked when this
    process exits. Only for a child known to be dead: an attacher may still be reading a segment of a live one."""
    from multiprocessing import resource_tracker

    removed = []
    for name in live_segments(pid):
        owner = segment_owner(name)
        if owner is None or not owner_gone(*owner):  # the pid taken again by a new process, which made this one
            continue
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            continue
        # registered by SharedMemory(create=True), unless the kill came just before: the tracker's unregister of
        # a name it does not know prints a traceback, and register keeps a set, so register first
        resource_tracker.register(f"/{name}", "shared_memory")
        resource_tracker.unregister(f"/{name}", "shared_memory")
        removed.append(name)
    return removed


def live_segments(pid: int | None = None) -> list[str]:
    """Names of this project's segments in /dev/shm (optionally only those owned by ``pid``)."""
    if not SHM_DIR.is_dir():
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}_"
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))
