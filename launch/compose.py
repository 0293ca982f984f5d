"""Parse -> resume -> check -> tune, once, then train: what ``python run.py`` does.

Every flag and the env are checked before anything is written or started (a bad value ends with one line and
exit code 2); then the machine profile sets what was left automatic; then the runner starts the processes."""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from spreeze.proc import hangup_proof_resource_tracker, interrupt, stop_signals


class SetupError(Exception):
    """A setting or a machine limit found before anything started; the message is one line for the user."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Resolved:
    """What a run starts from: the one resolved config, the env's facts, the autotuner's record and where each
    setting came from (``spreeze.settings.config_record``)."""
    config: object
    env_info: object
    profile: dict
    sources: dict = field(default_factory=dict)


def resolve(config, explicit: set[str], sources: dict | None = None, log=print) -> Resolved:
    """Resume, check, make the run directory, tune, check again; raises :class:`SetupError`.

    ``explicit``: the fields the user set, which neither a resumed run's values nor the tuner override.
    ``sources``: where each value came from (``spreeze.settings.parse``), updated here for what the resumed
    run and the tuner set."""
    from spreeze.checkpoint import read_resumed_checkpoint, resume_config
    from spreeze.config import ConfigError
    from spreeze.defaults import cuda_graphs_default, resolve_devices
    from spreeze.envs import check_env
    from spreeze.files import run_dir_busy
    from spreeze.replay import ReplayTooLarge, check_fits_in_memory
    from spreeze.runners import make_run_dir
    from spreeze.settings import mark_changed

    from autotune import tune

    sources = dict(sources or {})
    resumed_profile = None
    target = config.resume or config.run_dir
    busy = run_dir_busy(Path(target)) if target else None
    if busy:  # a resume of a run still going (in another terminal), or a run dir another run has taken
        raise SetupError(busy)
    try:
        if config.resume:
            config = resume_config(config, explicit)
            resumed_profile = read_profile(Path(config.resume))
            sources = {name: sources.get(name, "default") if name in explicit else "resume"
                       for name in config.to_dict()}
            was = resumed_sources(Path(config.resume))
            # values the resumed run's machine (or cluster) chose, not its user: this launch chooses them again
            #   cuda_graphs: a checkpoint resumes graphed or eager alike; learner_threads: for that machine's cores;
            #   remote_samplers: one per CPU of the cluster it ran on
            for name, chosen_by, unset in (("cuda_graphs", ("default",), None),
                                           ("learner_threads", ("autotune", "default"), 0),
                                           ("remote_samplers", ("autotune",), 0)):
                if name not in explicit and was.get(name) in chosen_by:
                    config = replace(config, **{name: unset})
                    if name != "cuda_graphs":  # resolved below, which records its source
                        sources[name] = "default"
            if "reprofile" not in explicit:  # a one-off ("measure now"), not a setting every resume repeats
                config, sources["reprofile"] = replace(config, reprofile=False), "default"
            config.validate()
        env_info = check_env(config)
        if env_info.max_episode_steps is None:
            log(f"[spreeze] warning: {config.env_id} has no time limit: a test episode (and `play`) runs until the "
                "env terminates, and one that never does holds back every later test; --env-kwargs "
                "max_episode_steps=N sets one")
        if config.serial and (config.render or (config.window and "window" in explicit)):  # beside processes only
            log("[spreeze] --serial runs every role in this process: no live window (curve.png is written at the "
                f"end){' and no --render process' if config.render else ''}")
        resumed_counters = read_resumed_checkpoint(config, env_info) if config.resume else {}
        warn_if_budget_ends_in_warm_up(config, resumed_counters, log)
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, max(config.total_envs, 1),
                             active_regions=config.active_envs or None,
                             shared=config.experience_transport == "shm")
        # a cuda:N this machine lacks is a bad value, whether or not the profile runs
        actor_device, critic_device = resolve_devices(config)
        graphs = None
        if config.cuda_graphs is None:  # before the profile, which times the learner's updates as the run makes them
            on, why = cuda_graphs_default(config, actor_device, critic_device)
            config, sources["cuda_graphs"] = replace(config, cuda_graphs=on), "default"
            graphs = {"value": on, "by": "default", "reason": why}
            if "cuda" in actor_device + critic_device:
                log(f"[spreeze] CUDA graphs {'on' if on else 'off'} ({why}"
                    f"{'; --no-cuda-graphs launches kernel by kernel' if on else ''})")
        config, cluster = check_ray(config, env_info, explicit, log)
        if not config.samplers and not config.remote_only and not config.deterministic:
            # the tuner chooses the count after minutes of profiling: a replay that one sampler's envs (the
            # fewest it chooses, the replay's largest share per env) cannot warm up or write is refused now
            try:
                replace(config, samplers=1).validate()
            except ConfigError as err:
                n = config.envs_per_sampler
                raise ConfigError(f"{err} (even with one sampler process, the fewest the autotuner chooses: {n} "
                                  f"env{'s' if n != 1 else ''})") from None
    except (ConfigError, ReplayTooLarge, ValueError) as err:
        raise SetupError(str(err)) from None
    if not config.resume and config.run_dir and (Path(config.run_dir) / "config.json").exists():
        # a second run there would append to the first one's CSV files and replace its checkpoints
        from spreeze.checkpoint import CHECKPOINT_NAME

        if not (Path(config.run_dir) / "checkpoints" / CHECKPOINT_NAME).is_file():  # --resume refuses it too
            raise SetupError(f"--run-dir {config.run_dir} holds a run that ended before its first checkpoint, so "
                             "--resume cannot continue it: remove that directory, or choose another one")
        raise SetupError(f"--run-dir {config.run_dir} holds a run already: --resume {config.run_dir} continues it; "
                         "choose another directory for a new run")
    try:
        run_dir = make_run_dir(config)
    except OSError as err:
        raise SetupError(f"cannot create the run directory: {err}") from None
    config = replace(config, run_dir=str(run_dir))
    announce_preset(config, sources, log)
    untuned = config
    try:
        # a resumed run keeps its sampler count and batch, except a batch its learner was re-deciding: the tuner
        # chooses that again, so the sweep it is re-decided on is this machine's (cached or measured)
        re_deciding = bool(config.resume) and re_decides(resumed_profile, config, explicit)
        if re_deciding:
            config = replace(config, batch_size=0)
            # a precision the profile chose goes back to unset too: config.json holds the resolved value, and the
            # profile cache is keyed on the setting as given, so a kept True/False would miss the launch's profile
            # and measure the machine again; the same measurements choose the same precision. Not where the profile
            # chose the width from that precision (autotune/decide.py: choose_hidden_size): the checkpoint keeps
            # the width, whose own timing could pick the other precision, a pair the rule never takes
            chosen_was = (resumed_profile or {}).get("chosen") or {}
            bf16_was = chosen_was.get("bf16") or {}
            width_chosen = (chosen_was.get("hidden_size") or {}).get("by") == "profile"
            if "bf16" not in explicit and bf16_was.get("by") in ("profile", "default") and not width_chosen:
                config = replace(config, bf16=None)
            log("[spreeze] resumed: the learner goes on re-deciding the batch (--batch-rule noise) from its "
                "checkpoint's, on this machine's profile")
        elif config.resume and "batch_size" not in explicit:
            # config.json holds the launch batch; a learner that re-decided it trained at the checkpoint's (within
            # a --buffer-size given now)
            was = int(resumed_counters.get("batch_size") or 0)
            at = min(was, config.buffer_size)
            if at and at != config.batch_size:
                where = ("where the run's learner had got to" if at == was else
                         f"as --buffer-size {config.buffer_size} allows (the run's learner had got to {was})")
                log(f"[spreeze] resumed at batch {at}, {where}; its launch batch was {config.batch_size}; the "
                    "batch stays there")
                config = replace(config, batch_size=at)
                untuned = replace(untuned, batch_size=at)  # the resume's value, not the tuner's (config.json)
        kept = {"samplers"} | (set() if re_deciding else {"batch_size"}) if config.resume else set()
        config, profile = tune(config, env_info, explicit, reprofile=config.reprofile,
                               cache_dir=config.cache_dir or None, kept=kept)
        if graphs is not None:
            profile["cuda_graphs"] = graphs
        threads = profile.get("chosen", {}).get("learner_threads", {}).get("value")
        if not config.learner_threads and threads:
            config = replace(config, learner_threads=int(threads))
        config.validate()
        sources = mark_changed(sources, untuned, config, "autotune")
        for name in ("batch_size", "bf16", "learner_threads"):  # --deterministic's fixed values, not the machine's
            if profile.get("chosen", {}).get(name, {}).get("by") == "deterministic":
                sources[name] = "default"
        # now that the sampler count is known: the spares' regions come on top of --buffer-size
        check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, config.total_envs,
                             active_regions=config.active_envs, shared=config.experience_transport == "shm")
        if cluster is not None:
            profile["ray"] = cluster
            if cluster["remote_samplers"]["by"] == "profile":
                sources["remote_samplers"] = "autotune"
    except KeyboardInterrupt:
        _remove_if_empty(run_dir)
        raise SetupError("interrupted while profiling; nothing was started", exit_code=130) from None
    except (ConfigError, ReplayTooLarge, ValueError) as err:
        _remove_if_empty(run_dir)
        raise SetupError(str(err)) from None
    return Resolved(config, env_info, profile, sources)


def warn_if_budget_ends_in_warm_up(config, counters: dict, log) -> None:
    """A --total-steps that leaves fewer env steps than the warm-up stops the run before the learner's first
    update. A resumed run counts its checkpoint's steps against the budget and refills its replay (unless it saved
    one), so ``--resume RUN --total-steps <its steps + a few thousand>`` is the usual way to get here."""
    from spreeze.replay import REPLAY_FILE

    left = config.total_steps - int(counters.get("env_steps", 0))
    if not config.total_steps or left <= 0:  # no step limit, or used up: the run stops at once and says so
        return
    if (config.resume and config.experience_transport == "shm"
            and (Path(config.resume) / "checkpoints" / REPLAY_FILE).exists()):
        return  # the saved replay comes back (one that does not fit is a warning of the supervisor's)
    if left < config.learning_begins_at:
        log(f"[spreeze] warning: --total-steps {config.total_steps:,} leaves {left:,} env steps"
            f"{' to this session' if config.resume else ''}, fewer than the {config.learning_begins_at:,} the "
            f"learner waits for{' in a refilled replay' if config.resume else ''} (--learning-starts, or one "
            "batch): the run "
            "will stop before its first update; raise --total-steps (or 0 for no step limit)")


def read_profile(run_dir: Path) -> dict | None:
    """The autotuner's record a run wrote (``autotune.json``), or None when it is missing or unreadable."""
    import json

    try:
        return json.loads((run_dir / "autotune.json").read_text())
    except (OSError, ValueError):
        return None


