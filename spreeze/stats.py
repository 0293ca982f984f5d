"""Counters and heartbeats shared by every process of a run (one writer per slot, so no lock).

The supervisor reads them to log metrics, to enforce budgets and to notice a silent child (Sample
Factory's heartbeats); samplers read the learner's update count for the collect:update ratio.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from spreeze.shm import ArraySpec, SegmentHandle, SharedArrays

# Slots of the learner's float64 array.
UPDATES = 0
POLICY_VERSION = 1
FETCH_SECONDS = 2
UPDATE_SECONDS = 3
WAIT_SECONDS = 4
CRITIC_LOSS = 5
ACTOR_LOSS = 6
ALPHA = 7
BATCH_SIZE = 8      # the learner's current batch (--batch-rule noise may change it during the run)
LEARNER_DONE = 9
ACTOR_UPDATES = 10
NOISE_SCALE = 11
SAMPLED_ROWS = 12   # rows the learner sampled in all (the sum of its batches: the batch may change)
NOISE_MEASUREMENTS = 13  # measurements behind NOISE_SCALE's running estimate (a resume's earlier ones if it went on)
_LEARNER_SLOTS = 14

# Slots of the ingest process's float64 array (--ray): what arrived from the remote samplers.
INGEST_BLOCKS = 0
INGEST_ROWS = 1
INGEST_BYTES = 2
INGEST_WRITE_SECONDS = 3   # time inside replay writes (under region locks)
INGEST_LOST_BLOCKS = 4     # blocks in flight when their sampler died: counted, never silent
INGEST_RESTARTS = 5        # remote sampler actors replaced
INGEST_ALIVE = 6           # remote sampler actors running now
INGEST_RTT_SECONDS = 7     # the latest round trip of a request (request to rows in the replay)
INGEST_REQUESTS = 8        # requests answered (each of one or more blocks)
INGEST_POLICY_VERSION = 9  # the newest actor version a remote block was sampled with (-1: none yet)
INGEST_IN_FLIGHT = 10      # blocks asked for and not yet arrived: lost with an ingest that dies (the supervisor counts them)
_INGEST_SLOTS = 11

LEARNER_ROLE = 0
EVALUATOR_ROLE = 1
INGEST_ROLE = 2


def sampler_role(index: int) -> int:
    return 3 + index


@dataclass(frozen=True)
class StatsHandle:
    segment: SegmentHandle
    n_samplers: int
    n_remote: int = 0


class SharedStats:
    def __init__(self, arrays: SharedArrays, n_samplers: int, n_remote: int = 0):
        self._arrays = arrays
        self.n_samplers = n_samplers
        self.n_remote = n_remote                      # --ray: sampler actors, counted by the ingest process
        self.env_steps = arrays["env_steps"]          # per sampler
        self.episodes = arrays["episodes"]            # per sampler
        self.train_returns = arrays["train_returns"]  # per sampler: last finished training episode's return
        self.sampler_wait_s = arrays["sampler_wait_s"]  # per sampler: time paused by the ratio control
        self.paused = arrays["paused"]                # per sampler: 1 while the CPU governor pauses it
        self.dropped_episodes = arrays["dropped_episodes"]  # per sampler: episodes dropped for env faults
        # per role: time.monotonic() of the last sign of life; one clock for every process of the machine
        # (CLOCK_MONOTONIC), which a step of the wall clock (NTP, a resumed VM) does not move
        self.heartbeats = arrays["heartbeats"]
        self.learner = arrays["learner"]
        self.remote_env_steps = arrays["remote_env_steps"]  # per remote sampler, as ingested
        self.remote_episodes = arrays["remote_episodes"]
        self.remote_train_returns = arrays["remote_train_returns"]
        self.remote_dropped_episodes = arrays["remote_dropped_episodes"]
        self.ingest = arrays["ingest"]
        # the steps of the run's earlier launches (--resume): a count of its own, since a --remote-only run has
        # no local sampler whose counter could carry them
        self.resumed_env_steps = arrays["resumed_env_steps"]

    @classmethod
    def create(cls, n_samplers: int, n_remote: int = 0) -> "SharedStats":
        specs = (
            ArraySpec("env_steps", (n_samplers,), "int64", 0),
            ArraySpec("episodes", (n_samplers,), "int64", 0),
            ArraySpec("train_returns", (n_samplers,), "float64", float("nan")),
            ArraySpec("sampler_wait_s", (n_samplers,), "float64", 0.0),
            ArraySpec("paused", (n_samplers,), "int64", 0),
            ArraySpec("dropped_episodes", (n_samplers,), "int64", 0),
            ArraySpec("heartbeats", (n_samplers + 3,), "float64", 0.0),
            ArraySpec("learner", (_LEARNER_SLOTS,), "float64", 0.0),
            ArraySpec("remote_env_steps", (max(n_remote, 1),), "int64", 0),
            ArraySpec("remote_episodes", (max(n_remote, 1),), "int64", 0),
            ArraySpec("remote_train_returns", (max(n_remote, 1),), "float64", float("nan")),
            ArraySpec("remote_dropped_episodes", (max(n_remote, 1),), "int64", 0),
            ArraySpec("ingest", (_INGEST_SLOTS,), "float64", 0.0),
            ArraySpec("resumed_env_steps", (1,), "int64", 0),
        )
        return cls(SharedArrays.create(specs, tag="stats"), n_samplers, n_remote)

    @classmethod
    def attach(cls, handle: StatsHandle) -> "SharedStats":
        return cls(SharedArrays.attach(handle.segment), handle.n_samplers, handle.n_remote)

    @property
    def handle(self) -> StatsHandle:
        return StatsHandle(self._arrays.handle, self.n_samplers, self.n_remote)

    def total_env_steps(self) -> int:
        """Local and remote samplers' steps, and those of earlier launches: the collect:update ratio and the
        budgets count them all."""
        return int(self.env_steps.sum()) + int(self.remote_env_steps.sum()) + int(self.resumed_env_steps[0])

    def restore_learner(self, counters: dict, actor_updates: int, batch_size: int) -> int:
        """A resumed run's learner counts from its checkpoint's ``counters``: set by the supervisor when it creates
        the shared state (so no test or metrics row reads 0 updates before the learner has loaded the checkpoint)
        and by the learner once it has. Returns the rows sampled (a checkpoint from before that count: updates x
        its batch, else ``batch_size``)."""
        updates = int(counters["updates"])
        rows = int(counters.get("sampled_rows", updates * int(counters.get("batch_size", batch_size))))
        self.learner[UPDATES] = updates
        self.learner[ACTOR_UPDATES] = int(actor_updates)
        self.learner[POLICY_VERSION] = int(counters["policy_version"])
        self.learner[SAMPLED_ROWS] = rows
        return rows

    def updates(self) -> int:
        return int(self.learner[UPDATES])

    def sampled_rows(self) -> int:
        return int(self.learner[SAMPLED_ROWS])

    def beat(self, role: int) -> None:
        self.heartbeats[role] = time.monotonic()

    def snapshot(self) -> dict:
        train_returns = np.concatenate([self.train_returns, self.remote_train_returns[:self.n_remote]])
        return {
            "env_steps": self.total_env_steps(),
            "local_env_steps": int(self.env_steps.sum()),
            "remote_env_steps": int(self.remote_env_steps.sum()),
            "ingest_rows": int(self.ingest[INGEST_ROWS]),
            "ingest_bytes": int(self.ingest[INGEST_BYTES]),
            "ingest_blocks": int(self.ingest[INGEST_BLOCKS]),
            "ingest_requests": int(self.ingest[INGEST_REQUESTS]),
            "ingest_write_s": float(self.ingest[INGEST_WRITE_SECONDS]),
            "remote_lost_blocks": int(self.ingest[INGEST_LOST_BLOCKS]),
            "remote_restarts": int(self.ingest[INGEST_RESTARTS]),
            "remote_alive": int(self.ingest[INGEST_ALIVE]),
            "remote_block_rtt_s": float(self.ingest[INGEST_RTT_SECONDS]),
            "remote_policy_version": int(self.ingest[INGEST_POLICY_VERSION]) if self.ingest[INGEST_REQUESTS] else -1,
            "episodes": int(self.episodes.sum()) + int(self.remote_episodes.sum()),
            "updates": self.updates(),
            "actor_updates": int(self.learner[ACTOR_UPDATES]),
            "policy_version": int(self.learner[POLICY_VERSION]),
            "fetch_s": float(self.learner[FETCH_SECONDS]),
            "update_s": float(self.learner[UPDATE_SECONDS]),
            "learner_wait_s": float(self.learner[WAIT_SECONDS]),
            "sampler_wait_s": float(self.sampler_wait_s.sum()),
            "active_samplers": int((self.paused == 0).sum()),
            "dropped_episodes": int(self.dropped_episodes.sum()) + int(self.remote_dropped_episodes.sum()),
            "critic_loss": float(self.learner[CRITIC_LOSS]),
            "actor_loss": float(self.learner[ACTOR_LOSS]),
            "alpha": float(self.learner[ALPHA]),
            "noise_scale": float(self.learner[NOISE_SCALE]),
            "noise_measurements": int(self.learner[NOISE_MEASUREMENTS]),
            "batch_size": int(self.learner[BATCH_SIZE]),
            "sampled_rows": self.sampled_rows(),
            "train_return": float(np.nanmean(train_returns)) if np.isfinite(train_returns).any() else float("nan"),
        }

    def close(self) -> None:
        self.env_steps = self.episodes = self.train_returns = self.sampler_wait_s = self.paused = self.dropped_episodes = None
        self.heartbeats = self.learner = None
        self.remote_env_steps = self.remote_episodes = self.remote_train_returns = None
        self.remote_dropped_episodes = self.ingest = self.resumed_env_steps = None
        self._arrays.close()
