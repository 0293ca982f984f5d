"""Shared fixtures: a tiny registered env with known episode ends, and leak checks for every test."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spreeze.shm import live_segments  # noqa: E402


class CountdownEnv(gym.Env):
    """Obs = [step index, 1]; reward = 1 per step; terminates after ``terminate_at`` steps."""

    def __init__(self, terminate_at: int = 5):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self.terminate_at = terminate_at
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.array([float(self.t), 1.0], np.float32)
        return obs, 1.0, self.t >= self.terminate_at, False, {}


# Terminates at step 5: every 5th transition is terminal.
gym.register("SpreezeTestTerminating-v0", entry_point=CountdownEnv, kwargs={"terminate_at": 5}, max_episode_steps=100)
# Truncated by the time limit at step 3, never terminates.
gym.register("SpreezeTestTruncating-v0", entry_point=CountdownEnv, kwargs={"terminate_at": 10_000}, max_episode_steps=3)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no shared-memory segment of this process and no child process behind."""
    before_children = _children()
    yield
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before_children
                and p.name() != "resource_tracker" and "resource_tracker" not in " ".join(p.cmdline())]
    for p in leftover:
        p.kill()
    segments = live_segments(os.getpid())
    assert not segments, f"test left shared-memory segments: {segments}"
    assert not leftover, f"test left child processes: {[p.cmdline() for p in leftover]}"
