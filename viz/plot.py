"""Compare finished runs: ``python -m viz.plot runs/<run> [runs/<other> ...] --out compare.png``.

Draws each run's test return against wall-clock time and against env steps on one figure, from its
``evaluations.csv`` (or, for a run without one, the ``test_return`` column of ``metrics.csv``). Uses the
Agg canvas only, so it works the same with or without a display.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from viz.figure import number, save_png, time_unit


@dataclass
class RunCurve:
    name: str
    env_id: str
    algo: str
    time_s: np.ndarray
    env_steps: np.ndarray
    test_return: np.ndarray
    test_return_std: np.ndarray
    source: str


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_run(run_dir: Path) -> RunCurve | None:
    """The run's test-return curve, or None when it has no evaluation yet."""
    run_dir = Path(run_dir)
    source = "evaluations.csv"
    rows = [r for r in _rows(run_dir / source) if math.isfinite(number(r.get("test_return")))]
    if not rows:
        source = "metrics.csv"
        rows = [r for r in _rows(run_dir / source) if math.isfinite(number(r.get("test_return")))]
    if not rows:
        return None
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    def col(key: str) -> np.ndarray:
        return np.array([number(r.get(key)) for r in rows], dtype=float)

    return RunCurve(name=run_dir.resolve().name, env_id=config.get("env_id", "?"), algo=config.get("algo", "?"),
                    time_s=col("time_s"), env_steps=col("env_steps"), test_return=col("test_return"),
                    test_return_std=col("test_return_std"), source=source)


def build_figure(curves: list[RunCurve]):
    from viz.figure import new_agg_figure

    figure = new_agg_figure(figsize=(13.0, 5.0))
    ax_time, ax_steps = figure.subplots(1, 2)
    times = np.concatenate([c.time_s for c in curves])
    scale, unit = time_unit(float(times[np.isfinite(times)].max()) if np.isfinite(times).any() else math.nan)
    for i, curve in enumerate(curves):
        label = f"{curve.name} ({curve.algo})"
        for ax, x in ((ax_time, curve.time_s / scale), (ax_steps, curve.env_steps)):
            ax.plot(x, curve.test_return, "o-", markersize=2.5, color=f"C{i % 10}", label=label)
            std = np.nan_to_num(curve.test_return_std)
            if std.any():
                ax.fill_between(x, curve.test_return - std, curve.test_return + std, color=f"C{i % 10}", alpha=0.15)
    envs = sorted({c.env_id for c in curves})
    figure.suptitle(f"test return: {', '.join(envs)}")
    ax_time.set_title("test return vs wall-clock time")
    ax_time.set_xlabel(f"wall-clock time [{unit}]")
    ax_steps.set_title("test return vs env steps")
    ax_steps.set_xlabel("env steps (all samplers)")
    for ax in (ax_time, ax_steps):
        ax.set_ylabel("return per episode (sum of rewards)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    return figure


def main(argv: list[str] | None = None, prog: str = "python -m viz.plot") -> int:
    """``prog``: how errors name the command (``spreeze plot`` when the installed command runs it)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="PNG file to write")
    args = parser.parse_args(argv)
    curves = []
    for run_dir in args.runs:
        if not run_dir.is_dir():
            print(f"{prog}: error: {run_dir} is not a run directory", file=sys.stderr)
            return 2
        curve = read_run(run_dir)
        if curve is None:
            print(f"{prog}: {run_dir} has no test return yet (no evaluations.csv or metrics.csv rows); skipped",
                  file=sys.stderr)
        else:
            curves.append(curve)
    if not curves:
        print(f"{prog}: error: none of the runs has a test return to plot", file=sys.stderr)
        return 2
    save_png(build_figure(curves), args.out)
    print(f"wrote {args.out} ({len(curves)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
