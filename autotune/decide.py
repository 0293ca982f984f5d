"""The autotune decisions, as pure functions of plain numbers (no probing, no psutil, no torch).

Spreeze section 3.3: the batch size is raised until the learner's device is just saturated (GPU about
85 % busy) without letting the update frequency collapse, and the number of sampler processes keeps the
CPU about 75 % busy within what memory allows. Everything here takes measurements as plain numbers
(probe.py produces them, tests fake them) and returns the choice together with a one-line reason.

Constants and why they are what they are:

* ``TARGET_GPU_PERCENT = 85`` and ``TARGET_CPU_PERCENT = 75``: the paper's operating point.
* ``MIN_FRAME_RATE_GAIN = 0.15``: a doubling of the batch is taken only while it raises the update frame
  rate (updates/s x batch) by at least 15 %. With an update costing ``overhead + batch / throughput``,
  the gain of doubling ``b`` is exactly ``1 - busy(2b)``, where ``busy`` is the share of the update the
  device spends on the batch itself; so "gain >= 15 %" is "the doubled batch keeps the device at most
  85 % busy". On a GPU the measured NVML utilisation is checked as well.
* ``MIN_FRAME_RATE_GAIN_CPU = 0.5`` for a learner on the CPU: there a
  doubling must pay for itself in frames/s (at most 25 % fewer updates/s): on a CPU, gradient steps, not
  frames, bounded learning (docs/benchmarks.md, batch 512 against 256).
* ``MIN_UPDATES_PER_S = 40``: the update-frequency floor. The paper's own automatic setting ran at
  45.2 updates/s (Table 1) and the paper reports that RLlib at batch 4096 (8.8 updates/s) "worsens the
  training effect". At 40 updates/s each 0.1 s weight publication still carries ~4 fresh updates, and
  the target critics (averaging over ~1/tau updates) follow within seconds. A batch below the floor is never
  chosen unless even the smallest batch is below it.
* Cores left to the rest of the run: the learner (1 core when it drives a GPU, its torch threads on a
  CPU), the evaluator (0.5: it plays one episode every few seconds, then waits) and the supervisor with
  the live window (0.25: logging and redraws every few seconds).
* Samplers are also capped at the physical cores (minus a CPU learner's): a second sampler on a
  hyperthread sibling adds contention, not steps (docs/pitfalls.md). The paper's server (20-core
  Xeon) got 20 samplers, its 4-core laptop 4.
* ``BF16_MIN_SPEEDUP = 1.25``: bf16 autocast is taken only when the probe timed it at least 25 % faster than
  float32 at the smallest batch. A learner-bound run turns that speed straight into updates per second, while
  bf16's cost (rounding in the hidden layers) is the same at any speed; a small or noisy gain is not worth it.
  A CPU with avx512_bf16 ran it much faster, the H200 at these network sizes slower (docs/benchmarks.md).
* The narrower hidden layers a preset offers (``--narrow-hidden-size``) only for a CPU learner in float32: there
  the learner sets a run's pace and the narrower hidden layers take about (narrow / wide)^2 of the wide ones'
  multiply-adds, which learned faster on a CPU without a bf16 gain. Where bf16 paid, the wide layers in bf16 learned
  faster than the narrow ones in either precision (docs/benchmarks.md, "Which width where").
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

from spreeze.config import collect_ratio
from spreeze.noise_scale import batch_for_noise_scale, fed_sweep, first_capped

TARGET_CPU_PERCENT = 75.0
TARGET_GPU_PERCENT = 85.0
MIN_FRAME_RATE_GAIN = 0.15
MIN_FRAME_RATE_GAIN_CPU = 0.5
MIN_UPDATES_PER_S = 40.0
MIN_BATCH = 256
MAX_BATCH = 65_536
GPU_LEARNER_CORES = 1.0
EVALUATOR_CORES = 0.5
SUPERVISOR_CORES = 0.25
INGEST_CPU_S_PER_ROW = 1e-5
"""the ingest process's CPU time per remote row (--ray): Ray's request, fetch and unpacking plus the replay write,
at one block per request (requests of several blocks cost less)"""
INGEST_MAX_CORES = 1.0
"""one Python process: its CPU use stops at one core"""
MEMORY_HEADROOM_BYTES = 1 << 30
LEARNER_MEMORY_FACTOR = 2.0
"""the learner process holds about two samplers' worth of memory (networks, optimiser state, batches)"""
DEMAND_MARGIN = 1.25
"""samplers provisioned for 25 % more steps than the learner consumes, so the replay never starves it"""
BF16_MIN_SPEEDUP = 1.25
"""bf16 autocast only when timed at least this many times as fast as float32 (see the module docstring)"""


