"""Building and checking environments.

PyBullet quirks handled here come from docs/pitfalls.md: envs must be built inside the process
that steps them, and a locomotion env may silently attach to a shared-memory physics server, so
every PyBullet env is checked to be a private DIRECT connection after its first reset.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
import warnings
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from spreeze.config import ConfigError, parse_env_kwargs

_registered = False


@contextlib.contextmanager
def quiet_c_output():
    """Silence what C code writes to fds 1 and 2: pybullet prints a build banner on import and "argv[0]="
    on every connection, which would break the one-line error contract and clutter the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def register_envs() -> None:
    """Register the ``*BulletEnv-v0`` ids on gymnasium (pybullet-envs-gymnasium does it on import).

    Without pybullet installed (a machine set up for gymnasium's own envs only) those ids stay unknown,
    and ``check_env`` says so in its usual one line."""
    global _registered
    if not _registered:
        with warnings.catch_warnings(), quiet_c_output():
            warnings.simplefilter("ignore")
            try:
                import pybullet_envs_gymnasium  # noqa: F401  (import registers the ids)
            except ImportError:
                pass
        _registered = True


@dataclass(frozen=True)
class EnvInfo:
    """What the trainer needs to know about an env before starting any process."""
    env_id: str
    obs_dim: int
    act_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    max_episode_steps: int | None


def env_options(env) -> tuple[str, dict, tuple[str, ...]]:
    """``(env id, constructor kwargs, wrappers)`` of an env id, or of a Config (its --env-kwargs, --wrapper)."""
    if isinstance(env, str):
        return env, {}, ()
    return env.env_id, parse_env_kwargs(getattr(env, "env_kwargs", ())), tuple(getattr(env, "wrapper", ()))


def load_wrapper(spec: str):
    """The callable named by ``module:callable``; ConfigError (one line) if it cannot be imported or called."""
    module_name, _, attr = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raises on import
        raise ConfigError(f"--wrapper {spec}: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"--wrapper {spec}: module {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ConfigError(f"--wrapper {spec}: {attr!r} is a {type(target).__name__}, not a callable")
    return target


def build_env(env, **make_kwargs) -> gym.Env:
    """``gym.make`` with the env's kwargs (and ``make_kwargs``, e.g. a render mode), then its wrappers in order:
    the one way every process (sampler, evaluator, render, probe, check) builds an env."""
    env_id, kwargs, wrappers = env_options(env)
    made = gym.make(env_id, **kwargs, **make_kwargs)
    for spec in wrappers:
        wrapped = load_wrapper(spec)(made)
        if not isinstance(wrapped, gym.Env):
            raise ConfigError(f"--wrapper {spec} returned a {type(wrapped).__name__}, not a gymnasium env")
        made = wrapped
    return made


def check_env(env) -> EnvInfo:
    """Check that the env (an id, or a Config with its --env-kwargs and --wrapper) exists and has flat Box spaces
    once built and wrapped; raise ConfigError with one clear line otherwise."""
    env_id, _, wrappers = env_options(env)
    for spec in wrappers:
        load_wrapper(spec)
    register_envs()
    if ":" in env_id:  # gymnasium's "module:EnvId" form: importing the module registers the id
        module, _, bare_id = env_id.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"cannot import {module!r} for environment {env_id!r}: {err}") from err
        if bare_id not in gym.registry:
            raise ConfigError(f"module {module!r} registers no environment {bare_id!r}")
    elif env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=3, cutoff=0.4)
        hint = f"; closest registered ids: {', '.join(close)}" if close else ""
        raise ConfigError(f"unknown environment id {env_id!r}{hint}")
    try:
        with quiet_c_output():
            env = build_env(env)
    except ConfigError:
        raise
    except Exception as err:  # a registered id whose dependencies are missing (e.g. mujoco), a bad kwarg, a wrapper
        raise ConfigError(f"environment {env_id!r} cannot be built: {type(err).__name__}: {err}") from err
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(act_space, gym.spaces.Box):
            raise ConfigError(f"environment {env_id!r} has a {type(act_space).__name__} action space; "
                              "spreeze needs a continuous Box action space")
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            raise ConfigError(f"environment {env_id!r} needs a flat Box observation space, has {obs_space}")
        if len(act_space.shape) != 1 or not np.all(np.isfinite(act_space.low)) or not np.all(np.isfinite(act_space.high)):
            raise ConfigError(f"environment {env_id!r} needs a flat, bounded Box action space, has {act_space}")
        return EnvInfo(env_id=env_id, obs_dim=int(obs_space.shape[0]), act_dim=int(act_space.shape[0]),
                       action_low=tuple(float(x) for x in act_space.low),
                       action_high=tuple(float(x) for x in act_space.high),
                       max_episode_steps=env.spec.max_episode_steps if env.spec else None)
    finally:
        env.close()


def make_env(env, seed: int) -> tuple[gym.Env, np.ndarray]:
    """Build one env (an id, or a Config with its --env-kwargs and --wrapper) in the calling process, reset it
    with ``seed`` and return it with its first observation."""
    register_envs()
    with quiet_c_output():
        env = build_env(env)
        obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    _assert_private_physics(env)
    return env, obs


def _assert_private_physics(env: gym.Env) -> None:
    client = getattr(env.unwrapped, "_p", None)
    if client is None:
        return
    import pybullet

    method = client.getConnectionInfo()["connectionMethod"]
    if method != pybullet.DIRECT:
        raise RuntimeError(f"{env.spec.id} attached to a shared physics server (connection method {method}); "
                           "stop other pybullet GUI/shared-memory servers and retry")


class ActionScaler:
    """Maps policy actions in [-1, 1] to the env's Box bounds (the replay stores the [-1, 1] form)."""

    def __init__(self, low, high):
        self.low = np.asarray(low, dtype=np.float32)
        self.high = np.asarray(high, dtype=np.float32)

    def __call__(self, action: np.ndarray) -> np.ndarray:
        return self.low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (self.high - self.low)
