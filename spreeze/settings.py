"""Where each setting comes from: the layers defaults < preset < ``--config`` file < flags (or the API's keywords),
the presets shipped in ``spreeze/presets/``, and the record of every value's source that ``config.json`` keeps."""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib.resources
import json
import math
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from spreeze.config import Config
from spreeze.values import FIELD_CHOICES, ConfigError, flag_name, optional_of, yaml_scalar
from spreeze.flags import FLAG_ALIASES, build_parser, explicit_flags, suppressed_parser


@dataclass(frozen=True)
class Parsed:
    """A command line resolved against the --config file and the preset.

    ``sources``: for every field, where its value came from (``default``, ``preset:<name>``, ``config:<path>``,
    ``flag``); :func:`config_record` writes it into ``config.json``. ``explicit``: the fields the user gave, by
    flag or in the --config file, which a resumed run's saved values and the autotuner never override. A
    preset's values are not in it: they are defaults for an env family, so ``--resume`` keeps what the run was
    made with (the preset may have changed since), and the tuner only ever fills settings left at 0, which the
    presets leave to it (the sampler count and the batch depend on the machine)."""
    config: Config
    sources: dict
    explicit: frozenset


def parse(argv: list[str] | None = None, prog: str = "run.py") -> Parsed:
    """Flags over the --config file over the preset over the defaults, validated (a ``--resume``'s once its run's
    settings are merged in: :func:`validate_unless_resumed`); a bad value, preset or file exits with one line
    and code 2 before anything is written."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(prog)
    namespace = parser.parse_args(argv)
    flagged = explicit_flags(argv)
    try:
        from_file = read_config_file(namespace.config_file) if namespace.config_file else {}
        layered = {f.name: f.default for f in dataclasses.fields(Config)}
        layered.update(from_file)
        layered.update({name: getattr(namespace, name) for name in flagged})
        if layered["resume"] and "preset" in flagged | set(from_file):
            raise ConfigError("--resume continues with the run's own settings; give the settings to change as "
                              "flags instead of --preset")
        name = resolve_preset_name(layered["preset"], layered["env_id"])
        from_preset = read_preset(name, layered["algo"]) if name != "none" else {}
    except ConfigError as err:
        parser.error(str(err))
    given = {n: getattr(namespace, n) for n in flagged}
    config, sources = layered_config(from_preset, name, from_file, namespace.config_file, given, "flag")
    try:
        validate_unless_resumed(config)
    except ConfigError as err:
        parser.error(str(err))
    return Parsed(config, sources, frozenset(flagged | set(from_file)))


def validate_unless_resumed(config) -> None:
    """Validate a new run's settings now; a resumed run's once its saved settings are under the flags
    (``launch.compose.resolve``): checked against the defaults, a Pendulum run resumed with ``--buffer-size
    5000`` was refused for the default env's warm-up of 10,000 steps."""
    if not config.resume:
        config.validate()


def layered_config(from_preset: dict, preset_name: str, from_file: dict, file_path: str, given: dict,
                   given_label: str) -> tuple[Config, dict]:
    """The Config of the layers defaults < preset < --config file < ``given`` (flags, or the API's keywords),
    unvalidated, and where each value came from."""
    sources = {f.name: "default" for f in dataclasses.fields(Config)}
    values = {f.name: f.default for f in dataclasses.fields(Config)}
    for layer, label in ((from_preset, f"preset:{preset_name}"), (from_file, f"config:{file_path}"),
                         (given, given_label)):
        values.update(layer)
        sources.update(dict.fromkeys(layer, label))
    values["preset"] = preset_name  # the one in force, auto resolved, so config.json names it
    return Config(**values), sources


def parse_config(argv: list[str] | None = None, prog: str = "run.py") -> Config:
    """Parse flags (over --config and the preset) into a Config, validated as :func:`parse` says; a bad value
    exits with one line and code 2."""
    return parse(argv, prog).config


# --- settings files: a user's --config and the presets shipped in spreeze/presets/ ---------------------------

