"""A copy of the shared replay in the learner's GPU memory, so that batches are gathered on the device.

Gathering a large batch of random rows from shared memory on the CPU can take longer than the update on a GPU,
so the GPU waits however well a prefetch thread overlaps the two (docs/benchmarks.md, "GPU replay mirror"); PQL
keeps its replay on the GPU for this reason. Samplers go on writing into the shared regions under their locks;
the learner's side copies each region's rows written since its last sync:

* under the region's lock, packed into a pinned staging buffer, then one host-to-device copy per region (two at
  a ring wrap) into a slot-for-slot copy of the replay: rows are never half-written (a writer holds the lock
  while a block is pending) and the copy is queued on the learner's stream, behind the update that runs;
* a region that :meth:`SharedReplay.recover_region` repaired (its ``EPOCH`` counter moved) is copied whole again;
* the rows a batch is drawn from follow ``SharedReplay.sample``'s rule (:func:`spreeze.replay.live_rows`) on the
  counters and stamps as copied, and the draw is on the device, from a generator seeded by the learner's.

Lock-step mode (``--deterministic``) copies only finished rounds (:meth:`ReplayMirror.sync_entries`) and draws
the slots with the learner's numpy generator, exactly as the CPU gather does (``rounds.window_slots``), then
gathers on the device: the batches, and so ``rounds.csv``, are the CPU path's, byte for byte.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

import numpy as np
import torch

from spreeze.proc import available_memory
from spreeze.replay import EPOCH, PTR, SIZE, WRITTEN, Batch, SharedReplay, live_rows

HEADROOM_BYTES = 1 << 30  # GPU memory left to the update beyond the mirror: at least this, and a quarter of free
STAGING_ROWS = 1 << 16    # rows of each of the two staging buffers (a larger copy goes in several)


def mirror_wanted(config, device) -> bool:
    """``--replay-mirror`` in force for critics on ``device``: :meth:`spreeze.config.Config.mirror_wanted`."""
    return config.mirror_wanted(device)


def mirror_nbytes(replay: SharedReplay) -> int:
    """Device memory of a mirror of ``replay`` (the staging buffers are pinned host memory)."""
    return replay.slots * row_width(replay) * 4


def row_width(replay: SharedReplay) -> int:
    return 2 * replay.obs.shape[1] + replay.actions.shape[1] + 2


def free_bytes(device: torch.device) -> int:
    """Memory free for a mirror on ``device``: the GPU's (``torch.cuda.mem_get_info``), else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory()


