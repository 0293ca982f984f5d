"""Wrappers for the --wrapper tests, importable by spawned children as ``tests.env_wrappers:<name>``."""
from __future__ import annotations

import os

import gymnasium as gym

LOG_VARIABLE = "SPREEZE_TEST_WRAPPER_LOG"


class RecordBuilds(gym.Wrapper):
    """Appends "<process title> <the env's g or ->" to the file named by $SPREEZE_TEST_WRAPPER_LOG each time an
    env is wrapped, so a test sees which processes built the env and with which kwargs."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        import setproctitle

        path = os.environ.get(LOG_VARIABLE)
        if path:
            with open(path, "a") as f:
                f.write(f"{setproctitle.getproctitle().split()[0]} {getattr(env.unwrapped, 'g', '-')}\n")


def double_reward(env: gym.Env) -> gym.Env:
    """A plain function as the wrapper: rewards times two."""
    return gym.wrappers.TransformReward(env, lambda r: 2.0 * r)


def not_an_env(env: gym.Env):
    return "not an env"


NOT_CALLABLE = 42


def unit_actions(env: gym.Env) -> gym.Env:
    """Actions in [-1, 1] whatever the env's bounds (Pendulum's are [-2, 2])."""
    return gym.wrappers.RescaleAction(env, -1.0, 1.0)
