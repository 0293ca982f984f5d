"""Train an agent: ``python run.py --env Walker2DBulletEnv-v0`` (``--help`` lists every setting).

Order matters: every flag and the env are checked before anything is written or started (a bad value
ends with one line and exit code 2); then the machine profile sets what was left automatic; then the
supervisor starts the processes.
"""
from __future__ import annotations

import sys
from dataclasses import replace


def _env_alias(argv: list[str]) -> list[str]:
    """``--env`` is the documented short form of ``--env-id``."""
    out = []
    for arg in argv:
        if arg == "--env":
            arg = "--env-id"
        elif arg.startswith("--env="):
            arg = "--env-id=" + arg.split("=", 1)[1]
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    from spreeze.config import ConfigError, explicit_flags, parse_config

    argv = _env_alias(sys.argv[1:] if argv is None else argv)
    config = parse_config(argv)
    from spreeze.envs import check_env
    from spreeze.replay import ReplayTooLarge, check_fits_in_memory

    try:
        env_info = check_env(config.env_id)
        n_regions = max(config.sampler_processes, 1) * config.envs_per_sampler
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, n_regions)
    except (ConfigError, ReplayTooLarge) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2

    from autotune import tune

    try:
        config, profile = tune(config, env_info, explicit_flags(argv), reprofile=config.reprofile,
                               cache_dir=config.cache_dir or None)
    except (ReplayTooLarge, ValueError) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[spreeze] interrupted while profiling; nothing was started", file=sys.stderr)
        return 130
    threads = profile.get("chosen", {}).get("learner_threads", {}).get("value")
    if not config.learner_threads and threads:
        config = replace(config, learner_threads=int(threads))
    try:
        config.validate()
    except ConfigError as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2

    from spreeze.supervisor import train

    return train(config, env_info, profile=profile).exit_code


if __name__ == "__main__":
    sys.exit(main())
