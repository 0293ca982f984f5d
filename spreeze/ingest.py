"""Both ends of the remote samplers' experience path (``--ray``), without Ray itself.

A remote sampler is the same :class:`spreeze.sampler.Sampler`, given stand-ins for the shared state it would
have on the learner's machine: a :class:`BlockSink` that keeps its replay writes as one block, a
:class:`BlockWeights` holding the newest weights it was sent, and :class:`BlockStats` counters. The block
crosses the object store (``spreeze.remote``) to one ingest process, whose :class:`Ingest` writes it into the
shared replay under the same region locks as a local sampler, and counts it where the learner's ratio and the
metrics read it. Kept free of Ray so that it can be tested by feeding blocks directly.
"""
from __future__ import annotations

import time

import numpy as np

from spreeze.sampler import ratio_allows_collect
from spreeze.stats import (INGEST_BLOCKS, INGEST_BYTES, INGEST_LOST_BLOCKS, INGEST_ROWS, INGEST_WRITE_SECONDS,
                           SharedStats)
from spreeze.weights import load_flat

COLUMNS = ("obs", "actions", "rewards", "next_obs", "terminated")


class BlockSink:
    """What a remote Sampler writes into instead of the replay: copies of its per-env writes, until taken."""

    def __init__(self):
        self.parts: list[tuple] = []   # (region, obs, actions, rewards, next_obs, terminated)

    def write(self, region: int, obs, actions, rewards, next_obs, terminated) -> None:
        if len(rewards):  # the sampler reuses its staging arrays: copy now
            self.parts.append((int(region), *(np.array(a, dtype=np.float32) for a in
                                              (obs, actions, rewards, next_obs, terminated))))

    def size(self) -> int:
        return 0  # never read: the ingest process decides when a remote sampler may collect

    def take(self) -> list[tuple]:
        parts, self.parts = self.parts, []
        return parts


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


def make_block(sampler, sink: BlockSink, stats: BlockStats) -> dict:
    """Step ``sampler`` until it wrote one block (``--write-block`` steps of each env) and package it."""
    while not sink.parts:
        sampler.step()
    return {"parts": sink.take(), "policy_version": int(sampler.policy_version), **stats.counters()}


def block_nbytes(block: dict) -> int:
    return sum(a.nbytes for part in block["parts"] for a in part[1:])


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
        counted as collected; or a replay still short of the warm-up."""
        s = self.stats
        steps = s.total_env_steps() + requested * self.block_steps
        return (ratio_allows_collect(self.config, steps, s.updates(), self.slack, s.sampled_rows())
                or self.replay.size() < self.config.learning_begins_at)

    def write(self, remote: int, block: dict) -> int:
        """Write one block of remote sampler ``remote`` (region by region, each under its lock); returns rows.
        A block naming a region that is not this sampler's is refused whole and counted as lost."""
        regions = remote_regions(self.config, remote)
        if any(part[0] not in regions for part in block["parts"]):
            self.stats.ingest[INGEST_LOST_BLOCKS] += 1
            raise ValueError(f"a block of remote sampler {remote} names regions outside {list(regions)}")
        began, rows = time.perf_counter(), 0
        for region, *columns in block["parts"]:
            self.replay.write(region, *columns)
            rows += len(columns[2])
        s, ingest = self.stats, self.stats.ingest
        ingest[INGEST_WRITE_SECONDS] += time.perf_counter() - began
        ingest[INGEST_BLOCKS] += 1
        ingest[INGEST_ROWS] += rows
        ingest[INGEST_BYTES] += block_nbytes(block)
        s.remote_env_steps[remote] += block["env_steps"]
        s.remote_episodes[remote] += block["episodes"]
        s.remote_dropped_episodes[remote] += block["dropped_episodes"]
        if np.isfinite(block["train_return"]):
            s.remote_train_returns[remote] = block["train_return"]
        return rows

    def lost(self, blocks: int = 1) -> None:
        """Blocks that were in flight when their sampler died: never silent."""
        self.stats.ingest[INGEST_LOST_BLOCKS] += blocks
