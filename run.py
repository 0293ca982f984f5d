"""Train an agent: ``python run.py --env-id Walker2DBulletEnv-v0`` (``--help`` lists every setting)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from spreeze.config import ConfigError, parse_config

    argv = sys.argv[1:] if argv is None else argv
    argv = ["--env-id" if a == "--env" else (a.replace("--env=", "--env-id=", 1) if a.startswith("--env=") else a)
            for a in argv]
    config = parse_config(argv)
    from spreeze.envs import check_env
    from spreeze.replay import ReplayTooLarge, check_fits_in_memory

    try:
        env_info = check_env(config.env_id)
        n_regions = max(config.samplers, 1) * config.envs_per_sampler
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, n_regions)
    except (ConfigError, ReplayTooLarge) as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2
    from spreeze.supervisor import train

    return train(config, env_info).exit_code


if __name__ == "__main__":
    sys.exit(main())