class Measurement(NamedTuple):
    """One point of the learner sweep: batch size, measured updates per second, GPU busy percent or None."""
    batch: int
    updates_per_s: float
    gpu_util: float | None = None

    @property
    def frame_rate(self) -> float:
        return self.batch * self.updates_per_s


def batch_candidates(max_batch: int = MAX_BATCH, min_batch: int = MIN_BATCH) -> list[int]:
    """256, 512, 1024, ... up to ``max_batch`` (the smallest is always included)."""
    sizes, b = [], min_batch
    while b <= max_batch or not sizes:
        sizes.append(b)
        b *= 2
    return sizes


def cpu_learner_cores(physical_cores: int) -> int:
    """Cores reserved for a learner that runs on the CPU: a quarter of the physical cores, 1 to 4.

    Small MLP updates scale poorly past a few torch threads, so cores beyond 4 are better spent on samplers.
    """
    return max(1, min(4, physical_cores // 4))


def _as_measurements(measurements: Iterable) -> list[Measurement]:
    points = [m if isinstance(m, Measurement) else Measurement(*m) for m in measurements]
    points = [Measurement(int(m.batch), float(m.updates_per_s), None if m.gpu_util is None else float(m.gpu_util))
              for m in points]
    return sorted(points, key=lambda m: m.batch)


def _walk(points: list[Measurement], min_gain: float, target_gpu_percent: float,
          min_updates_per_s: float, max_batch: int | None) -> tuple[int, str, bool]:
    """Index of the chosen point, the reason, and whether the walk stopped before the end of the list."""
    if max_batch is not None:
        allowed = [m for m in points if m.batch <= max_batch]
        points = allowed or points[:1]
    first = points[0]
    if first.updates_per_s < min_updates_per_s:
        return 0, (f"even the smallest batch {first.batch} runs only {first.updates_per_s:.0f} updates/s "
                   f"(floor {min_updates_per_s:.0f}/s), so the smallest is used"), True
    if first.gpu_util is not None and first.gpu_util >= target_gpu_percent:
        return 0, (f"batch {first.batch} already keeps the GPU {first.gpu_util:.0f}% busy "
                   f"(target {target_gpu_percent:.0f}%)"), True
    chosen, best_rate = 0, first.frame_rate
    for i in range(1, len(points)):
        cur = points[i]
        gain = cur.frame_rate / best_rate - 1.0 if best_rate > 0 else math.inf
        if cur.updates_per_s < min_updates_per_s:
            return chosen, (f"saturation knee: batch {cur.batch} would drop to {cur.updates_per_s:.0f} updates/s, "
                            f"below the {min_updates_per_s:.0f}/s floor"), True
        if gain < min_gain:
            prev = points[chosen]
            util = f", GPU {prev.gpu_util:.0f}% busy" if prev.gpu_util is not None else ""
            return chosen, (f"saturation knee: {prev.frame_rate:,.0f} frames/s at {prev.updates_per_s:.0f} updates/s"
                            f"{util}; doubling to {cur.batch} adds only {100 * gain:+.0f}% frames/s "
                            f"(needs {100 * min_gain:.0f}%)"), True
        chosen, best_rate = i, max(best_rate, cur.frame_rate)
        if cur.gpu_util is not None and cur.gpu_util >= target_gpu_percent:
            return chosen, (f"GPU {cur.gpu_util:.0f}% busy at batch {cur.batch} (target {target_gpu_percent:.0f}%), "
                            f"{cur.frame_rate:,.0f} frames/s at {cur.updates_per_s:.0f} updates/s"), True
    last = points[chosen]
    util = f", GPU {last.gpu_util:.0f}% busy" if last.gpu_util is not None else ""
    return chosen, (f"largest batch measured ({last.batch}): frame rate still growing, "
                    f"{last.frame_rate:,.0f} frames/s at {last.updates_per_s:.0f} updates/s{util}"), False


def min_gain_for(on_gpu: bool) -> float:
    """The doubling rule's threshold for a learner on a GPU (readable by NVML or not) or on the CPU."""
    return MIN_FRAME_RATE_GAIN if on_gpu else MIN_FRAME_RATE_GAIN_CPU


def choose_batch_size(measurements: Sequence, *, min_gain: float = MIN_FRAME_RATE_GAIN,
                      target_gpu_percent: float = TARGET_GPU_PERCENT,
                      min_updates_per_s: float = MIN_UPDATES_PER_S,
                      max_batch: int | None = None) -> tuple[int, str]:
    """Pick the batch at the saturation knee of the learner's frame rate.

    ``measurements``: ``(batch, updates_per_s, gpu_util or None)`` for growing batches (the sweep stops
    where memory runs out, so more GPU memory means a longer list). Walking up, a doubling is taken while
    it raises the frame rate by ``min_gain`` (:func:`min_gain_for` the learner's device) and keeps
    ``min_updates_per_s``; on a GPU the walk stops at the first batch whose utilisation reaches
    ``target_gpu_percent``.
    """
    points = _as_measurements(measurements)
    if not points:
        raise ValueError("choose_batch_size needs at least one measurement")
    index, reason, _ = _walk(points, min_gain, target_gpu_percent, min_updates_per_s, max_batch)
    allowed = [m for m in points if max_batch is None or m.batch <= max_batch] or points[:1]
    return allowed[index].batch, reason


def sweep_should_stop(measurements: Sequence, *, min_gain: float = MIN_FRAME_RATE_GAIN,
                      min_updates_per_s: float = MIN_UPDATES_PER_S) -> str | None:
    """Why measuring larger batches cannot change the choice any more (None: keep going).

    Larger batches only lower the update rate, so once the frame rate stops growing more points are wasted
    time. The GPU's busy share does not stop the sweep: it ends only the knee rule's walk (which
    :func:`choose_batch_size` applies to the whole sweep), while ``--batch-rule noise`` weighs every swept batch's
    seconds per update, and replayed CUDA graphs keep a GPU busy at any batch (NVML counts the time any kernel
    runs, not how full the GPU is), so a sweep stopped there held the smallest batch alone.

    The sweep does stop at the first doubling that adds less than ``min_gain`` frames/s, so the noise rule
    chooses among the batches up to one past the knee, though with a large noise scale a doubling that adds
    less could still lower seconds per update x (1 + B_noise/B). A bound kept on purpose: the sweep's seconds
    count against the run, and on the 2-core CPU measured, batch 512 learned worse than 256 (docs/benchmarks.md).
    """
    points = _as_measurements(measurements)
    if not points:
        return None
    _, reason, stopped = _walk(points, min_gain, math.inf, min_updates_per_s, None)
    if stopped and len(points) == 1 and points[0].updates_per_s < min_updates_per_s:
        return None  # a slow learner under the floor at the smallest batch: one doubling more, as past a knee,
        # so the noise rule has a second batch to weigh (it may still make faster progress per second)
    return reason if stopped else None


def updates_per_s_at(measurements: Sequence, batch: int) -> float:
    """Update rate at ``batch`` by log-log interpolation of the sweep (flat frame rate beyond its ends)."""
    points = _as_measurements(measurements)
    if not points:
        raise ValueError("no measurements")
    for m in points:
        if m.batch == batch:
            return m.updates_per_s
    if batch <= points[0].batch:
        return points[0].updates_per_s  # smaller batches: the fixed per-update cost dominates
    if batch >= points[-1].batch:
        return points[-1].frame_rate / batch  # beyond the sweep: the frame rate stays at its last value
    for lo, hi in zip(points, points[1:]):
        if lo.batch < batch < hi.batch:
            t = (math.log(batch) - math.log(lo.batch)) / (math.log(hi.batch) - math.log(lo.batch))
            return math.exp((1 - t) * math.log(lo.updates_per_s) + t * math.log(hi.updates_per_s))
    return points[-1].updates_per_s


def choose_samplers(*, logical_cores: int, physical_cores: int, env_step_s: float, mem_available: int,
                    per_sampler_bytes: int, learner_on_gpu: bool, learner_cores: float | None = None,
                    replay_bytes: int = 0, learner_steps_per_s: float | None = None,
                    background_cores: float = 0.0, target_cpu_percent: float = TARGET_CPU_PERCENT,
                    headroom_bytes: int = MEMORY_HEADROOM_BYTES, ingest_cores: float = 0.0,
                    demand_at: str = "at this collect:update ratio", spare_samplers: int = 0) -> tuple[int, str]:
    """Number of sampler processes (at least 1) and the reason.

    * CPU: ``target_cpu_percent`` of the usable logical CPUs, minus what other programs kept busy while
      profiling (``background_cores``), the learner, the evaluator, the supervisor/window and (--ray) the
      ingest process that writes the remote samplers' rows (``ingest_cores``); one sampler keeps one core busy.
    * physical cores (minus a CPU learner's): samplers on hyperthread siblings only add contention.
    * memory: what is available after the replay, the learner, the evaluator, the ``spare_samplers`` (paused
      processes from the start, which the governor may resume) and ``headroom_bytes``, divided by the measured
      memory of one sampler process.
    * learner demand (only with a collect:update ratio): ``learner_steps_per_s`` env steps/s is all the
      learner lets the samplers collect; with ``env_step_s`` per step, more samplers would just wait.
    """
    if learner_cores is None:
        learner_cores = GPU_LEARNER_CORES if learner_on_gpu else cpu_learner_cores(physical_cores)
    logical_cores = max(1, int(logical_cores))
    physical_cores = max(1, min(int(physical_cores), logical_cores))
    budget = target_cpu_percent / 100.0 * logical_cores
    cpu_cores = budget - background_cores - learner_cores - EVALUATOR_CORES - SUPERVISOR_CORES - ingest_cores
    limits = {"CPU": math.floor(cpu_cores + 1e-9)}
    limits["physical cores"] = physical_cores - (0 if learner_on_gpu else math.ceil(learner_cores))
    other_bytes = (LEARNER_MEMORY_FACTOR + 1.0 + spare_samplers) * per_sampler_bytes  # learner, evaluator, spares
    free_bytes = mem_available - replay_bytes - headroom_bytes - other_bytes
    limits["memory"] = math.floor(free_bytes / per_sampler_bytes) if per_sampler_bytes > 0 else 10 ** 6
    if learner_steps_per_s is not None and learner_steps_per_s > 0 and env_step_s > 0:
        limits["learner demand"] = math.ceil(learner_steps_per_s * DEMAND_MARGIN * env_step_s)
    binding = min(limits, key=lambda k: limits[k])
    n = max(1, limits[binding])
    background = f" - {background_cores:.1f} busy with other programs" if background_cores >= 0.05 else ""
    learner = f"{learner_cores:g} learner ({'GPU' if learner_on_gpu else 'CPU'})"
    ingest = f" - {ingest_cores:.2f} ingest of the remote samplers' rows" if ingest_cores > 0 else ""
    cpu_text = (f"{target_cpu_percent:.0f}% of {logical_cores} logical CPUs = {budget:.2f} cores{background} - "
                f"{learner} - {EVALUATOR_CORES:g} evaluator - {SUPERVISOR_CORES:g} supervisor/window{ingest} "
                f"= {cpu_cores:.2f}")
    others = ", ".join(f"{k} {max(v, 0)}" for k, v in limits.items() if k != binding)
    if binding == "CPU":
        head = f"CPU target: {cpu_text}"
    elif binding == "physical cores":
        head = f"physical cores: {physical_cores}" + ("" if learner_on_gpu else f" minus {math.ceil(learner_cores)} for the CPU learner")
    elif binding == "memory":
        spares = f", {spare_samplers} spare sampler(s)" if spare_samplers else ""
        head = (f"memory: {max(free_bytes, 0) / 2**30:.1f} GiB left after replay, learner, evaluator{spares} and "
                f"headroom, {per_sampler_bytes / 2**20:.0f} MiB per sampler")
    else:
        head = (f"learner demand: it consumes ~{learner_steps_per_s:,.0f} env steps/s {demand_at}, "
                f"one sampler makes {1 / env_step_s:,.0f}/s")
    floor_note = "; at least 1" if limits[binding] < 1 else ""
    return n, f"limited by {head}{floor_note} (other limits: {others})"


def choose_batch_by_noise(sweep: Sequence, noise_scale: float | None, buffer_size: int) -> tuple[int, str]:
    """``--batch-rule noise`` at launch: with a critic noise scale measured by an earlier run of this env on
    this machine, the swept batch minimising seconds per update x (1 + B_noise/B); without one, the smallest
    swept batch (the learner measures B_noise and re-decides within its first few thousand updates)."""
    points = [(m.batch, m.updates_per_s) for m in _as_measurements(sweep)]
    if noise_scale is not None and math.isfinite(noise_scale) and noise_scale >= 0 and \
            any(b <= buffer_size for b, _ in points):  # else the smallest, as below
        batch, reason = batch_for_noise_scale(points, noise_scale, max_batch=buffer_size)
        return batch, f"{reason} (noise scale from the last run of this env here; the learner re-decides as it measures)"
    allowed = [b for b, _ in points if b <= buffer_size] or [min(b for b, _ in points)]
    return min(allowed), ("no usable gradient noise scale for this env here yet: the smallest swept batch; the "
                          "learner measures B_noise and re-decides (time per update x (1 + B_noise/B))")


def choose_precision(precision: dict | None, given: bool | None, deterministic: bool = False) -> tuple[bool, str, str]:
    """``(bf16, by, reason)`` for the learner. ``precision``: the probe's timing of both at one batch,
    ``{"batch", "fp32_updates_per_s", "bf16_updates_per_s"}``, or None when it did not time them; ``given``: the
    user's --bf16/--no-bf16, None for unset."""
    if given is not None:
        return bool(given), "user", "given by hand"
    if deterministic:
        return False, "deterministic", "--deterministic: float32, so the curve does not depend on the CPU's bf16 support"
    if precision and precision.get("bf16_error"):  # a profile again would meet the same error
        return False, "default", f"float32: bf16 failed on this device when timed ({precision['bf16_error']})"
    if not precision or not precision.get("fp32_updates_per_s") or precision.get("bf16_updates_per_s") is None:
        return False, "default", "float32: this profile did not time bf16 (--reprofile times it)"
    fp32, bf16 = float(precision["fp32_updates_per_s"]), float(precision["bf16_updates_per_s"])
    speedup = bf16 / fp32
    timed = f"at batch {precision['batch']}: bf16 {bf16:.0f} updates/s against float32 {fp32:.0f} ({speedup:.2f}x"
    if speedup >= BF16_MIN_SPEEDUP:
        return True, "profile", f"{timed}, at least {BF16_MIN_SPEEDUP:g}x)"
    return False, "profile", f"{timed}, under {BF16_MIN_SPEEDUP:g}x)"


def choose_hidden_size(wide: int, narrow: int, *, bf16: bool, on_gpu: bool) -> tuple[int, str]:
    """``(hidden_size, reason)``: ``narrow`` (a preset's offer; 0 for none) for a CPU learner running in float32,
    else ``wide``. ``bf16``: the learner's precision as chosen (or given)."""
    if not narrow or narrow >= wide:
        return wide, "no narrower width offered"
    if on_gpu:
        return wide, f"{wide} units: the learner is on a GPU (narrower layers buy a CPU learner updates)"
    if bf16:
        return wide, f"{wide} units: bf16 autocast pays on this CPU, and the wide layers in bf16 learned faster"
    return narrow, (f"{narrow} units instead of {wide}: a float32 CPU learner sets the pace, and the narrower "
                    f"hidden layers take about {(narrow / wide) ** 2:.2f} of the wide ones' multiply-adds")


def replay_fits(samplers: int, *, buffer_size: int, envs_per_sampler: int, remote_samplers: int = 0,
                warm_up: int = 1, min_region_rows: int = 1) -> bool:
    """Whether the replay split over ``samplers`` (and the remote ones) x ``envs_per_sampler`` envs still holds the
    ``warm_up`` rows and gives each env at least ``min_region_rows`` slots (a write block and its n-step tail):
    the checks a config makes once its sampler count is known (spreeze/config.py: validate)."""
    envs = (samplers + remote_samplers) * envs_per_sampler
    share = buffer_size // max(envs, 1)
    return share >= min_region_rows and share * envs >= warm_up


def plan(measurements: dict, *, samplers_given: int | None, batch_given: int | None, buffer_size: int,
         collect_per_update: float, mem_available: int, replay_bytes: int, replay_ratio: float = 32.0,
         learner_threads_given: int | None = None, background_cores: float = 0.0,
         batch_rule: str = "knee", learner_overlap: bool = False, remote_samplers: int = 0,
         target_cpu_percent: float = TARGET_CPU_PERCENT, cuda_graphs: bool = False,
         replay_split: dict | None = None, spare_samplers: int = 0) -> dict:
    """All choices from one profile (the dict probe.py measures): ``{name: {value, by, reason}}``.

    ``*_given`` are the user's values (None: choose). Pure: plain dicts and numbers in, plain dict out.
    ``learner_overlap``: a CPU learner's actor update has a thread of its own running as many torch threads as the
    critics' thread, so the learner takes twice its cores from the samplers. ``remote_samplers`` (--ray) add to
    the steps/s that feed the learner (counted as fast as a local one) but take none of this machine's cores.
    ``target_cpu_percent`` (--cpu-target-percent) is the share of the CPUs the samplers are sized for, the
    governor's target during the run. ``background_cores`` is 0 for the launch-time choice on purpose: the load
    other programs happened to cause while profiling is transient, and a cached profile must not carry it into
    every later run;
    the run-time :class:`~autotune.governor.CpuGovernor` reacts to load that really persists.
    ``cuda_graphs``: the learner was timed replaying CUDA graphs, which keep a GPU busy at any batch, so the knee
    rule walks on the frame rate alone (NVML's busy share says nothing about how full the GPU is there).
    ``replay_split``: :func:`replay_fits`'s ``envs_per_sampler``, ``warm_up`` and ``min_region_rows``: a chosen
    sampler count is lowered until the replay split over its envs passes the config's checks (and the batch kept
    within what the regions can hold), which a launch otherwise failed only after profiling, at every relaunch.
    """
    cpu, sampler, learner = measurements["cpu"], measurements["sampler"], measurements["learner"]
    on_gpu = bool(learner["on_gpu"])
    sweep = [Measurement(p["batch"], p["updates_per_s"], p.get("gpu_util")) for p in learner["sweep"]]
    chosen = {}
    # --batch-rule noise lets the learner grow the batch during the run: the samplers are provisioned for the
    # largest learner demand among the batches it may take, and the batch is chosen on the rates they can feed
    by_noise = batch_given is None and batch_rule == "noise"
    if batch_given is not None:
        chosen["batch_size"] = {"value": int(batch_given), "by": "user", "reason": "given by hand"}
    elif not by_noise:
        batch, reason = choose_batch_size(sweep, max_batch=buffer_size, min_gain=min_gain_for(on_gpu),
                                          target_gpu_percent=math.inf if cuda_graphs else TARGET_GPU_PERCENT)
        if reason.startswith("largest batch measured") and learner.get("stopped"):
            reason += f"; the sweep ended there: {learner['stopped']}"  # memory, its time budget or its size limit
        chosen["batch_size"] = {"value": batch, "by": "profile", "reason": reason}
    if on_gpu:
        learner_cores = GPU_LEARNER_CORES
    else:
        learner_cores = float(learner_threads_given or learner.get("threads") or cpu_learner_cores(cpu["physical"]))
    chosen["learner_threads"] = {"value": int(learner_threads_given or math.ceil(learner_cores)),
                                 "by": "user" if learner_threads_given else "profile",
                                 "reason": "given by hand" if learner_threads_given else (
                                     "the learner runs on the GPU; one thread drives it" if on_gpu else
                                     f"a quarter of the {cpu['physical']} physical cores, 1 to 4 (measured with this many)")}
    if learner_overlap and not on_gpu:
        learner_cores *= 2.0
        chosen["learner_threads"]["reason"] += "; as many cores again for --learner-overlap's actor update thread"
    ratios = [collect_ratio(collect_per_update, m.batch, replay_ratio) for m in sweep]  # steps per update
    if by_noise:
        demands = [(m.updates_per_s * r, m.batch) for m, r in zip(sweep, ratios) if m.batch <= buffer_size] or \
            [(sweep[0].updates_per_s * ratios[0], sweep[0].batch)]
        demand, top = max(demands)
        demand = demand if demand > 0 else None
        demand_at = f"at batch {top}, the largest learner demand among the batches --batch-rule noise may take"
    else:
        batch = chosen["batch_size"]["value"]
        ratio = collect_ratio(collect_per_update, batch, replay_ratio)
        demand = updates_per_s_at(sweep, batch) * ratio if ratio > 0 else None
        demand_at = "at this collect:update ratio"
    remote_rows = remote_samplers / sampler["env_step_s"]  # what they collect (counted as fast as a local one)
    # the ingest process writes those rows on this machine, up to what the learner consumes
    ingest_cores = min(INGEST_MAX_CORES, min(remote_rows, demand or math.inf) * INGEST_CPU_S_PER_ROW)
    if demand and remote_samplers:  # what the remote samplers collect is not the local ones' to collect
        demand = max(demand - remote_rows, 1e-9)
        demand_at += f", less what {remote_samplers} remote sampler(s) collect (counted as fast as a local one)"
    if samplers_given is not None:
        chosen["samplers"] = {"value": int(samplers_given), "by": "user", "reason": "given by hand"}
    else:
        n, reason = choose_samplers(logical_cores=cpu["logical"], physical_cores=cpu["physical"],
                                    env_step_s=sampler["env_step_s"], mem_available=mem_available,
                                    per_sampler_bytes=sampler["rss_bytes"], learner_on_gpu=on_gpu,
                                    learner_cores=learner_cores, replay_bytes=replay_bytes,
                                    learner_steps_per_s=demand, background_cores=background_cores,
                                    target_cpu_percent=target_cpu_percent, ingest_cores=ingest_cores,
                                    demand_at=demand_at, spare_samplers=spare_samplers)
        if replay_split is not None:
            fitted = n
            while fitted > 1 and not replay_fits(fitted, buffer_size=buffer_size, remote_samplers=remote_samplers,
                                                 **replay_split):
                fitted -= 1
            if fitted < n:
                reason += (f"; {fitted}, not {n}: --buffer-size {buffer_size:,} split over more samplers' envs "
                           "would not hold the warm-up or a write block per env")
                n = fitted
        chosen["samplers"] = {"value": n, "by": "profile", "reason": reason}
    n = chosen["samplers"]["value"]
    sampling = n / sampler["env_step_s"]
    if by_noise:
        feeding = (n + remote_samplers) / sampler["env_step_s"]
        probed = [(m.batch, m.updates_per_s) for m in sweep]
        fed = fed_sweep(probed, feeding, ratios)
        batch, reason = choose_batch_by_noise([Measurement(b, u) for b, u in fed], learner.get("noise_scale"),
                                              buffer_size)
        if capped := first_capped(probed, fed):
            reason += (f"; update rates from batch {capped[0]} on capped at what {n + remote_samplers} sampler(s) "
                       f"collect (~{feeding:,.0f} steps/s)")
        chosen["batch_size"] = {"value": batch, "by": "profile", "reason": reason}
        updates = dict(fed)[batch]
    else:  # the learner runs no faster than the samplers (local and remote) feed it at this ratio
        ratio = collect_ratio(collect_per_update, batch, replay_ratio)
        fed = (n + remote_samplers) / sampler["env_step_s"] / ratio if ratio > 0 else math.inf
        updates = min(updates_per_s_at(sweep, batch), fed)
    # the rows the replay can hold: --buffer-size, less what does not divide evenly over the envs' regions
    envs = (n + remote_samplers) * (replay_split or {}).get("envs_per_sampler", 0)
    holds = buffer_size // envs * envs if envs else buffer_size
    if batch > holds and batch_given is None:  # every batch measured is larger than the replay
        batch = chosen["batch_size"]["value"] = holds
        chosen["batch_size"]["reason"] += f"; the replay holds only {holds:,} rows, so a batch of them all"
    ratio = collect_ratio(collect_per_update, batch, replay_ratio)
    chosen["expected"] = {"sampling_steps_per_s": sampling,
                          "updates_per_s": updates,
                          "update_frame_rate": updates * batch,
                          "learner_demand_steps_per_s": updates * ratio if ratio > 0 else None}
    return chosen