def open_mirror(config, replay, device, warn=None) -> "ReplayMirror | None":
    """The mirror the learner samples from, or None for the shared-memory gather: turned off, another experience
    transport, or (with one warning through ``warn``) too little free memory on the device."""
    device = torch.device(device)
    if not isinstance(replay, SharedReplay) or not mirror_wanted(config, device):
        return None
    needed, free = mirror_nbytes(replay), free_bytes(device)
    if needed + max(HEADROOM_BYTES, free // 4) > free:
        reason = f"needs {needed / 2**30:.2f} GiB and {device} has {free / 2**30:.2f} GiB free"
    else:
        try:
            return ReplayMirror(replay, device)
        except torch.cuda.OutOfMemoryError as err:
            reason = f"could not be allocated on {device} ({err})"
    (warn or (lambda text: print(f"[spreeze] warning: {text}", file=sys.stderr)))(
        f"replay mirror off: it {reason}; batches are gathered from shared memory on the CPU")
    return None


class _Staging:
    """A pinned host buffer (plain memory on a CPU device) and the event of the copies that read it last."""

    def __init__(self, rows: int, width: int, n_regions: int, pinned: bool):
        self.rows = torch.empty((rows, width), dtype=torch.float32, pin_memory=pinned)
        self.array = self.rows.numpy()
        self.meta = torch.empty((3, n_regions), dtype=torch.int64, pin_memory=pinned)
        self.event = torch.cuda.Event() if pinned else None
        self.used = 0

    def wait(self) -> None:
        """Until the device has read what the last copies took from here (then it may be overwritten)."""
        if self.event is not None:
            self.event.synchronize()
        self.used = 0


class ReplayMirror:
    """The replay's rows, packed one per slot (obs, actions, reward, next_obs, terminated), on ``device``.

    Used by one thread at a time (the learner's prefetch thread on a GPU): ``sample`` syncs, then draws."""

    def __init__(self, replay: SharedReplay, device, staging_rows: int = STAGING_ROWS):
        self.replay = replay
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        od, ad = replay.obs.shape[1], replay.actions.shape[1]
        # (column, first, last) of the packed row; the batch's tensors are contiguous copies of these
        spans, at = [], 0
        for name, width in (("obs", od), ("actions", ad), ("rewards", 0), ("next_obs", od), ("terminated", 0)):
            spans.append((name, at, at + max(width, 1), width == 0))
            at += max(width, 1)
        self.spans = tuple(spans)
        self.rows = torch.empty((replay.slots, at), dtype=torch.float32, device=self.device)
        n = replay.n_regions
        self.counters = np.zeros((n, 3), np.int64)  # PTR, SIZE, WRITTEN of each region as copied
        self.epochs = np.full(n, -1, np.int64)       # -1: never copied
        self.stamps = np.zeros(replay.slots, np.int64)
        rows = max(1, min(staging_rows, replay.slots))
        self._staging = [_Staging(rows, at, n, self.cuda) for _ in range(2)]
        self._turn = 0
        self._meta = torch.zeros((3, n), dtype=torch.int64, device=self.device)  # ptr, live, ends of the view
        self._total = 0
        self.generator: torch.Generator | None = None
        self.copies = 0  # host-to-device copies queued (tests count them)

    # ----- copying ------------------------------------------------------------------------------------------
    def _stage(self, slot: int, n: int) -> None:
        """Queue slots ``[slot, slot + n)`` of the replay (contiguous, under its region's lock) for the device."""
        r = self.replay
        while n > 0:
            stage = self._staging[self._turn]
            if stage.used == len(stage.array):  # full: take the other buffer once the device has read it
                self._flush()
                stage = self._staging[self._turn]
            take = min(n, len(stage.array) - stage.used)
            rows = stage.array[stage.used: stage.used + take]
            for name, first, last, scalar in self.spans:
                source = getattr(r, name)[slot: slot + take]
                rows[:, first:last] = source[:, None] if scalar else source
            self.stamps[slot: slot + take] = r.stamps[slot: slot + take]
            self.rows[slot: slot + take].copy_(stage.rows[stage.used: stage.used + take], non_blocking=True)
            self.copies += 1
            stage.used += take
            slot += take
            n -= take

    def _stage_entries(self, region: int, start_slot: int, n: int) -> None:
        """``n`` consecutive ring slots of ``region`` from ``start_slot``: one copy, or two at the wrap."""
        cap = self.replay.region_capacity
        base = region * cap
        first = min(n, cap - start_slot)
        self._stage(base + start_slot, first)
        if n > first:
            self._stage(base, n - first)

    def _flush(self) -> None:
        stage = self._staging[self._turn]
        if stage.event is not None:
            stage.event.record(torch.cuda.current_stream(self.device))
        self._turn = 1 - self._turn
        self._staging[self._turn].wait()

    def sync(self) -> int:
        """Copy every region's rows written since the last sync (a repaired region whole); returns the rows."""
        r, counters = self.replay, self.replay.counters
        copied, changed = 0, False
        with torch.cuda.device(self.device) if self.cuda else nullcontext():
            for region in range(r.n_regions):
                # unlocked peek: WRITTEN and EPOCH only grow, so an unchanged region needs no lock
                if (counters[region, WRITTEN] == self.counters[region, 2]
                        and counters[region, EPOCH] == self.epochs[region]):
                    continue
                r._acquire(region)
                try:
                    ptr, size, written, pending, epoch = (int(v) for v in counters[region, :5])
                    if pending:  # only a dead writer's repair leaves it; recover_region clears it under the lock
                        continue
                    whole = epoch != self.epochs[region]
                    n = size if whole else min(written - int(self.counters[region, 2]), size)
                    if n:
                        self._stage_entries(region, (ptr - n) % r.region_capacity, n)
                    self.counters[region] = (ptr, size, written)
                    self.epochs[region] = epoch
                    copied, changed = copied + n, True  # an emptied region changes the view without a row
                finally:
                    r._release(region)
            if changed:
                self._publish_view()
        return copied

    def sync_entries(self, first: int, end: int) -> int:
        """Lock-step: copy each region's entries ``[first, end)`` (counted since the start) not yet copied. The
        rounds they belong to are finished and no writer reaches their slots this round, so no lock is taken."""
        cap, copied = self.replay.region_capacity, 0
        with torch.cuda.device(self.device) if self.cuda else nullcontext():
            for region in range(self.replay.n_regions):
                start = max(first, int(self.counters[region, 2]))
                if end > start:
                    self._stage_entries(region, start % cap, end - start)
                    self.counters[region, 2] = end
                    copied += end - start
            if copied:
                self._flush()
        return copied

    def _publish_view(self) -> None:
        """The rows a batch may come from, as copied; sent to the device through the staging buffer's pinned
        ints (a copy from pageable memory would wait for the update running on the stream)."""
        counters = np.zeros((len(self.counters), 3), np.int64)
        counters[:, PTR], counters[:, SIZE], counters[:, WRITTEN] = self.counters.T
        ptr, live = live_rows(counters, self.stamps, self.replay.region_capacity, self.replay.capacity)
        ends = np.cumsum(live)
        self._total = int(ends[-1]) if len(ends) else 0
        meta = self._staging[self._turn].meta
        meta.numpy()[:] = (ptr, live, ends)
        self._meta.copy_(meta, non_blocking=True)
        self._flush()

    # ----- batches ------------------------------------------------------------------------------------------
    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Sync, then a uniform batch (device tensors) over the rows ``SharedReplay.sample`` would draw from.
        The device generator is seeded from ``rng`` on first use, so a resumed run does not repeat batches."""
        self.sync()
        if self._total == 0:
            raise ValueError("cannot sample from an empty replay")
        if self.generator is None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(int(rng.integers(2**62)))
        with torch.cuda.device(self.device) if self.cuda else nullcontext():
            picks = torch.randint(self._total, (batch_size,), generator=self.generator, device=self.device)
            ptr, _, ends = self._meta
            regions = torch.searchsorted(ends, picks, right=True)
            # the k-th of a region's newest live rows, counted back from its ring pointer (as SharedReplay.sample)
            local = (ptr[regions] + picks - ends[regions]) % self.replay.region_capacity
            return self.gather(regions * self.replay.region_capacity + local)

    def gather(self, slots) -> Batch:
        """The rows at ``slots`` (a device tensor, or numpy slots from ``rounds.window_slots``) as a Batch of
        contiguous device tensors."""
        if isinstance(slots, np.ndarray):
            slots = torch.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device)
        rows = self.rows.index_select(0, slots)
        return Batch(*((rows[:, first] if scalar else rows[:, first:last]).contiguous()
                       for _, first, last, scalar in self.spans))

    def close(self) -> None:
        self.rows = self._meta = None
        self._staging = []


def window_source(mirror: ReplayMirror | None, replay: SharedReplay, plan, k: int):
    """Lock-step: ``sample(batch_size, rng)`` for learner round ``k``, from the mirror (after copying the round's
    window) or from shared memory; both draw the same slots from ``rng``."""
    from spreeze.rounds import sample_window, window_slots

    if mirror is None:
        return lambda size, rng: sample_window(replay, plan, k, size, rng)
    mirror.sync_entries(*plan.window(k))
    return lambda size, rng: mirror.gather(window_slots(plan, k, size, rng))
