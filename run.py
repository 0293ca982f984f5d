"""Train an agent: ``python run.py --env Walker2DBulletEnv-v0`` (``--help`` lists every setting).

Order matters: every flag and the env are checked before anything is written or started (a bad value
ends with one line and exit code 2); then the machine profile sets what was left automatic; then the
supervisor starts the processes.
"""
from __future__ import annotations

import sys
from dataclasses import replace


def main(argv: list[str] | None = None) -> int:
    import signal

    from spreeze.config import ConfigError, explicit_flags, parse_config

    # started in the background by a shell, SIGINT may be inherited as ignored; kill -INT must still stop us
    signal.signal(signal.SIGINT, signal.default_int_handler)

    argv = sys.argv[1:] if argv is None else argv
    config = parse_config(argv)
    explicit = explicit_flags(argv)
    from spreeze.checkpoint import resume_config
    from spreeze.envs import check_env
    from spreeze.learner import resolve_devices
    from spreeze.replay import ReplayTooLarge, check_fits_in_memory

    try:
        if config.resume:
            config = resume_config(config, explicit)
            config.validate()
        env_info = check_env(config.env_id)
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, max(config.total_envs, 1),
                             active_regions=config.active_envs or None)
        resolve_devices(config)  # a cuda:N this machine lacks is a bad value, whether or not the profile runs
    except (ConfigError, ReplayTooLarge, ValueError) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2

    from spreeze.supervisor import make_run_dir

    try:
        run_dir = make_run_dir(config)
    except OSError as err:
        print(f"run.py: error: cannot create the run directory: {err}", file=sys.stderr)
        return 2
    config = replace(config, run_dir=str(run_dir))

    from autotune import tune

    try:
        config, profile = tune(config, env_info, explicit | ({"samplers", "batch_size"} if config.resume else set()),
                               reprofile=config.reprofile, cache_dir=config.cache_dir or None)
    except (ReplayTooLarge, ValueError) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[spreeze] interrupted while profiling; nothing was started", file=sys.stderr)
        if not any(run_dir.iterdir()):
            run_dir.rmdir()
        return 130
    threads = profile.get("chosen", {}).get("learner_threads", {}).get("value")
    if not config.learner_threads and threads:
        config = replace(config, learner_threads=int(threads))
    try:
        config.validate()
        # now that the sampler count is known: the spares' regions come on top of --buffer-size
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, config.total_envs,
                             active_regions=config.active_envs)
    except (ConfigError, ReplayTooLarge) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        if not any(run_dir.iterdir()):
            run_dir.rmdir()
        return 2

    from spreeze.supervisor import train

    from autotune import remember_noise_scale

    result = train(config, env_info, profile=profile)
    problem = remember_noise_scale(profile, result.summary.get("critic_noise_scale"))
    if problem:
        print(f"[spreeze] warning: {problem}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
