"""The replay buffer in shared memory that samplers write into and the learner samples from.

Layout (rlpyt-style, built from an example transition): one segment holds ``obs``, ``actions``,
``rewards``, ``next_obs`` and ``terminated`` for ``capacity`` slots, split into one *region* per
environment. Each region is a ring with its own lock and its own (ptr, size, written) counters, so:

* a sampler writes a block of its env's transitions under that env's lock only (no global lock, no
  Queue/Pipe copy of experience: Spreeze section 3.2);
* the learner gathers a batch while holding the locks of the regions it touches, so it never reads a
  slot half-overwritten;
* slots are a function of (env index, step) whichever process stepped the env, which the reproducible
  mode builds on, and a sampler that dies mid-write can only have held its own envs' locks.

Storage is pre-filled with NaN so a read of a never-written slot stands out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import psutil

from spreeze.shm import ArraySpec, SegmentHandle, SharedArrays, segment_nbytes

PTR, SIZE, WRITTEN, PENDING = 0, 1, 2, 3
LOCK_TIMEOUT_S = 5.0


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


def transition_specs(obs_dim: int, act_dim: int, capacity: int, n_regions: int) -> tuple[ArraySpec, ...]:
    """Array specs for a buffer of ``capacity`` slots, built from one example transition's shapes."""
    region_capacity = capacity // n_regions
    slots = region_capacity * n_regions
    nan = float("nan")
    return (
        ArraySpec("obs", (slots, obs_dim), "float32", nan),
        ArraySpec("actions", (slots, act_dim), "float32", nan),
        ArraySpec("rewards", (slots,), "float32", nan),
        ArraySpec("next_obs", (slots, obs_dim), "float32", nan),
        ArraySpec("terminated", (slots,), "float32", nan),
        ArraySpec("counters", (n_regions, 4), "int64", 0),
    )


