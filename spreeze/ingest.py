"""Both ends of the remote samplers' experience path (``--ray``), without Ray itself.

A remote sampler is the same :class:`spreeze.sampler.Sampler`, given stand-ins for the shared state it would
have on the learner's machine: a :class:`BlockSink` that keeps its replay writes, a :class:`BlockWeights`
holding the newest weights it was sent, and :class:`BlockStats` counters. The writes of one request (one or
more ``--write-block`` blocks) are packed into one array per column (:func:`pack`) and cross the object store
(``spreeze.remote``) to one ingest process, whose :class:`Ingest` writes them into the shared replay under the
same region locks as a local sampler (one write per region), and counts them where the learner's ratio and the
metrics read them. Kept free of Ray so that it can be tested by feeding blocks directly.
"""
from __future__ import annotations

import time

import numpy as np

from spreeze.sampler import ratio_allows_collect
from spreeze.stats import (INGEST_BLOCKS, INGEST_BYTES, INGEST_LOST_BLOCKS, INGEST_POLICY_VERSION, INGEST_REQUESTS,
                           INGEST_ROWS, INGEST_WRITE_SECONDS, SharedStats)
from spreeze.weights import load_flat

COLUMNS = ("obs", "actions", "rewards", "next_obs", "terminated")


class BlockSink:
    """What a remote Sampler writes into instead of the replay: copies of its per-env writes, until taken."""

    def __init__(self):
        self.parts: list[tuple] = []   # (region, obs, actions, rewards, next_obs, terminated)
        self.writes = 0                # calls, empty ones included: a Sampler's flush writes every env once

    def write(self, region: int, obs, actions, rewards, next_obs, terminated) -> None:
        self.writes += 1
        if len(rewards):  # the sampler reuses its staging arrays: copy now
            self.parts.append((int(region), *(np.array(a, dtype=np.float32) for a in
                                              (obs, actions, rewards, next_obs, terminated))))

    def size(self) -> int:
        return 0  # never read: the ingest process decides when a remote sampler may collect

    def take(self) -> list[tuple]:
        parts, self.parts = self.parts, []
        return parts


def pack(parts: list[tuple]) -> dict:
    """Parts (per env write, in the order written) as one array per column, each region's rows together and in
    order, with ``regions`` and ``counts`` saying which rows are whose: a request of several blocks costs the
    object store and the ingest a handful of arrays, not five per env per block."""
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])  # stable: a region's parts keep their order
    regions, counts = [], []
    for i in order:
        region, n = parts[i][0], len(parts[i][3])
        if regions and regions[-1] == region:
            counts[-1] += n
        else:
            regions.append(region)
            counts.append(n)
    block = {"regions": np.array(regions, np.int64), "counts": np.array(counts, np.int64)}
    for c, name in enumerate(COLUMNS, start=1):
        block[name] = (np.concatenate([parts[i][c] for i in order]) if parts else
                       np.zeros((0,), np.float32))
    return block


class BlockWeights:
    """The newest actor weights a remote sampler was sent; an older version never replaces a newer one."""

    def __init__(self):
        self.flat: np.ndarray | None = None
        self.version = -1

    def offer(self, version: int, flat: np.ndarray) -> bool:
        if version <= self.version:
            return False
        self.flat, self.version = flat, int(version)
        return True

    def pull(self, module, have_version: int) -> int:
        """As :meth:`SharedWeights.pull`: load the held weights into ``module`` if newer than it has."""
        if self.flat is None or self.version <= have_version:
            return have_version
        load_flat(module, np.array(self.flat, dtype=np.float32))  # object-store arrays are read-only
        return self.version


class BlockStats:
    """The counters a remote Sampler updates, local to its actor and reported with each block. ``base``: the
    run's env steps when the block was asked for (the warm-up's random actions end on the run's count)."""

    def __init__(self, n_samplers: int, n_remote: int, index: int):
        self.n_samplers, self.n_remote = n_samplers, n_remote
        self.env_steps = np.zeros(index + 1, np.int64)
        self.episodes = np.zeros(index + 1, np.int64)
        self.dropped_episodes = np.zeros(index + 1, np.int64)
        self.train_returns = np.full(index + 1, np.nan)
        self.base = 0

    def total_env_steps(self) -> int:
        return self.base + int(self.env_steps.sum())

    def counters(self) -> dict:
        """Counts since the last block, then zeroed (the return is the last finished episode's)."""
        out = {"env_steps": int(self.env_steps.sum()), "episodes": int(self.episodes.sum()),
               "dropped_episodes": int(self.dropped_episodes.sum()),
               "train_return": float(np.nanmax(self.train_returns)) if np.isfinite(self.train_returns).any()
               else float("nan")}
        self.env_steps[:] = self.episodes[:] = self.dropped_episodes[:] = 0
        self.train_returns[:] = np.nan
        return out


