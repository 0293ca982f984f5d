"""The replay buffer in shared memory that samplers write into and the learner samples from.

Layout (rlpyt-style, built from an example transition): one segment holds ``obs``, ``actions``,
``rewards``, ``next_obs``, ``terminated`` and a write ``stamp`` per slot, split into one *region* per
environment. Each region is a ring with its own lock and its own (ptr, size, written) counters, so:

* a sampler writes a block of its env's transitions under that env's lock only (no global lock, no
  Queue/Pipe copy of experience: Spreeze section 3.2);
* the learner copies each region's share of a batch under that region's lock, so it never reads a
  slot half-overwritten and a writer waits for one region's copy at most;
* slots are a function of (env index, step) whichever process stepped the env, which the reproducible
  mode builds on, and a sampler that dies mid-write can only have held its own envs' locks.

Regions are sized for the envs that run from the start (``active_regions``): ``capacity // active_regions``
slots each, paused spare samplers' envs included, so the active envs alone can fill ``capacity`` and the
segment holds the spares' share on top. Every row carries a *stamp*, the buffer's total write count when
it was written; a batch is drawn uniformly from the rows among the newest ``capacity`` writes (plus a 1/32
margin), so the regions of a sampler paused for long age out of sampling as a single ring would forget
them. (A ring whose writer runs much slower than the others also keeps fewer live rows than its slots.)

Storage is pre-filled with NaN so a read of a never-written slot stands out.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil

from spreeze.files import atomic_write
from spreeze.proc import (HOLDER_GRACE_S, available_memory, give_lock, hold_interrupts, interrupt_if_pending,
                          interrupts_deferred, take_lock)
from spreeze.shm import SHM_DIR, ArraySpec, SegmentHandle, SharedArrays, segment_nbytes

# PTR, SIZE, WRITTEN stay adjacent and in this order: write() moves them in one store
PTR, SIZE, WRITTEN, PENDING, EPOCH, HOLDER = 0, 1, 2, 3, 4, 5  # EPOCH: repairs; HOLDER: the lock holder's pid
LOCK_TIMEOUT_S = 5.0
SAMPLE_TRIES = 3  # draws of one batch when regions are repaired under it


class Batch(NamedTuple):
    """A batch of transitions as numpy arrays (rows aligned)."""
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminated: np.ndarray


class ReplayTooLarge(ValueError):
    """The requested replay does not fit in available memory; the message suggests a size that does."""


class LockTimeout(RuntimeError):
    """A region lock was not released in time: its holder most likely died inside the critical section."""


def region_capacity_for(capacity: int, active_regions: int) -> int:
    """Slots per region: the capacity split over the regions that are written from the start."""
    return capacity // max(active_regions, 1)


def transition_specs(obs_dim: int, act_dim: int, capacity: int, n_regions: int,
                     active_regions: int | None = None) -> tuple[ArraySpec, ...]:
    """Array specs for ``n_regions`` regions of ``capacity // active_regions`` slots each."""
    slots = region_capacity_for(capacity, active_regions or n_regions) * n_regions
    nan = float("nan")
    return (
        ArraySpec("obs", (slots, obs_dim), "float32", nan),
        ArraySpec("actions", (slots, act_dim), "float32", nan),
        ArraySpec("rewards", (slots,), "float32", nan),
        ArraySpec("next_obs", (slots, obs_dim), "float32", nan),
        ArraySpec("terminated", (slots,), "float32", nan),
        ArraySpec("stamps", (slots,), "int64", 0),
        ArraySpec("counters", (n_regions, 6), "int64", 0),
    )


