"""Update frame rate of the learner's loop alone, per device, batch size and precision.

The loop is the learner's own (a batch gathered from a shared replay of random transitions, moved to the
devices, one SAC or TD3 update), with nothing else running: the ceiling that ``throughput`` compares the
in-system rate with, and the figure that tells how large a batch a GPU wants.

    python -m benchmarks.updates --env Pendulum-v1 --actor-device cuda:0 --batch-sizes 256 4096 16384
    python -m benchmarks.updates --env Walker2d-v5 --actor-device cuda:0 --cuda-graphs off on --precisions fp32
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
from pathlib import Path

from benchmarks.common import machine, markdown_table, results_dir, write_csv
from benchmarks.throughput import isolated_learner


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Walker2DBulletEnv-v0")
    parser.add_argument("--algo", default="sac")
    parser.add_argument("--actor-device", default="cpu")
    parser.add_argument("--critic-device", default="auto", help="auto: cuda:1 with two GPUs, else the actor's")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU devices)")
    parser.add_argument("--prefetch", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                        help="batch gathering in a thread: auto (on with a GPU, as the learner does), on, off")
    parser.add_argument("--mirror", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                        help="--replay-mirror: batches drawn on the device from a copy of the replay (auto: on a GPU)")
    parser.add_argument("--cuda-graphs", nargs="+", choices=["auto", "off", "on"], default=["auto"],
                        help="--cuda-graphs: updates replayed as CUDA graphs; auto: as a run chooses (on for a "
                             "learner on one GPU)")
    parser.add_argument("--project-args", default="--preset none",
                        help="run.py flags of the measured learner (e.g. '--critic-atoms 101 --policy-delay 2'), as one "
                             "quoted string; without '--preset none' the env's preset applies, as in a run")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of each measurement")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/<machine>)")
    args = parser.parse_args(argv)

    from spreeze.defaults import cuda_graphs_default, resolve_devices
    from spreeze.envs import check_env
    from spreeze.settings import parse_config

    env_info = check_env(args.env)
    base = parse_config(["--env", args.env, "--algo", args.algo, *shlex.split(args.project_args)],
                        prog="benchmarks.updates")
    rows = []
    for graphs, mirror, prefetch, precision, batch_size in itertools.product(
            args.cuda_graphs, args.mirror, args.prefetch, args.precisions, args.batch_sizes):
        config = dataclasses.replace(base, batch_size=batch_size, bf16=precision == "bf16",
                                     actor_device=args.actor_device, critic_device=args.critic_device,
                                     replay_mirror=mirror,
                                     cuda_graphs={"auto": base.cuda_graphs, "on": True, "off": False}[graphs])
        actor_device, critic_device = resolve_devices(config)
        if config.cuda_graphs is None:  # as the run's launch chooses
            config = dataclasses.replace(config, cuda_graphs=cuda_graphs_default(config, actor_device,
                                                                                 critic_device)[0])
        graphs = "on" if config.cuda_graphs else "off"
        measured = isolated_learner(config, env_info, args.seconds, args.threads,
                                    prefetch={"auto": None, "on": True, "off": False}[prefetch])
        rows.append({"env": args.env, "algo": args.algo, "project_args": args.project_args,
                     "actor_device": actor_device, "critic_device": critic_device,
                     "cuda_graphs": graphs, "mirror": mirror, "prefetch": prefetch, "precision": precision, "batch_size": batch_size,
                     "update_hz": measured["update_hz"], "update_frame_rate": measured["update_frame_rate"],
                     "fetch_share": measured["fetch_share"]})
        print(f"graphs {graphs}, mirror {mirror}, prefetch {prefetch}, {precision}, batch {batch_size}: {measured['update_hz']:.1f} updates/s, "
              f"{measured['update_frame_rate']:,.0f} frames/s, fetch share {measured['fetch_share']:.3f}", flush=True)
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    stem = f"updates-{args.env}-{args.actor_device.replace(':', '')}"
    write_csv(out / f"{stem}.csv", rows)
    (out / f"{stem}.machine.json").write_text(json.dumps(machine(), indent=2))
    print(markdown_table(rows))
    best = max(rows, key=lambda r: r["update_frame_rate"])
    print(f"best_update_frame_rate: {best['update_frame_rate']:.0f}")
    print(f"best_batch_size: {best['batch_size']}")
    print(f"best_precision: {best['precision']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
