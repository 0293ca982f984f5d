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
_LEARNER_SLOTS = 13

LEARNER_ROLE = 0
EVALUATOR_ROLE = 1


def sampler_role(index: int) -> int:
    return 2 + index


@dataclass(frozen=True)
class StatsHandle:
    segment: SegmentHandle
    n_samplers: int


class SharedStats:
    def __init__(self, arrays: SharedArrays, n_samplers: int):
        self._arrays = arrays
        self.n_samplers = n_samplers
        self.env_steps = arrays["env_steps"]          # per sampler
        self.episodes = arrays["episodes"]            # per sampler
        self.train_returns = arrays["train_returns"]  # per sampler: last finished training episode's return
        self.sampler_wait_s = arrays["sampler_wait_s"]  # per sampler: time paused by the ratio control
        self.paused = arrays["paused"]                # per sampler: 1 while the CPU governor pauses it
        self.dropped_episodes = arrays["dropped_episodes"]  # per sampler: episodes dropped for env faults
        self.heartbeats = arrays["heartbeats"]        # per role: time.time() of last sign of life
        self.learner = arrays["learner"]

    @classmethod
    def create(cls, n_samplers: int) -> "SharedStats":
        specs = (
            ArraySpec("env_steps", (n_samplers,), "int64", 0),
            ArraySpec("episodes", (n_samplers,), "int64", 0),
            ArraySpec("train_returns", (n_samplers,), "float64", float("nan")),
            ArraySpec("sampler_wait_s", (n_samplers,), "float64", 0.0),
            ArraySpec("paused", (n_samplers,), "int64", 0),
            ArraySpec("dropped_episodes", (n_samplers,), "int64", 0),
            ArraySpec("heartbeats", (n_samplers + 2,), "float64", 0.0),
            ArraySpec("learner", (_LEARNER_SLOTS,), "float64", 0.0),
        )
        return cls(SharedArrays.create(specs, tag="stats"), n_samplers)

    @classmethod
    def attach(cls, handle: StatsHandle) -> "SharedStats":
        return cls(SharedArrays.attach(handle.segment), handle.n_samplers)

    @property
    def handle(self) -> StatsHandle:
        return StatsHandle(self._arrays.handle, self.n_samplers)

    def total_env_steps(self) -> int:
        return int(self.env_steps.sum())

    def updates(self) -> int:
        return int(self.learner[UPDATES])

    def sampled_rows(self) -> int:
        return int(self.learner[SAMPLED_ROWS])

    def beat(self, role: int) -> None:
        self.heartbeats[role] = time.time()

    def snapshot(self) -> dict:
        return {
            "env_steps": self.total_env_steps(),
            "episodes": int(self.episodes.sum()),
            "updates": self.updates(),
            "actor_updates": int(self.learner[ACTOR_UPDATES]),
            "policy_version": int(self.learner[POLICY_VERSION]),
            "fetch_s": float(self.learner[FETCH_SECONDS]),
            "update_s": float(self.learner[UPDATE_SECONDS]),
            "learner_wait_s": float(self.learner[WAIT_SECONDS]),
            "sampler_wait_s": float(self.sampler_wait_s.sum()),
            "active_samplers": int((self.paused == 0).sum()),
            "dropped_episodes": int(self.dropped_episodes.sum()),
            "critic_loss": float(self.learner[CRITIC_LOSS]),
            "actor_loss": float(self.learner[ACTOR_LOSS]),
            "alpha": float(self.learner[ALPHA]),
            "noise_scale": float(self.learner[NOISE_SCALE]),
            "batch_size": int(self.learner[BATCH_SIZE]),
            "sampled_rows": self.sampled_rows(),
            "train_return": float(np.nanmean(self.train_returns)) if np.isfinite(self.train_returns).any() else float("nan"),
        }

    def close(self) -> None:
        self.env_steps = self.episodes = self.train_returns = self.sampler_wait_s = self.paused = self.dropped_episodes = None
        self.heartbeats = self.learner = None
        self._arrays.close()
