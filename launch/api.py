"""The Python API, ``spreeze.train(env_id, **overrides) -> Run``, for notebooks and sweeps.

It runs the command line's own path (check, resume, tune, train: :func:`launch.compose.resolve` and
:func:`launch.compose.run`), so a run started from Python is the run ``spreeze train`` would make with the same
settings. A bad setting raises :class:`spreeze.config.ConfigError` (a ValueError) with the command line's one-line
message before any process starts or any file is written."""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    """A finished run: its directory, its test evaluations (one dict per row of ``evaluations.csv``), its
    ``summary.json`` and the exit code the command line would have returned (0, 1 on an error, 130 if stopped)."""
    run_dir: Path
    exit_code: int
    summary: dict
    evaluations: list[dict] = field(default_factory=list)


def train(env_id: str, callbacks=(), **overrides) -> Run:
    """Train on ``env_id``; every keyword is a Config field (the flag's name with ``_``: ``minutes=5``,
    ``algo="td3"``, ``window=False``). Settings left out are chosen as on the command line (autotuned).

    ``callbacks``: objects with any of ``on_evaluation(row)``, ``on_metrics(row)``, ``on_checkpoint(path)``,
    called in this process as the run goes (SB3's callbacks run in the training process too); one that raises
    is logged and training goes on."""
    from launch.compose import SetupError, resolve, run

    from spreeze.config import ConfigError

    config, explicit, sources = make_config(env_id, overrides)
    try:
        resolved = resolve(config, explicit, sources)
    except SetupError as err:
        if err.exit_code == 130:
            raise KeyboardInterrupt(str(err)) from None
        raise ConfigError(str(err)) from None
    result = run(resolved, callbacks=callbacks)
    return Run(Path(result.run_dir), int(result.exit_code), dict(result.summary),
               [dict(row) for row in result.evaluations])


def make_config(env_id: str, overrides: dict) -> tuple[object, set[str], dict]:
    """A validated Config from keyword arguments over ``config_file=`` over the preset (as flags are layered),
    the fields the user gave, and where each value came from; ConfigError (one line) for an unknown name, a
    value of the wrong type, a bad preset or file, or a value ``Config.validate`` refuses."""
    from spreeze.config import Config, ConfigError
    from spreeze.settings import (layered_config, read_config_file, read_preset, resolve_preset_name,
                                  validate_unless_resumed)

    hints = typing.get_type_hints(Config)
    names = [f.name for f in dataclasses.fields(Config)]
    values = {}
    for name, value in {"env_id": env_id, **overrides}.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            raise ConfigError(f"unknown setting {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                             " (the settings are the fields of spreeze.config.Config)"))
        values[name] = _checked(name, value, hints[name])
    file_path = values.get("config_file", "")
    from_file = read_config_file(file_path) if file_path else {}
    if {**from_file, **values}.get("resume") and "preset" in {**from_file, **values}:
        raise ConfigError("resume continues with the run's own settings; give the settings to change instead of "
                          "preset")  # as run.py refuses --resume with --preset
    preset = resolve_preset_name({**from_file, **values}.get("preset", "auto"), env_id)
    algo = {**from_file, **values}.get("algo", Config.algo)
    from_preset = read_preset(preset, algo) if preset != "none" else {}
    config, sources = layered_config(from_preset, preset, from_file, file_path, values, "api")
    validate_unless_resumed(config)
    return config, set(values) | set(from_file), sources


def _checked(name: str, value, kind):
    """``value`` as the field's type, refusing what the command line's parser would refuse (with its message)."""
    from spreeze.config import ConfigError

    from spreeze.values import optional_of

    if optional_of(kind):
        if value is None:
            return None
        kind = optional_of(kind)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, (str, os.PathLike))
        value = os.fspath(value) if ok else value
    elif typing.get_origin(kind) is tuple:  # env_kwargs={"g": 9.81} or ["g=9.81"]; wrapper="mod:fn" or a list
        if isinstance(value, dict):  # each value as a --config file's mapping writes it: read back the same
            from spreeze.settings import _scalar_text

            value = [f"{key}={_scalar_text(item)}" for key, item in value.items()]
        elif isinstance(value, str):
            value = [value]
        ok = isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)
        value = tuple(value) if ok else value
        kind = tuple
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"argument --{name.replace('_', '-')}: invalid {kind.__name__} value: {value!r}")
    return value
