"""Time-to-return race against Stable-Baselines3 SAC (Spreeze Fig. 2, as wall-clock ratios on one machine).

Runs, one after the other on the same machine and the same wall-clock budget:
- spreeze, exactly as a user starts it (``python run.py --env ENV``, autotuned unless flags are given
  with ``--project-args``), its evaluator testing the latest policy every ``--eval-interval-s``;
- Stable-Baselines3 SAC with the rl-baselines3-zoo hyperparameters (``benchmarks.sb3_sac``), whose actor
  is copied every ``--eval-interval-s`` and tested after its run, with the same number of deterministic
  episodes.
Both clocks start when the race launches the process, so imports, profiling and process start-up count.
It prints a markdown table and ``name: value`` lines, and writes the two curves (CSV), a summary (CSV)
and one plot (PNG) under ``benchmarks/results/<machine>/``.

    python -m benchmarks.race --env Walker2DBulletEnv-v0 --seconds 1800 --levels 500 1000 1500
    python -m benchmarks.race --env Pendulum-v1 --seconds 60 --eval-interval-s 1 --levels -400 -200
"""
from __future__ import annotations

import csv
import json
import multiprocessing as mp
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (REPO, machine, markdown_table, parser_for, results_dir, run_spreeze, save_figure,
                               write_csv)

DEFAULT_LEVELS = {"Walker2DBulletEnv-v0": [500.0, 1000.0, 1500.0], "Pendulum-v1": [-400.0, -200.0]}
ROLLING = 5


def first_reach(times, returns, level: float, window: int = 1) -> float | None:
    """Wall time of the first test whose return (``window`` 1) or whose mean with the ``window - 1`` tests
    before it reaches ``level``; None if the curve never gets there."""
    returns = np.asarray(returns, dtype=float)
    for i in range(window - 1, len(returns)):
        if returns[i - window + 1:i + 1].mean() >= level:
            return float(times[i])
    return None