def check_fits_in_memory(obs_dim: int, act_dim: int, capacity: int, n_regions: int,
                         headroom_bytes: int = 1 << 30, active_regions: int | None = None, shared: bool = True) -> int:
    """Return the replay's size in bytes, or raise ReplayTooLarge (with a suggested capacity) before allocating.
    ``shared``: it lives in /dev/shm (the queue transport's replay is the learner's private memory)."""
    nbytes = segment_nbytes(transition_specs(obs_dim, act_dim, capacity, n_regions, active_regions))
    available = available_memory() - headroom_bytes  # a container's memory limit too
    per_slot = nbytes / capacity
    if nbytes > available:
        suggestion = max(int(available * 0.8 / per_slot) // 1000 * 1000, 1000)
        raise ReplayTooLarge(f"a replay of {capacity:,} transitions needs {nbytes / 2**30:.1f} GiB but only "
                             f"{max(available, 0) / 2**30:.1f} GiB is available; try --buffer-size {suggestion}")
    shm_free = shm_free_bytes() if shared else None
    if shm_free is not None and nbytes > shm_free - SHM_HEADROOM_BYTES:
        # filling a segment past what /dev/shm holds is a SIGBUS: the run would die without a word
        suggestion = max(int(max(shm_free - SHM_HEADROOM_BYTES, 0) * 0.8 / per_slot) // 1000 * 1000, 1000)
        raise ReplayTooLarge(f"a replay of {capacity:,} transitions needs {nbytes / 2**20:,.0f} MiB of shared memory "
                             f"but {SHM_DIR} has {shm_free / 2**20:,.0f} MiB free (a container's default is 64 MiB: "
                             f"give it more, e.g. docker run --shm-size=4g); or try --buffer-size {suggestion}")
    return nbytes


SHM_HEADROOM_BYTES = 16 << 20  # the weights and stats segments beside the replay


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory filesystem the segments live in, or None where there is none to ask."""
    try:
        stat = os.statvfs(SHM_DIR)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def live_rows(counters: np.ndarray, stamps: np.ndarray, region_capacity: int,
              capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`SharedReplay.live_sizes` on given counters (PTR, SIZE, WRITTEN columns) and stamps, so the GPU
    mirror (spreeze/mirror.py) applies the same eligibility rule to the rows it has copied."""
    sizes = counters[:, SIZE]
    # a ring not yet full writes at its size; reading its PTR too could pair a new PTR with an old SIZE
    # (the writer moves PTR first) and point at slots never written
    ptr = np.where(sizes < region_capacity, sizes, counters[:, PTR])
    # a 1/32 margin: regions still being written have ragged oldest stamps (writers interleave by block)
    horizon = int(counters[:, WRITTEN].sum()) - capacity - capacity // 32
    if horizon <= 0:
        return ptr, sizes
    cap = region_capacity
    bases = np.arange(len(counters)) * cap
    oldest = np.where(sizes == cap, ptr, 0)
    stale = np.flatnonzero((sizes > 0) & (stamps[bases + oldest] < horizon))
    if stale.size == 0:
        return ptr, sizes
    live = sizes.copy()
    for r in stale:  # rows of a ring are in stamp order from its oldest: two sorted runs
        r, base = int(r), int(bases[r])
        older = stamps[base + int(ptr[r]): base + cap] if sizes[r] == cap else stamps[base: base]
        newer = stamps[base: base + int(ptr[r]) if sizes[r] == cap else base + int(sizes[r])]
        live[r] = (older.size - np.searchsorted(older, horizon)) + (newer.size - np.searchsorted(newer, horizon))
    return ptr, live


@dataclass(frozen=True)
class ReplayHandle:
    """Everything a child process needs to attach to the replay (locks are passed at process start)."""
    segment: SegmentHandle
    locks: tuple
    region_capacity: int
    active_regions: int


class SharedReplay:
    def __init__(self, arrays: SharedArrays, locks: tuple, region_capacity: int, active_regions: int):
        self._arrays = arrays
        self.locks = locks
        self.region_capacity = region_capacity
        self.n_regions = len(locks)
        self.active_regions = active_regions
        self.obs = arrays["obs"]
        self.actions = arrays["actions"]
        self.rewards = arrays["rewards"]
        self.next_obs = arrays["next_obs"]
        self.terminated = arrays["terminated"]
        self.stamps = arrays["stamps"]
        self.counters = arrays["counters"]

    @classmethod
    def create(cls, obs_dim: int, act_dim: int, capacity: int, n_regions: int, mp_context,
               active_regions: int | None = None) -> "SharedReplay":
        """``n_regions`` rings (one per env, paused spares' envs included) of ``capacity // active_regions``
        slots, so that the ``active_regions`` envs that run from the start can hold ``capacity`` together."""
        active = min(active_regions or n_regions, n_regions)
        if capacity < active:
            raise ValueError(f"replay capacity {capacity} is smaller than the number of envs {active}")
        check_fits_in_memory(obs_dim, act_dim, capacity, n_regions, active_regions=active)
        arrays = SharedArrays.create(transition_specs(obs_dim, act_dim, capacity, n_regions, active), tag="replay")
        locks = tuple(mp_context.Lock() for _ in range(n_regions))
        return cls(arrays, locks, region_capacity_for(capacity, active), active)

    @classmethod
    def attach(cls, handle: ReplayHandle) -> "SharedReplay":
        return cls(SharedArrays.attach(handle.segment), handle.locks, handle.region_capacity, handle.active_regions)

    @property
    def handle(self) -> ReplayHandle:
        return ReplayHandle(self._arrays.handle, self.locks, self.region_capacity, self.active_regions)

    @property
    def capacity(self) -> int:
        """Transitions sampled from at most: the newest ``capacity`` writes (all slots hold more with spares)."""
        return self.region_capacity * self.active_regions

    @property
    def slots(self) -> int:
        return self.region_capacity * self.n_regions

    def size(self) -> int:
        """Transitions currently stored (all regions)."""
        return int(self.counters[:, SIZE].sum())

    def written(self) -> int:
        """Transitions ever written (all regions)."""
        return int(self.counters[:, WRITTEN].sum())

    def _acquire(self, region: int) -> None:
        """The region's lock, with this process recorded as its holder (:meth:`recover_region` reads it). A
        Ctrl-C from here to :meth:`_release` rises after it (the main process of --serial and lock-step takes
        region locks itself): between the acquire and the ``try`` that releases it, it would leave the lock held."""
        if not take_lock(self.locks[region], LOCK_TIMEOUT_S, self.counters, (region, HOLDER), os.getpid()):
            raise LockTimeout(f"replay region {region} stayed locked for {LOCK_TIMEOUT_S} s")

    def _release(self, region: int) -> None:
        give_lock(self.locks[region], self.counters, (region, HOLDER))

    def check_block(self, n: int, obs, actions, rewards, next_obs, terminated) -> None:
        """Raise ValueError unless every column holds ``n`` rows of the replay's shapes. Checked before a write
        takes its lock: a column that failed to copy mid-block left the rows before it new and the rest old,
        marked pending, visible to the learner until a recovery that only a dead writer triggers."""
        for name, dst, src in (("obs", self.obs, obs), ("actions", self.actions, actions),
                               ("rewards", self.rewards, rewards), ("next_obs", self.next_obs, next_obs),
                               ("terminated", self.terminated, terminated)):
            if np.shape(src) != (n, *dst.shape[1:]):
                raise ValueError(f"a block's {name} has shape {np.shape(src)}; the replay takes {(n, *dst.shape[1:])}")

    def write(self, region: int, obs, actions, rewards, next_obs, terminated) -> None:
        """Append a block of transitions of one env to its region (ring: the oldest are overwritten)."""
        n = len(rewards)
        if n == 0:
            return
        if n > self.region_capacity:
            raise ValueError(f"block of {n} transitions exceeds the region capacity {self.region_capacity}")
        self.check_block(n, obs, actions, rewards, next_obs, terminated)
        base = region * self.region_capacity
        self._acquire(region)
        try:
            # PENDING marks rows being overwritten, so a writer killed mid-block can be repaired
            self.counters[region, PENDING] = n
            ptr = int(self.counters[region, PTR])
            first = min(n, self.region_capacity - ptr)
            clock = int(self.counters[:, WRITTEN].sum())  # the global write count (other writers move it too)
            stamps = np.arange(clock, clock + n, dtype=np.int64)
            for dst, src in ((self.obs, obs), (self.actions, actions), (self.rewards, rewards),
                             (self.next_obs, next_obs), (self.terminated, terminated), (self.stamps, stamps)):
                dst[base + ptr: base + ptr + first] = src[:first]
                if first < n:
                    dst[base: base + n - first] = src[first:]
            # the rows are whole: cleared before the counters move, since recovery finds the torn rows from
            # PTR, and a writer killed between the two would have it repair intact rows after the block
            self.counters[region, PENDING] = 0
            # one 24-byte store of the three adjacent columns (in PTR, SIZE, WRITTEN order, which lock-free
            # readers expect): a writer killed among three separate Python stores could leave WRITTEN, and
            # with it the write clock, a block short; the window is now a copy's, not an interpreter's
            size = min(int(self.counters[region, SIZE]) + n, self.region_capacity)
            self.counters[region, PTR:WRITTEN + 1] = ((ptr + n) % self.region_capacity, size,
                                                      int(self.counters[region, WRITTEN]) + n)
        finally:
            self._release(region)

    def live_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per region: the ring pointer and how many of its newest rows are among the buffer's newest
        ``capacity`` writes, with a small margin (the rows a batch is drawn from). Read without locks: a
        writer only adds rows."""
        return live_rows(self.counters.copy(), self.stamps, self.region_capacity, self.capacity)

    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Uniform sample over the stored rows among the newest ``capacity`` writes. Each region's rows are
        copied under that region's lock alone, so a writer waits for one region's share of a gather, not for
        the whole batch (with many samplers and large GPU batches, holding every lock for the whole gather
        stalled them). A region repaired between the unlocked read of the sizes and its copy (the recovery of
        a writer that died, which may empty it) could yield NaN rows: the draw is made again."""
        for _ in range(SAMPLE_TRIES):
            batch = self._sample_once(batch_size, rng)
            if batch is not None:
                return batch
        raise RuntimeError(f"replay regions were repaired under each of {SAMPLE_TRIES} draws of a batch")

    def _sample_once(self, batch_size: int, rng: np.random.Generator) -> Batch | None:
        """One draw; None when a region it drew from was repaired (its EPOCH moved) before its rows were copied."""
        epochs = self.counters[:, EPOCH].copy()  # before the sizes: a repair after this read is seen below
        ptr, sizes = self.live_sizes()
        total = int(sizes.sum())
        if total == 0:
            raise ValueError("cannot sample from an empty replay")
        picks = rng.integers(0, total, size=batch_size)
        ends = np.cumsum(sizes)
        regions = np.searchsorted(ends, picks, side="right")
        # the k-th of a region's newest `sizes` rows, counted back from its ring pointer
        local = (ptr[regions] - sizes[regions] + picks - (ends[regions] - sizes[regions])) % self.region_capacity
        slots = regions * self.region_capacity + local
        order = np.argsort(regions, kind="stable")
        touched, starts = np.unique(regions[order], return_index=True)
        bounds = np.append(starts, batch_size)
        sources = (self.obs, self.actions, self.rewards, self.next_obs, self.terminated)
        batch = Batch(*(np.empty((batch_size, *source.shape[1:]), source.dtype) for source in sources))
        for k, region in enumerate(touched):
            rows = order[bounds[k]:bounds[k + 1]]
            region_slots = slots[rows]
            self._acquire(int(region))
            try:
                if self.counters[region, EPOCH] != epochs[region]:
                    return None
                for dst, src in zip(batch, sources):
                    dst[rows] = src[region_slots]
            finally:
                self._release(int(region))
        return batch

    def recover_region(self, region: int, wait_s: float = 1.0, dead_pid: int | None = None) -> bool:
        """After the region's writer died: free its lock if the writer died holding it, and repair rows it
        may have left half-written. Returns True if the lock had been left held.

        Live holders keep a region lock for a batch gather or a chunk of a saved replay (micro- to milliseconds),
        but a loaded machine may stretch that: so a lock still held after ``wait_s`` is freed
        only when its recorded holder is ``dead_pid``, a process that no longer exists, or none (a holder that
        died before writing its pid, or a test's bare acquire); a live holder is waited for, up to
        LOCK_TIMEOUT_S, and then left alone (freeing it would let two processes into the region, and its own
        release would then fail). ``mp.Lock`` is a semaphore and may be released by another process. The rows
        of the interrupted block that are already sampled (all of them in a full ring; in a ring not yet full,
        those its first wrap reached before the counters moved) are replaced by copies of intact rows of the
        same region; with none intact the region is emptied.
        """
        with interrupts_deferred():  # taken over, a lock must be released and the repair finished
            return self._recover_region(region, wait_s, dead_pid)

    def _recover_region(self, region: int, wait_s: float, dead_pid: int | None) -> bool:
        lock = self.locks[region]
        deadline = time.monotonic() + max(wait_s, LOCK_TIMEOUT_S)
        left_held = False
        while not lock.acquire(timeout=wait_s):
            holder = int(self.counters[region, HOLDER])
            if holder == 0:  # none recorded: one that died before writing its pid, or a live one about to write it
                # (or to release, its pid cleared): a live one may be descheduled right there on a loaded machine
                if lock.acquire(timeout=HOLDER_GRACE_S):
                    break
                holder = int(self.counters[region, HOLDER])
            if holder and holder != dead_pid and psutil.pid_exists(holder):
                if time.monotonic() < deadline:
                    interrupt_if_pending()  # waiting for a live holder: nothing taken over yet
                    continue
                return False  # still held by a live process: not the dead writer's, nothing of its to repair
            left_held = True  # the dead writer's: this process takes it over
            break
        hold_interrupts()  # paired with _release's, as _acquire's is
        self.counters[region, HOLDER] = os.getpid()
        try:
            pending = int(self.counters[region, PENDING])
            size = int(self.counters[region, SIZE])
            if left_held and size < self.region_capacity:
                # a writer killed among its counter stores may have moved PTR and not SIZE: in a ring not yet
                # full they are equal, and the next write goes on at SIZE (the orphaned rows were never sampled)
                self.counters[region, PTR] = size
            if pending:
                base, cap = region * self.region_capacity, self.region_capacity
                ptr = int(self.counters[region, PTR])
                torn = (ptr + np.arange(min(pending, cap))) % cap
                sampled = np.ones(cap, bool) if size == cap else np.arange(cap) < size
                bad = torn[sampled[torn]]
                keep = sampled.copy()
                keep[torn] = False
                intact = np.flatnonzero(keep)
                if bad.size and intact.size:
                    newest_first = intact[np.argsort((intact - ptr) % cap)[::-1]]  # most recent intact rows
                    sources = newest_first[np.arange(bad.size) % newest_first.size]
                    for array in (self.obs, self.actions, self.rewards, self.next_obs, self.terminated):
                        array[base + bad] = array[base + sources]
                    # the copies take the oldest intact stamp: the ring's stamps stay in order from its oldest
                    self.stamps[base + bad] = self.stamps[base + newest_first[-1]]
                elif bad.size:
                    for array in (self.obs, self.actions, self.rewards, self.next_obs, self.terminated):
                        array[base: base + cap] = np.nan
                    self.counters[region, SIZE] = 0
                    self.counters[region, PTR] = 0
            if pending or left_held:  # rows or counters changed in place: a copy (spreeze/mirror.py) is taken anew
                self.counters[region, EPOCH] += 1
            self.counters[region, PENDING] = 0
        finally:
            self._release(region)
        return left_held

    def close(self) -> None:
        self.obs = self.actions = self.rewards = self.next_obs = self.terminated = self.stamps = None
        self.counters = None
        self._arrays.close()


REPLAY_FILE = "replay.npz"
DISK_MARGIN_BYTES = 64 << 20
SAVE_CHUNK_ROWS = 1 << 14  # rows save_replay copies per hold of a region lock


class ReplayFileError(ValueError):
    """A saved replay that cannot be used (missing, truncated, from another env); the run refills instead."""


def save_replay(replay: SharedReplay, path: Path, meta: dict | None = None) -> int:
    """Write the rows a batch may be drawn from (each region's newest, oldest first, but for rows a writer
    replaced during the save) beside the checkpoint.

    Each region is copied in chunks, each under the region's lock, so samplers may go on writing; the file is
    written to a temporary name, fsynced and renamed, so it is complete or absent. Returns the rows written;
    raises OSError when the disk has no room for it (checked before writing). ``meta``: plain values a resumed
    run must match (env, n-step, discount), stored as JSON."""
    path = Path(path)
    ptr, live = replay.live_sizes()
    row_bytes = sum(a[0].nbytes for a in (replay.obs, replay.actions, replay.rewards, replay.next_obs,
                                           replay.terminated, replay.stamps))
    needed = int(live.sum()) * row_bytes + DISK_MARGIN_BYTES
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise OSError(f"{free / 2**20:.0f} MiB free, the replay needs {needed / 2**20:.0f} MiB")
    # one copy of the live rows, filled chunk by chunk (chunks joined afterwards held the replay twice over, beside
    # the live one: a MemoryError on a large replay)
    # the stamps too: a restore writes the rows back in the order they were first written
    columns = {name: np.empty((int(live.sum()),) + getattr(replay, name).shape[1:], getattr(replay, name).dtype)
               for name in ("obs", "actions", "rewards", "next_obs", "terminated", "stamps")}
    region_rows = np.zeros(replay.n_regions, np.int64)
    cap = replay.region_capacity
    filled = 0
    for r in range(replay.n_regions):
        replay._acquire(r)
        try:
            # re-read under the lock: the region may have grown since live_sizes()
            n = min(int(live[r]), int(replay.counters[r, SIZE]))
            head = int(replay.counters[r, PTR])
            epoch = int(replay.counters[r, EPOCH])
        finally:
            replay._release(r)
        slots = r * cap + (head - n + np.arange(n)) % cap
        # a chunk per lock hold, so the region's writer waits for one chunk's copy, not for a large region's:
        # rows it overwrites meanwhile are copied as it left them, whole (each row is written under the lock)
        # (a region repaired meanwhile, by the recovery of a writer that died, keeps the rows copied before)
        for begin in range(0, n, SAVE_CHUNK_ROWS):
            chunk = slots[begin: begin + SAVE_CHUNK_ROWS]
            replay._acquire(r)
            try:
                if replay.counters[r, EPOCH] != epoch:
                    break
                for name, column in columns.items():
                    np.take(getattr(replay, name), chunk, axis=0, out=column[filled: filled + len(chunk)])
            finally:
                replay._release(r)
            region_rows[r] += len(chunk)
            filled += len(chunk)
    arrays = {name: column[:filled] for name, column in columns.items()}  # a region repaired meanwhile: fewer
    atomic_write(path, lambda f: np.savez(f, region_rows=region_rows, meta=np.array(json.dumps(meta or {})), **arrays))
    return int(region_rows.sum())


def load_replay(replay: SharedReplay, path: Path, expect: dict | None = None) -> int:
    """Refill ``replay`` from a file of :func:`save_replay` (regions beyond this replay's count go round-robin
    into its own). Each saved region's rows go back in blocks of a sampler's write block, ordered by their
    saved stamps, so the restored rows age as the original ones did: a region that saved few rows, the newest
    of the run, would otherwise be written first and age out of sampling first. A file saved without stamps
    (an earlier version's) is written in turns of a block per region. Returns the rows
    restored; raises :class:`ReplayFileError` for a file that is unreadable, does not fit this replay or was
    saved with other ``expect`` values (env, n-step, discount), having restored nothing."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: np.asarray(data[name]) for name in
                      ("region_rows", "obs", "actions", "rewards", "next_obs", "terminated")}
            stamps = np.asarray(data["stamps"]) if "stamps" in data.files else None
            meta = json.loads(str(data["meta"])) if "meta" in data.files else {}
    except Exception as err:  # zipfile.BadZipFile, EOFError, KeyError, ValueError, OSError: all mean "unusable"
        raise ReplayFileError(f"{path} cannot be read ({type(err).__name__}: {err})") from err
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            raise ReplayFileError(f"{path} was saved with {key} {meta.get(key)!r}, this run has {value!r}")
    counts = arrays["region_rows"].astype(np.int64)
    n = len(arrays["rewards"])
    names = ("obs", "actions", "rewards", "next_obs", "terminated")
    try:
        replay.check_block(n, *(arrays[name] for name in names))
    except ValueError:
        raise ReplayFileError(f"{path} does not match this replay (other observation or action sizes, or damaged)") \
            from None
    if counts.ndim != 1 or counts.sum() != n or (counts < 0).any() or (stamps is not None and stamps.shape != (n,)):
        raise ReplayFileError(f"{path} does not match this replay (other observation or action sizes, or damaged)")
    if not all(np.isfinite(a).all() for name, a in arrays.items() if name != "region_rows"):
        raise ReplayFileError(f"{path} holds non-finite values")
    starts = np.concatenate([[0], np.cumsum(counts)])
    block = max(1, min(32, replay.region_capacity))  # a sampler's write block
    kept = [np.arange(starts[old], starts[old + 1])[-replay.region_capacity:]  # the newest that fit
            for old in range(len(counts))]
    # each saved region's rows in blocks, written in the order of the blocks' first stamps (ties, as writers of
    # different regions share the clock, in region order); without stamps, in turns of a block per region
    pieces = [(int(stamps[rows[begin]]) if stamps is not None else begin // block, old, rows[begin: begin + block])
              for old, rows in enumerate(kept) for begin in range(0, len(rows), block)]
    pieces.sort(key=lambda piece: piece[:2])
    for _, old, part in pieces:
        replay.write(old % replay.n_regions, *(arrays[name][part] for name in names))
    # the rows that stayed: saved regions sharing one of this replay's rings overwrite each other's oldest
    per_region = np.zeros(replay.n_regions, np.int64)
    for old, rows in enumerate(kept):
        per_region[old % replay.n_regions] += len(rows)
    return int(np.minimum(per_region, replay.region_capacity).sum())
