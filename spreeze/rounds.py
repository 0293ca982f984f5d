"""The lock-step round protocol (``--deterministic``), as every process derives it from the config alone.

Round ``k``: every env steps ``--steps-per-round`` times with policy ``pi_k`` while the learner trains on rounds
``<= k-1`` and publishes ``pi_{k+1}`` into the other of two weight slots: a policy lag of exactly one round
(HTS-RL; Cleanba). Env ``e``'s ``n``-th row lands in region ``e``, slot ``n % capacity``, whoever stepped it; the
learner samples a window that round ``k``'s writes cannot reach, so no lock and no timing decide what it reads.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from spreeze.replay import Batch, SharedReplay

WAIT_S = 0.1  # every blocking wait re-checks the stop Event and the parent this often


class RoundProtocolError(RuntimeError):
    """A process found state another round should have left: a bug, never a timing matter."""


def use_deterministic_torch() -> None:
    """Deterministic kernels in this process; CUBLAS needs a fixed workspace, set before CUDA starts, and ops
    lacking a deterministic CUDA kernel warn instead of stopping a long run (docs/pitfalls.md)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass(frozen=True)
class RoundPlan:
    """What every process derives from the config alone: who steps which env, what it acts with, how many
    updates each round runs and where the learner may read."""
    num_envs: int
    samplers: int
    steps_per_round: int
    region_capacity: int
    learning_begins_at: int
    collect_ratio: float
    eval_every_steps: int

    @classmethod
    def from_config(cls, config) -> "RoundPlan":
        """``--serial``: one sampler with every env. Config.validate checks that a region holds two rounds."""
        num_envs = config.total_envs
        return cls(num_envs=num_envs, samplers=1 if config.serial else max(1, min(config.samplers, num_envs)),
                   steps_per_round=config.steps_per_round, region_capacity=config.region_capacity,
                   learning_begins_at=config.learning_begins_at,
                   collect_ratio=config.collect_ratio, eval_every_steps=config.eval_every_steps)

    @property
    def round_env_steps(self) -> int:
        return self.num_envs * self.steps_per_round

    def env_steps_after(self, k: int) -> int:
        return (k + 1) * self.round_env_steps

    def sampler_envs(self, index: int) -> list[int]:
        """Contiguous blocks of envs per sampler process; what an env sees does not depend on the block."""
        return [int(e) for e in np.array_split(np.arange(self.num_envs), self.samplers)[index]]

    def random_actions(self, k: int, t: int) -> bool:
        """Warm-up: uniform actions while fewer than ``learning_begins_at`` env steps came before this step (the
        warm-up, and one full batch), as in free-running mode."""
        return (k * self.steps_per_round + t) * self.num_envs < self.learning_begins_at

    def updates_after(self, k: int) -> int:
        """Critic updates done once learner round ``k`` ends: none until the data it may read (rounds < k) reach
        ``learning_begins_at``, then one per ``collect_ratio`` env steps collected beyond that point."""
        if k * self.round_env_steps < self.learning_begins_at:
            return 0
        return whole_updates(self.env_steps_after(k) - self.learning_begins_at, self.collect_ratio)

    def window(self, k: int) -> tuple[int, int]:
        """Entries ``[first, end)`` of every region (counted since the start) that learner round ``k`` samples:
        the newest ones, one round of every ring kept free for the round being written."""
        end = k * self.steps_per_round
        return end - min(end, self.region_capacity - self.steps_per_round), end

    def eval_due(self, k: int) -> bool:
        """A test evaluation after round ``k``: each time the env steps pass a multiple of ``eval_every_steps``."""
        after = self.env_steps_after(k)
        return after // self.eval_every_steps > (after - self.round_env_steps) // self.eval_every_steps


def whole_updates(env_steps: int, collect_ratio: float) -> int:
    """Whole critic updates ``env_steps`` pay for at ``collect_ratio`` env steps each. A ratio such as 256/10 or
    0.1 has no exact binary value, and ``//`` floors the exact quotient of the two floats: 256 // (256/10) is 9.
    A quotient within rounding of a whole number counts as that number."""
    quotient = env_steps / collect_ratio
    nearest = round(quotient)
    if abs(quotient - nearest) <= 1e-9 * max(1.0, abs(quotient)):
        return int(nearest)
    return int(math.floor(quotient))


def window_slots(plan: RoundPlan, k: int, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """The replay slots of a uniform batch from learner round ``k``'s window; the CPU gather and the GPU mirror
    (spreeze/mirror.py) both take these, so their batches, and runs, are the same."""
    first, end = plan.window(k)
    per_region = end - first
    picks = rng.integers(0, plan.num_envs * per_region, size=batch_size)
    return (picks // per_region) * plan.region_capacity + (first + picks % per_region) % plan.region_capacity


def sample_window(replay: SharedReplay, plan: RoundPlan, k: int, batch_size: int, rng: np.random.Generator) -> Batch:
    """A uniform batch from learner round ``k``'s window, lock-free: no sampler writes there during round ``k``."""
    slots = window_slots(plan, k, batch_size, rng)
    return Batch(replay.obs[slots], replay.actions[slots], replay.rewards[slots], replay.next_obs[slots],
                 replay.terminated[slots])


@dataclass(frozen=True)
class RoundLink:
    """What the coordinator and the workers share besides the replay and the weights (handed to each child as it
    is spawned): a start semaphore per worker (samplers, then the learner), released once per round; one done
    semaphore, released by each worker when its part of the round is done; every env's last episode return."""
    start: tuple
    done: object
    env_returns: object

    @classmethod
    def create(cls, num_envs: int, n_workers: int, ctx) -> "RoundLink":
        return cls(tuple(ctx.Semaphore(0) for _ in range(n_workers)), ctx.Semaphore(0),
                   ctx.RawArray("d", [math.nan] * num_envs))

    def record_episode(self, env: int, episode_return: float) -> None:
        self.env_returns[env] = episode_return

    def rounds(self, worker: int, should_stop):
        """Rounds 0, 1, 2, ... as the coordinator opens them for ``worker``, until the run stops (a worker is never
        restarted, so it counts them itself); the caller releases ``done`` after each."""
        k = 0
        while not should_stop():
            if self.start[worker].acquire(timeout=WAIT_S):
                yield k
                k += 1