def run_sb3(env_id: str, seconds: float, eval_interval_s: float, eval_episodes: int, seed: int,
            workdir: Path) -> tuple[list[dict], dict]:
    """Train SB3 in a child process, then test its actor snapshots (not counted in its time)."""
    import torch

    from benchmarks.sb3_sac import evaluate_snapshots

    out = workdir / "sb3-run"
    command = [sys.executable, "-m", "benchmarks.sb3_sac", "--env", env_id, "--seconds", str(seconds),
               "--snapshot-interval-s", str(eval_interval_s), "--seed", str(seed), "--out", str(out)]
    print("[race] stable-baselines3:", shlex.join(command[1:]), flush=True)
    launched_at = time.time()
    command += ["--launched-at", repr(launched_at)]
    with open(workdir / "sb3.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=seconds + 300).returncode
    if code != 0:
        raise RuntimeError(f"stable-baselines3 exited with {code}; see {workdir / 'sb3.log'}")
    saved = torch.load(out / "sb3_snapshots.pt", weights_only=True)
    snapshots = [s for s in saved["snapshots"] if s["time_s"] <= seconds]
    print(f"[race] testing {len(snapshots)} SB3 actor snapshots", flush=True)
    workers = max(1, min(2, len(snapshots)))
    chunks = [snapshots[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.starmap(evaluate_snapshots,
                               [(env_id, [s["actor"] for s in chunk], eval_episodes, seed) for chunk in chunks])
    returns: dict[int, float] = {}
    for w, chunk_returns in enumerate(results):
        for j, value in enumerate(chunk_returns):
            returns[w + j * workers] = value
    curve = [{"framework": "stable-baselines3", "time_s": s["time_s"], "env_steps": s["env_steps"],
              "updates": s["updates"], "test_return": returns[i]} for i, s in enumerate(snapshots)]
    return curve, saved["summary"]


def load_sb3(env_id: str, folder: Path) -> tuple[list[dict], dict]:
    """The SB3 curve and summary an earlier race on this machine wrote into ``folder`` (SB3 does not change
    between runs of the project, so one 30-minute SB3 run can serve several project runs)."""
    with open(folder / f"race-{env_id}.csv") as f:
        curve = [{"framework": row["framework"], "time_s": float(row["time_s"]), "env_steps": int(row["env_steps"]),
                  "updates": int(row["updates"]), "test_return": float(row["test_return"])}
                 for row in csv.DictReader(f) if row["framework"] == "stable-baselines3"]
    summary = json.loads((folder / f"race-{env_id}-sb3-summary.json").read_text())
    summary["reused_from"] = str(folder)
    return curve, summary


def summarize(name: str, curve: list[dict], levels: list[float]) -> dict:
    times = [p["time_s"] for p in curve]
    returns = [p["test_return"] for p in curve]
    row = {"framework": name, "tests": len(curve),
           "final_test_return": returns[-1] if returns else float("nan"),
           f"final_mean_last{ROLLING}": float(np.mean(returns[-ROLLING:])) if returns else float("nan"),
           "best_test_return": max(returns) if returns else float("nan"),
           "env_steps": curve[-1]["env_steps"] if curve else 0, "updates": curve[-1]["updates"] if curve else 0}
    for level in levels:
        row[f"first_test_{level:g}_s"] = first_reach(times, returns, level)
        row[f"mean{ROLLING}_{level:g}_s"] = first_reach(times, returns, level, ROLLING)
    return row


def plot(curves: dict[str, list[dict]], levels: list[float], env_id: str, seconds: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for (name, curve), color in zip(curves.items(), ["tab:blue", "tab:orange"]):
        t = np.array([p["time_s"] for p in curve]) / 60
        r = np.array([p["test_return"] for p in curve])
        ax.plot(t, r, ".", color=color, alpha=0.3, markersize=3)
        if len(r) >= ROLLING:
            smooth = np.convolve(r, np.ones(ROLLING) / ROLLING, mode="valid")
            ax.plot(t[ROLLING - 1:], smooth, color=color, label=f"{name} (mean of {ROLLING} tests)")
        else:
            ax.plot(t, r, color=color, label=name)
    for level in levels:
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlim(0, seconds / 60)
    ax.set_xlabel("wall-clock minutes from launch (start-up included)")
    ax.set_ylabel("test return (deterministic policy)")
    ax.set_title(f"{env_id}: spreeze vs Stable-Baselines3 SAC (zoo hyperparameters), same machine")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = parser_for(__doc__, "wall-clock budget of each framework")
    parser.add_argument("--levels", type=float, nargs="+", default=None,
                        help="test returns whose first-reach times are reported")
    parser.add_argument("--eval-interval-s", type=float, default=5.0)
    parser.add_argument("--eval-episodes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--project-args", default="", help="extra run.py flags, as one quoted string")
    parser.add_argument("--order", choices=["spreeze-first", "sb3-first"], default="spreeze-first")
    parser.add_argument("--reuse-sb3", type=Path, default=None,
                        help="folder of an earlier race on this machine whose SB3 curve to reuse instead of running SB3")
    args = parser.parse_args(argv)
    levels = args.levels if args.levels is not None else DEFAULT_LEVELS.get(args.env)
    if not levels:
        parser.error(f"give --levels for {args.env}")
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    print("[race] machine:", json.dumps(machine()), flush=True)

    with tempfile.TemporaryDirectory(prefix="spreeze_race_") as tmp:
        workdir = Path(tmp)
        runners = {
            "spreeze": lambda: run_spreeze(args.env, args.seconds, args.eval_interval_s, args.eval_episodes,
                                           args.seed, shlex.split(args.project_args), workdir),
            "stable-baselines3": (lambda: load_sb3(args.env, args.reuse_sb3)) if args.reuse_sb3 else
                                 (lambda: run_sb3(args.env, args.seconds, args.eval_interval_s, args.eval_episodes,
                                                  args.seed, workdir)),
        }
        order = ["spreeze", "stable-baselines3"] if args.order == "spreeze-first" else ["stable-baselines3", "spreeze"]
        curves, summaries = {}, {}
        for name in order:
            curves[name], summaries[name] = runners[name]()
    curves = {name: curves[name] for name in ("spreeze", "stable-baselines3")}

    rows = [summarize(name, curve, levels) for name, curve in curves.items()]
    rows[0]["startup_s"] = summaries["spreeze"]["startup_s"]
    rows[1]["startup_s"] = None
    stem = f"race-{args.env}"
    write_csv(out / f"{stem}.csv", [p for curve in curves.values() for p in curve])
    write_csv(out / f"{stem}-summary.csv", rows)
    plot(curves, levels, args.env, args.seconds, out / f"{stem}.png")
    (out / f"{stem}-spreeze-summary.json").write_text(
        json.dumps({k: v for k, v in summaries["spreeze"].items() if k != "log"}, indent=2))
    (out / f"{stem}-sb3-summary.json").write_text(json.dumps(summaries["stable-baselines3"], indent=2))

    print(markdown_table(rows))
    project, sb3 = rows
    for name, row in (("spreeze", project), ("sb3", sb3)):
        print(f"{name}_final_test_return: {row['final_test_return']:.1f}")
        print(f"{name}_final_mean_last{ROLLING}: {row[f'final_mean_last{ROLLING}']:.1f}")
    for level in levels:
        for key in (f"first_test_{level:g}_s", f"mean{ROLLING}_{level:g}_s"):
            print(f"spreeze_{key}: {project[key]}")
            print(f"sb3_{key}: {sb3[key]}")
            if project[key] is not None and sb3[key] is not None:
                print(f"time_ratio_{key}: {project[key] / sb3[key]:.3f}")
    print(f"[race] wrote {out / (stem + '.csv')}, {out / (stem + '-summary.csv')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
