"""The text values of settings, below the config: the one error type for a bad setting, the choices a text
setting may take, flag names, and the --env-kwargs values read as YAML scalars."""
from __future__ import annotations

import re
import types
import typing

import yaml


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line meant for the user."""


# The values a text setting may take: the parser shows them ({sac,td3,crossq}) and refuses others, and
# Config.validate checks the same table, so a value the API or a saved config.json brings is held to it too
FIELD_CHOICES = {
    "algo": ("sac", "td3", "crossq"),
    "batch_rule": ("noise", "knee"),
    "experience_transport": ("shm", "queue"),
    "replay_mirror": ("auto", "on", "off"),
    "lr_schedule": ("constant", "linear"),
}


def optional_of(kind):
    """X for a field typed ``Optional[X]`` (None: unset), else None: the flags, a config file and the API all
    read a set value of such a field as an X."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return None


def flag_name(name: str) -> str:
    """``batch_size`` -> ``batch-size``: a field's flag without its dashes."""
    return name.replace("_", "-")


def one_of(choices) -> str:
    """``a, b or c``: the choices as the one-line errors name them."""
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]


# --- --env-kwargs ---------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def yaml_scalar(text: str):
    """One --env-kwargs value as YAML reads it (9.81, 3, true, null, text, 'quoted'), except that ``1e-5`` is a
    number here as in YAML 1.2 (PyYAML follows YAML 1.1, where it is text)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--env-kwargs: cannot read value {text!r} ({getattr(err, 'problem', None) or err})") from None
    if isinstance(value, (dict, list)):
        raise ConfigError(f"--env-kwargs: value {text!r} must be a single value (number, true/false or text)")
    if isinstance(value, str) and value == text and _NUMBER.fullmatch(text):
        return float(text)
    return value


def parse_env_kwargs(items: typing.Iterable[str]) -> dict:
    """``("g=9.81", "render_mode=rgb_array")`` -> ``{"g": 9.81, ...}``; ConfigError (one line) on a bad pair."""
    kwargs = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier() or not text:
            raise ConfigError(f"--env-kwargs takes key=value pairs (say g=9.81), not {item!r}")
        if key in kwargs:
            raise ConfigError(f"--env-kwargs gives {key!r} twice")
        kwargs[key] = yaml_scalar(text)
    return kwargs