def resumed_sources(run_dir: Path) -> dict:
    """Where each of the resumed run's values came from (``sources`` in its ``config.json``); {} when unreadable."""
    import json

    try:
        sources = json.loads((run_dir / "config.json").read_text()).get("sources") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return sources if isinstance(sources, dict) else {}


def re_decides(resumed: dict | None, config, explicit: set[str]) -> bool:
    """Whether a resumed run's learner goes on re-deciding its batch: the run's profile chose it under
    ``--batch-rule noise`` (its ``autotune.json``), and no ``--batch-size`` is given now."""
    was = ((resumed or {}).get("chosen") or {}).get("batch_size") or {}
    return (was.get("by") == "profile" and "batch_size" not in explicit and config.batch_rule == "noise"
            and not config.deterministic
            and bool(config.noise_scale_interval))  # 0: the learner measures nothing, so keeps the checkpoint's


def check_ray(config, env_info, explicit: set[str], log) -> tuple:
    """--ray: the cluster is reachable and runs this Ray version (else one line, exit 2, before any process
    starts); its CPUs and a block's round trip go into the profile, and ``--remote-samplers 0`` becomes one
    sampler per cluster CPU."""
    if not config.ray:
        return config, None
    from spreeze.remote import FIRST_BLOCK_S, check_cluster

    cluster = check_cluster(config, env_info)
    if config.remote_samplers:
        cluster["remote_samplers"] = {"value": config.remote_samplers, "by": "user", "reason": "given"}
        if 0 < cluster["cluster_cpus"] < config.remote_samplers:
            log(f"[spreeze] warning: {config.remote_samplers} remote samplers on a cluster of "
                f"{cluster['cluster_cpus']:g} CPUs: each takes a CPU, and those beyond wait unplaced, replaced "
                f"every {FIRST_BLOCK_S:.0f} s, until the cluster grows")
    else:
        n = max(1, int(cluster["cluster_cpus"]))
        cluster["remote_samplers"] = {"value": n, "by": "profile",
                                      "reason": f"one per cluster CPU ({cluster['cluster_cpus']:g})"}
        config = replace(config, remote_samplers=n)
    log(f"[spreeze] ray cluster {config.ray}: {cluster['nodes']} node(s), {cluster['cluster_cpus']:g} CPUs, "
        f"Ray {cluster['ray_version']}; a block of {cluster['block_rows']} rows round-trips in "
        f"{cluster['block_round_trip_ms']:.1f} ms; {config.remote_samplers} remote sampler(s)")
    config.validate()
    return config, cluster


