"""Automatic batch size, sampler count and learner precision from a measured profile of this machine
(Spreeze section 3.3; the precision: bf16 autocast only where the probe timed it clearly faster).

``tune(config, env_info, explicit)`` is the one entry point. On the first launch for a machine (and env,
algorithm, network shape) it profiles for some seconds with a progress bar, prints one summary and saves
the measurements in the per-user cache; later launches reuse them and say so in one line. The choices
themselves are recomputed from the measurements every time (decide.py, pure functions), so values
given by hand, a new ``--buffer-size`` or ``--collect-per-update`` are always honoured.

Layout: probe.py measures, decide.py decides, cache.py stores, governor.py adjusts the number of
active samplers during a run.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from typing import Callable

from autotune import cache, decide
from autotune.governor import CpuGovernor
from autotune.probe import ProbeFailed, ProbeSettings, SHORT_SETTINGS
from spreeze.noise_scale import changed_settings, learning_settings

TUNED = ("samplers", "batch_size")
_GIVEN_REASONS = {"user": "given by hand", "config": "set in the config", "resume": "kept from the run it resumes",
                  "deterministic": "--deterministic: a fixed default, so the curve does not depend on the machine"}


def _given(config, name: str, explicit: set[str], kept: set[str] = frozenset()) -> tuple[int | None, str | None]:
    """The value to keep and who set it: ("user") on the command line, ("resume") the resumed run's (``kept``),
    ("config") a non-zero value otherwise.

    0 means "choose" even when typed by hand (``--samplers 0`` is documented as automatic); with --remote-only
    there are no local samplers to choose.
    """
    if name == "samplers" and getattr(config, "remote_only", False):
        return 0, "user" if name in explicit or "remote_only" in explicit else "config"
    value = getattr(config, name)
    if value:
        return int(value), "user" if name in explicit else "resume" if name in kept else "config"
    return None, None


def _width_kept(config, explicit: set[str]) -> tuple[str, str] | None:
    """Who keeps --hidden-size, and why, where a preset offers a narrower width the profile could take (as
    ``_given`` says who keeps a sampler count or batch); None: the profile chooses."""
    if not config.narrow_hidden_size:
        return None
    if "hidden_size" in explicit:
        return "user", _GIVEN_REASONS["user"]
    if config.deterministic:
        return "deterministic", "--deterministic: the width does not follow the CPU"
    if config.resume:
        return "resume", "kept from the resumed run (its networks are in the checkpoint)"
    if config.critic_hidden_size:  # the critics, which cost the most, keep their own width
        return "config", "--critic-hidden-size sets the critics' width, so narrower layers buy little"
    return None


def tune(config, env_info, explicit: set[str], reprofile: bool = False, cache_dir: str | None = None,
         log: Callable[[str], None] = print, *, settings: ProbeSettings | None = None, progress: bool = True,
         probe: Callable | None = None, kept: set[str] = frozenset()) -> tuple[object, dict]:
    """Return ``(config with samplers and batch_size filled, profile dict)``.
    ``kept``: the fields a resumed run keeps from its saved config (recorded as "resume", not "given by hand").

    ``explicit``: names of the fields the user set (``spreeze.flags.explicit_flags``); their non-zero
    values are kept. ``reprofile`` measures again even when a saved profile exists. ``cache_dir``
    overrides ``$SPREEZE_CACHE_DIR`` / ``~/.cache/spreeze``. ``settings`` shortens or lengthens the
    measurements (``probe.SHORT_SETTINGS`` for tests); ``probe`` replaces ``probe.run_probe`` (tests).
    Raises ``spreeze.replay.ReplayTooLarge`` when the replay cannot fit in memory, and ``ValueError``
    when a requested cuda device does not exist; a failed measurement only warns and falls back to the
    plain defaults.
    """
    from autotune import probe as probe_mod
    from spreeze.replay import check_fits_in_memory

    began = time.perf_counter()
    explicit = set(explicit or ())
    settings = settings or ProbeSettings()
    deterministic_batch = None
    if config.deterministic and not config.batch_size:
        # the batch shapes the curve: in the reproducible mode it never follows the machine (Cleanba)
        from spreeze.config import DETERMINISTIC_BATCH_SIZE

        deterministic_batch = min(DETERMINISTIC_BATCH_SIZE, config.buffer_size)
        config = replace(config, batch_size=deterministic_batch)
    bf16_given = (config.bf16, "user" if "bf16" in explicit else "config")  # as _given: the value and who set it
    if config.bf16 is None and config.deterministic:  # float32 before probing: the probe then times no bf16
        config = replace(config, bf16=False)
    given = {name: _given(config, name, explicit, set(kept)) for name in TUNED}
    width_kept = _width_kept(config, explicit)
    if width_kept:
        config = replace(config, narrow_hidden_size=0)
    if deterministic_batch is not None:
        given["batch_size"] = (deterministic_batch, "deterministic")
    profile: dict = {"source": None, "cache_path": None, "cache_problem": None, "measurements": None,
                     "chosen": {}, "seconds": 0.0}
    if all(value is not None for value, _ in given.values()):
        profile["source"] = "none"
        profile["chosen"] = {name: {"value": value, "by": by, "reason": _GIVEN_REASONS[by]}
                             for name, (value, by) in given.items()}
        config = _choose_precision(config, bf16_given, profile["chosen"], None, "float32: nothing was profiled "
                                   "(samplers and batch size were given); --bf16 asks for bf16")
        devices = probe_mod.devices_for(config)
        config = _choose_width(config, profile["chosen"], devices, width_kept, "default")
        # the learner's threads as a profile would plan them for this machine's cores: left at 0 (a resume resets
        # the tuner's count), the run took every core the samplers leave, hyper-threads included
        threads = probe_mod.planned_learner_threads(config, any(d.startswith("cuda") for d in devices),
                                                    probe_mod.machine_inventory()["physical"])
        profile["chosen"]["learner_threads"] = {
            "value": threads,
            "by": "deterministic" if config.deterministic else "user" if config.learner_threads else "default",
            "reason": ("--deterministic: one thread" if config.deterministic else "given by hand"
                       if config.learner_threads else "this machine's physical cores, as a profile plans them "
                       "(one on a GPU); nothing was profiled")}
        profile["seconds"] = time.perf_counter() - began
        why = "; ".join(f"{label} {value} ({_GIVEN_REASONS[by].partition(':')[0]})" for label, (value, by) in
                        (("samplers", given["samplers"]), ("batch size", given["batch_size"])))
        log(f"[spreeze] autotune: {why}; no profiling needed")
        return config, profile

    # the spares' regions come on top of --buffer-size (the active envs alone hold it): with the sampler count
    # given, priced as the run will split it; still open, the most it can be (one active sampler and the spares)
    regions, active = ((config.total_envs, config.active_envs) if config.samplers else (1 + config.spares, 1))
    replay_bytes = check_fits_in_memory(env_info.obs_dim, env_info.act_dim, config.buffer_size, regions,
                                        active_regions=active, shared=config.experience_transport == "shm")
    inventory = probe_mod.machine_inventory()
    import torch

    devices = probe_mod.devices_for(config)
    on_gpu = any(d.startswith("cuda") for d in devices)
    learner_threads = probe_mod.planned_learner_threads(config, on_gpu, inventory["physical"])
    hardware = cache.hardware_fingerprint(inventory, torch.__version__, torch.version.cuda)
    # the largest batch the sweep may try (as probe.measure_learner picks its candidates)
    sweep_cap = decide.batch_candidates(max(decide.MIN_BATCH, min(settings.max_batch, config.buffer_size)))[-1]
    full = decide.batch_candidates(decide.MAX_BATCH)[-1]
    workload = cache.workload_key(config, env_info, devices, learner_threads,
                                  sweep_cap=sweep_cap if sweep_cap < full else None)
    path = cache.profile_path(cache.cache_dir(cache_dir), hardware, workload)
    profile["cache_path"] = str(path)

    record, problem = (None, None) if reprofile else cache.load(path, hardware, workload)
    if problem:
        profile["cache_problem"] = problem
        log(f"[spreeze] warning: {problem}; profiling this machine again")
    if record is not None:
        measurements, profile["source"] = record["measurements"], "cache"
        profile["profiled_at"] = record.get("created")
    else:
        why = "a new profile was asked for" if reprofile else ("no usable saved profile" if problem else
                                                        "first launch on this machine")
        log(f"[spreeze] profiling this machine ({why}; once, typically 10-30 s)")
        try:
            measurements = _measure(config, env_info, inventory, devices, learner_threads, settings, progress,
                                    probe or probe_mod.run_probe)
        except ProbeFailed as err:
            profile["cache_path"] = None  # nothing saved
            return _fallback(config, bf16_given, given, profile, inventory, devices, str(err), began, log,
                             width_kept)
        profile["source"] = "measured"
        # a profile measured again (--reprofile, or a stale file) keeps the env's noise scale a run left there
        measurements["learner"].update(cache.kept_noise_scale(path, hardware, workload))
        if measurements["learner"].get("incomplete"):  # a cut-off sweep would be reused by every later launch
            save_problem = (f"the profile was cut short ({measurements['learner'].get('stopped')}) and is not "
                            "saved")
        else:
            save_problem = cache.save(path, hardware, workload, measurements)
        if save_problem:
            profile["cache_problem"], profile["cache_path"] = save_problem, None  # nothing there to update later
            log(f"[spreeze] warning: {save_problem}; the next launch will profile again")

    planned, stale = _without_stale_noise_scale(measurements, config)
    chosen = decide.plan(planned, samplers_given=given["samplers"][0], batch_given=given["batch_size"][0],
                         buffer_size=config.buffer_size, collect_per_update=config.collect_per_update,
                         replay_ratio=config.replay_ratio,
                         mem_available=inventory["memory_available"], replay_bytes=replay_bytes,
                         learner_threads_given=1 if config.deterministic else (config.learner_threads or None),
                         batch_rule=config.batch_rule,
                         learner_overlap=config.learner_overlap, remote_samplers=config.remote_samplers,
                         target_cpu_percent=config.cpu_target_percent, cuda_graphs=bool(config.cuda_graphs),
                         spare_samplers=config.spares,
                         replay_split=None if config.deterministic else replay_split(config))
    for name, (value, by) in given.items():
        if value is not None:
            chosen[name]["by"] = by
            chosen[name]["reason"] = _GIVEN_REASONS[by]
    if stale and config.batch_rule == "noise" and chosen["batch_size"]["by"] == "profile":
        chosen["batch_size"]["reason"] += f"; the last run's noise scale was left out ({stale})"
    if config.deterministic and chosen["samplers"]["by"] == "profile" and \
            chosen["samplers"]["value"] > config.total_envs:  # lock-step rounds run min(samplers, envs) processes
        chosen["samplers"].update(value=config.total_envs, reason=chosen["samplers"]["reason"] + (
            f"; capped at the {config.total_envs} envs of --deterministic's rounds (one sampler process per env at most)"))
    if config.deterministic:  # spreeze.defaults.learner_threads: one thread, whatever was asked
        chosen["learner_threads"].update(by="deterministic", reason="--deterministic: one thread (another split of a "
                                         "sum over threads changes the last bits of an update)")
    tuned = replace(config, samplers=chosen["samplers"]["value"], batch_size=chosen["batch_size"]["value"])
    tuned = _choose_precision(tuned, bf16_given, chosen, measurements["learner"].get("precision"))
    tuned = _choose_width(tuned, chosen, devices, width_kept, "profile")  # as the probe's sweep took it
    profile.update(measurements=measurements, chosen=chosen, replay_bytes=replay_bytes,
                   memory_available=inventory["memory_available"], devices=list(devices))
    profile["seconds"] = time.perf_counter() - began
    if profile["source"] == "cache":
        log(f"[spreeze] autotune: reusing this machine's profile from {profile.get('profiled_at')} ({path}; "
            f"reprofile to measure again): samplers {_choice(chosen, 'samplers')}, batch size {_choice(chosen, 'batch_size')}"
            f", {'bf16' if chosen['bf16']['value'] else 'float32'} ({_by(chosen['bf16'])})"
            + (f", hidden layers of {_choice(chosen, 'hidden_size')}" if "hidden_size" in chosen else ""))
    else:
        for line in summary_lines(profile):
            log(line)
    return tuned, profile


def _measure(config, env_info, inventory: dict, devices, learner_threads: int, settings: ProbeSettings,
             progress: bool, run_probe: Callable) -> dict:
    from autotune import probe as probe_mod

    began = time.perf_counter()
    candidates = decide.batch_candidates(max(decide.MIN_BATCH, min(settings.max_batch, config.buffer_size)))
    bar = _progress_bar(2 + len(candidates), progress)
    try:
        bar.set_postfix_str("CPU load")
        load = probe_mod.cpu_load(settings.load_seconds)
        bar.update(1)
        bar.set_postfix_str("starting the probe process")

        def on_event(kind: str, payload) -> None:
            if kind == "phase":
                bar.set_postfix_str("stepping the env like a sampler" if payload == "sampler" else "learner batch sweep")
            elif kind == "sampler":
                bar.update(1)
                bar.set_postfix_str(f"{1e3 * payload['env_step_s']:.2f} ms/step")
            elif kind == "batch":
                bar.update(1)
                bar.set_postfix_str(f"batch {payload['batch']}: {payload['updates_per_s']:.0f} updates/s")

        result = run_probe(config, env_info, settings, learner_threads, on_event)
        if not result["learner"].get("sweep"):  # e.g. GPU memory ran out at the smallest batch: no batch to choose
            raise ProbeFailed(f"the learner timed no batch ({result['learner'].get('stopped') or 'no reason'})")
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
    learner = dict(result["learner"])
    learner.setdefault("devices", list(devices))
    learner.setdefault("on_gpu", any(d.startswith("cuda") for d in devices))
    learner.setdefault("threads", int(learner_threads))
    return {"cpu": {"model": inventory["cpu_model"], "logical": inventory["logical"], "physical": inventory["physical"],
                    "per_core_percent": load["per_core_percent"], "background_cores": load["background_cores"]},
            "memory": {"total": inventory["memory_total"], "available": inventory["memory_available"]},
            "gpus": inventory["gpus"], "nvml": inventory["nvml"], "sampler": result["sampler"], "learner": learner,
            "settings": asdict(settings), "seconds": time.perf_counter() - began}


def _progress_bar(total: int, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="[spreeze] profiling this machine", disable=not enabled, leave=False,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} {postfix}")
    except ImportError:  # tqdm is in requirements.txt; a missing one must not stop a run
        class _Quiet:
            total, n = total, 0

            def update(self, k=1):
                self.n += k

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Quiet()


def replay_split(config) -> dict:
    """What ``decide.replay_fits`` checks of a sampler count beyond the buffer (Config.validate's per-env checks)."""
    return {"envs_per_sampler": config.envs_per_sampler, "warm_up": config.learning_starts,
            "min_region_rows": config.write_block + config.n_step - 1}


def _fallback(config, bf16_given: tuple, given: dict, profile: dict, inventory: dict, devices, why: str, began: float,
              log, width_kept: tuple | None = None) -> tuple:
    """The plain defaults of spreeze.defaults when the measurement failed: a warning, never a crash."""
    from spreeze.defaults import default_batch_size, default_samplers

    # 0 given is a value here (--remote-only: no local sampler), None is "choose"
    samplers = given["samplers"][0]
    if samplers is None:
        samplers = default_samplers(inventory["logical"])
        if config.deterministic:  # lock-step rounds run min(samplers, envs)
            samplers = min(samplers, config.total_envs)
        else:  # as plan() does: a split the config accepts
            while samplers > 1 and not decide.replay_fits(samplers, buffer_size=config.buffer_size,
                                                          remote_samplers=config.remote_samplers,
                                                          **replay_split(config)):
                samplers -= 1
    batch = (given["batch_size"][0] if given["batch_size"][0] is not None
             else min(default_batch_size(devices[0]), config.buffer_size))
    chosen = {}
    for name, value in (("samplers", samplers), ("batch_size", batch)):
        by = given[name][1] or "default"
        chosen[name] = {"value": value, "by": by, "reason": _GIVEN_REASONS.get(by, "plain default: the measurement failed")}
    config = _choose_precision(replace(config, samplers=samplers, batch_size=batch), bf16_given, chosen, None,
                               "float32: the measurement failed")
    config = _choose_width(config, chosen, devices, width_kept, "default")
    profile.update(source="failed", chosen=chosen, probe_error=why, seconds=time.perf_counter() - began)
    log(f"[spreeze] warning: profiling failed ({why}); using defaults: {samplers} sampler(s), batch {batch}")
    return config, profile


def _choose_precision(config, given: tuple, chosen: dict, precision: dict | None, unmeasured: str | None = None):
    """Fill ``chosen["bf16"]`` (decide.choose_precision; ``given``: --bf16/--no-bf16 or None, and who set it) and
    return the config with ``bf16`` resolved."""
    value, by, reason = decide.choose_precision(precision, given[0], config.deterministic)
    if by == "user":
        by, reason = given[1], _GIVEN_REASONS[given[1]]
    elif by == "default" and unmeasured:
        reason = unmeasured
    chosen["bf16"] = {"value": value, "by": by, "reason": reason}
    return replace(config, bf16=value)


def _choose_width(config, chosen: dict, devices, kept: tuple | None, by: str):
    """Fill ``chosen["hidden_size"]`` where a preset offers a narrower width (decide.choose_hidden_size, from the
    precision already resolved; ``kept``: who keeps --hidden-size instead, and why) and return the config with it
    resolved: the offer is spent (``narrow_hidden_size`` 0), so a resumed run keeps the width it saved."""
    if kept:
        chosen["hidden_size"] = {"value": config.hidden_size, "by": kept[0], "reason": kept[1]}
        return config
    if not config.narrow_hidden_size:
        return config
    on_gpu = any(str(d).startswith("cuda") for d in devices)
    value, reason = decide.choose_hidden_size(config.hidden_size, config.narrow_hidden_size, bf16=bool(config.bf16),
                                              on_gpu=on_gpu)
    chosen["hidden_size"] = {"value": value, "by": by, "reason": reason}
    return replace(config, hidden_size=value, narrow_hidden_size=0)


def _by(entry: dict) -> str:
    return "by hand" if entry["by"] == "user" else entry["by"]


def _choice(chosen: dict, name: str) -> str:
    return f"{chosen[name]['value']} ({_by(chosen[name])})"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def summary_lines(profile: dict) -> list[str]:
    """The one summary printed after profiling: machine, measured figures, choices and who made them."""
    m, chosen = profile["measurements"], profile["chosen"]
    cpu, sampler, learner = m["cpu"], m["sampler"], m["learner"]
    load = " ".join(f"{p:.0f}%" for p in cpu.get("per_core_percent", []))
    saved = f"saved in {profile['cache_path']}" if profile.get("cache_path") else "not saved"
    lines = [f"[spreeze] machine profile ({m.get('seconds', 0):.1f} s; {saved})",
             f"[spreeze]   CPU        {cpu.get('model', '?')}: {cpu['logical']} logical / {cpu['physical']} physical "
             f"cores usable; per-core load while profiling {load} ({cpu.get('background_cores', 0):.1f} cores busy)",
             f"[spreeze]   memory     {_gib(profile['memory_available'])} available of {_gib(m['memory']['total'])}; "
             f"replay needs {_gib(profile['replay_bytes'])}"]
    gpus = m.get("gpus") or []
    if gpus:
        listed = "; ".join(f"#{g['index']} {g['name']} ({_gib(g['memory_total'])}, {_gib(g['memory_free'])} free"
                           + (f", {g['utilization']:.0f}% busy)" if g.get("utilization") is not None else ")")
                           for g in gpus)
    else:
        listed = f"none ({m.get('nvml', 'NVML not available')})"
    where = ", ".join(learner.get("devices", []))
    if gpus and not learner.get("on_gpu"):
        where += " (this torch build sees no CUDA device, or the CPU was asked for)"
    lines.append(f"[spreeze]   GPUs       {listed}; learner on {where}")
    lines.append(f"[spreeze]   sampler    {1e3 * sampler['env_step_s']:.2f} ms CPU per env step incl. policy "
                 f"({sampler['steps_per_s']:,.0f} steps/s per sampler, {sampler.get('envs', 1)} env(s) each); "
                 f"{sampler['rss_bytes'] / 2**20:.0f} MiB resident per sampler process")
    points, prev = [], None
    for p in learner["sweep"]:
        frames = p["batch"] * p["updates_per_s"]
        gain = f", {100 * (frames / prev - 1):+.0f}%" if prev else ""
        util = f", GPU {p['gpu_util']:.0f}%" if p.get("gpu_util") is not None else ""
        points.append(f"{p['batch']}: {p['updates_per_s']:.0f}/s ({frames / 1e3:,.1f}k frames/s{gain}{util})")
        prev = frames
    threads = learner.get("threads")
    lines.append(f"[spreeze]   learner    updates/s by batch ({threads} thread{'s' if threads != 1 else ''}): "
                 + " | ".join(points))
    if learner.get("stopped"):
        lines.append(f"[spreeze]              sweep stopped: {learner['stopped']}")
    if cpu.get("background_cores", 0) > 0.25 * cpu["logical"]:
        lines.append(f"[spreeze]   note       other programs kept {cpu['background_cores']:.1f} of {cpu['logical']} cores busy "
                     "while profiling, so the measured rates may be low; profile again when the machine is quieter")
    for name, label in (("samplers", "samplers  "), ("batch_size", "batch size")):
        entry = chosen[name]
        who = {"user": "given by hand", "config": "set in the config", "profile": "chosen by the profile",
               "default": "plain default", "deterministic": "fixed", "resume": "kept from the resumed run"
               }.get(entry["by"], entry["by"])
        lines.append(f"[spreeze]   {label} {entry['value']} ({who}"
                     f"{'' if entry['by'] in ('user', 'config', 'resume') else ': ' + entry['reason']})")
    if "bf16" in chosen:
        entry = chosen["bf16"]
        who = "chosen by the profile: " if entry["by"] == "profile" else ""
        lines.append(f"[spreeze]   precision  {'bf16 autocast' if entry['value'] else 'float32'} ({who}{entry['reason']})")
    if "hidden_size" in chosen:
        entry = chosen["hidden_size"]
        who = "chosen by the profile: " if entry["by"] == "profile" else ""
        lines.append(f"[spreeze]   width      hidden layers of {entry['value']} ({who}{entry['reason']})")
    expected = chosen.get("expected")
    if expected:
        demand = expected.get("learner_demand_steps_per_s")
        demand_text = f"; the learner takes ~{demand:,.0f} steps/s at this collect:update ratio" if demand else ""
        lines.append(f"[spreeze]   expected   sampling ~{expected['sampling_steps_per_s']:,.0f} steps/s, "
                     f"{expected['updates_per_s']:.0f} updates/s = {expected['update_frame_rate']:,.0f} frames/s"
                     f"{demand_text}; learner threads {chosen['learner_threads']['value']}")
    return lines


def _without_stale_noise_scale(measurements: dict, config) -> tuple[dict, str | None]:
    """The measurements for :func:`decide.plan`, less a remembered noise scale measured under other learning
    settings (or under unrecorded ones, by an older version), and why it was left out; the profile keeps it."""
    learner = measurements.get("learner") or {}
    if learner.get("noise_scale") is None:
        return measurements, None
    under = learner.get("noise_scale_settings")
    if under is None:
        why = "measured under learning settings that were not recorded"
    else:
        changed = changed_settings(under, learning_settings(config))
        if not changed:
            return measurements, None
        why = f"measured with other {changed}"
    return {**measurements, "learner": {k: v for k, v in learner.items() if k != "noise_scale"}}, why


def remember_noise_scale(profile: dict, noise_scale: float | None, config=None) -> str | None:
    """Keep the critic's gradient noise scale a run measured in this machine's profile of the env, for the
    next launch's ``--batch-rule noise``, with the learning settings it was measured under (``config``'s; a
    launch with others does not use it); returns why it could not, or None."""
    path = profile.get("cache_path") if profile else None
    if not path or noise_scale is None or not (math.isfinite(noise_scale) and noise_scale >= 0):
        return None
    values = {"noise_scale": float(noise_scale), "noise_scale_at": time.time()}
    # without them (None) the next launch does not use it: an earlier one's must not vouch for this one
    values["noise_scale_settings"] = learning_settings(config) if config is not None else None
    return cache.update_learner(path, values)


__all__ = ["CpuGovernor", "ProbeFailed", "ProbeSettings", "SHORT_SETTINGS", "remember_noise_scale", "summary_lines",
           "tune"]
