"""Everything autotune measures, isolated here (the decisions in decide.py only see the numbers).

* :func:`machine_inventory` (fast, every launch): usable logical and physical cores (CPU affinity
  respected), memory, CPU model, and the GPUs NVML reports (none without a driver: normal).
* :func:`cpu_load`: per-core load while we sit idle (psutil's first call only primes the counter).
* :func:`run_probe`: one short-lived ``spawn`` child that first behaves like a sampler (its envs, the
  actor's forward pass, one torch thread; its resident memory is the per-sampler memory), then like the
  learner (``make_algo`` on the devices the run will use, updates on random data over growing batch
  sizes until the saturation rule of decide.py has its answer, memory runs out or the time budget ends).
  The child is time-limited and always reaped. It runs in its own process so that the CUDA context and
  the probe's memory are gone before training starts, and so that its thread settings touch nothing else.

This module imports no torch at module level: the spawned child must set its thread count first.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from autotune import decide
from spreeze.gpu import gpu_inventory
from spreeze.proc import CpuUse, available_memory, child_setup, start_process, stop_process, usable_cores
from spreeze.shm import remove_segments_of


class ProbeFailed(RuntimeError):
    """The probe process failed, crashed or ran out of time before measuring enough."""


@dataclass(frozen=True)
class ProbeSettings:
    load_seconds: float = 0.5
    """seconds of idle per-core CPU load reading before the probe starts"""
    env_seconds: float = 2.0
    """seconds of timed sampler-like stepping (after a short warm-up)"""
    batch_seconds: float = 0.6
    """seconds of timed updates per batch size on a CPU learner"""
    gpu_batch_seconds: float = 1.5
    """seconds of timed updates per batch size on a GPU (NVML's busy figure averages up to 1 s)"""
    warmup_updates: int = 3
    """untimed updates at each new batch size (first-call allocations, cuDNN/cuBLAS heuristics)"""
    max_batch: int = decide.MAX_BATCH
    """largest batch size tried"""
    sweep_budget_s: float = 35.0
    """the learner sweep stops starting new batch sizes after this many seconds"""
    timeout_s: float = 90.0
    """the probe process is killed after this many seconds; what it measured by then is used"""


SHORT_SETTINGS = ProbeSettings(load_seconds=0.2, env_seconds=0.5, batch_seconds=0.25, gpu_batch_seconds=0.5,
                               warmup_updates=1, max_batch=2048, sweep_budget_s=8.0, timeout_s=45.0)


# ----- machine inventory (parent process, fast) ------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_physical_cores(cpus: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may use (hyperthread siblings counted once)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            cpus = set(range(os.cpu_count() or 1))
    cores = set()
    try:
        for cpu in cpus:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        return max(1, len(cores))
    except OSError:  # no sysfs topology (not Linux, containers hiding it): scale psutil's counts to the affinity
        logical_all = psutil.cpu_count(logical=True) or len(cpus)
        physical_all = psutil.cpu_count(logical=False) or logical_all
        return max(1, min(len(cpus), round(physical_all * len(cpus) / logical_all)))


def machine_inventory() -> dict:
    """Cores, memory and GPUs, without any load measurement (a few ms)."""
    memory = psutil.virtual_memory()
    gpus, nvml = gpu_inventory()
    logical = usable_cores()
    return {"cpu_model": cpu_model(), "logical": logical, "physical": min(logical, usable_physical_cores()),
            "memory_total": int(memory.total), "memory_available": available_memory(),  # a container's limit too
            "gpus": gpus, "nvml": nvml, "platform": platform.machine()}


def cpu_load(seconds: float) -> dict:
    """Per-core busy percent of the usable CPUs over ``seconds`` while this process sleeps, and the cores other
    programs kept busy: under a container's CPU quota, those of the quota's cgroup (the host's other tenants use
    none of this run's quota, and their load on the host's cores would read as cores taken from it)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(psutil.cpu_count() or 1))
    meter = CpuUse()
    psutil.cpu_percent(percpu=True)  # the first call only primes the counters
    time.sleep(max(seconds, 0.05))
    per_core = psutil.cpu_percent(percpu=True)
    usable = [float(per_core[c]) for c in cpus if c < len(per_core)] or [float(x) for x in per_core]
    background = sum(usable) / 100.0
    if meter.quota_cpus is not None:
        share = meter.percent()
        if math.isfinite(share):
            background = share / 100.0 * meter.quota_cpus
    return {"per_core_percent": usable, "background_cores": background, "seconds": seconds}


# ----- the probe process -----------------------------------------------------------------------------
def run_probe(config, env_info, settings: ProbeSettings, learner_threads: int,
              on_event: Callable[[str, object], None] = lambda kind, payload: None) -> dict:
    """Measure the sampler and the learner in a spawned child; returns ``{"sampler": ..., "learner": ...}``.

    ``on_event(kind, payload)`` sees the child's progress: ``("phase", name)``, ``("sampler", dict)``,
    ``("precision", dict)``, ``("batch", dict)``. A timeout keeps what was measured if both parts have at least
    one figure, marked ``incomplete`` (with the precision the sweep was timed in, which the learner's final
    message would have carried); otherwise (and on any child error or crash) :class:`ProbeFailed` is raised.
    The child never outlives this call.
    """
    receiver, sender = mp.get_context("spawn").Pipe(duplex=False)
    deadline = time.monotonic() + settings.timeout_s
    sampler, sweep, learner, note, precision = None, [], None, None, None
    process = None
    try:  # the start inside: a Ctrl-C right after it must still reap the child (exit would wait for it)
        process = start_process(_probe_main, sender, config, env_info, asdict(settings), learner_threads,
                                name="spreeze-autotune-probe", watch_parent=True)
        sender.close()
        while learner is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                note = f"probe stopped by its {settings.timeout_s:.0f} s time limit"
                break
            if not receiver.poll(min(0.2, remaining)):
                if not process.is_alive() and not receiver.poll(0):
                    raise ProbeFailed(f"the probe process exited with code {process.exitcode} before finishing")
                continue
            try:
                kind, payload = receiver.recv()
            except EOFError:
                raise ProbeFailed(f"the probe process ended early (exit code {process.exitcode})") from None
            if kind == "error":
                raise ProbeFailed(f"the probe process failed: {payload}")
            if kind == "sampler":
                sampler = payload
            elif kind == "batch":
                sweep.append(payload)
            elif kind == "precision":
                precision = payload
            elif kind == "learner":
                learner = payload
            on_event(kind, payload)
    finally:
        if process is not None:
            _reap(process, finished=learner is not None)
        sender.close()  # a second close is a no-op
        receiver.close()
    if learner is None:
        if sampler is None or not sweep:
            raise ProbeFailed(note or "the probe process measured nothing")
        learner = {"sweep": sweep, "stopped": note, "incomplete": True, "precision": precision}
    return {"sampler": sampler, "learner": learner}


def _reap(process, finished: bool) -> None:
    """Wait briefly for a child that finished; kill one that did not. A child that did not close its shared-memory
    segment (a GPU critic's sweep draws from a replay), killed here or dead of its own (a crash, the OOM killer),
    leaves it to be removed here: nobody else attaches to it."""
    stop_process(process, 2.0 if finished else 0.05)
    if process.exitcode is not None:
        remove_segments_of(process.pid)
    try:
        process.close()
    except ValueError:  # still running after kill: nothing more we can do from here
        pass


def _probe_main(conn, config, env_info, settings: dict, learner_threads: int) -> None:
    """Entry point of the spawned probe process."""
    try:
        child_setup(1)  # as a sampler is set up; OMP_NUM_THREADS before torch is imported (docs/pitfalls.md)
        import torch

        s = ProbeSettings(**settings)
        conn.send(("phase", "sampler"))
        conn.send(("sampler", measure_sampler(config, env_info, s)))
        torch.set_num_threads(max(1, int(learner_threads)))
        conn.send(("phase", "learner"))
        learner = measure_learner(config, env_info, s, learner_threads, lambda kind, payload: conn.send((kind, payload)))
        conn.send(("learner", learner))
    except BaseException:  # report anything, including SystemExit from a SIGTERM handler
        try:
            conn.send(("error", traceback.format_exc(limit=6).strip().splitlines()[-1]))
        except (OSError, ValueError):
            pass
    finally:
        conn.close()


def _memory_of_this_process() -> tuple[int, int | None]:
    process = psutil.Process()
    rss = int(process.memory_info().rss)
    try:
        uss = int(process.memory_full_info().uss)
    except (psutil.AccessDenied, AttributeError, OSError):
        uss = None
    return rss, uss


def measure_sampler(config, env_info, settings: ProbeSettings) -> dict:
    """Step ``envs_per_sampler`` envs with the actor's batched forward pass, like ``sampler.Sampler.step``."""
    import torch

    from spreeze.algos import make_actor
    from spreeze.envs import ActionScaler, make_env

    began = time.perf_counter()
    n_envs = max(1, int(config.envs_per_sampler))
    envs, first = [], []
    for i in range(n_envs):
        env, obs = make_env(config, seed=config.seed * 100_003 + 7_919 + i)
        envs.append(env)
        first.append(obs)
    obs = np.stack(first).astype(np.float32)
    actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
    scale = ActionScaler(env_info.action_low, env_info.action_high)
    sigmas = torch.full((n_envs,), 0.5 * (config.noise_min + config.noise_max))
    setup_s = time.perf_counter() - began

    def step() -> float:
        t = time.perf_counter()
        actions = actor.act(torch.from_numpy(obs), deterministic=False, noise_sigma=sigmas).numpy()
        policy_s = time.perf_counter() - t
        for i, env in enumerate(envs):
            next_obs, _, terminated, truncated, _ = env.step(scale(actions[i]))
            if terminated or truncated:
                next_obs, _ = env.reset()
            obs[i] = next_obs
        return policy_s

    warm_until = time.perf_counter() + min(0.25, settings.env_seconds / 4)
    while time.perf_counter() < warm_until:
        step()
    iterations, policy_total = 0, 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while iterations < 20 or time.perf_counter() - wall0 < settings.env_seconds:
        policy_total += step()
        iterations += 1
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    rss, uss = _memory_of_this_process()
    for env in envs:
        env.close()
    steps = iterations * n_envs
    # CPU seconds, not wall seconds: on a busy machine the wall time includes waiting for a core, and
    # the figure is meant as the cost of a step on a core of its own (the decision gives each sampler one)
    env_step_s = (cpu if cpu > 0 else wall) / steps
    return {"envs": n_envs, "env_step_s": env_step_s, "env_step_wall_s": wall / steps,
            "policy_s": policy_total / iterations, "steps_per_s": 1.0 / env_step_s, "cpu_share": cpu / wall,
            "rss_bytes": rss, "uss_bytes": uss, "setup_s": setup_s, "steps": steps}


def measure_learner(config, env_info, settings: ProbeSettings, threads: int,
                    send: Callable[[str, dict], None] = lambda kind, payload: None) -> dict:
    """Updates per second over growing batch sizes, on the devices the run will use, with random data.
    ``send(kind, payload)`` hears each result as it comes: ``("precision", dict)`` once the precision the sweep
    runs in is timed and chosen, then ``("batch", dict)`` per swept batch."""
    import torch

    from spreeze.algos import make_algo
    from spreeze.defaults import resolve_devices
    from spreeze.mirror import mirror_wanted, open_mirror
    from spreeze.replay import Batch

    actor_device, critic_device = resolve_devices(config)
    devices = list(dict.fromkeys([actor_device, critic_device]))
    cuda_devices = [torch.device(d) for d in devices if d.startswith("cuda")]
    torch.manual_seed(config.seed)
    algo = make_algo(config, env_info.obs_dim, env_info.act_dim, actor_device, critic_device)
    candidates = decide.batch_candidates(max(decide.MIN_BATCH, min(settings.max_batch, config.buffer_size)))
    rows = max(2 * candidates[-1], 4096)  # a pool to gather from: 131,072 rows (~27 MB for Walker2D) at most
    rng = np.random.default_rng(config.seed + 4_242)
    od, ad = env_info.obs_dim, env_info.act_dim
    pool = Batch(rng.standard_normal((rows, od), dtype=np.float32),
                 rng.uniform(-1.0, 1.0, (rows, ad)).astype(np.float32),
                 rng.standard_normal(rows, dtype=np.float32),
                 rng.standard_normal((rows, od), dtype=np.float32),
                 (rng.random(rows) < 0.01).astype(np.float32))

    # the learner's batch source: with the replay mirror (a GPU critic), batches are drawn on the device from a
    # copy of a shared replay holding the pool, so the sweep's knee is that of the path the run takes
    replay = mirror = None
    if mirror_wanted(config, critic_device):
        replay = sweep_replay(pool)
        mirror = open_mirror(config, replay, critic_device, warn=lambda text: None)

    def rebuild(narrower):  # the learner at the width the profile chose, in the precision it chose
        torch.manual_seed(config.seed)
        return make_algo(narrower, od, ad, actor_device, critic_device)

    try:
        return _sweep_learner(algo, pool, rng, mirror, settings, cuda_devices, candidates, devices, threads, send,
                              rebuild)
    finally:
        if mirror is not None:
            mirror.close()
        if replay is not None:
            replay.close()


def sweep_replay(pool) -> "SharedReplay":
    """The replay a GPU critic's sweep draws from, holding ``pool``. No other process uses it, so its lock is a
    thread lock: a spawn context's lock is a named semaphore the resource tracker would name as leaked when the
    probe is killed at its time limit (its segment is removed by :func:`_reap`)."""
    import threading

    from spreeze.replay import SharedReplay

    rows, od = pool.obs.shape
    replay = SharedReplay.create(od, pool.actions.shape[1], rows, 1, threading)
    try:
        replay.write(0, *pool)
    except BaseException:
        replay.close()
        raise
    return replay


def _sweep_learner(algo, pool, rng, mirror, settings: ProbeSettings, cuda_devices: list, candidates: list,
                   devices: list, threads: int, send, rebuild) -> dict:
    import torch

    from spreeze.replay import Batch

    on_gpu, rows = bool(cuda_devices), len(pool.rewards)

    def sync() -> None:
        for device in cuda_devices:
            torch.cuda.synchronize(device)

    def gpu_util() -> float | None:
        values = []
        for device in cuda_devices:
            try:
                values.append(float(torch.cuda.utilization(device)))
            except Exception:  # utilisation is optional: pynvml missing or the board does not report it
                pass
        return max(values) if values else None

    def update(batch_size: int) -> None:
        if mirror is not None:
            algo.update(algo.batch(mirror.sample(batch_size, rng)))
            return
        # gathered like SharedReplay.sample (fancy indexing), then placed and updated as the learner does
        idx = rng.integers(0, rows, size=batch_size)
        algo.update(algo.batch(Batch(*(column[idx] for column in pool))))

    seconds = settings.gpu_batch_seconds if on_gpu else settings.batch_seconds
    precision = None
    if algo.config.bf16 is None:  # unset: time both at the smallest batch; the sweep then runs in the chosen one
        precision = {"batch": candidates[0]}
        for name, bf16 in (("fp32", False), ("bf16", True)):
            algo.config = replace(algo.config, bf16=bf16)
            try:
                rate = _time_batch(update, sync, gpu_util, candidates[0], seconds, settings.warmup_updates)
            except Exception as err:  # bf16 is optional: a device without it must not cost the whole profile
                if not bf16:
                    raise
                precision.update(bf16_updates_per_s=None, bf16_error=f"{type(err).__name__}: {err}"[:200])
                break
            precision[f"{name}_updates_per_s"] = rate["updates_per_s"]
        algo.config = replace(algo.config, bf16=decide.choose_precision(precision, None)[0])
        send("precision", precision)
    # the width as the run will take it (autotune.tune decides again from the same figures): the sweep times it
    width, _ = decide.choose_hidden_size(algo.config.hidden_size, algo.config.narrow_hidden_size,
                                         bf16=bool(algo.config.bf16), on_gpu=on_gpu)
    if width != algo.config.hidden_size:
        algo.close()
        algo = rebuild(replace(algo.config, hidden_size=width, narrow_hidden_size=0))
    sweep: list[dict] = []
    stopped = f"largest batch tried ({candidates[-1]})"
    base_rss = psutil.Process().memory_info().rss
    sweep_end = time.monotonic() + settings.sweep_budget_s
    for batch_size in candidates:
        if sweep and time.monotonic() > sweep_end:
            stopped = f"sweep time budget of {settings.sweep_budget_s:.0f} s used"
            break
        if sweep and not on_gpu:
            grown = psutil.Process().memory_info().rss - base_rss
            if 2 * grown + (1 << 28) > available_memory() - decide.MEMORY_HEADROOM_BYTES:
                stopped = f"memory: batch {batch_size} would not fit"
                break
        try:
            point = _time_batch(update, sync, gpu_util, batch_size, seconds, settings.warmup_updates)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            stopped = f"GPU memory ran out at batch {batch_size}"
            break
        sweep.append(point)
        send("batch", point)
        reason = decide.sweep_should_stop([(p["batch"], p["updates_per_s"], p["gpu_util"]) for p in sweep],
                                          min_gain=decide.min_gain_for(on_gpu))
        if reason:
            stopped = reason
            break
        if on_gpu:
            fits = True
            for device in cuda_devices:
                free, _ = torch.cuda.mem_get_info(device)
                if 2.2 * torch.cuda.max_memory_allocated(device) > free + torch.cuda.memory_reserved(device):
                    fits = False
            if not fits:
                stopped = f"GPU memory: batch {2 * batch_size} would not fit"
                break
    names = [torch.cuda.get_device_name(d) for d in cuda_devices]
    return {"devices": devices, "on_gpu": on_gpu, "gpu_names": names, "threads": int(threads),
            "sweep": sweep, "stopped": stopped, "replay_mirror": mirror is not None, "precision": precision,
            "hidden_size": int(width)}


def _time_batch(update, sync, gpu_util, batch_size: int, seconds: float, warmup_updates: int) -> dict:
    """Best of three timed chunks (interference from other programs only ever slows a chunk down)."""
    warm_began = time.perf_counter()
    for i in range(max(1, warmup_updates)):
        update(batch_size)
        if i == 0:
            sync()
            if time.perf_counter() - warm_began > seconds / 3:  # a slow update: one warm-up is enough
                break
    sync()
    rates, utils = [], []
    chunk = seconds / 3
    for _ in range(3):
        count, began = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - began < chunk:
            update(batch_size)
            count += 1
        sync()
        rates.append(count / (time.perf_counter() - began))
        util = gpu_util()
        if util is not None:
            utils.append(util)
    steady = utils[1:] or utils  # NVML averages over the last up to 1 s: the first chunk still sees warm-up
    return {"batch": batch_size, "updates_per_s": max(rates), "gpu_util": statistics.median(steady) if steady else None,
            "chunk_rates": rates}


def devices_for(config) -> tuple[str, str]:
    """The learner's devices as the run will place them (imports torch: fine in the parent, spawn only)."""
    from spreeze.defaults import resolve_devices

    return resolve_devices(config)


def planned_learner_threads(config, on_gpu: bool, physical_cores: int) -> int:
    """The learner's torch threads in the run (spreeze.defaults.learner_threads): one with --deterministic, and one
    with --serial, where this process is every role."""
    if config.deterministic:
        return 1
    if getattr(config, "serial", False) and not config.learner_threads:
        return 1
    if config.learner_threads:
        return int(config.learner_threads)
    return 1 if on_gpu else decide.cpu_learner_cores(physical_cores)


__all__ = ["ProbeFailed", "ProbeSettings", "SHORT_SETTINGS", "cpu_load", "cpu_model", "devices_for",
           "gpu_inventory", "machine_inventory", "measure_learner", "measure_sampler", "planned_learner_threads",
           "run_probe", "usable_physical_cores"]
