"""Throughput of the framework against its limits (Spreeze Table 1, measured as ratios).

For each sampler count it measures, on this machine:
- raw env Hz: one process stepping the env with random actions, no framework;
- sampling Hz of a real training run (free-running, no ratio control) and the sampling efficiency
  = framework Hz / (samplers x raw Hz);
- the update frame rate of the update loop alone (same batch, threads and device, random data in a
  shared replay) against the in-system one (learner efficiency), and the share of learner time spent
  fetching data from the replay (Spreeze measured 20 % with queues).

    python -m benchmarks.throughput --env Walker2DBulletEnv-v0 --seconds 60 --samplers 1 --envs-per-sampler 4
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import machine, markdown_table, results_dir, save_figure, write_csv


def raw_env_hz(env_id: str, seconds: float) -> float:
    from spreeze.envs import make_env

    env, _ = make_env(env_id, seed=0)
    steps, begun = 0, time.perf_counter()
    while time.perf_counter() - begun < seconds:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        if terminated or truncated:
            env.reset()
    env.close()
    return steps / (time.perf_counter() - begun)


def sampler_alone_hz(config, env_info, seconds: float) -> float:
    """One sampler (policy forward, exploration, replay writes) with nothing else running: the framework's
    per-process ceiling, to tell its overhead apart from contention with the learner."""
    import torch
    from dataclasses import replace as dc_replace

    from spreeze.algos import make_actor
    from spreeze.replay import SharedReplay
    from spreeze.sampler import Sampler
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    torch.set_num_threads(1)
    config = dc_replace(config, samplers=1, spare_samplers=0, learning_starts=0, collect_per_update=0)
    ctx = mp.get_context("spawn")
    replay = SharedReplay.create(env_info.obs_dim, env_info.act_dim, 200_000, config.envs_per_sampler, ctx)
    weights = SharedWeights.create(make_actor(config, env_info.obs_dim, env_info.act_dim), ctx)
    stats = SharedStats.create(1)
    sampler = Sampler(0, config, env_info, replay, weights, stats)
    try:
        begun = time.perf_counter()
        while time.perf_counter() - begun < seconds:
            sampler.step()
        return stats.total_env_steps() / (time.perf_counter() - begun)
    finally:
        sampler.close()
        del sampler
        for shared in (replay, weights, stats):
            shared.close()


def isolated_learner(config, env_info, seconds: float, threads: int, prefetch: bool | None = None) -> dict:
    """The learner's own loop (sample from a shared replay + update) with nothing else running; ``prefetch``
    None gathers batches in a thread when on a GPU, as the learner does."""
    import torch

    from spreeze.algos import make_algo
    from spreeze.learner import BatchPrefetcher, resolve_devices
    from spreeze.replay import SharedReplay

    torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    replay = SharedReplay.create(env_info.obs_dim, env_info.act_dim, 100_000, 4, ctx)
    prefetcher = None
    try:
        rng = np.random.default_rng(0)
        for region in range(4):
            n = replay.region_capacity
            replay.write(region, rng.standard_normal((n, env_info.obs_dim), dtype=np.float32),
                         rng.uniform(-1, 1, (n, env_info.act_dim)).astype(np.float32),
                         rng.standard_normal(n, dtype=np.float32), rng.standard_normal((n, env_info.obs_dim), dtype=np.float32),
                         np.zeros(n, np.float32))
        devices = resolve_devices(config)
        algo = make_algo(config, env_info.obs_dim, env_info.act_dim, *devices)
        # the learner's own batch source: a prefetch thread when it runs on a GPU, as in Learner.next_batch
        if prefetch is None:
            prefetch = any(d.startswith("cuda") for d in devices)
        prefetcher = BatchPrefetcher(replay, config.batch_size, rng) if prefetch else None
        next_batch = prefetcher.next if prefetcher else (lambda: replay.sample(config.batch_size, rng))
        for _ in range(10):
            algo.update(algo.batch(next_batch()))
        fetch = update = 0.0
        updates, begun = 0, time.perf_counter()
        while time.perf_counter() - begun < seconds:
            t0 = time.perf_counter()
            batch = algo.batch(next_batch())
            t1 = time.perf_counter()
            algo.update(batch)
            t2 = time.perf_counter()
            fetch += t1 - t0
            update += t2 - t1
            updates += 1
        elapsed = time.perf_counter() - begun
        return {"update_hz": updates / elapsed, "update_frame_rate": updates * config.batch_size / elapsed,
                "fetch_share": fetch / (fetch + update)}
    finally:
        if prefetcher is not None:
            prefetcher.close()
        replay.close()


def in_system(config, env_info, seconds: float) -> dict:
    from spreeze.supervisor import train

    with tempfile.TemporaryDirectory() as tmp:
        run_config = replace(config, minutes=seconds / 60.0, total_steps=0, run_dir=str(Path(tmp) / "run"),
                             log_interval_s=2.0)
        result = train(run_config, env_info, log=lambda *_: None)
    if result.exit_code != 0:
        raise RuntimeError(f"benchmark run failed with exit code {result.exit_code}")
    return result.summary


def plot(rows: list[dict], env_id: str, path: Path) -> None:
    """The distance from the limits, one group of bars per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["sampling_efficiency", "efficiency_vs_sampler_alone", "learner_efficiency", "fetch_share"]
    fig, ax = plt.subplots(figsize=(max(6.5, 2.5 + 2.2 * len(rows)), 4.5))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [row[key] for row in rows], width, label=key.replace("_", " "))
    ax.axhline(0.85, color="grey", linestyle=":", linewidth=0.8)
    ax.axhline(0.05, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['samplers']} x {r['envs_per_sampler']}, batch {r['batch_size']}" for r in rows])
    ax.set_ylim(0, 1.1)
    ax.set_title(f"{env_id}: distance from the limits\n(dotted: efficiency target 0.85, fetch share target 0.05)", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="Walker2DBulletEnv-v0")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of each in-system run")
    parser.add_argument("--samplers", type=int, nargs="*", default=[], help="sampler counts (default: the automatic one)")
    parser.add_argument("--envs-per-sampler", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[0], help="batch sizes (0: the automatic one)")
    parser.add_argument("--algo", default="sac")
    parser.add_argument("--learning-starts", type=int, default=2000)
    parser.add_argument("--tag", default=None, help="results sub-folder (default: from this machine)")
    parser.add_argument("--out", default=None, help="results folder (overrides --tag)")
    args = parser.parse_args(argv)

    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.proc import usable_cores
    from spreeze.supervisor import resolve

    env_info = check_env(args.env)
    raw_hz = raw_env_hz(args.env, min(10.0, args.seconds / 3))
    print(f"raw_env_hz: {raw_hz:.1f}")
    rows = []
    for samplers in args.samplers or [0]:
        for batch_size in args.batch_sizes:
            config = resolve(Config(env_id=args.env, algo=args.algo, samplers=samplers, batch_size=batch_size,
                                    envs_per_sampler=args.envs_per_sampler, collect_per_update=0, spare_samplers=0,
                                    window=False,
                                    learning_starts=args.learning_starts, total_steps=0, minutes=1))
            if samplers == 0 or batch_size == 0:  # the autotuned choice (cached profile, else a measurement)
                from autotune import tune

                explicit = {name for name, value in (("samplers", samplers), ("batch_size", batch_size)) if value}
                config, _ = tune(replace(config, samplers=samplers, batch_size=batch_size), env_info, explicit,
                                 log=lambda *_: None, progress=False)
            threads = config.learner_threads or max(1, usable_cores() - config.samplers)
            alone = isolated_learner(config, env_info, min(15.0, args.seconds / 3), threads)
            sampler_hz = sampler_alone_hz(config, env_info, min(10.0, args.seconds / 3))
            summary = in_system(config, env_info, args.seconds)
            row = {
                "env": args.env, "samplers": config.samplers, "envs_per_sampler": config.envs_per_sampler,
                "batch_size": config.batch_size, "cpu_usage_percent": summary["cpu_usage_percent"],
                "gpu_usage_percent": summary["gpu_usage_percent"] if summary["gpu_usage_percent"] is not None else "none",
                "raw_env_hz": raw_hz, "sampling_hz": summary["sampling_frame_rate_hz"],
                "sampling_efficiency": summary["sampling_frame_rate_hz"] / (config.samplers * raw_hz),
                "sampler_alone_hz": sampler_hz,
                "efficiency_vs_sampler_alone": summary["sampling_frame_rate_hz"] / (config.samplers * sampler_hz),
                "isolated_update_frame_rate": alone["update_frame_rate"],
                "update_frame_rate": summary["update_frame_rate_hz"],
                "update_frequency_hz": summary["update_frequency_hz"],
                "learner_efficiency": summary["update_frame_rate_hz"] / alone["update_frame_rate"],
                "fetch_share": summary["fetch_share"], "isolated_fetch_share": alone["fetch_share"],
            }
            rows.append(row)
    out = Path(args.out) if args.out else results_dir(args.tag)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput-{args.env}"
    write_csv(out / f"{stem}.csv", rows)
    plot(rows, args.env, out / f"{stem}.png")
    (out / f"{stem}.machine.json").write_text(json.dumps(machine(), indent=2))
    print(markdown_table(rows))
    for row in rows:
        prefix = "" if len(rows) == 1 else f"samplers={row['samplers']},batch={row['batch_size']} "
        for key in ("sampling_hz", "sampling_efficiency", "sampler_alone_hz", "efficiency_vs_sampler_alone", "update_frame_rate", "isolated_update_frame_rate",
                    "learner_efficiency", "fetch_share"):
            print(f"{prefix}{key}: {row[key]:.4g}")
    print(f"results: {out / stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
