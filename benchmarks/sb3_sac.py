"""Stable-Baselines3 opponents with the rl-baselines3-zoo tuned hyperparameters, for the race.

``sb3-sac``: SB3's SAC with ``hyperparams/sac.yml``; ``sb3-crossq``: sb3-contrib's CrossQ (Bhatt et al.
2024: batch-normalised critics, no target network) with ``hyperparams/crossq.yml``. Learning-rate
schedules (``lin_7.3e-4`` for Walker2D and Hopper) decay over the zoo's ``n_timesteps``, as the zoo runs
them. Run by ``benchmarks.race`` in its own process, the way a user runs SB3: one process, SB3's own
defaults for threads. It trains until ``--seconds`` of wall time have passed since ``--launched-at``
(the moment the race started this process, so start-up counts) and keeps a copy of the actor every
``--snapshot-interval-s``; the race evaluates those copies afterwards, so SB3's training is never paused
by its tests (which favours SB3: the project's evaluator shares the machine while it trains). Test ``i``
starts from the same seeded states as the project's test ``i`` (``spreeze.evaluator.eval_episode_seed``).

    python -m benchmarks.sb3_sac --env Walker2DBulletEnv-v0 --seconds 1800 --out DIR [--opponent sb3-crossq]
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

OPPONENTS = ("sb3-sac", "sb3-crossq")

# rl-baselines3-zoo hyperparams/sac.yml (the "pybullet-defaults" anchor for the Bullet locomotion envs,
# Pendulum-v1's own entry, the MuJoCo anchor below); keys are SAC() keyword arguments, policy_kwargs as a
# dict; "n_timesteps" is the zoo's training length, over which a "lin_" learning rate decays to 0.
_PYBULLET = {"n_timesteps": 1_000_000, "learning_rate": 7.3e-4, "buffer_size": 300_000, "batch_size": 256,
             "ent_coef": "auto", "gamma": 0.98, "tau": 0.02, "train_freq": 8, "gradient_steps": 8,
             "learning_starts": 10_000, "use_sde": True, "policy_kwargs": {"log_std_init": -3, "net_arch": [400, 300]}}
ZOO_SAC = {
    "Walker2DBulletEnv-v0": {**_PYBULLET, "learning_rate": "lin_7.3e-4"},
    "HalfCheetahBulletEnv-v0": _PYBULLET,
    "AntBulletEnv-v0": _PYBULLET,
    "HopperBulletEnv-v0": {**_PYBULLET, "learning_rate": "lin_7.3e-4"},
    "Pendulum-v1": {"n_timesteps": 20_000, "learning_rate": 1e-3},
}


def _mujoco_entries(anchor: dict, bodies: dict) -> dict:
    """The zoo's MuJoCo entries: ``anchor`` with each body's own keys, for -v4 and -v5 (the zoo writes them for
    -v3/-v4; -v5, the stand-in on machines without pybullet, has the same bodies and rewards)."""
    return {f"{body}-{version}": {**anchor, **extra} for body, extra in bodies.items() for version in ("v4", "v5")}


# the "mujoco-defaults" anchor: SB3's own SAC settings but a 10k-step warm-up
ZOO_SAC.update(_mujoco_entries({"n_timesteps": 1_000_000, "learning_starts": 10_000},
                               {"HalfCheetah": {}, "Ant": {}, "Hopper": {}, "Walker2d": {},
                                "Humanoid": {"n_timesteps": 2_000_000}, "Swimmer": {"gamma": 0.9999}}))
# hyperparams/crossq.yml: the Bullet entries reuse SAC's tuning ("need to check with CrossQ" there) with
# CrossQ's own network defaults
_CROSSQ_PYBULLET = {"n_timesteps": 1_000_000, "learning_rate": 7.3e-4, "buffer_size": 300_000, "batch_size": 256,
                    "ent_coef": "auto", "gamma": 0.98, "train_freq": 8, "gradient_steps": 8,
                    "learning_starts": 10_000, "use_sde": True,
                    "policy_kwargs": {"use_expln": True, "log_std_init": -3}}
ZOO_CROSSQ = {
    "Walker2DBulletEnv-v0": {**_CROSSQ_PYBULLET, "learning_rate": "lin_7.3e-4"},
    "HalfCheetahBulletEnv-v0": _CROSSQ_PYBULLET,
    "AntBulletEnv-v0": _CROSSQ_PYBULLET,
    "HopperBulletEnv-v0": {**_CROSSQ_PYBULLET, "learning_rate": "lin_7.3e-4"},
    "Pendulum-v1": {"n_timesteps": 20_000, "policy_delay": 2, "policy_kwargs": {"net_arch": [256, 256]}},
}
# crossq.yml's MuJoCo anchor: wide critics, a delayed actor, a shorter warm-up
ZOO_CROSSQ.update(_mujoco_entries(
    {"n_timesteps": 5_000_000, "buffer_size": 1_000_000, "learning_rate": 1e-3, "learning_starts": 5_000,
     "policy_delay": 3, "policy_kwargs": {"net_arch": {"pi": [256, 256], "qf": [2048, 2048]}}},
    {"HalfCheetah": {}, "Ant": {}, "Hopper": {}, "Walker2d": {}, "Humanoid": {}, "HumanoidStandup": {},
     "Swimmer": {"gamma": 0.999}}))
ZOO = {"sb3-sac": ZOO_SAC, "sb3-crossq": ZOO_CROSSQ}
DEFAULT_N_TIMESTEPS = 1_000_000


def hyperparameters(env_id: str, opponent: str = "sb3-sac") -> dict:
    """The zoo's hyperparameters for ``env_id`` as the zoo file writes them (``n_timesteps`` included); the
    library's defaults for an env the zoo does not tune."""
    return copy.deepcopy(ZOO[opponent].get(env_id, {}))