def announce_preset(config, sources: dict, log) -> None:
    """One line naming the preset in force and the values it set, so that a preset never changes a run
    silently."""
    label = f"preset:{config.preset}"
    used = [name for name, source in sources.items() if source == label]
    if used:
        values = ", ".join(f"{name.replace('_', '-')} {getattr(config, name)}" for name in used)
        log(f"[spreeze] preset {config.preset} for {config.env_id} (--preset none turns it off): {values}")


def train(config, env_info, log=None, profile: dict | None = None, sources: dict | None = None, callbacks=()):
    """Train with the observers the config asks for (window or curve.png, --render, governor)."""
    from spreeze import runners

    from launch.observers import build_observers

    kwargs = {} if log is None else {"log": log}
    return runners.train(config, env_info, profile=profile, observers=build_observers(config, callbacks),
                         sources=sources,
                         **kwargs)


def run(resolved: Resolved, log=None, callbacks=()):
    """Train from a resolved setup; the noise scale the run measured goes back into the machine's profile when it
    can stand for the next launch's (:func:`noise_scale_to_remember`)."""
    from autotune import remember_noise_scale

    result = train(resolved.config, resolved.env_info, log=log, profile=resolved.profile, sources=resolved.sources,
                   callbacks=callbacks)
    try:
        problem = remember_noise_scale(resolved.profile, noise_scale_to_remember(result, resolved.config),
                                       resolved.config)
    except KeyboardInterrupt:  # after the run gave Ctrl-C back: the run is done, only the profile's update is lost
        problem = "interrupted: the run's noise scale was not kept in the machine's profile"
    if problem:
        print(f"[spreeze] warning: {problem}", file=sys.stderr)
    return result