# a preset is per env family; the algorithm is the user's choice, which selects a preset's algo-settings
PRESET_ONLY_FOR_RUN = ("env_id", "preset", "config_file", "resume", "run_dir", "algo")
PRESET_KEYS = {"envs", "extends", "settings", "algo-settings"}


def read_config_file(path: str) -> dict:
    """The settings of a user's YAML file, converted like flags; ConfigError (one line) on a bad file or key."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    return settings_from_mapping(_yaml_mapping(text, f"--config {path}"), f"--config {path}",
                                 forbidden=("config_file",))


def preset_names() -> list[str]:
    return sorted(entry.name[:-len(".yaml")] for entry in _preset_dir().iterdir() if entry.name.endswith(".yaml"))


def preset_patterns(name: str) -> list[str]:
    """The env-id patterns (fnmatch) a preset is for."""
    envs = _preset_yaml(name).get("envs")
    if not isinstance(envs, list) or not all(isinstance(p, str) for p in envs):
        raise ConfigError(f"preset {name}: 'envs' must be a list of env-id patterns")
    return envs


def read_preset(name: str, algo: str = Config.algo, _seen: tuple[str, ...] = ()) -> dict:
    """A preset's settings for ``algo``, converted and checked exactly as a --config file's; ``extends: OTHER``
    starts from another preset's settings (so a family's variant lists only what differs, with its own evidence).

    ``settings`` hold for every algorithm; ``algo-settings: {sac: {...}}`` only for the one they were measured
    with (an update rule's values, such as a policy delay, mean something else for another algorithm, whose own
    defaults then stay)."""
    if name in _seen:
        raise ConfigError(f"preset {name}: 'extends' goes round in a circle ({' -> '.join(_seen + (name,))})")
    data = _preset_yaml(name)
    unknown = sorted(map(str, set(data) - PRESET_KEYS))
    if unknown:  # a typo (``extend:``, ``algo_settings:``) would silently drop what it was meant to bring
        raise ConfigError(f"preset {name}: unknown key(s) {', '.join(unknown)} (a preset has "
                          f"{', '.join(sorted(PRESET_KEYS))})")
    settings = data.get("settings") or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"preset {name}: 'settings' must be a mapping of flag names to values")
    per_algo = data.get("algo-settings") or {}
    if not isinstance(per_algo, dict) or not all(isinstance(v, dict) for v in per_algo.values()):
        raise ConfigError(f"preset {name}: 'algo-settings' must map algorithm names to mappings of settings")
    unknown = sorted(set(per_algo) - set(FIELD_CHOICES["algo"]))
    if unknown:
        raise ConfigError(f"preset {name}: 'algo-settings' names no algorithm: {', '.join(map(str, unknown))}")
    base = data.get("extends")
    if base is not None and base not in preset_names():
        raise ConfigError(f"preset {name}: 'extends: {base}' names no preset (have: {', '.join(preset_names())})")
    inherited = read_preset(base, algo, _seen + (name,)) if base is not None else {}
    origin = f"preset {name}"
    return (inherited | settings_from_mapping(settings, origin, forbidden=PRESET_ONLY_FOR_RUN)
            | settings_from_mapping(per_algo.get(algo) or {}, f"{origin} for {algo}", forbidden=PRESET_ONLY_FOR_RUN))


def resolve_preset_name(requested: str, env_id: str) -> str:
    """``auto``: the preset whose patterns match ``env_id`` (its bare id for ``module:EnvId``), else ``none``."""
    names = preset_names()
    if requested == "auto":
        bare = env_id.rpartition(":")[2]
        for name in names:
            if any(fnmatch.fnmatchcase(bare, pattern) for pattern in preset_patterns(name)):
                return name
        return "none"
    if requested == "none" or requested in names:
        return requested
    close = difflib.get_close_matches(requested, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(f"--preset must be auto, none or one of {', '.join(names)}; not {requested!r}{hint}")


def _preset_dir():
    return importlib.resources.files("spreeze") / "presets"


def _preset_yaml(name: str) -> dict:
    return _yaml_mapping((_preset_dir() / f"{name}.yaml").read_text(), f"preset {name}")


class _Loader(yaml.SafeLoader):
    """YAML 1.1, which PyYAML follows, reads an exponent without a dot (``1e-5``) as text; the command line (and
    YAML 1.2) as a number. Settings files read it as the flag would."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def _yaml_mapping(text: str, origin: str) -> dict:
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{origin}: malformed YAML{where}: {getattr(err, 'problem', None) or err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: must be a mapping of settings (key: value), not a {type(data).__name__}")
    return data


def settings_from_mapping(mapping: dict, origin: str, forbidden: typing.Iterable[str] = ()) -> dict:
    """Field values from ``{flag or field name: YAML value}``, converted by the command line's own parser (so
    a file's ``actor-lr: 1e-4``, which YAML reads as text, becomes the float the flag would give)."""
    names = {f.name for f in dataclasses.fields(Config)}
    aliases = {flag.lstrip("-").replace("-", "_"): name for name, flag in FLAG_ALIASES.items()}
    hints = typing.get_type_hints(Config)
    direct, tokens = {}, []
    for key, value in mapping.items():
        spelled = str(key).replace("-", "_")
        name = aliases.get(spelled, spelled)
        if name not in names:
            known = sorted({flag_name(n) for n in names} | {a.replace("_", "-") for a in aliases})
            close = difflib.get_close_matches(str(key).replace("_", "-"), known, n=1)
            raise ConfigError(f"{origin}: unknown key {key!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        if name in forbidden:
            raise ConfigError(f"{origin}: {key!r} cannot be set here")
        kind, flag = hints[name], f"--{flag_name(name)}"
        if value is not None:
            kind = optional_of(kind) or kind  # Optional[X] set: an X
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{origin}: {key} must be true or false, not {value!r}")
            tokens.append(flag if value else f"--no-{flag_name(name)}")
        elif typing.get_origin(kind) is tuple:
            items = _list_items(name, value, origin)
            if items:
                tokens += [f"{flag}={item}" for item in items]
            else:
                direct[name] = ()
        elif value is None and type(None) in typing.get_args(kind):
            direct[name] = None
        elif isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{origin}: {key} must be a single value, not {value!r}")
        else:
            if isinstance(value, bool) and {"on", "off"} <= set(FIELD_CHOICES.get(name, ())):
                value = "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as true/false
            tokens.append(f"{flag}={value}")
    parser = suppressed_parser()

    def fail(message: str) -> typing.NoReturn:
        raise ConfigError(f"{origin}: {message}")

    parser.error = fail
    return {**vars(parser.parse_args(tokens)), **direct}


def _list_items(name: str, value, origin: str) -> list[str]:
    if name == "env_kwargs" and isinstance(value, dict):  # env-kwargs: {g: 9.81}
        return [f"{k}={_scalar_text(v)}" for k, v in value.items()]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ConfigError(f"{origin}: {flag_name(name)} must be a list of strings" +
                      (" or a mapping" if name == "env_kwargs" else "") + f", not {value!r}")


def _scalar_text(value) -> str:
    """The --env-kwargs text that :func:`yaml_scalar` reads back as ``value`` (a --config file's mapping)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, str):
        try:
            same = yaml_scalar(value) == value
        except ConfigError:
            same = False
        return value if same else json.dumps(value)  # a double-quoted YAML string
    return json.dumps(value)  # true, false, null, numbers


# --- provenance -------------------------------------------------------------------------------------------------

def mark_changed(sources: dict, before: Config, after: Config, label: str) -> dict:
    """``sources`` with ``label`` for every field whose value differs between two configs."""
    changed = {f.name for f in dataclasses.fields(Config) if getattr(before, f.name) != getattr(after, f.name)}
    return {**sources, **dict.fromkeys(changed, label)}


def config_record(config: Config, sources: dict | None = None) -> dict:
    """What ``config.json`` holds: every field's value, and under ``sources`` where each came from (a field
    with no record is a default). Resume reads the fields back, and ``sources`` only to tell what the resumed
    run's machine chose (CUDA graphs, the learner's threads) from what its user gave."""
    record = config.to_dict()
    record["sources"] = {name: (sources or {}).get(name, "default") for name in record}
    return record