def learning_rate(value):
    """The zoo's ``lin_<lr>``: a linear decay to 0 over training (SB3 passes the progress remaining, 1 -> 0)."""
    if isinstance(value, str) and value.startswith("lin_"):
        initial = float(value[len("lin_"):])
        return lambda progress_remaining: progress_remaining * initial
    return value


def make_model(env_id: str, seed: int, opponent: str = "sb3-sac"):
    """The opponent's model and the number of timesteps its schedule runs over."""
    from spreeze.envs import make_env

    if opponent == "sb3-crossq":
        from sb3_contrib import CrossQ as Algorithm
    else:
        from stable_baselines3 import SAC as Algorithm
    kwargs = hyperparameters(env_id, opponent)
    n_timesteps = int(kwargs.pop("n_timesteps", DEFAULT_N_TIMESTEPS))
    if "learning_rate" in kwargs:
        kwargs["learning_rate"] = learning_rate(kwargs["learning_rate"])
    env, _ = make_env(env_id, seed=seed)
    return Algorithm("MlpPolicy", env, seed=seed, verbose=0, **kwargs), n_timesteps


def train(env_id: str, seconds: float, launched_at: float, snapshot_interval_s: float, seed: int,
          out: Path, opponent: str = "sb3-sac") -> dict:
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import Logger

    model, n_timesteps = make_model(env_id, seed, opponent)
    # a logger of no outputs: SB3's default (verbose 0) leaves an empty tempdir/SB3-<time> folder per learn()
    model.set_logger(Logger(folder=None, output_formats=[]))
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

    # the zoo's training length, so that a schedule decays as it does there; the clock stops it earlier
    model.learn(total_timesteps=n_timesteps, callback=Clock())
    summary = {"opponent": opponent, "env_steps": model.num_timesteps, "updates": model._n_updates,
               # the zoo's training length ends it before the clock on a long budget
               "stopped_by": "n_timesteps" if model.num_timesteps >= n_timesteps else "seconds",
               "wall_time_s": time.time() - launched_at, "torch_threads": torch.get_num_threads(),
               "hyperparameters": {k: str(v) for k, v in hyperparameters(env_id, opponent).items()}}
    torch.save({"snapshots": snapshots, "summary": summary}, out / "sb3_snapshots.pt")
    return summary


def evaluate_snapshots(env_id: str, actor_states: list[dict], indices: list[int], episodes: int, seed: int,
                       opponent: str = "sb3-sac") -> list[float]:
    """Mean return of ``episodes`` deterministic episodes of each saved actor (runs in a worker process);
    snapshot ``indices[k]`` is tested from the start states of the project's test of that number."""
    import numpy as np
    import torch

    from spreeze.evaluator import eval_episode_seed

    torch.set_num_threads(1)
    model, _ = make_model(env_id, seed, opponent)
    env = model.get_env()
    means = []
    for index, actor_state in zip(indices, actor_states):
        model.actor.load_state_dict(actor_state)
        returns = []
        for episode in range(episodes):
            env.seed(eval_episode_seed(seed, index, episode))
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
    parser.add_argument("--opponent", choices=OPPONENTS, default="sb3-sac")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train(args.env, args.seconds, args.launched_at or time.time(), args.snapshot_interval_s, args.seed, args.out,
          args.opponent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