def make_block(sampler, sink: BlockSink, stats: BlockStats, blocks: int = 1) -> dict:
    """Step ``sampler`` until it wrote ``blocks`` blocks (``--write-block`` steps of each env, each) and package
    them as one (:func:`pack`), with its counters and the seconds it took."""
    began = time.perf_counter()
    target = sink.writes + blocks * len(sampler.env_indices)
    while sink.writes < target:
        sampler.step()
    return {**pack(sink.take()), "blocks": int(blocks), "policy_version": int(sampler.policy_version),
            "sample_s": time.perf_counter() - began, **stats.counters()}


def block_rows(block: dict) -> int:
    return int(block["counts"].sum())


def block_nbytes(block: dict) -> int:
    return sum(block[name].nbytes for name in COLUMNS)


class ForeignBlock(ValueError):
    """A remote sampler's block that is not its to write (regions not its own, columns that do not fit the
    replay): refused whole and counted as lost."""


def remote_regions(config, remote: int) -> range:
    """Replay regions of remote sampler ``remote``: after every local sampler's (spares' included)."""
    first = (config.sampler_processes + remote) * config.envs_per_sampler
    return range(first, first + config.envs_per_sampler)


class Ingest:
    """Writes remote samplers' blocks into the shared replay and counts them; decides when they may collect."""

    def __init__(self, config, replay, stats: SharedStats):
        self.config = config
        self.replay = replay
        self.stats = stats
        # the local samplers' slack (Sampler.slack): with a larger one the remote samplers would take every
        # step the ratio allows and the local ones would only wait
        self.slack = 2 * (config.write_block + config.n_step - 1) * config.total_envs
        self.block_steps = config.envs_per_sampler * config.write_block

    def may_collect(self, requested: int = 0) -> bool:
        """The collect:update ratio over local and remote steps, the ``requested`` blocks still in flight
        counted as collected; or a replay still short of the warm-up with them counted too (else a warm-up
        would ask for every request that fits in flight, and the learner then work that lead off first)."""
        s, ahead = self.stats, requested * self.block_steps
        return (ratio_allows_collect(self.config, s.total_env_steps() + ahead, s.updates(), self.slack,
                                     s.sampled_rows())
                or self.replay.size() + ahead < self.config.learning_begins_at)

    def blocks_allowed(self, requested: int, want: int) -> int:
        """How many of ``want`` blocks one request may carry: the k-th only if :meth:`may_collect` allows it with
        the k-1 before it counted as in flight, as if each were asked for on its own."""
        k = 0
        while k < want and self.may_collect(requested + k):
            k += 1
        return k

    def write(self, remote: int, block: dict) -> int:
        """Write one request's blocks of remote sampler ``remote`` (region by region, each under its lock: one
        write per region, in pieces of at most a region's capacity); returns rows. A block naming a region that
        is not this sampler's is refused whole and counted as lost."""
        regions = remote_regions(self.config, remote)
        if any(int(region) not in regions for region in block["regions"]):
            self.stats.ingest[INGEST_LOST_BLOCKS] += block["blocks"]
            raise ForeignBlock(f"a block of remote sampler {remote} names regions outside {list(regions)}")
        columns = [block[name] for name in COLUMNS]
        try:
            self.replay.check_block(int(np.sum(block["counts"])), *columns)
        except ValueError as err:
            self.stats.ingest[INGEST_LOST_BLOCKS] += block["blocks"]
            raise ForeignBlock(f"remote sampler {remote}: {err}") from None
        began, start = time.perf_counter(), 0
        cap = self.replay.region_capacity
        for region, n in zip(block["regions"].tolist(), block["counts"].tolist()):
            for a in range(start, start + n, cap):
                b = min(a + cap, start + n)
                self.replay.write(region, *(c[a:b] for c in columns))
            start += n
        s, ingest = self.stats, self.stats.ingest
        version = block.get("policy_version", -1)  # -1: warm-up actions, before any actor was pulled
        ingest[INGEST_POLICY_VERSION] = max(ingest[INGEST_POLICY_VERSION], version) if ingest[INGEST_REQUESTS] \
            else version  # the slot starts at 0, which no warm-up block has
        ingest[INGEST_WRITE_SECONDS] += time.perf_counter() - began
        ingest[INGEST_BLOCKS] += block["blocks"]
        ingest[INGEST_REQUESTS] += 1
        ingest[INGEST_ROWS] += start
        ingest[INGEST_BYTES] += block_nbytes(block)
        s.remote_env_steps[remote] += block["env_steps"]
        s.remote_episodes[remote] += block["episodes"]
        s.remote_dropped_episodes[remote] += block["dropped_episodes"]
        if np.isfinite(block["train_return"]):
            s.remote_train_returns[remote] = block["train_return"]
        return start

    def lost(self, blocks: int = 1) -> None:
        """Blocks that were in flight when their sampler died: never silent."""
        self.stats.ingest[INGEST_LOST_BLOCKS] += blocks
