"""Stable-Baselines3 SAC with the rl-baselines3-zoo tuned hyperparameters, as the race's opponent.

Run by ``benchmarks.race`` in its own process, the way a user runs SB3: one process, SB3's own
defaults for threads. It trains until ``--seconds`` of wall time have passed since ``--launched-at``
(the moment the race started this process, so start-up counts) and keeps a copy of the actor every
``--snapshot-interval-s``; the race evaluates those copies afterwards, so SB3's training is never paused
by its tests (which favours SB3: the project's evaluator shares the machine while it trains).

    python -m benchmarks.sb3_sac --env Walker2DBulletEnv-v0 --seconds 1800 --out DIR
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

# rl-baselines3-zoo hyperparams/sac.yml (the "pybullet-defaults" anchor for the Bullet locomotion envs,
# Pendulum-v1's own entry); keys are SAC() keyword arguments, policy_kwargs as a dict.
_PYBULLET = {"learning_rate": 7.3e-4, "buffer_size": 300_000, "batch_size": 256, "ent_coef": "auto",
             "gamma": 0.98, "tau": 0.02, "train_freq": 8, "gradient_steps": 8, "learning_starts": 10_000,
             "use_sde": True, "policy_kwargs": {"log_std_init": -3, "net_arch": [400, 300]}}
ZOO_SAC = {
    "Walker2DBulletEnv-v0": _PYBULLET,
    "HalfCheetahBulletEnv-v0": _PYBULLET,
    "AntBulletEnv-v0": _PYBULLET,
    "HopperBulletEnv-v0": _PYBULLET,
    "Pendulum-v1": {"learning_rate": 1e-3},
}


def hyperparameters(env_id: str) -> dict:
    """The zoo's SAC hyperparameters for ``env_id``; SB3's defaults for an env the zoo does not tune."""
    return copy.deepcopy(ZOO_SAC.get(env_id, {}))


def make_model(env_id: str, seed: int):
    from stable_baselines3 import SAC

    from spreeze.envs import make_env

    env, _ = make_env(env_id, seed=seed)
    return SAC("MlpPolicy", env, seed=seed, verbose=0, **hyperparameters(env_id))


def train(env_id: str, seconds: float, launched_at: float, snapshot_interval_s: float, seed: int,
          out: Path) -> dict:
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    model = make_model(env_id, seed)
    snapshots: list[dict] = []

    class Clock(BaseCallback):
        """Stops training at the budget and copies the actor at fixed wall-time intervals."""

        def __init__(self):
            super().__init__()
            self.next_snapshot = 0.0

        def _on_step(self) -> bool:
            elapsed = time.time() - launched_at
            if elapsed >= self.next_snapshot:
                snapshots.append({"time_s": elapsed, "env_steps": self.model.num_timesteps,
                                  "updates": self.model._n_updates,
                                  "actor": {k: v.detach().clone() for k, v in self.model.actor.state_dict().items()}})
                self.next_snapshot = elapsed + snapshot_interval_s
            return elapsed < seconds

    model.learn(total_timesteps=10**9, callback=Clock())
    summary = {"env_steps": model.num_timesteps, "updates": model._n_updates,
               "wall_time_s": time.time() - launched_at, "torch_threads": torch.get_num_threads(),
               "hyperparameters": {k: str(v) for k, v in hyperparameters(env_id).items()}}
    torch.save({"snapshots": snapshots, "summary": summary}, out / "sb3_snapshots.pt")
    return summary


def evaluate_snapshots(env_id: str, actor_states: list[dict], episodes: int, seed: int) -> list[float]:
    """Mean return of ``episodes`` deterministic episodes of each saved actor (runs in a worker process)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    model = make_model(env_id, seed)
    env = model.get_env()
    means = []
    for actor_state in actor_states:
        model.actor.load_state_dict(actor_state)
        returns = []
        for episode in range(episodes):
            env.seed(seed + 1000 + episode)
            obs, done, total = env.reset(), False, 0.0
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, reward, dones, _ = env.step(action)
                total += float(reward[0])
                done = bool(dones[0])
            returns.append(total)
        means.append(float(np.mean(returns)))
    env.close()
    return means


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--launched-at", type=float, default=None, help="unix time the budget counts from")
    parser.add_argument("--snapshot-interval-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train(args.env, args.seconds, args.launched_at or time.time(), args.snapshot_interval_s, args.seed, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
