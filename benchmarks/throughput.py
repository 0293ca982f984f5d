"""Throughput of the framework against its limits (Spreeze Table 1, measured as ratios).

For each sampler count it measures, on this machine:
- sampling Hz of a real training run (free-running, no ratio control);
- the env's own limit, right after that run: one process stepping the bare env, no framework. Two action
  sequences are first recorded, untimed, from one reset seed: the run's trained actor acting with its
  exploration as a sampler does (``actor.act(obs, deterministic=False)``, loaded from ``final/actor.pt``),
  and uniform random actions. The same timed loop then resets the env with that seed and replays each
  sequence (alternating, so both see the same machine load; no forward pass and no action drawing inside
  the timed loop), so the two figures differ only in the actions:
  ``raw_env_hz_policy`` (the limit) and ``raw_env_hz_random`` (for comparison; Walker2D's physics is
  cheaper under random actions). ``policy_replay_reproduced``: every replay ended on the recorded
  observation, i.e. stepped the recorded trajectory;
- the sampling efficiency = framework Hz / (samplers x raw_env_hz_policy), and
  ``sampling_efficiency_vs_random`` against the random-action figure;
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.common import figure, machine, markdown_table, results_dir, save_figure, write_csv
from spreeze.proc import subnormals_flushed

POLICY_ROLLOUT_SEED = 20_261_126  # the recorded rollout and its timed replays start from this reset seed


@dataclass
class Recording:
    """A rollout of the bare env: reset with ``seed``, then ``actions[i]`` (env units, as given to
    ``env.step``) led to ``observations[i]`` (the observation after a reset when the episode ended there)."""
    env_id: str
    seed: int
    actions: np.ndarray
    observations: np.ndarray
    episode_ends: int


def exploring_policy(actor, scale, noise_sigma: float, seed: int):
    """``obs -> env action`` acting as a sampler does: the actor with its exploration (SAC samples its
    Gaussian; TD3 adds noise of ``noise_sigma``), one observation per call, its noise from ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    sigma = torch.tensor([noise_sigma], dtype=torch.float32)

    def act(obs) -> np.ndarray:
        with torch.no_grad():
            action = actor.act(torch.from_numpy(np.asarray(obs, np.float32)[None]), deterministic=False,
                               noise_sigma=sigma, generator=generator)
        return scale(action[0].numpy())
    return act


def uniform_actions(low, high, seed: int):
    """``obs -> env action`` drawn uniformly from the action box (what the old raw env Hz stepped with)."""
    rng = np.random.default_rng(seed)
    low, high = np.asarray(low, np.float32), np.asarray(high, np.float32)
    return lambda obs: rng.uniform(low, high).astype(np.float32)


def record_rollout(env_id: str, act, seed: int, steps: int, max_seconds: float = float("inf")) -> Recording:
    """Untimed: step the bare env from ``reset(seed)`` with ``act(obs)`` (``steps`` times, or fewer once
    ``max_seconds`` have passed), resetting at episode ends as the sampler does; keep every action and
    observation."""
    from spreeze.envs import make_env

    env, obs = make_env(env_id, seed)
    actions, observations, ends = [], [], 0
    begun = time.perf_counter()
    try:
        for _ in range(steps):
            if time.perf_counter() - begun >= max_seconds:
                break
            action = np.asarray(act(obs), dtype=np.float32)
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
                ends += 1
            actions.append(action)
            observations.append(np.asarray(obs, np.float32))
    finally:
        env.close()
    return Recording(env_id, seed, np.stack(actions), np.stack(observations), ends)


def replay_observations(recording: Recording) -> np.ndarray:
    """Untimed: the observations of one replay of ``recording`` (equal to the recorded ones when the env is
    deterministic given its reset seed, so a replay steps the same trajectory)."""
    from spreeze.envs import make_env

    env, obs = make_env(recording.env_id, recording.seed)
    out = np.empty_like(recording.observations)
    try:
        for i, action in enumerate(recording.actions):
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
            out[i] = obs
    finally:
        env.close()
    return out


def replay_env_hz(recording: Recording, seconds: float) -> dict:
    """Env steps/s of the bare env replaying ``recording`` (no forward pass in the timed loop): passes over
    it, each from ``reset(seed)``, until ``seconds`` have passed and at least one pass is complete.
    ``reproduced``: every complete pass ended on the recorded final observation (the same trajectory)."""
    from spreeze.envs import make_env

    env, _ = make_env(recording.env_id, recording.seed)
    actions, last = recording.actions, len(recording.actions) - 1
    steps = passes = mismatches = i = 0
    begun = time.perf_counter()
    try:
        while True:
            obs, _, terminated, truncated, _ = env.step(actions[i])
            if terminated or truncated:
                obs, _ = env.reset()
            steps += 1
            if i == last:
                passes += 1
                mismatches += not np.array_equal(np.asarray(obs, np.float32), recording.observations[-1])
                env.reset(seed=recording.seed)
                i = 0
                if time.perf_counter() - begun >= seconds:
                    break
                continue
            i += 1
            if passes and time.perf_counter() - begun >= seconds:
                break
        elapsed = time.perf_counter() - begun
    finally:
        env.close()
    return {"hz": steps / elapsed, "steps": steps, "seconds": elapsed, "passes": passes,
            "reproduced": mismatches == 0}


