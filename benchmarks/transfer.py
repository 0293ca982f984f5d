"""Shared-memory replay against multiprocessing.Queue (Spreeze Fig. 3a ablation), measured as ratios.

The same training run, free-running (``--collect-per-update 0``) so that transfer speed is what limits
it, once with samplers writing into the shared replay and once per queue size with samplers sending
their write blocks through a ``multiprocessing.Queue`` to a replay of the learner's own. For each it
reports the learner's time spent receiving data (fetch share of its busy time, and milliseconds per
update), the experience transfer rate, the update rate, and the test return reached after the same wall
time. Prints a markdown table and ``name: value`` lines; writes CSV and PNG under
``benchmarks/results/<machine>/``.

    python -m benchmarks.transfer --env Walker2DBulletEnv-v0 --seconds 180 --queue-sizes 4 64 1024
"""
from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import (figure, machine, markdown_table, parser_for, results_dir, run_spreeze, save_figure,
                               write_csv)

LAST_TESTS = 3


def bytes_per_transition(obs_dim: int, act_dim: int) -> int:
    """float32 obs, action, reward, next obs and terminated flag: what one transition moves."""
    return 4 * (2 * obs_dim + act_dim + 2)


def measure(name: str, curve: list[dict], summary: dict, transition_bytes: int) -> dict:
    """One table row from a run's summary and test curve (every figure measured by the run itself)."""
    update_hz = summary["update_frequency_hz"]
    fetch_share = figure(summary, "fetch_share")
    returns = [p["test_return"] for p in curve]
    return {
        "transport": name,
        "sampling_hz": summary["sampling_frame_rate_hz"],
        "transfer_mb_s": summary["sampling_frame_rate_hz"] * transition_bytes / 1e6,
        "update_frequency_hz": update_hz,
        "update_frame_rate": summary["update_frame_rate_hz"],
        "fetch_share": fetch_share,
        # free-running, the learner is busy all the time after learning starts: one update takes 1/update_hz
        "fetch_ms_per_update": 1000 * fetch_share / update_hz if update_hz > 0 else float("nan"),
        "cpu_percent": figure(summary, "cpu_usage_percent"),
        "env_steps": summary["env_steps"],
        "updates": summary["updates"],
        f"test_return_last{LAST_TESTS}": float(np.mean(returns[-LAST_TESTS:])) if returns else float("nan"),
        "best_test_return": max(returns) if returns else float("nan"),
    }


def verdict(rows: list[dict]) -> dict:
    """Whether the shared replay beats every queue size on transfer cost and on return at fixed time."""
    shm, queues = rows[0], rows[1:]
    key = f"test_return_last{LAST_TESTS}"
    return {"shm_lower_fetch_share_than_every_queue": all(shm["fetch_share"] < q["fetch_share"] for q in queues),
            "shm_higher_return_than_every_queue": all(shm[key] > q[key] for q in queues)}


def plot(curves: dict[str, list[dict]], rows: list[dict], env_id: str, seconds: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curve, ax_fetch) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for name, curve in curves.items():
        ax_curve.plot([p["time_s"] / 60 for p in curve], [p["test_return"] for p in curve], label=name, linewidth=1)
    ax_curve.set_xlim(0, seconds / 60)
    ax_curve.set_xlabel("wall-clock minutes from launch")
    ax_curve.set_ylabel("test return")
    ax_curve.set_title(f"{env_id}, free-running")
    ax_curve.grid(alpha=0.3)
    ax_curve.legend()
    names = [r["transport"] for r in rows]
    ax_fetch.bar(names, [100 * r["fetch_share"] for r in rows], color=["tab:blue"] + ["tab:orange"] * (len(rows) - 1))
    ax_fetch.set_ylabel("learner time receiving data (% of busy time)")
    ax_fetch.set_title("experience transfer cost")
    ax_fetch.tick_params(axis="x", rotation=20)
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = parser_for(__doc__, "wall-clock budget of each run")
    parser.add_argument("--queue-sizes", type=int, nargs="+", default=[4, 64, 1024],
                        help="queue capacities, in sampler write blocks")
    parser.add_argument("--eval-interval-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--project-args", default="",
                        help="extra run.py flags for every run, e.g. '--samplers 1 --batch-size 256'")
    args = parser.parse_args(argv)
    from spreeze.envs import check_env

    info = check_env(args.env)
    transition_bytes = bytes_per_transition(info.obs_dim, info.act_dim)
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    print("[transfer] machine:", json.dumps(machine()), flush=True)
    settings = [("shm", ["--experience-transport", "shm"])]
    settings += [(f"queue-{q}", ["--experience-transport", "queue", "--queue-size", str(q)]) for q in args.queue_sizes]
    common = ["--collect-per-update", "0", *shlex.split(args.project_args)]
    rows, curves = [], {}
    with tempfile.TemporaryDirectory(prefix="spreeze_transfer_") as tmp:
        for name, flags in settings:
            workdir = Path(tmp) / name
            workdir.mkdir()
            curve, summary = run_spreeze(args.env, args.seconds, args.eval_interval_s, 1, args.seed,
                                         common + flags, workdir)
            curves[name] = curve
            rows.append(measure(name, curve, summary, transition_bytes))
            print(f"[transfer] {name}: fetch share {rows[-1]['fetch_share']:.3f}, "
                  f"test return {rows[-1][f'test_return_last{LAST_TESTS}']:.1f}", flush=True)

    stem = f"transfer-{args.env}"
    write_csv(out / f"{stem}.csv", rows)
    write_csv(out / f"{stem}-curves.csv", [{"transport": n, **p} for n, c in curves.items() for p in c])
    plot(curves, rows, args.env, args.seconds, out / f"{stem}.png")
    print(markdown_table(rows))
    for row in rows:
        tag = row["transport"].replace("-", "")
        for key in ("fetch_share", "fetch_ms_per_update", "transfer_mb_s", f"test_return_last{LAST_TESTS}"):
            print(f"{tag}_{key}: {row[key]:.4g}")
    for key, value in verdict(rows).items():
        print(f"{key}: {value}")
    print(f"[transfer] wrote {out / (stem + '.csv')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