def noise_scale_to_remember(result, config) -> float | None:
    """The run's final critic noise scale, or None when it cannot stand for the next launch's: the run ended in
    an error (a diverged critic's is no guide; Ctrl-C is how a run without a budget ends, and counts as an
    end), or its learner measured it fewer times than one batch decision takes (a smoke test's one or two
    measurements must not replace a long run's estimate). The count is the estimate's own: a resume that measured
    afresh counts this session's measurements, not the earlier sessions' updates."""
    from spreeze.learner import REDECIDE_EVERY_MEASUREMENTS

    measured = int(result.summary.get("critic_noise_measurements") or 0) if config.noise_scale_interval else 0
    if result.exit_code not in (0, 130) or measured < REDECIDE_EVERY_MEASUREMENTS:
        return None
    return result.summary.get("critic_noise_scale")


def main(argv: list[str] | None = None, prog: str = "run.py") -> int:
    from spreeze.settings import parse

    hangup_proof_resource_tracker()  # before the profile's processes and segments start it
    # started in the background by a shell, SIGINT may be inherited as ignored; kill -INT must still stop us
    signal.signal(signal.SIGINT, _interrupt)
    # a SIGTERM (or a closed terminal's SIGHUP) before training (env check, profiling, loading a checkpoint) ends
    # the launch as Ctrl-C does: the profile's process stopped, an empty run directory removed, exit 130 (the run
    # then installs its own)
    previous = {signum: signal.signal(signum, _interrupt) for signum in stop_signals() if signum != signal.SIGINT}
    argv = sys.argv[1:] if argv is None else argv
    try:
        parsed = parse(argv, prog=prog)
        try:
            resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources)
        except SetupError as err:
            if err.exit_code == 130:
                print(f"[spreeze] {err}", file=sys.stderr)
            else:
                print(f"{prog}: error: {err}", file=sys.stderr)
            return err.exit_code
        except KeyboardInterrupt:  # outside the profile, which says so itself: no traceback
            print("[spreeze] interrupted before training; nothing was started", file=sys.stderr)
            return 130
        from spreeze.files import RunDirBusy

        try:
            return run(resolved).exit_code
        except RunDirBusy as err:  # taken by another launch while this one profiled (both found it free)
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # the run's set-up, before it takes Ctrl-C over (it starts its processes after)
            print("[spreeze] interrupted before training; nothing was started (the run directory may hold its "
                  "set-up files)", file=sys.stderr)
            return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupt(signum, frame):
    """Ctrl-C and SIGTERM before training take the path they take during it (spreeze/proc.py): raised now, or at
    the end of a shared lock's hold in this process, so that no lock is left held."""
    interrupt()


def _remove_if_empty(run_dir: Path) -> None:
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