def env_limits(env_id: str, policy, noise_sigma: float, seconds: float, rounds: int = 2) -> dict:
    """The bare env's step rate under uniform random actions and under the trained policy's actions (with
    its exploration). Both action sequences are recorded first, untimed, from the same reset seed; then
    identical timed loops replay them, alternating ``rounds`` times (``seconds`` in all, half per kind), so
    that both see the same load on the machine and differ only in the actions."""
    recordings = {
        "random": record_rollout(env_id, uniform_actions(policy.scale.low, policy.scale.high, POLICY_ROLLOUT_SEED),
                                 POLICY_ROLLOUT_SEED, 50_000, max_seconds=seconds / 8),
        "policy": record_rollout(env_id, exploring_policy(policy.actor, policy.scale, noise_sigma, POLICY_ROLLOUT_SEED),
                                 POLICY_ROLLOUT_SEED, 50_000, max_seconds=seconds / 8),
    }
    totals = {kind: {"steps": 0, "seconds": 0.0, "passes": 0, "reproduced": True} for kind in recordings}
    for _ in range(rounds):
        for kind, recording in recordings.items():
            replay = replay_env_hz(recording, seconds / (2 * rounds))
            total = totals[kind]
            total["steps"] += replay["steps"]
            total["seconds"] += replay["seconds"]
            total["passes"] += replay["passes"]
            total["reproduced"] &= replay["reproduced"]
    policy_recording = recordings["policy"]
    return {"raw_env_hz_random": totals["random"]["steps"] / totals["random"]["seconds"],
            "raw_env_hz_policy": totals["policy"]["steps"] / totals["policy"]["seconds"],
            "recorded_steps": len(policy_recording.actions), "recorded_episode_ends": policy_recording.episode_ends,
            "replay_passes": totals["policy"]["passes"],
            "replay_reproduced": totals["random"]["reproduced"] and totals["policy"]["reproduced"]}


@subnormals_flushed()  # as the learner and the samplers compute
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


@subnormals_flushed()  # as the learner and the samplers compute
def isolated_learner(config, env_info, seconds: float, threads: int, prefetch: bool | None = None) -> dict:
    """The learner's own loop (sample from a shared replay + update) with nothing else running; ``prefetch``
    None gathers batches in a thread when on a GPU, as the learner does."""
    import torch

    from spreeze.algos import make_algo
    from spreeze.defaults import resolve_devices
    from spreeze.learner import BatchPrefetcher
    from spreeze.mirror import open_mirror
    from spreeze.replay import SharedReplay

    torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    replay = SharedReplay.create(env_info.obs_dim, env_info.act_dim, 100_000, 4, ctx)
    prefetcher = mirror = None
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
        # the learner's own batch source (Learner.batch_source): the replay mirror with --replay-mirror, else the
        # shared replay; a prefetch thread when it runs on a GPU, as in Learner.next_batch
        mirror = open_mirror(config, replay, devices[1])
        source = mirror or replay
        if prefetch is None:
            prefetch = any(d.startswith("cuda") for d in devices)
        prefetcher = BatchPrefetcher(source, config.batch_size, rng) if prefetch else None
        next_batch = prefetcher.next if prefetcher else (lambda: source.sample(config.batch_size, rng))
        for _ in range(10):
            algo.update(algo.batch(next_batch()))

        def sync() -> None:  # queued GPU work (CUDA graph replays queue far ahead) is counted when it has run
            for device in {d for d in devices if d.startswith("cuda")}:
                torch.cuda.synchronize(device)

        sync()
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
        sync()
        elapsed = time.perf_counter() - begun
        return {"update_hz": updates / elapsed, "update_frame_rate": updates * config.batch_size / elapsed,
                "fetch_share": fetch / (fetch + update)}
    finally:
        if prefetcher is not None:
            prefetcher.close()
        if mirror is not None:
            mirror.close()
        replay.close()


def in_system(config, env_info, seconds: float):
    """A real training run of ``seconds``; its summary and its trained actor (``final/actor.pt``)."""
    import spreeze
    from launch.compose import train

    with tempfile.TemporaryDirectory() as tmp:
        run_config = replace(config, minutes=seconds / 60.0, total_steps=0, run_dir=str(Path(tmp) / "run"),
                             log_interval_s=2.0)
        result = train(run_config, env_info, log=lambda *_: None)
        if result.exit_code != 0:
            raise RuntimeError(f"benchmark run failed with exit code {result.exit_code}")
        return result.summary, spreeze.load_policy(result.run_dir)


