"""How experience reaches the learner: the shared replay (``--experience-transport shm``), or the
``multiprocessing.Queue`` path Spreeze replaced, kept as the baseline of its Fig. 3a ablation."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import numpy as np

from spreeze.replay import Batch, LockTimeout, SharedReplay, check_fits_in_memory

QUEUE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class QueueReplayHandle:
    """What a child needs to join the queue path (the queue and the per-env sent counts are passed at process
    start)."""
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
    interface as :class:`SharedReplay`. A full queue blocks the samplers (backpressure) for up to
    ``QUEUE_TIMEOUT_S``, then raises :class:`LockTimeout`, as a region lock held that long does (a learner that
    stopped reading); ``size()`` is the number of transitions sent, so samplers and learner agree on when
    learning begins.
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
    def create(cls, obs_dim: int, act_dim: int, capacity: int, queue_size: int, mp_context,
               n_regions: int) -> "QueueReplay":
        """``n_regions``: the run's envs. Each counts what its sampler sent in a slot of its own, written by that
        sampler alone: a shared counter's lock, held by a sampler killed inside it, would stop every other."""
        check_fits_in_memory(obs_dim, act_dim, capacity, 1, shared=False)  # the learner's own memory, not /dev/shm
        return cls(QueueReplayHandle(mp_context.Queue(maxsize=queue_size), mp_context.Array("q", n_regions, lock=False),
                                     queue_size, obs_dim, act_dim, capacity))

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
        return min(self.written(), self.capacity)

    def written(self) -> int:
        return int(sum(self.sent))

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
        self.sent[region] += len(rewards)  # this sampler's own slot: no lock

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

    def recover_region(self, region: int, wait_s: float = 1.0, dead_pid: int | None = None) -> bool:
        """Nothing to repair here (the signature is :meth:`SharedReplay.recover_region`'s, which the supervisor
        calls for either transport). A sampler killed while its feeder thread is writing a block into the pipe
        can leave the queue corrupt, as Python's documentation warns for any ``multiprocessing.Queue``: the
        learner's next read may then block inside it, and the run ends on the learner's missing heartbeat. That
        is one reason the shared-memory path, whose regions are repaired, is the default."""
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
