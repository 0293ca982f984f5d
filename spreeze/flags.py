"""The command line generated from :class:`~spreeze.config.Config`: one flag per field, its help text the
docstring under the field (read from the source, so a flag, its default and its help cannot drift apart), filed
in a ``--help`` section by :data:`FIELD_GROUPS`."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing

from spreeze.config import Config
from spreeze.values import FIELD_CHOICES, flag_name, optional_of

FLAG_ALIASES = {"env_id": "--env",  # the short form the README and users type: run.py --env Walker2DBulletEnv-v0
                "config_file": "--config"}
LIST_METAVARS = {"env_kwargs": "KEY=VALUE", "wrapper": "MODULE:CALLABLE"}

# --help's sections, in this order: (key, title, one line on what the section is for)
HELP_GROUPS = [
    ("env", "environment", None),
    ("settings", "presets and settings files", "flags win over --config, which wins over the preset, over the defaults"),
    ("budget", "budget", "the first limit reached ends the run; with none it trains until Ctrl-C or SIGTERM"),
    ("algorithm", "algorithm", "the learning rule, its networks and its rates"),
    ("replay", "replay, batch and ratios", "what the learner trains on and how much data each update gets"),
    ("parallelism", "parallelism", "processes, threads and how experience moves between them"),
    ("devices", "devices", "where the networks live and in which precision"),
    ("logging", "logging, evaluation and output", "tests, progress lines, the window and the run directory"),
    ("faults", "faults, checkpoints and resuming", None),
    ("reproducibility", "reproducibility", "seeds and the lock-step --deterministic mode"),
    ("autotune", "autotune", "the cached profile of this machine"),
]

# The section of every Config field in --help; a field missing here is listed under "other" and fails
# tests/test_config.py, so a new setting is filed where users look for it
FIELD_GROUPS = {
    "env_id": "env", "env_kwargs": "env", "wrapper": "env",
    "preset": "settings", "config_file": "settings",
    "total_steps": "budget", "minutes": "budget", "target_return": "budget",
    "algo": "algorithm", "gamma": "algorithm", "tau": "algorithm", "n_step": "algorithm",
    "actor_lr": "algorithm", "critic_lr": "algorithm", "alpha_lr": "algorithm", "initial_alpha": "algorithm",
    "hidden_size": "algorithm", "narrow_hidden_size": "algorithm", "critic_hidden_size": "algorithm", "critic_atoms": "algorithm", "critic_layer_norm": "algorithm",
    "lr_schedule": "algorithm", "q_range": "algorithm", "normalize_obs": "algorithm", "hidden_layers": "algorithm",
    "policy_delay": "algorithm", "learner_overlap": "algorithm", "target_noise": "algorithm", "target_noise_clip": "algorithm",
    "noise_min": "algorithm", "noise_max": "algorithm",
    "buffer_size": "replay", "learning_starts": "replay", "batch_size": "replay", "batch_rule": "replay",
    "noise_scale_interval": "replay", "collect_per_update": "replay", "replay_ratio": "replay",
    "samplers": "parallelism", "envs_per_sampler": "parallelism", "spare_samplers": "parallelism",
    "cpu_target_percent": "parallelism", "learner_threads": "parallelism", "write_block": "parallelism",
    "experience_transport": "parallelism", "queue_size": "parallelism", "publish_interval_s": "parallelism",
    "serial": "parallelism", "ray": "parallelism", "remote_samplers": "parallelism", "remote_only": "parallelism",
    "remote_inflight": "parallelism",
    "actor_device": "devices", "critic_device": "devices", "bf16": "devices", "replay_mirror": "devices",
    "cuda_graphs": "devices",
    "eval_interval_s": "logging", "eval_episodes": "logging", "log_interval_s": "logging", "window": "logging",
    "tensorboard": "logging", "wandb": "logging",
    "render": "logging", "run_dir": "logging",
    "checkpoint_interval_s": "faults", "max_restarts_per_minute": "faults", "resume": "faults",
    "save_replay": "faults",
    "seed": "reproducibility", "deterministic": "reproducibility", "num_envs": "reproducibility",
    "steps_per_round": "reproducibility", "eval_every_steps": "reproducibility",
    "reprofile": "autotune", "cache_dir": "autotune",
}

# shown instead of STR where the value is open-ended but has a known shape
FIELD_METAVARS = {"actor_device": "{auto,cpu,cuda:N}", "critic_device": "{auto,cpu,cuda:N}", "env_id": "ENV_ID",
                  "resume": "RUN_DIR", "run_dir": "DIR", "cache_dir": "DIR",
                  "preset": "{auto,none,NAME}", "ray": "ADDRESS", "config_file": "FILE.yaml"}


def field_docs(cls: type = Config) -> dict[str, str]:
    """Map each field to the docstring written under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


class _ExtendTuple(argparse.Action):
    """Collect the items of a list flag (given once or repeated) into the tuple a frozen Config holds."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(getattr(namespace, self.dest, None) or ()) + tuple(values))


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "run.py") -> OneLineParser:
    """Every Config field as a flag, in its --help section (FIELD_GROUPS), with its choices where it has any."""
    # allow_abbrev=False: `--min 30` must not pass for `--minutes 30` (a resumed run would keep its budget)
    # the usage line names the one flag most runs need: the ~50 others are listed below by section
    parser = OneLineParser(prog=prog, usage="%(prog)s [--env ENV_ID] [options]",
                           description="spreeze: high-throughput SAC/TD3/CrossQ on one machine",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    groups = {key: parser.add_argument_group(title, description) for key, title, description in HELP_GROUPS}
    other = None
    docs = field_docs()
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        group = groups.get(FIELD_GROUPS.get(f.name))
        if group is None:
            other = other or parser.add_argument_group("other")
            group = other
        kind = hints[f.name]
        optional = optional_of(kind)
        kind = optional or kind  # Optional[X]: a flag of type X, unset = None
        flags = [f"--{flag_name(f.name)}", *([FLAG_ALIASES[f.name]] if f.name in FLAG_ALIASES else [])]
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse %-formats help strings
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        elif typing.get_origin(kind) is tuple:  # `--env-kwargs a=1 b=2`, or the flag repeated
            group.add_argument(*flags, dest=f.name, nargs="+", action=_ExtendTuple, default=f.default,
                               help=help_text, metavar=LIST_METAVARS.get(f.name, "ITEM"))
        elif f.name in FIELD_CHOICES:  # argparse shows {a,b,c} and refuses anything else in one line
            group.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help_text,
                               choices=FIELD_CHOICES[f.name])
        else:
            group.add_argument(*flags, dest=f.name, type=_or_none(kind) if optional else kind, default=f.default,
                               help=help_text, metavar=FIELD_METAVARS.get(f.name, kind.__name__.upper()))
    return parser


def _or_none(kind):
    """An Optional[X] flag's type: X, or ``none`` to unset it (a resumed run's saved value included)."""
    def parse(text: str):
        return None if text.strip().lower() == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def suppressed_parser() -> OneLineParser:
    """:func:`build_parser` with every default suppressed: its namespace holds exactly the fields some flag set."""
    parser = build_parser()
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    return parser


def explicit_flags(argv: list[str] | None = None) -> set[str]:
    """Names of the fields the user set on the command line (so autotuned values never override them).

    Asked of the parser itself: every default is suppressed, so the namespace holds exactly the fields
    that some flag set, whatever its spelling (alias, ``--no-`` form, ``--flag=value``)."""
    argv = sys.argv[1:] if argv is None else argv
    namespace, _ = suppressed_parser().parse_known_args(argv)
    return set(vars(namespace))
