"""Checkpoints and the final policy, always written atomically (temp file, fsync, rename), so a file on
disk is complete or absent even if the process is killed mid-write."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spreeze.envs import ActionScaler
from spreeze.files import atomic_write

CHECKPOINT_NAME = "latest.pt"
FINAL_ACTOR_NAME = "actor.pt"
FINAL_DIR = "final"
BEST_DIR = "best"


def atomic_save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(run_dir: Path, algo_state: dict, counters: dict, config: dict,
                    generators: dict | None = None) -> Path:
    path = Path(run_dir) / "checkpoints" / CHECKPOINT_NAME
    state = {"algo": algo_state, "counters": counters, "config": config}
    if generators is not None:
        state["generators"] = generators
    atomic_save(state, path)
    return path


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's tensors and plain values. ``weights_only=True``: a checkpoint is a file that may come
    from someone else, and a full unpickle would run any code it carries."""
    return torch.load(path, map_location="cpu", weights_only=True)


def save_actor(run_dir: Path, actor: torch.nn.Module, config: dict, env_info, folder: str = FINAL_DIR,
               extra: dict | None = None) -> Path:
    """An actor alone, loadable with :func:`load_policy`: ``final/`` at the end, ``best/`` at each new best."""
    path = Path(run_dir) / folder / FINAL_ACTOR_NAME
    state = {k: v.detach().cpu() for k, v in actor.state_dict().items()}
    atomic_save({"actor": state, "config": config, "obs_dim": env_info.obs_dim, "act_dim": env_info.act_dim,
                 "action_low": list(env_info.action_low), "action_high": list(env_info.action_high),
                 **(extra or {})}, path)
    return path


def save_final_actor(run_dir: Path, actor: torch.nn.Module, config: dict, env_info) -> Path:
    return save_actor(run_dir, actor, config, env_info, FINAL_DIR)


def read_best(run_dir: Path) -> dict | None:
    """What ``best/actor.pt`` records about itself (mean of the last tests, version, steps), if present."""
    path = Path(run_dir) / BEST_DIR / FINAL_ACTOR_NAME
    if not path.is_file():
        return None
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True).get("best") or {}) or None
    except Exception:  # an unreadable best file is replaced by the next best
        return None


class Policy:
    """A trained actor as a plain function: env observation in, env action (in the env's bounds) out.
    ``env_id``: the env it was trained on (None where the caller did not say)."""

    def __init__(self, actor: torch.nn.Module, scale: ActionScaler, env_id: str | None = None):
        self.actor = actor.eval()
        self.scale = scale
        self.env_id = env_id

    def __call__(self, obs) -> np.ndarray:
        obs_t = torch.as_tensor(np.asarray(obs, np.float32))
        action = self.actor.act(obs_t, deterministic=True).numpy()
        return self.scale(action)


LATEST = "latest"  # load_policy's name for the actor inside the newest training checkpoint


def load_policy(run_or_file: str | Path, checkpoint: str | Path | None = None) -> Policy:
    """``policy = spreeze.load_policy("runs/<run>")``; then ``env.step(policy(obs))``.

    ``checkpoint``: ``"final"`` (the actor at the end of the run), ``"best"`` (the policy of the best mean of
    the last 5 tests, saved during the run; before the fifth test, the latest tested one), ``"latest"`` (the actor in the newest training checkpoint, which a
    run still going or killed has too), or a path: a policy or checkpoint file, as given or inside the run (or
    its ``checkpoints/``); None is ``"final"``. ``run_or_file`` may itself be such a file, read as it is (a
    ``checkpoint`` with it raises ValueError, rather than being ignored). A missing one raises FileNotFoundError."""
    path = policy_file(run_or_file, checkpoint)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if "algo" in saved:  # a training checkpoint: the actor among the algorithm's state
        return _checkpoint_policy(saved)
    from spreeze.algos import make_actor
    from spreeze.config import Config

    config = Config.from_dict(saved["config"])
    actor = make_actor(config, saved["obs_dim"], saved["act_dim"])
    actor.load_state_dict(saved["actor"])
    return Policy(actor, ActionScaler(saved["action_low"], saved["action_high"]), config.env_id)


def policy_file(run_or_file: str | Path, checkpoint: str | Path | None = None) -> Path:
    """The file :func:`load_policy` reads for ``checkpoint`` (None: ``"final"``); FileNotFoundError saying where
    it looked, ValueError for a ``checkpoint`` with a file (which names one already)."""
    run = Path(run_or_file)
    if run.is_file():
        if checkpoint is not None:
            raise ValueError(f"{run} is a file, loaded as it is: checkpoint={str(checkpoint)!r} chooses a file "
                             "within a run directory")
        return run
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is neither a run directory nor a policy file")
    checkpoint = FINAL_DIR if checkpoint is None else checkpoint
    if str(checkpoint) in (FINAL_DIR, BEST_DIR):
        path = run / str(checkpoint) / FINAL_ACTOR_NAME
        why = "the run has not finished?" if str(checkpoint) == FINAL_DIR else "no test evaluation has finished yet?"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist ({why})")
        return path
    if str(checkpoint) == LATEST:
        path = run / "checkpoints" / CHECKPOINT_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (no checkpoint written yet?)")
        return path
    # inside the run first: a relative name that also exists where the caller stands (another run's
    # checkpoints/latest.pt, say) must not load that run's policy instead
    candidates = [run / checkpoint, run / "checkpoints" / checkpoint, Path(checkpoint)]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} not found: not 'final', 'best' or 'latest', and none of "
                            + ", ".join(str(p) for p in candidates) + " exists")


