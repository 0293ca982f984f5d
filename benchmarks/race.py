"""Time-to-return race against Stable-Baselines3 (Spreeze Fig. 2, as wall-clock ratios on one machine).

Runs, one after the other on the same machine and the same wall-clock budget, for each of ``--seeds``
seeds:
- spreeze, exactly as a user starts it (``python run.py --env ENV``, autotuned unless flags are given
  with ``--project-args``) with a fresh, empty profile cache, so that profiling counts as it does on a
  first launch; its evaluator tests the latest policy every ``--eval-interval-s``;
- the opponent (``--opponent sb3-sac``: Stable-Baselines3 SAC, or ``sb3-crossq``: sb3-contrib's CrossQ),
  with the rl-baselines3-zoo hyperparameters and learning-rate schedule (``benchmarks.sb3_sac``), whose
  actor is copied every ``--eval-interval-s`` and tested after its run, with the same number of
  deterministic episodes; its test ``i`` starts from the same seeded states as spreeze's test ``i``.
Both clocks start when the race launches the process, so imports, profiling and process start-up count.
It prints a markdown table (per seed, and the median and range over seeds) and ``name: value`` lines, and
writes the curves (CSV), the summaries (CSV) and one plot with every seed's curves (PNG) under
``benchmarks/results/<machine>/``. A "versus" table (``race-ENV-versus.csv``) reads each seed as the learning-speed
targets do: when spreeze's mean of 5 tests first reached the opponent's best mean of 5, over the time the
opponent took to get there; who ended higher; and how much of its best mean of 5 each side kept at the end.
``--from-csv race-ENV.csv`` reports again from an earlier race's curves, running nothing.

    python -m benchmarks.race --env Walker2DBulletEnv-v0 --seconds 900 --seeds 3 --levels 1000 1500 2000
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

from benchmarks.common import (REPO, flag, machine, markdown_table, parser_for, results_dir, run_py_settings,
                               run_spreeze, save_figure, write_csv)

DEFAULT_LEVELS = {"Walker2DBulletEnv-v0": [500.0, 1000.0, 1500.0], "Pendulum-v1": [-400.0, -200.0]}
ROLLING = 5


def first_reach(times, returns, level: float, window: int = 1) -> float | None:
    """Wall time of the first test whose return (``window`` 1) or whose mean with the ``window - 1`` tests
    before it reaches ``level``; None if the curve never gets there."""
    hits = np.flatnonzero(rolling(returns, window) >= level)
    return float(times[hits[0] + window - 1]) if hits.size else None


def rolling(returns, window: int = ROLLING) -> np.ndarray:
    """Element ``i``: the mean of tests ``i .. i + window - 1`` (so it belongs to test ``i + window - 1``);
    empty for fewer than ``window`` tests. One computation for every figure, so a curve's best mean of 5 is
    reached exactly where it was found."""
    returns = np.asarray(returns, dtype=float)
    return np.convolve(returns, np.ones(window) / window, mode="valid") if len(returns) >= window else np.empty(0)


def run_sb3(env_id: str, seconds: float, eval_interval_s: float, eval_episodes: int, seed: int,
            workdir: Path, opponent: str = "sb3-sac") -> tuple[list[dict], dict]:
    """Train the opponent in a child process, then test its actor snapshots (not counted in its time)."""
    import torch

    from benchmarks.sb3_sac import evaluate_snapshots

    out = workdir / "sb3-run"
    command = [sys.executable, "-m", "benchmarks.sb3_sac", "--env", env_id, "--seconds", str(seconds),
               "--snapshot-interval-s", str(eval_interval_s), "--seed", str(seed), "--out", str(out),
               "--opponent", opponent]
    print(f"[race] {opponent}:", shlex.join(command[1:]), flush=True)
    launched_at = time.time()
    command += ["--launched-at", repr(launched_at)]
    with open(workdir / "sb3.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=seconds + 300).returncode
    if code != 0:
        raise RuntimeError(f"{opponent} exited with {code}; see {workdir / 'sb3.log'}")
    saved = torch.load(out / "sb3_snapshots.pt", weights_only=True)
    snapshots = [s for s in saved["snapshots"] if s["time_s"] <= seconds]
    print(f"[race] testing {len(snapshots)} {opponent} actor snapshots", flush=True)
    workers = max(1, min(2, len(snapshots)))
    chunks = [list(range(len(snapshots)))[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.starmap(evaluate_snapshots,
                               [(env_id, [snapshots[i]["actor"] for i in chunk], chunk, eval_episodes, seed, opponent)
                                for chunk in chunks])
    returns: dict[int, float] = {}
    for chunk, chunk_returns in zip(chunks, results):
        returns.update(zip(chunk, chunk_returns))
    curve = [{"framework": opponent_name(opponent), "seed": seed, "time_s": s["time_s"], "env_steps": s["env_steps"],
              "updates": s["updates"], "test_return": returns[i]} for i, s in enumerate(snapshots)]
    # the protocol its curve was measured under: a later race may reuse it (--reuse-sb3) only under the same one
    from spreeze.evaluator import EVAL_SEED_SCHEME

    return curve, {**saved["summary"], "budget_s": seconds, "eval_interval_s": eval_interval_s,
                   "eval_episodes": eval_episodes, "eval_seed_scheme": EVAL_SEED_SCHEME}


def opponent_name(opponent: str) -> str:
    return "stable-baselines3" if opponent == "sb3-sac" else opponent


RACE_SETS = {"env_id", "minutes", "total_steps", "seed", "eval_interval_s", "eval_episodes", "run_dir", "resume",
             "env_kwargs", "wrapper", "target_return"}  # Config fields: any spelling of their flags is caught
# spreeze-only settings that would race the two sides on different terms: lock-step tests every --eval-every-steps
# env steps (not every --eval-interval-s, as the opponent is tested), and a settings file can set any of RACE_SETS
_LOCK_STEP_TESTS = ("lock-step tests come every --eval-every-steps env steps, the opponent's every "
                    "--eval-interval-s seconds")
RACE_REFUSES = {"deterministic": _LOCK_STEP_TESTS, "eval_every_steps": _LOCK_STEP_TESTS,
                "config_file": "a settings file can set what the race sets for both sides (env kwargs, wrappers, a "
                               "target return): give its settings as flags"}
MACHINE_KEYS = ("cpu_model", "cpu_flags", "usable_cores", "gpus")  # what must match for curves to be compared
RECORDED_KEYS = ("cpu_id",)  # must match too where both races recorded it (older files lack it)
SPEED_TOLERANCE = 1.25  # one thread's matmul rate may differ this much either way (timing noise between runs)
BUDGET_SLACK = 0.9  # a reused curve's last test must come this late in the race's budget, or its run was shorter


def opponent_machine(env_id: str, folder: Path) -> dict:
    """The machine the opponent's curves in ``folder`` were measured on: the race's own (its
    ``race-ENV-machine.json``), or, where that race reused them in turn, the one it recorded for them."""
    path = folder / f"race-{env_id}-machine.json"
    if not path.exists():
        raise ValueError(f"{path} is missing: cannot tell that the opponent's curves were measured on this machine")
    then = json.loads(path.read_text())
    return then.get("opponent_machine") or then


def check_same_machine(env_id: str, folder: Path, now: dict) -> str | None:
    """ValueError unless the opponent's curves in ``folder`` were measured on this machine
    (:func:`opponent_machine`): curves of another CPU, or of the same model at another speed (a VM's share of its
    host), are not a fair opponent. Returns a warning when either side did not record its speed."""
    then = opponent_machine(env_id, folder)
    differ = [k for k in MACHINE_KEYS if then.get(k) != now.get(k)]
    differ += [k for k in RECORDED_KEYS if then.get(k) and now.get(k) and then[k] != now[k]]
    if differ:
        raise ValueError(f"the opponent's curves in {folder} were measured on another machine "
                         f"({', '.join(f'{k}: {then.get(k)} here {now.get(k)}' for k in differ)})")
    speed_then, speed_now = then.get("cpu_gflops"), now.get("cpu_gflops")
    if not speed_then or not speed_now:
        unrecorded = "the opponent's curves in " + str(folder) if not speed_then else "this machine"
        return (f"no CPU speed (cpu_gflops) recorded for {unrecorded}: the same CPU model can run at another speed "
                f"on another host, so this race may not be fair")
    if max(speed_then / speed_now, speed_now / speed_then) > SPEED_TOLERANCE:
        raise ValueError(f"the opponent's curves in {folder} were measured on a CPU of another speed "
                         f"(one thread's matmul: {speed_then:g} GFLOP/s there, {speed_now:g} here; more than "
                         f"{SPEED_TOLERANCE:g}x apart)")
    return None


def load_sb3(env_id: str, folder: Path, seed: int | None = None, seconds: float | None = None,
             opponent: str | None = None, several: bool = False, eval_interval_s: float | None = None,
             eval_episodes: int | None = None) -> tuple[list[dict], dict]:
    """The opponent's curve and summary an earlier race on this machine wrote into ``folder`` (SB3 does not
    change between runs of the project, so one SB3 run can serve several project runs); ``seed`` picks that
    seed's curve from a race of several seeds. Refused (ValueError) when it cannot stand for this race: another
    opponent, a curve without seeds in a race of ``several``, a run shorter than ``seconds`` (its clock stopped
    it earlier, or its last test came before ``BUDGET_SLACK`` of them), tests at another interval or of another
    number of episodes, or other zoo settings than this race's; a longer one is cut at ``seconds``. What an older
    race's files do not record (the curve's seed, a per-seed summary, the budget, the test schedule, the zoo
    settings) cannot be checked: the summary's ``reuse_unchecked`` lists it, and the race prints it."""
    with open(folder / f"race-{env_id}.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["framework"] != "spreeze"]
    if opponent is not None and {row["framework"] for row in rows} - {opponent_name(opponent)}:
        raise ValueError(f"{folder} holds the curves of {sorted({row['framework'] for row in rows})}, "
                         f"not {opponent_name(opponent)}")
    if rows and row_has_seed(rows[0]):
        seeds = sorted({int(row["seed"]) for row in rows})
        if seed is None and len(seeds) > 1:
            raise ValueError(f"{folder} holds the opponent's curves of seeds {seeds}: race one of them with --seed")
        rows = [row for row in rows if seed is None or int(row["seed"]) == seed]
    elif rows and several:
        raise ValueError(f"{folder} holds one opponent curve without seeds: it cannot stand for several seeds")
    if not rows:
        raise ValueError(f"{folder} holds no opponent curve{'' if seed is None else f' of seed {seed}'} for {env_id}")
    unchecked: list[str] = []  # what an older race's files do not record, so this reuse cannot check it: said
    if not row_has_seed(rows[0]) and seed is not None:
        unchecked.append(f"the curve's seed (this race's is {seed})")
    last = max(float(row["time_s"]) for row in rows)
    if seconds is not None:
        rows = [row for row in rows if float(row["time_s"]) <= seconds]
    curve = [{"framework": row["framework"], "seed": int(row.get("seed") or seed or 0), "time_s": float(row["time_s"]),
              "env_steps": int(row["env_steps"]), "updates": int(row["updates"]),
              "test_return": float(row["test_return"])} for row in rows]
    per_seed = folder / f"race-{env_id}-seed{seed}-sb3-summary.json"
    if several and not per_seed.exists():
        raise ValueError(f"{per_seed} is missing: the summary of one seed cannot stand for another")
    if not per_seed.exists() and seed is not None:
        unchecked.append(f"the run's own summary (race-{env_id}-seed{seed}-sb3-summary.json): the race's first "
                         "seed's stands for it")
    summary = json.loads((per_seed if per_seed.exists() else folder / f"race-{env_id}-sb3-summary.json").read_text())
    if seconds is not None and last < BUDGET_SLACK * seconds and summary.get("stopped_by") != "n_timesteps":
        # a run that ended early because it had trained the zoo's whole step count is whole, not shorter
        raise ValueError(f"the opponent's curve in {folder} ends at {last:.0f} s: its run was shorter than "
                         f"this race's {seconds:g} s")
    if seconds is not None and summary.get("stopped_by") == "seconds" and \
            float(summary.get("wall_time_s", seconds)) < seconds:  # the clock of a shorter race stopped it
        raise ValueError(f"the opponent's run in {folder} was stopped by its clock at {summary['wall_time_s']:.0f} s: "
                         f"shorter than this race's {seconds:g} s")
    if seconds is not None:
        if summary.get("budget_s") is None:
            unchecked.append("its budget")
        elif float(summary["budget_s"]) < seconds and summary.get("stopped_by") != "n_timesteps":  # ran whole
            raise ValueError(f"the opponent's run in {folder} had a budget of {float(summary['budget_s']):g} s: "
                             f"shorter than this race's {seconds:g} s")
    for name, wanted in (("eval_interval_s", eval_interval_s), ("eval_episodes", eval_episodes)):
        if wanted is None:
            continue
        if summary.get(name) is None:
            unchecked.append(f"--{name.replace('_', '-')}")
        elif float(summary[name]) != float(wanted):
            raise ValueError(f"the opponent's curve in {folder} was tested with --{name.replace('_', '-')} "
                             f"{summary[name]:g}, this race with {wanted:g}")
    from benchmarks.sb3_sac import hyperparameters

    wanted = {k: str(v) for k, v in hyperparameters(env_id, opponent or summary.get("opponent") or "sb3-sac").items()}
    if summary.get("hyperparameters") is None:
        unchecked.append("the zoo settings it trained with")
    elif summary["hyperparameters"] != wanted:
        other = sorted(k for k in wanted.keys() | summary["hyperparameters"].keys()
                       if wanted.get(k) != summary["hyperparameters"].get(k))
        raise ValueError(f"the opponent in {folder} trained with other settings than the zoo's this race uses "
                         f"(differing: {', '.join(other)})")
    from spreeze.evaluator import EVAL_SEED_SCHEME

    episodes = int(summary.get("eval_episodes") or eval_episodes or 1)
    if episodes > 1 and summary.get("eval_seed_scheme") != EVAL_SEED_SCHEME:
        raise ValueError(f"the opponent's curve in {folder} tested {episodes} episodes a test from the start states "
                         "of an earlier version (eval_seed_scheme): after each test's first, not this race's")
    summary["reused_from"] = str(folder)
    summary.pop("reuse_unchecked", None)  # a race that reused them in turn: what this one could not check
    if unchecked:
        summary["reuse_unchecked"] = unchecked
    return curve, summary


def cut_at(curves: dict[str, dict[int, list[dict]]], seconds: float) -> dict[str, dict[int, list[dict]]]:
    """Curves read back (``--from-csv``) cut at this report's budget, as a race cuts its own runs: the later tests
    of a longer run must not count in its figures. One that ends before ``BUDGET_SLACK`` of the budget (a shorter
    budget, or a run that stopped early, as at ``--target-return``) is named on stderr: its figures are not of
    this budget."""
    cut: dict[str, dict[int, list[dict]]] = {}
    for name, seeds in curves.items():
        for seed, curve in seeds.items():
            last = max((p["time_s"] for p in curve), default=0.0)
            if last < BUDGET_SLACK * seconds:
                print(f"[report] warning: {name} seed {seed}'s curve ends at {last:.0f} s, before the "
                      f"{seconds:g} s budget", file=sys.stderr)
            cut.setdefault(name, {})[seed] = [p for p in curve if p["time_s"] <= seconds]
    return cut


def row_has_seed(row: dict) -> bool:
    return bool(row.get("seed"))


AXES = {"seconds": ("time_s", "s"), "steps": ("env_steps", "steps")}  # x of a curve: its key, the figures' suffix


def summarize(name: str, curve: list[dict], levels: list[float], seed: int | None = None, axis: str = "seconds") -> dict:
    """One run's figures; ``axis`` steps times the levels in env steps (for --deterministic runs, whose curve
    over env steps does not depend on the machine's load) instead of seconds from launch."""
    key, unit = AXES[axis]
    times = [p[key] for p in curve]
    returns = [p["test_return"] for p in curve]
    row = {"framework": name, "seed": seed, "tests": len(curve),
           "final_test_return": returns[-1] if returns else float("nan"),
           # NaN under ROLLING tests, as the best mean is: a mean of fewer tests must not join the medians
           f"final_mean_last{ROLLING}": float(rolling(returns)[-1]) if len(returns) >= ROLLING else float("nan"),
           f"best_mean{ROLLING}": best_mean(returns),
           "best_test_return": best_mean(returns, 1),
           "env_steps": curve[-1]["env_steps"] if curve else 0, "updates": curve[-1]["updates"] if curve else 0}
    row[f"last{ROLLING}_of_best"] = held(judged_final(returns), row[f"best_mean{ROLLING}"])
    for level in levels:
        row[f"first_test_{level:g}_{unit}"] = first_reach(times, returns, level)
        row[f"mean{ROLLING}_{level:g}_{unit}"] = first_reach(times, returns, level, ROLLING)
    return row


def held(final: float, best: float) -> float:
    """How much of its best mean of 5 a run kept at the end (issue 12's no-collapse reading, >= 0.8 wanted);
    NaN unless the best mean of 5 is above 0, where a ratio means "kept"; a final of -inf (a NaN test among the
    last 5: :func:`judged_final`) kept nothing."""
    if not best > 0 or np.isnan(final):
        return float("nan")
    return 0.0 if np.isneginf(final) else final / best


def judged_final(returns) -> float:
    """The mean of the last 5 tests as the end is judged: NaN under 5 tests (undefined), -inf when one of them is
    not finite (a policy that diverged has collapsed; left out as NaN, it would drop from the medians)."""
    if len(returns) < ROLLING:
        return float("nan")
    last = np.asarray(returns[-ROLLING:], dtype=float)
    return float(rolling(last)[-1]) if np.all(np.isfinite(last)) else float("-inf")  # the best's arithmetic


def best_mean(returns, window: int = ROLLING) -> float:
    """The highest mean of ``window`` consecutive tests; a window holding a NaN test (an env that returned NaN)
    is skipped, not the whole curve; NaN when no window is whole."""
    means = rolling(returns, window)
    means = means[~np.isnan(means)]
    return float(means.max()) if means.size else float("nan")


def versus(curves: dict[str, dict[int, list[dict]]], opponent: str) -> list[dict]:
    """Per seed, the race read as issue 12's targets: the opponent's best mean of 5 tests and when it first got
    there; when spreeze's mean of 5 first reached that (None: never) and the ratio of the two times (<= 1/3
    wanted); both sides' final mean of 5 and how much of their best they kept. A median row follows for
    several seeds, in which a level never reached counts as infinitely late."""
    rows = []
    for seed in sorted(curves["spreeze"]):
        ours, theirs = curves["spreeze"][seed], curves[opponent][seed]
        target = best_mean([p["test_return"] for p in theirs])
        nan = float("nan")  # undefined (an opponent without a whole mean of 5), not "never": left out of medians
        at = nan if np.isnan(target) else first_reach([p["time_s"] for p in theirs],
                                                      [p["test_return"] for p in theirs], target, ROLLING)
        reach = nan if np.isnan(target) else first_reach([p["time_s"] for p in ours],
                                                         [p["test_return"] for p in ours], target, ROLLING)
        mine, other = summarize("spreeze", ours, []), summarize(opponent, theirs, [])
        finals = mine[f"final_mean_last{ROLLING}"], other[f"final_mean_last{ROLLING}"]
        judged = judged_final([p["test_return"] for p in ours]), judged_final([p["test_return"] for p in theirs])
        rows.append({"seed": seed, f"opponent_best_mean{ROLLING}": target, f"opponent_best_mean{ROLLING}_s": at,
                     "reach_opponent_best_s": reach,
                     "reach_ratio": nan if np.isnan(target) or not at else None if reach is None else reach / at,
                     f"spreeze_final_mean_last{ROLLING}": finals[0],
                     f"opponent_final_mean_last{ROLLING}": finals[1],
                     # undefined without the opponent's last 5; a spreeze run without its own (it failed) lost;
                     # a NaN test among either side's last 5 loses for that side (-inf), both sides alike
                     "spreeze_ends_higher": (None if np.isnan(judged[1]) or judged[0] == judged[1] == -np.inf
                                             else bool(judged[0] > judged[1])),
                     f"spreeze_last{ROLLING}_of_best": mine[f"last{ROLLING}_of_best"],
                     f"opponent_last{ROLLING}_of_best": other[f"last{ROLLING}_of_best"]})
    if len(rows) > 1:
        wins = sum(bool(r["spreeze_ends_higher"]) for r in rows)
        judged = sum(r["spreeze_ends_higher"] is not None for r in rows)
        median = aggregate("", [{"framework": "", **r, "spreeze_ends_higher": None} for r in rows])
        rows += [{k: median.get(k) for k in rows[0]} | {"seed": f"median of {len(rows)}",
                                                       "spreeze_ends_higher": f"{wins} of {judged}"},
                 {k: median.get(f"{k}_range", "") for k in rows[0]} | {"seed": "range"}]
    return rows


def read_curves(path: Path) -> dict[str, dict[int, list[dict]]]:
    """The curves a race or comparison wrote (its ``.csv``), by framework or setting and seed."""
    found: dict[str, dict[int, list[dict]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            point = {k: v if k == "framework" else int(float(v)) if k in ("env_steps", "updates") else float(v)
                     for k, v in row.items() if v != ""}
            point["seed"] = int(point.get("seed", 0))
            found.setdefault(point["framework"], {}).setdefault(point["seed"], []).append(point)
    return found


def aggregate(name: str, rows: list[dict]) -> dict:
    """Median and range over seeds of every figure; a level never reached counts as infinitely late, so a
    median that is "never" reads as None."""
    out = {"framework": f"{name} (median of {len(rows)})", "seed": None}
    for key in rows[0]:
        if key in ("framework", "seed"):
            continue
        reach = key.startswith(("first_test_", f"mean{ROLLING}_", "reach_"))
        if reach:  # None: never reached (infinitely late); NaN: undefined for that seed, left out
            values = [np.inf if r[key] is None else float(r[key]) for r in rows
                      if r[key] is None or not np.isnan(float(r[key]))]
        else:  # a figure that was not measured (or is undefined, NaN), not a level never reached
            values = [float(r[key]) for r in rows if r[key] is not None and not np.isnan(float(r[key]))]
        if not values:  # a level is None only where it was never reached; undefined in every seed is NaN
            out[key], out[f"{key}_range"] = (np.nan, f"undefined (0 of {len(rows)} seeds)") if reach else (None, "")
            continue
        median = float(np.median(values))
        out[key] = None if np.isinf(median) else median
        finite = [v for v in values if np.isfinite(v)]
        out[f"{key}_range"] = (f"{min(finite):.4g}..{max(finite):.4g}" + (" +never" if len(finite) < len(values) else "")
                               if finite else "never")
        if len(values) < len(rows):  # a seed without this figure (e.g. fewer than 5 tests): said, not hidden
            out[f"{key}_range"] += f" ({len(values)} of {len(rows)} seeds)"
    return out


COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def plot(curves: dict[str, dict[int, list[dict]]], levels: list[float], env_id: str, seconds: float, path: Path,
         title: str, axis: str = "seconds") -> None:
    """Every seed's curve of each side: dots are single tests, lines the mean of the last 5 (x: minutes from
    launch, or env steps with ``axis`` steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for (name, by_seed), color in zip(curves.items(), COLORS):
        for k, (seed, curve) in enumerate(sorted(by_seed.items())):
            t = np.array([p[AXES[axis][0]] for p in curve]) / (60 if axis == "seconds" else 1)
            r = np.array([p["test_return"] for p in curve])
            label = f"{name} ({len(by_seed)} seed{'s' if len(by_seed) > 1 else ''})" if k == 0 else None
            ax.plot(t, r, ".", color=color, alpha=0.25, markersize=3)
            if len(r) >= ROLLING:
                ax.plot(t[ROLLING - 1:], rolling(r), color=color, alpha=0.85, linewidth=1.2, label=label)
            else:
                ax.plot(t, r, color=color, label=label)
    for level in levels:
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    if axis == "seconds":
        ax.set_xlim(0, seconds / 60)
        ax.set_xlabel("wall-clock minutes from launch (start-up and profiling included)")
    else:
        ax.set_xlabel("env steps")
    ax.set_ylabel(f"test return (deterministic policy; lines: mean of {ROLLING} tests)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = parser_for(__doc__, "wall-clock budget of each framework")
    parser.add_argument("--levels", type=float, nargs="+", default=None,
                        help="test returns whose first-reach times are reported")
    parser.add_argument("--eval-interval-s", type=float, default=5.0)
    parser.add_argument("--eval-episodes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--seeds", type=int, default=1, help="seeds to race, from --seed on; medians over them")
    parser.add_argument("--opponent", choices=["sb3-sac", "sb3-crossq"], default="sb3-sac")
    parser.add_argument("--project-args", default="", help="extra run.py flags, as one quoted string")
    parser.add_argument("--order", choices=["alternate", "spreeze-first", "sb3-first"], default="alternate",
                        help="which side runs first for each seed; alternate: spreeze first for the first seed, the "
                             "opponent for the second, ..., so a slow drift of the machine (heat, caches) does not "
                             "always land on the same side")
    parser.add_argument("--from-csv", type=Path, default=None,
                        help="run nothing: report again from the curves an earlier race wrote (its race-ENV.csv)")
    parser.add_argument("--reuse-sb3", type=Path, default=None,
                        help="folder of an earlier race on this machine whose opponent curves to reuse instead of "
                             "running the opponent again")
    args = parser.parse_args(argv)
    levels = args.levels if args.levels is not None else DEFAULT_LEVELS.get(args.env)
    if not levels:
        parser.error(f"give --levels for {args.env}")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.from_csv:
        return report_again(args, parser, levels)
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    here = machine()  # timed once, on the still idle machine
    print("[race] machine:", json.dumps(here), flush=True)
    warning = None
    if args.reuse_sb3:  # before this race's own machine.json is written (the folder may be the same)
        try:
            warning = check_same_machine(args.env, args.reuse_sb3, here)
        except ValueError as err:
            parser.error(str(err))
        if warning:
            print(f"[race] warning: {warning}", flush=True)
    # reused curves keep the machine they were measured on: a later race reusing this one's checks against it
    recorded = {**here, "opponent_machine": opponent_machine(args.env, args.reuse_sb3)} if args.reuse_sb3 else here
    (out / f"race-{args.env}-machine.json").write_text(json.dumps(recorded, indent=2))
    opponent = opponent_name(args.opponent)
    project_args = shlex.split(args.project_args)
    try:
        given = run_py_settings(project_args)
    except ValueError as err:
        parser.error(f"--project-args: {err}")
    clash = sorted(set(given) & RACE_SETS)
    if clash:  # they would change spreeze's side only (or SB3 would race the bare env)
        parser.error(f"--project-args may not set {', '.join(map(flag, clash))}: the race sets them for both sides")
    unfair = sorted(name for name in set(given) & RACE_REFUSES.keys() if given[name])  # --no-deterministic is fair
    if unfair:
        parser.error(f"--project-args may not set {flag(unfair[0])}: {RACE_REFUSES[unfair[0]]}")
    seeds = list(range(args.seed, args.seed + args.seeds))
    if args.reuse_sb3:  # every seed's curve checked before hours of spreeze runs, not after the first
        for seed in seeds:
            try:
                _, checked = load_sb3(args.env, args.reuse_sb3, seed, args.seconds, args.opponent,
                                      several=len(seeds) > 1, eval_interval_s=args.eval_interval_s,
                                      eval_episodes=args.eval_episodes)
            except (OSError, ValueError) as err:
                parser.error(str(err))
            if checked.get("reuse_unchecked"):
                print(f"[race] warning: the reused seed {seed} does not record {'; '.join(checked['reuse_unchecked'])}"
                      ": this race cannot check that it matches", flush=True)

    curves: dict[str, dict[int, list[dict]]] = {"spreeze": {}, opponent: {}}
    summaries: dict[str, dict[int, dict]] = {"spreeze": {}, opponent: {}}
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="spreeze_race_") as tmp:
            workdir = Path(tmp)
            # a fresh profile cache: the first launch's profiling is part of a new user's wait
            cache = [] if "--cache-dir" in project_args else ["--cache-dir", str(workdir / "profile-cache")]
            runners = {
                "spreeze": lambda: run_spreeze(args.env, args.seconds, args.eval_interval_s, args.eval_episodes,
                                               seed, project_args + cache, workdir),
                opponent: (lambda: load_sb3(args.env, args.reuse_sb3, seed, args.seconds, args.opponent,
                                            several=len(seeds) > 1, eval_interval_s=args.eval_interval_s,
                                            eval_episodes=args.eval_episodes))
                if args.reuse_sb3 else
                (lambda: run_sb3(args.env, args.seconds, args.eval_interval_s, args.eval_episodes, seed, workdir,
                                 args.opponent)),
            }
            spreeze_first = (args.order == "spreeze-first" or
                             (args.order == "alternate" and (seed - seeds[0]) % 2 == 0))
            order = ["spreeze", opponent] if spreeze_first else [opponent, "spreeze"]
            for name in order:
                print(f"[race] seed {seed}: {name}", flush=True)
                curve, summary = runners[name]()
                if name == opponent and warning:  # the reused curve's summary says how far it could be checked
                    summary = {**summary, "machine_warning": warning}
                for point in curve:
                    point["seed"] = seed
                curves[name][seed], summaries[name][seed] = curve, summary
    stem = f"race-{args.env}"
    for seed in seeds:
        spreeze_summary = {k: v for k, v in summaries["spreeze"][seed].items() if k != "log"}
        names = [f"{stem}-seed{seed}"] + ([stem] if seed == seeds[0] else [])
        for prefix in names:
            (out / f"{prefix}-spreeze-summary.json").write_text(json.dumps(spreeze_summary, indent=2))
            (out / f"{prefix}-sb3-summary.json").write_text(json.dumps(summaries[opponent][seed], indent=2))
    # the curves first: hours of runs are kept even if a figure below fails (and can be reported --from-csv)
    write_csv(out / f"{stem}.csv", [p for name in curves for seed in seeds for p in curves[name][seed]])
    report(args, out, levels, curves, summaries, opponent)
    return 0


def report_again(args, parser, levels: list[float]) -> int:
    """``--from-csv``: the tables and plot of an earlier race from its curves, into another folder (so a stored
    race's files are not overwritten); start-up times from the race's own summaries beside the CSV."""
    path: Path = args.from_csv
    if path.name != f"race-{args.env}.csv":
        parser.error(f"{path} is not the curves of a race on {args.env} (race-{args.env}.csv)")
    out = args.out or path.parent / "reported"
    if out.resolve() == path.parent.resolve():
        parser.error("--from-csv writes its report into another folder than the race's: give another --out")
    curves = cut_at(read_curves(path), args.seconds)
    if "spreeze" not in curves or len(curves) != 2:
        parser.error(f"{path} is not a race's curves (spreeze and one opponent)")
    opponent = next(name for name in curves if name != "spreeze")
    if set(curves["spreeze"]) != set(curves[opponent]):
        parser.error(f"{path}: the two sides were raced with different seeds")
    startups = {}
    for seed in curves["spreeze"]:
        own = [path.parent / f"race-{args.env}-seed{seed}-spreeze-summary.json"]
        if len(curves["spreeze"]) == 1:  # a one-seed race (or one from before seeds) also wrote the plain name
            own.append(path.parent / f"race-{args.env}-spreeze-summary.json")
        found = next((p for p in own if p.exists()), None)
        startups[seed] = json.loads(found.read_text()) if found else {}
    out.mkdir(parents=True, exist_ok=True)
    report(args, out, levels, curves, {"spreeze": startups}, opponent)
    return 0


def report(args, out: Path, levels: list[float], curves: dict[str, dict[int, list[dict]]],
           summaries: dict[str, dict[int, dict]], opponent: str) -> None:
    """The race's tables, CSVs and plot, from its curves (``summaries``: the runs' own, for start-up times)."""
    seeds = sorted(curves["spreeze"])
    rows = [summarize(name, curves[name][seed], levels, seed) for name in curves for seed in seeds]
    for row in rows:
        row["startup_s"] = summaries["spreeze"][row["seed"]].get("startup_s") if row["framework"] == "spreeze" else None
    medians = [aggregate(name, [r for r in rows if r["framework"] == name]) for name in curves] if len(seeds) > 1 else []
    duel = versus(curves, opponent)
    stem = f"race-{args.env}"
    write_csv(out / f"{stem}-summary.csv", rows)
    write_csv(out / f"{stem}-versus.csv", duel)
    if medians:
        write_csv(out / f"{stem}-median.csv", medians)
    opponent_title = "sb3-contrib CrossQ" if opponent == "sb3-crossq" else "Stable-Baselines3 SAC"
    plot(curves, levels, args.env, args.seconds, out / f"{stem}.png",
         f"{args.env}: spreeze vs {opponent_title} (zoo hyperparameters), same machine")

    print(markdown_table(rows))
    if medians:
        print(markdown_table(medians))
    print(markdown_table(duel))
    picked = medians or rows
    project = next(r for r in picked if r["framework"].startswith("spreeze"))
    sb3 = next(r for r in picked if not r["framework"].startswith("spreeze"))
    for name, row in (("spreeze", project), ("sb3", sb3)):
        print(f"{name}_final_test_return: {_num(row['final_test_return'])}")
        print(f"{name}_final_mean_last{ROLLING}: {_num(row[f'final_mean_last{ROLLING}'])}")
        print(f"{name}_best_mean{ROLLING}: {_num(row[f'best_mean{ROLLING}'])}")
    by_seed = {(r["framework"], r["seed"]): r for r in rows}
    for level in levels:
        for key in (f"first_test_{level:g}_s", f"mean{ROLLING}_{level:g}_s"):
            print(f"spreeze_{key}: {project[key]}")
            print(f"sb3_{key}: {sb3[key]}")
            ratio, seeds_with = median_time_ratio([(by_seed[("spreeze", s)][key], by_seed[(opponent, s)][key])
                                                   for s in seeds])
            if seeds_with:
                print(f"time_ratio_{key}: {'never' if ratio is None else f'{ratio:.3f}'}"
                      + (f" (median of the seeds' own ratios, {seeds_with} of {len(seeds)} seeds)"
                         if len(seeds) > 1 else ""))
    summary_row = duel[-2] if len(duel) > 1 else duel[0]
    print(f"reach_ratio_to_opponent_best_mean{ROLLING}: {summary_row['reach_ratio']}")
    print(f"[race] wrote {stem}-summary.csv, -versus.csv{', -median.csv' if medians else ''} and .png into {out}")


def median_time_ratio(pairs: list[tuple]) -> tuple[float | None, int]:
    """The median over seeds of each seed's own ratio spreeze / opponent for a level (not a ratio of the two
    sides' medians, which would pair different seeds): a level spreeze never reached is infinitely late (None
    when the median is), one the opponent never reached leaves that seed out. Also how many seeds it covers."""
    ratios = [np.inf if ours is None else ours / theirs for ours, theirs in pairs
              if theirs is not None and np.isfinite(theirs) and theirs > 0 and (ours is None or np.isfinite(ours))]
    if not ratios:
        return None, 0
    median = float(np.median(ratios))
    return (None if np.isinf(median) else median), len(ratios)


def _num(value) -> str:
    return "nan" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
