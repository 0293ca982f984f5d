"""Parse -> resume -> check -> tune, once, then train: what ``python run.py`` does.

Every flag and the env are checked before anything is written or started (a bad value ends with one line and
exit code 2); then the machine profile sets what was left automatic; then the runner starts the processes."""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path


class SetupError(Exception):
    """A setting or a machine limit found before anything started; the message is one line for the user."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Resolved:
    """What a run starts from: the one resolved config, the env's facts and the autotuner's record."""
    config: object
    env_info: object
    profile: dict


def resolve(config, explicit: set[str]) -> Resolved:
    """Resume, check, make the run directory, tune, check again; raises :class:`SetupError`.

    ``explicit``: the fields the user set, which neither a resumed run's values nor the tuner override."""
    from spreeze.checkpoint import resume_config
    from spreeze.config import ConfigError
    from spreeze.defaults import resolve_devices
    from spreeze.envs import check_env
    from spreeze.replay import ReplayTooLarge, check_fits_in_memory
    from spreeze.runners import make_run_dir

    from autotune import tune

    try:
        if config.resume:
            config = resume_config(config, explicit)
            config.validate()
        env_info = check_env(config.env_id)
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, max(config.total_envs, 1),
                             active_regions=config.active_envs or None)
        resolve_devices(config)  # a cuda:N this machine lacks is a bad value, whether or not the profile runs
    except (ConfigError, ReplayTooLarge, ValueError) as err:
        raise SetupError(str(err)) from None
    try:
        run_dir = make_run_dir(config)
    except OSError as err:
        raise SetupError(f"cannot create the run directory: {err}") from None
    config = replace(config, run_dir=str(run_dir))
    try:
        config, profile = tune(config, env_info, explicit | ({"samplers", "batch_size"} if config.resume else set()),
                               reprofile=config.reprofile, cache_dir=config.cache_dir or None)
        threads = profile.get("chosen", {}).get("learner_threads", {}).get("value")
        if not config.learner_threads and threads:
            config = replace(config, learner_threads=int(threads))
        config.validate()
        # now that the sampler count is known: the spares' regions come on top of --buffer-size
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, config.total_envs,
                             active_regions=config.active_envs)
    except KeyboardInterrupt:
        _remove_if_empty(run_dir)
        raise SetupError("interrupted while profiling; nothing was started", exit_code=130) from None
    except (ConfigError, ReplayTooLarge, ValueError) as err:
        _remove_if_empty(run_dir)
        raise SetupError(str(err)) from None
    return Resolved(config, env_info, profile)


def train(config, env_info, log=None, profile: dict | None = None):
    """Train with the observers the config asks for (window or curve.png, --render, governor)."""
    from spreeze import runners

    from launch.observers import build_observers

    kwargs = {} if log is None else {"log": log}
    return runners.train(config, env_info, profile=profile, observers=build_observers(config), **kwargs)


def run(resolved: Resolved, log=None):
    """Train from a resolved setup; the noise scale the run measured goes back into the machine's profile."""
    from autotune import remember_noise_scale

    result = train(resolved.config, resolved.env_info, log=log, profile=resolved.profile)
    problem = remember_noise_scale(resolved.profile, result.summary.get("critic_noise_scale"))
    if problem:
        print(f"[spreeze] warning: {problem}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None, prog: str = "run.py") -> int:
    from spreeze.config import explicit_flags, parse_config

    # started in the background by a shell, SIGINT may be inherited as ignored; kill -INT must still stop us
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else argv
    config = parse_config(argv, prog=prog)
    try:
        resolved = resolve(config, explicit_flags(argv))
    except SetupError as err:
        if err.exit_code == 130:
            print(f"[spreeze] {err}", file=sys.stderr)
        else:
            print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    return run(resolved).exit_code


def _remove_if_empty(run_dir: Path) -> None:
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