def plot(rows: list[dict], env_id: str, path: Path) -> None:
    """The distance from the limits, one group of bars per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["sampling_efficiency", "sampling_efficiency_vs_random", "efficiency_vs_sampler_alone",
            "learner_efficiency", "fetch_share"]
    fig, ax = plt.subplots(figsize=(max(6.5, 2.5 + 2.2 * len(rows)), 4.5))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(rows))]
        label = key.replace("_", " ") + (" (policy actions)" if key == "sampling_efficiency" else "")
        ax.bar(xs, [row[key] for row in rows], width, label=label)
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
    parser.add_argument("--replay-mirror", choices=["auto", "on", "off"], default="auto",
                        help="batches from a copy of the replay in GPU memory (auto: with a GPU learner)")
    parser.add_argument("--side-seconds", type=float, default=0.0,
                        help="seconds for each measurement beside the run (the learner alone, a sampler alone, the "
                             "bare env); 0: a third of --seconds, at most 10 (15 for the learner)")
    parser.add_argument("--tag", default=None, help="results sub-folder (default: from this machine)")
    parser.add_argument("--out", default=None, help="results folder (overrides --tag)")
    args = parser.parse_args(argv)

    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.sampler import mixed_noise_sigmas
    from spreeze.defaults import learner_threads, resolve

    env_info = check_env(args.env)
    side = args.side_seconds
    limit_s = side or min(10.0, args.seconds / 3)
    rows = []
    for samplers in args.samplers or [0]:
        for batch_size in args.batch_sizes:
            config = resolve(Config(env_id=args.env, algo=args.algo, samplers=samplers, batch_size=batch_size,
                                    envs_per_sampler=args.envs_per_sampler, collect_per_update=0, spare_samplers=0,
                                    window=False, replay_mirror=args.replay_mirror,
                                    learning_starts=args.learning_starts, total_steps=0, minutes=1))
            if samplers == 0 or batch_size == 0:  # the autotuned choice (cached profile, else a measurement)
                from autotune import tune

                explicit = {name for name, value in (("samplers", samplers), ("batch_size", batch_size)) if value}
                config, _ = tune(replace(config, samplers=samplers, batch_size=batch_size), env_info, explicit,
                                 log=lambda *_: None, progress=False)
            config = replace(config, bf16=bool(config.bf16))  # given rows (not tuned) run float32, as the row says
            threads = learner_threads(config)
            alone = isolated_learner(config, env_info, side or min(15.0, args.seconds / 3), threads)
            sampler_hz = sampler_alone_hz(config, env_info, side or min(10.0, args.seconds / 3))
            summary, policy = in_system(config, env_info, args.seconds)
            limits = env_limits(args.env, policy, float(mixed_noise_sigmas(config, 1)[0]), limit_s)
            print(f"raw_env_hz_random: {limits['raw_env_hz_random']:.1f}  raw_env_hz_policy: "
                  f"{limits['raw_env_hz_policy']:.1f} (policy rollout from reset seed {POLICY_ROLLOUT_SEED}: "
                  f"{limits['recorded_steps']} steps, {limits['recorded_episode_ends']} episode ends, replayed "
                  f"{limits['replay_passes']} times; every replay on the recorded trajectory: "
                  f"{limits['replay_reproduced']})", flush=True)
            sampling_hz = summary["sampling_frame_rate_hz"]
            row = {
                "env": args.env, "samplers": config.samplers, "envs_per_sampler": config.envs_per_sampler,
                "batch_size": config.batch_size, "replay_mirror": config.replay_mirror, "bf16": config.bf16,
                "cpu_usage_percent": figure(summary, "cpu_usage_percent"),
                "gpu_usage_percent": summary["gpu_usage_percent"] if summary["gpu_usage_percent"] is not None else "none",
                "raw_env_hz_random": limits["raw_env_hz_random"], "raw_env_hz_policy": limits["raw_env_hz_policy"],
                "policy_replay_reproduced": limits["replay_reproduced"], "sampling_hz": sampling_hz,
                "sampling_efficiency": sampling_hz / (config.samplers * limits["raw_env_hz_policy"]),
                "sampling_efficiency_vs_random": sampling_hz / (config.samplers * limits["raw_env_hz_random"]),
                "sampler_alone_hz": sampler_hz,
                "efficiency_vs_sampler_alone": sampling_hz / (config.samplers * sampler_hz),
                "isolated_update_frame_rate": alone["update_frame_rate"],
                "update_frame_rate": summary["update_frame_rate_hz"],
                "update_frequency_hz": summary["update_frequency_hz"],
                "learner_efficiency": summary["update_frame_rate_hz"] / alone["update_frame_rate"],
                "fetch_share": figure(summary, "fetch_share"), "isolated_fetch_share": alone["fetch_share"],
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
        for key in ("raw_env_hz_random", "raw_env_hz_policy", "sampling_hz", "sampling_efficiency",
                    "sampling_efficiency_vs_random", "sampler_alone_hz", "efficiency_vs_sampler_alone",
                    "update_frame_rate", "isolated_update_frame_rate", "learner_efficiency", "fetch_share"):
            print(f"{prefix}{key}: {row[key]:.4g}")
    print(f"results: {out / stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
