"""Envs that misbehave on purpose, importable by spawned children as ``tests.faulty_envs:<Id>``."""
from __future__ import annotations

import gymnasium as gym
import numpy as np


class FaultyPendulum(gym.Wrapper):
    """Pendulum that breaks in a chosen way.

    mode "nan_every": every ``every``-th step returns a NaN observation;
    mode "raise_in_sampler0": ``step`` always raises in the process titled spreeze-sampler-0;
    mode "huge_reward": rewards of 1e30 (finite, but squared in the critic loss they overflow);
    mode "huge_reward_after": normal for ``after`` steps of this env, then rewards of 1e30;
    mode "raise_in_samplers": ``step`` always raises in every sampler process (the evaluator's env works);
    mode "reset_raises_every" / "reset_nan_every": every ``every``-th reset after the first raises / returns a
    NaN observation.
    """

    def __init__(self, mode: str, every: int = 250, after: int = 0):
        super().__init__(gym.make("Pendulum-v1"))
        self.mode, self.every, self.after, self.steps, self.resets = mode, every, after, 0, 0

    def reset(self, **kwargs):
        self.resets += 1
        obs, info = self.env.reset(**kwargs)
        if self.resets > 1 and self.resets % self.every == 0:
            if self.mode == "reset_raises_every":
                raise RuntimeError("simulated reset failure")
            if self.mode == "reset_nan_every":
                obs = np.full_like(obs, np.nan)
        return obs, info

    def step(self, action):
        self.steps += 1
        if self.mode == "raise_in_sampler0":
            import setproctitle

            if setproctitle.getproctitle().startswith("spreeze-sampler-0"):
                raise RuntimeError("simulated simulator crash")
        if self.mode == "raise_in_samplers":
            import setproctitle

            if setproctitle.getproctitle().startswith("spreeze-sampler"):
                raise RuntimeError("simulated simulator crash")
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.mode == "nan_every" and self.steps % self.every == 0:
            obs = np.full_like(obs, np.nan)
        if self.mode == "huge_reward" or (self.mode == "huge_reward_after" and self.steps > self.after):
            reward = 1e30
        return obs, reward, terminated, truncated, info


gym.register("NanEveryPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "nan_every", "every": 250})
gym.register("AlwaysNanPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "nan_every", "every": 1})
gym.register("CrashInSampler0Pendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "raise_in_sampler0"})
gym.register("HugeRewardPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "huge_reward"})
# 750 good steps per env (3000 with the 4 envs of one sampler: learning runs and checkpoints), then 1e30
gym.register("LateHugeRewardPendulum-v0", entry_point=FaultyPendulum,
             kwargs={"mode": "huge_reward_after", "after": 750})
gym.register("CrashInEverySamplerPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "raise_in_samplers"})
# every second reset fails: at every episode's end, as the reset after it (the fault's own) works
gym.register("FlakyResetPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "reset_raises_every", "every": 2})
gym.register("NanResetPendulum-v0", entry_point=FaultyPendulum, kwargs={"mode": "reset_nan_every", "every": 2})