def _checkpoint_policy(saved: dict) -> Policy:
    """The actor of a training checkpoint. It stores no env facts, so the env itself gives the shapes and the
    action bounds (as ``python -m viz.play --checkpoint`` does)."""
    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env

    config = Config.from_dict(saved["config"])
    env_info = check_env(config)  # the env the run trained on: its --env-kwargs and --wrapper shape it
    actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
    actor.load_state_dict(saved["algo"]["actor"])
    return Policy(actor, ActionScaler(env_info.action_low, env_info.action_high), config.env_id)


# what the checkpoint's tensors were shaped by, or hold: another value could not load them (the critics' widths,
# atoms and layer norms, the observation statistics), or would be overwritten by them (the C51 support's range)
RESUME_MUST_MATCH = ("env_id", "algo", "hidden_size", "hidden_layers", "critic_hidden_size", "critic_atoms",
                     "critic_layer_norm", "normalize_obs", "q_range")


def resume_config(config, explicit: set[str]):
    """The configuration to continue ``config.resume`` with: the run's saved one, with the flags given now
    on top. Raises ConfigError (one line) when the path is not a resumable run or a flag contradicts it."""
    import dataclasses
    import json

    from spreeze.config import Config, ConfigError
    from spreeze.flags import FLAG_ALIASES
    from spreeze.values import flag_name

    def as_given(name: str, value) -> str:
        if isinstance(value, bool):
            return f"--{flag_name(name)}" if value else f"--no-{flag_name(name)}"
        return f"{FLAG_ALIASES.get(name, '--' + flag_name(name))} {value}"

    run_dir = Path(config.resume)
    checkpoint = run_dir / "checkpoints" / CHECKPOINT_NAME
    if not (run_dir / "config.json").is_file() or not checkpoint.is_file():
        raise ConfigError(f"--resume {run_dir}: not a spreeze run with a checkpoint "
                          f"(needs config.json and checkpoints/{CHECKPOINT_NAME})")
    try:
        saved = Config.from_dict(json.loads((run_dir / "config.json").read_text()))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--resume {run_dir}: unreadable config.json ({err})") from err
    for name in RESUME_MUST_MATCH:
        if name in explicit and getattr(config, name) != getattr(saved, name):
            raise ConfigError(f"--resume {run_dir}: the run was made with {as_given(name, getattr(saved, name))}, "
                              f"not {as_given(name, getattr(config, name))}")
    if "run_dir" in explicit and Path(config.run_dir).resolve() != run_dir.resolve():
        raise ConfigError(f"--resume {run_dir} continues the run in its own directory, not in --run-dir "
                          f"{config.run_dir} (to branch a run, copy its directory and resume the copy)")
    fields = {f.name for f in dataclasses.fields(Config)} - {"resume", "run_dir"}
    overrides = {name: getattr(config, name) for name in explicit if name in fields}
    return dataclasses.replace(saved, **overrides, resume=str(run_dir), run_dir=str(run_dir))


def read_resumed_checkpoint(config, env_info) -> dict:
    """The counters of the checkpoint ``config.resume`` goes on from, read once it is known which env this launch
    builds (the learner loads the weights again; none are kept through the profile).

    Raises ConfigError (one line) when it cannot be read, or when its actor does not fit the actor this launch
    builds (a ``--wrapper`` or ``--env-kwargs`` given at the resume that changes the observation or action size):
    the learner's load would fail only after ``config.json`` had been rewritten, so every later resume failed too."""
    from spreeze.algos import make_actor
    from spreeze.config import ConfigError

    path = Path(config.resume) / "checkpoints" / CHECKPOINT_NAME
    try:
        saved = load_checkpoint(path)
        kept = {name: tuple(value.shape) for name, value in saved["algo"]["actor"].items()}
    except Exception as err:  # a torn or foreign file: torch raises many kinds
        raise ConfigError(f"--resume {config.resume}: unreadable checkpoint {path.name} "
                          f"({type(err).__name__}: {str(err).strip()[:200]})") from None
    built = {name: tuple(value.shape)
             for name, value in make_actor(config, env_info.obs_dim, env_info.act_dim).state_dict().items()}
    if kept != built:
        raise ConfigError(f"--resume {config.resume}: the checkpoint's actor does not fit the one this launch builds "
                          f"for {config.env_id} ({env_info.obs_dim} observations, {env_info.act_dim} actions); a "
                          "--wrapper or --env-kwargs given at the resume must not change their sizes")
    return dict(saved.get("counters") or {})
