"""The per-user profile cache: one JSON file per (hardware fingerprint, env id, learner shape).

Only *measurements* are cached; the choices are recomputed from them at every launch (cheap and pure),
so a changed ``--buffer-size``, ``--collect-per-update`` or a value given by hand is honoured without
re-profiling. The file name carries the env id, the algorithm and two digests: the hardware (CPU model,
usable cores, memory, GPUs, torch build) and what else the measurement depends on (network shape, bf16,
envs per sampler, devices, learner threads, the replay mirror, the env's keyword arguments and wrappers, a
sweep cut short by a small replay). A missing, unreadable, corrupt or foreign file
is never fatal: :func:`load` returns why it could not be used, and the caller profiles again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path

from spreeze.files import atomic_write

SCHEMA = 1
ENV_VAR = "SPREEZE_CACHE_DIR"


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit`` (``--cache-dir``), else ``$SPREEZE_CACHE_DIR``, else the platform's per-user cache folder
    (platformdirs: ``$XDG_CACHE_HOME/spreeze`` or ``~/.cache/spreeze`` on Linux, ``~/Library/Caches/spreeze``
    on macOS, ``%LOCALAPPDATA%\\spreeze\\Cache`` on Windows)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # an environment set up before platformdirs was a requirement: the Linux convention
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "spreeze"
    return Path(user_cache_dir("spreeze", appauthor=False))


def hardware_fingerprint(inventory: dict, torch_version: str, cuda_version: str | None) -> dict:
    """What makes two machines measure the same; deliberately not the free memory or the current load."""
    return {"cpu_model": inventory["cpu_model"], "logical": int(inventory["logical"]),
            "physical": int(inventory["physical"]),
            "memory_total_gib": round(inventory["memory_total"] / 2**30),
            "gpus": [[g["name"], round(g["memory_total"] / 2**20)] for g in inventory["gpus"]],
            "platform": inventory.get("platform", ""), "torch": torch_version, "cuda": cuda_version}


def workload_key(config, env_info, devices: tuple[str, str], learner_threads: int,
                 sweep_cap: int | None = None) -> dict:
    """What else the measurements depend on. ``sweep_cap``: the largest batch the sweep may try when something
    (a small --buffer-size) holds it under the probe's own limit: such a sweep must not be reused by a run that
    may take larger batches, so it gets a file of its own."""
    return {"env_id": env_info.env_id, "obs_dim": int(env_info.obs_dim), "act_dim": int(env_info.act_dim),
            "algo": config.algo, "hidden_size": int(config.hidden_size), "hidden_layers": int(config.hidden_layers),
            "envs_per_sampler": int(config.envs_per_sampler), "bf16": getattr(config, "bf16", None),
            "devices": list(devices),
            "learner_threads": int(learner_threads),
            # the env as the samplers step it: keyword arguments and wrappers change its step time (only when set)
            **({"env_kwargs": _kwargs_in_force(config.env_kwargs)} if getattr(config, "env_kwargs", ()) else {}),
            **({"wrapper": list(config.wrapper)} if getattr(config, "wrapper", ()) else {}),
            **({"sweep_cap": int(sweep_cap)} if sweep_cap else {}),
            # the probe draws batches from the GPU replay mirror when the run will (spreeze/mirror.py); the key
            # only has the entry then, so CPU profiles keep their files
            **({"replay_mirror": True} if config.mirror_wanted(devices[1]) else {}),
            # critics that cost more per update than the plain ones, an update split over two threads, an actor
            # updated less often, or updates replayed as CUDA graphs (the probe times the run's own update); only
            # when set, so profiles of plain updates keep their files
            **{name: value for name in ("critic_atoms", "critic_hidden_size", "critic_layer_norm", "learner_overlap",
                                        "policy_delay", "cuda_graphs", "normalize_obs", "narrow_hidden_size")
               if (value := _as_timed(config, name))}}


def _kwargs_in_force(env_kwargs) -> list[str]:
    """``KEY=VALUE`` strings as the env gets them, whatever their order: sorted, the last value of a key kept."""
    last = {}
    for item in env_kwargs:
        key, _, value = str(item).partition("=")
        last[key] = value
    return [f"{key}={value}" for key, value in sorted(last.items())]


def _as_timed(config, name: str):
    """A setting's value as the probe's update sees it, 0 where it is its default's: TD3's --policy-delay 2 is the
    delay TD3 takes for 0, a --critic-hidden-size equal to --hidden-size is the width 0 gives (a second profile
    for the same update was measured for nothing)."""
    value = getattr(config, name, 0)
    if name == "policy_delay" and value and hasattr(config, "effective_policy_delay"):
        import dataclasses

        return 0 if value == dataclasses.replace(config, policy_delay=0).effective_policy_delay else value
    if name == "critic_hidden_size" and value == getattr(config, "hidden_size", None):
        return 0
    return value


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def profile_path(directory: Path, hardware: dict, workload: dict) -> Path:
    env = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload["env_id"])
    return Path(directory) / f"{env}-{workload['algo']}-{_digest(hardware)}-{_digest(workload)}.json"


def _number(value, positive: bool = True) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > 0 if positive else value >= 0)


def validate_measurements(m) -> None:
    """Raise ValueError naming the first field that is missing or wrong (what a reused profile must hold)."""
    if not isinstance(m, dict):
        raise ValueError("measurements are not an object")
    for part in ("cpu", "sampler", "learner"):
        if not isinstance(m.get(part), dict):
            raise ValueError(f"'{part}' is missing")
    cpu, sampler, learner = m["cpu"], m["sampler"], m["learner"]
    for name in ("logical", "physical"):
        if not (isinstance(cpu.get(name), int) and cpu[name] > 0):
            raise ValueError(f"cpu.{name} must be a positive integer")
    if not _number(cpu.get("background_cores", 0.0), positive=False):
        raise ValueError("cpu.background_cores must be a number >= 0")
    for name in ("env_step_s", "rss_bytes"):
        if not _number(sampler.get(name)):
            raise ValueError(f"sampler.{name} must be a positive number")
    if not isinstance(learner.get("on_gpu"), bool):
        raise ValueError("learner.on_gpu must be true or false")
    sweep = learner.get("sweep")
    if not isinstance(sweep, list) or not sweep:
        raise ValueError("learner.sweep must be a non-empty list")
    for point in sweep:
        if not isinstance(point, dict) or not isinstance(point.get("batch"), int) or point["batch"] <= 0:
            raise ValueError("learner.sweep has a point without a positive integer batch")
        if not _number(point.get("updates_per_s")):
            raise ValueError("learner.sweep has a point without positive updates_per_s")
        util = point.get("gpu_util")
        if util is not None and not _number(util, positive=False):
            raise ValueError("learner.sweep has a point with a bad gpu_util")


def load(path: Path, hardware: dict, workload: dict) -> tuple[dict | None, str | None]:
    """``(record, None)`` for a usable profile; ``(None, None)`` when there is none yet; ``(None, why)`` else."""
    path = Path(path)
    if not path.exists():
        return None, None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return None, f"cannot read the saved profile {path} ({type(err).__name__}: {err})"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"the saved profile {path} is corrupt ({err})"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        return None, f"the saved profile {path} has schema {found!r}, expected {SCHEMA}"
    if record.get("hardware") != hardware or record.get("workload") != workload:
        return None, f"the saved profile {path} was made for other hardware or settings"
    try:
        validate_measurements(record.get("measurements"))
    except ValueError as err:
        return None, f"the saved profile {path} is incomplete ({err})"
    return record, None


def save(path: Path, hardware: dict, workload: dict, measurements: dict,
         created: tuple[str, float] | None = None) -> str | None:
    """Write atomically (temp file + rename); returns why it failed, or None. ``created``: when the machine was
    measured, if not now (a run adding its noise scale does not make the profile newer than its measurements)."""
    path = Path(path)
    created = created or (time.strftime("%Y-%m-%d %H:%M:%S"), time.time())
    record = {"schema": SCHEMA, "created": created[0], "created_unix": created[1],
              "hardware": hardware, "workload": workload, "measurements": measurements}
    try:
        text = json.dumps(record, indent=1)
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
        return None
    except (OSError, TypeError, ValueError) as err:
        return f"could not save the profile to {path} ({type(err).__name__}: {err})"


def update_learner(path: Path, values: dict) -> str | None:
    """Add ``values`` to a saved profile's learner measurements (atomically); returns why it failed, or None."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        record["measurements"]["learner"].update(values)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"could not update the profile {path} ({type(err).__name__}: {err})"
    created = (record["created"], record["created_unix"]) if {"created", "created_unix"} <= set(record) else None
    return save(path, record["hardware"], record["workload"], record["measurements"], created)


NOISE_SCALE_FIELDS = ("noise_scale", "noise_scale_at", "noise_scale_settings")


def kept_noise_scale(path: Path, hardware: dict, workload: dict) -> dict:
    """The noise scale a run left in the profile at ``path`` (of this hardware and workload, any schema), to keep
    when the machine is measured again: it describes the env under its learning settings, not the machine.
    ``{}`` when there is none, or the file cannot be read."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        learner = record["measurements"]["learner"]
        same = record.get("hardware") == hardware and record.get("workload") == workload
        value = float(learner["noise_scale"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    if not same or not (math.isfinite(value) and value >= 0):
        return {}
    return {name: learner.get(name) for name in NOISE_SCALE_FIELDS}
