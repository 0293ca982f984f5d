"""The replay buffer in shared memory that samplers write into and the learner samples from.

Layout (rlpyt-style, built from an example transition): one segment holds ``obs``, ``actions``,
``rewards``, ``next_obs`` and ``terminated`` for ``capacity`` slots, split into one *region* per
environment. Each region is a ring with its own lock and its own (ptr, size, written) counters, so:

* a sampler writes a block of its env's transitions under that env's lock only (no global lock, no
  Queue/Pipe copy of experience: Spreeze section 3.2);
* the learner copies each region's share of a batch under that region's lock, so it never reads a
  slot half-overwritten and a writer waits for one region's copy at most;
* slots are a function of (env index, step) whichever process stepped the env, which the reproducible
  mode builds on, and a sampler that dies mid-write can only have held its own envs' locks.

Storage is pre-filled with NaN so a read of a never-written slot stands out.
"""
from __future__ import annotations

import queue
import time
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
        """Uniform sample over every stored transition. Each region's rows are copied under that region's
        lock alone, so a writer waits for one region's share of a gather, not for the whole batch (with
        many samplers and large GPU batches, holding every lock for the whole gather stalled them)."""
        sizes = self.counters[:, SIZE].copy()
        total = int(sizes.sum())
        if total == 0:
            raise ValueError("cannot sample from an empty replay")
        picks = rng.integers(0, total, size=batch_size)
        ends = np.cumsum(sizes)
        regions = np.searchsorted(ends, picks, side="right")
        slots = regions * self.region_capacity + picks - (ends[regions] - sizes[regions])
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
                for dst, src in zip(batch, sources):
                    dst[rows] = src[region_slots]
            finally:
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


QUEUE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class QueueReplayHandle:
    """What a child needs to join the queue path (the queue and counter are passed at process start)."""
    queue: object
    sent: object
    queue_size: int
    obs_dim: int
    act_dim: int
    capacity: int


class QueueReplay:
    """The experience path Spreeze replaced, kept as the baseline of its Fig. 3a ablation.

    Samplers put copies of their write blocks on a ``multiprocessing.Queue``; the learner unpickles them
    into a replay of its own when it samples a batch, so that receiving time counts as fetch time. Same
    interface as :class:`SharedReplay`. A full queue blocks the samplers (backpressure); ``size()`` is the
    number of transitions sent, so samplers and learner agree on when learning begins.
    """

    def __init__(self, handle: QueueReplayHandle, stop_event=None, reader: bool = False):
        self._handle = handle
        self.stop_event = stop_event
        self.reader = reader
        self.sampled = False
        self.queue = handle.queue
        self.sent = handle.sent
        self.storage: Batch | None = None
        self.ptr = self.stored = self.received = 0

    @classmethod
    def create(cls, obs_dim: int, act_dim: int, capacity: int, queue_size: int, mp_context) -> "QueueReplay":
        check_fits_in_memory(obs_dim, act_dim, capacity, 1)
        return cls(QueueReplayHandle(mp_context.Queue(maxsize=queue_size), mp_context.Value("q", 0), queue_size,
                                     obs_dim, act_dim, capacity))

    @classmethod
    def attach(cls, handle: QueueReplayHandle, stop_event=None, reader: bool = False) -> "QueueReplay":
        return cls(handle, stop_event, reader)

    @property
    def handle(self) -> QueueReplayHandle:
        return self._handle

    @property
    def capacity(self) -> int:
        return self._handle.capacity

    def size(self) -> int:
        if self.reader and not self.sampled:
            # warm-up: nothing samples yet, so the reader drains here, or a small queue fills before
            # learning can begin and the samplers wait for good
            self.receive(wait=False)
        return min(self.sent.value, self.capacity)

    def written(self) -> int:
        return self.sent.value

    def write(self, region: int, obs, actions, rewards, next_obs, terminated) -> None:
        if len(rewards) == 0:
            return
        # Queue.put pickles in a feeder thread later, and the sampler reuses its staging arrays: copy now
        # (Python docs, multiprocessing "Pipes and Queues")
        block = tuple(np.array(a, dtype=np.float32) for a in (obs, actions, rewards, next_obs, terminated))
        deadline = time.monotonic() + QUEUE_TIMEOUT_S
        while True:
            try:
                self.queue.put(block, timeout=0.1)
                break
            except queue.Full:
                if self.stop_event is not None and self.stop_event.is_set():
                    return  # shutting down: the learner reads no more
                if time.monotonic() > deadline:
                    raise LockTimeout(f"the experience queue stayed full for {QUEUE_TIMEOUT_S} s") from None
        with self.sent.get_lock():
            self.sent.value += len(rewards)

    def _store(self, block) -> None:
        h = self._handle
        if self.storage is None:
            self.storage = Batch(*(np.full(shape, np.nan, dtype=np.float32) for shape in
                                   ((h.capacity, h.obs_dim), (h.capacity, h.act_dim), (h.capacity,),
                                    (h.capacity, h.obs_dim), (h.capacity,))))
        n = len(block[2])
        rows = (self.ptr + np.arange(n)) % h.capacity
        for dst, src in zip(self.storage, block):
            dst[rows] = src
        self.ptr = (self.ptr + n) % h.capacity
        self.stored = min(self.stored + n, h.capacity)
        self.received += n

    def receive(self, wait: bool = True) -> int:
        """Move the blocks waiting in the queue (a queue's worth at most, so fast writers cannot keep the
        learner here) into the learner's replay; with ``wait``, wait for one if that replay is still empty."""
        taken = 0
        while taken < self._handle.queue_size:
            try:
                if wait and self.stored == 0:
                    block = self.queue.get(timeout=QUEUE_TIMEOUT_S)
                else:
                    block = self.queue.get_nowait()
            except queue.Empty:
                if wait and self.stored == 0:
                    raise LockTimeout(f"no experience arrived through the queue in {QUEUE_TIMEOUT_S} s")
                return taken
            self._store(block)
            taken += 1
        return taken

    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        self.sampled = True
        self.receive()
        rows = rng.integers(0, self.stored, size=batch_size)
        return Batch(*(array[rows] for array in self.storage))

    def recover_region(self, region: int, wait_s: float = 1.0) -> bool:
        """Nothing to repair: a sampler killed mid-put loses at most its own unsent block."""
        return False

    def close(self) -> None:
        # At shutdown nobody reads any more, and a feeder thread with unsent blocks would hold the process at
        # exit (Python docs, "Joining processes that use queues"); otherwise exit must flush them: a cancelled
        # feeder loses blocks whose slots the queue's semaphore still counts, leaving it full for good.
        if self.stop_event is not None and self.stop_event.is_set():
            self.queue.cancel_join_thread()
        self.storage = None


def attach_replay(handle, stop_event=None, reader: bool = False) -> SharedReplay | QueueReplay:
    """The replay of either experience path, from the handle the supervisor passed at process start
    (``stop_event`` lets a sampler blocked on a full queue give up at shutdown; ``reader``: the learner)."""
    if isinstance(handle, QueueReplayHandle):
        return QueueReplay.attach(handle, stop_event, reader)
    return SharedReplay.attach(handle)