def check_fits_in_memory(obs_dim: int, act_dim: int, capacity: int, n_regions: int,
                         headroom_bytes: int = 1 << 30) -> int:
    """Return the replay's size in bytes, or raise ReplayTooLarge (with a suggested capacity) before allocating."""
    nbytes = segment_nbytes(transition_specs(obs_dim, act_dim, capacity, n_regions))
    available = psutil.virtual_memory().available - headroom_bytes
    if nbytes > available:
        per_slot = nbytes / capacity
        suggestion = max(int(available * 0.8 / per_slot) // 1000 * 1000, 1000)
        raise ReplayTooLarge(f"a replay of {capacity:,} transitions needs {nbytes / 2**30:.1f} GiB but only "
                             f"{max(available, 0) / 2**30:.1f} GiB is available; try --buffer-size {suggestion}")
    return nbytes


@dataclass(frozen=True)
class ReplayHandle:
    """Everything a child process needs to attach to the replay (locks are passed at process start)."""
    segment: SegmentHandle
    locks: tuple
    region_capacity: int


class SharedReplay:
    def __init__(self, arrays: SharedArrays, locks: tuple, region_capacity: int):
        self._arrays = arrays
        self.locks = locks
        self.region_capacity = region_capacity
        self.n_regions = len(locks)
        self.obs = arrays["obs"]
        self.actions = arrays["actions"]
        self.rewards = arrays["rewards"]
        self.next_obs = arrays["next_obs"]
        self.terminated = arrays["terminated"]
        self.counters = arrays["counters"]

    @classmethod
    def create(cls, obs_dim: int, act_dim: int, capacity: int, n_regions: int, mp_context) -> "SharedReplay":
        if capacity < n_regions:
            raise ValueError(f"replay capacity {capacity} is smaller than the number of envs {n_regions}")
        check_fits_in_memory(obs_dim, act_dim, capacity, n_regions)
        arrays = SharedArrays.create(transition_specs(obs_dim, act_dim, capacity, n_regions), tag="replay")
        locks = tuple(mp_context.Lock() for _ in range(n_regions))
        return cls(arrays, locks, capacity // n_regions)

    @classmethod
    def attach(cls, handle: ReplayHandle) -> "SharedReplay":
        return cls(SharedArrays.attach(handle.segment), handle.locks, handle.region_capacity)

    @property
    def handle(self) -> ReplayHandle:
        return ReplayHandle(self._arrays.handle, self.locks, self.region_capacity)

    @property
    def capacity(self) -> int:
        return self.region_capacity * self.n_regions

    def size(self) -> int:
        """Transitions currently stored (all regions)."""
        return int(self.counters[:, SIZE].sum())

    def written(self) -> int:
        """Transitions ever written (all regions)."""
        return int(self.counters[:, WRITTEN].sum())

    def _acquire(self, region: int) -> None:
        if not self.locks[region].acquire(timeout=LOCK_TIMEOUT_S):
            raise LockTimeout(f"replay region {region} stayed locked for {LOCK_TIMEOUT_S} s")

    def write(self, region: int, obs, actions, rewards, next_obs, terminated) -> None:
        """Append a block of transitions of one env to its region (ring: the oldest are overwritten)."""
        n = len(rewards)
        if n == 0:
            return
        if n > self.region_capacity:
            raise ValueError(f"block of {n} transitions exceeds the region capacity {self.region_capacity}")
        base = region * self.region_capacity
        self._acquire(region)
        try:
            # PENDING marks rows being overwritten, so a writer killed mid-block can be repaired
            self.counters[region, PENDING] = n
            ptr = int(self.counters[region, PTR])
            first = min(n, self.region_capacity - ptr)
            for dst, src in ((self.obs, obs), (self.actions, actions), (self.rewards, rewards),
                             (self.next_obs, next_obs), (self.terminated, terminated)):
                dst[base + ptr: base + ptr + first] = src[:first]
                if first < n:
                    dst[base: base + n - first] = src[first:]
            self.counters[region, PTR] = (ptr + n) % self.region_capacity
            self.counters[region, SIZE] = min(int(self.counters[region, SIZE]) + n, self.region_capacity)
            self.counters[region, WRITTEN] += n
            self.counters[region, PENDING] = 0
        finally:
            self.locks[region].release()

    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Uniform sample over every stored transition, read under the locks of the regions touched."""
        sizes = self.counters[:, SIZE].copy()
        total = int(sizes.sum())
        if total == 0:
            raise ValueError("cannot sample from an empty replay")
        picks = rng.integers(0, total, size=batch_size)
        ends = np.cumsum(sizes)
        regions = np.searchsorted(ends, picks, side="right")
        slots = regions * self.region_capacity + picks - (ends[regions] - sizes[regions])
        touched = np.unique(regions)
        acquired = []
        try:
            for region in touched:  # ascending order: writers hold one lock at a time, so no deadlock
                self._acquire(int(region))
                acquired.append(int(region))
            batch = Batch(self.obs[slots], self.actions[slots], self.rewards[slots],
                          self.next_obs[slots], self.terminated[slots])
        finally:
            for region in acquired:
                self.locks[region].release()
        return batch

    def recover_region(self, region: int, wait_s: float = 1.0) -> bool:
        """After the region's writer died: free its lock if the writer died holding it, and repair rows it
        may have left half-written. Returns True if the lock had been left held.

        The learner holds a region lock for a batch gather (micro- to milliseconds), so a lock still held
        after ``wait_s`` belongs to the dead writer; ``mp.Lock`` is a semaphore and may be released by
        another process. Half-written rows are only a problem in a full ring (otherwise they lie beyond
        ``size`` and are never sampled): they are replaced by copies of intact rows of the same region.
        """
        lock = self.locks[region]
        left_held = not lock.acquire(timeout=wait_s)
        try:
            pending = int(self.counters[region, PENDING])
            size = int(self.counters[region, SIZE])
            if pending and size == self.region_capacity:
                base, cap = region * self.region_capacity, self.region_capacity
                ptr = int(self.counters[region, PTR])
                torn = (ptr + np.arange(pending)) % cap
                intact = (ptr - 1 - np.arange(pending)) % cap if pending < cap else None
                for array in (self.obs, self.actions, self.rewards, self.next_obs, self.terminated):
                    if intact is None:
                        array[base: base + cap] = np.nan
                    else:
                        array[base + torn] = array[base + intact]
                if intact is None:
                    self.counters[region, SIZE] = 0
                    self.counters[region, PTR] = 0
            self.counters[region, PENDING] = 0
        finally:
            lock.release()
        return left_held

    def close(self) -> None:
        self.obs = self.actions = self.rewards = self.next_obs = self.terminated = self.counters = None
        self._arrays.close()
