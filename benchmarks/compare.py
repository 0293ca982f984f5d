"""Which setting learns faster per wall-clock second: spreeze with several sets of flags, over seeds.

Each setting runs as a user starts it (``python run.py --env ENV <flags>``) with the same wall-clock budget
and a fresh profile cache, one run at a time; for each seed the settings take turns in a rotated order, so
a slow drift of the machine does not favour one of them. Reported per setting: the median and range over
seeds of the first time a test (and the mean of 5 tests) reaches each level, the best and the final mean of
5 tests; a plot holds every run's curve.

    python -m benchmarks.compare --env HalfCheetahBulletEnv-v0 --seconds 300 --seeds 3 \\
        --setting "1-step=--n-step 1" --setting "3-step=--n-step 3" --levels 500 1000

``--axis steps`` times the levels in env steps instead: with ``--deterministic --total-steps N`` in every
setting (and --seconds as a generous safety limit), each run's curve is a function of its seed alone, so the
comparison of learning per env step (and per update) holds on a loaded machine too.
"""
from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (flag, machine, markdown_table, parser_for, results_dir, run_py_settings, run_spreeze,
                               write_csv)
from benchmarks.race import AXES, ROLLING, aggregate, cut_at, plot, read_curves, summarize


# what the comparison holds equal for every setting (Config fields, any spelling of their flags): a setting's own
# value would come after the comparison's and win for that setting alone; a settings file could set any of them
HELD_EQUAL = {"env_id", "minutes", "seed", "eval_interval_s", "eval_episodes", "run_dir", "resume", "config_file"}


def parse_setting(text: str) -> tuple[str, list[str]]:
    """``label=flags`` into the label and the run.py flags; flags that set what the comparison holds equal are
    refused (``--total-steps``, ``--deterministic`` and ``--eval-every-steps`` stay: the steps axis needs them)."""
    label, sep, flags = text.partition("=")
    if not sep or not label.strip():
        raise ValueError(f"a setting is LABEL=FLAGS, got {text!r}")
    args = shlex.split(flags)
    held = sorted(set(run_py_settings(args)) & HELD_EQUAL)
    if held:
        raise ValueError(f"setting {label.strip()!r} may not set {', '.join(map(flag, held))}: the comparison sets "
                         "it for every setting (a settings file: give its settings as flags)")
    return label.strip(), args


def main(argv=None) -> int:
    parser = parser_for(__doc__, "wall-clock budget of each run")
    parser.add_argument("--setting", action="append", default=[], help="LABEL=FLAGS (run.py flags); repeat")
    parser.add_argument("--from-csv", nargs="+", type=Path, default=[],
                        help="run nothing: summarise and plot the curve CSVs of earlier comparisons (same protocol)")
    parser.add_argument("--levels", type=float, nargs="+", required=True, help="test returns to time")
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-interval-s", type=float, default=5.0)
    parser.add_argument("--eval-episodes", type=int, default=1)
    parser.add_argument("--name", default="compare", help="stem of the output files")
    parser.add_argument("--axis", choices=sorted(AXES), default="seconds",
                        help="time the levels in seconds from launch or in env steps")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep each run's log and text files (autotune.json, metrics.csv, ...) in "
                             "OUT/NAME-ENV-LABEL-seedN/, to see what the autotuner and the learner decided")
    args = parser.parse_args(argv)
    if args.from_csv:
        return merge(args)
    if not args.setting:
        parser.error("give --setting LABEL=FLAGS (or --from-csv)")
    try:
        settings = dict(parse_setting(text) for text in args.setting)
    except ValueError as err:
        parser.error(str(err))
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    here = machine()  # timed once, on the still idle machine
    print("[compare] machine:", json.dumps(here), flush=True)
    (out / f"{args.name}-{args.env}-machine.json").write_text(json.dumps(here, indent=2))
    labels = list(settings)
    curves: dict[str, dict[int, list[dict]]] = {label: {} for label in labels}
    summaries: dict[str, dict[int, dict]] = {label: {} for label in labels}
    for n, seed in enumerate(range(args.seed, args.seed + args.seeds)):
        for label in labels[n % len(labels):] + labels[: n % len(labels)]:
            with tempfile.TemporaryDirectory(prefix="spreeze_compare_") as tmp:
                flags = settings[label] + ["--cache-dir", str(Path(tmp) / "profile-cache")]
                print(f"[compare] seed {seed}: {label}", flush=True)
                try:
                    curve, summary = run_spreeze(args.env, args.seconds, args.eval_interval_s, args.eval_episodes,
                                                 seed, flags, Path(tmp))
                except RuntimeError:
                    kept = out / f"{args.name}-{args.env}-{label}-seed{seed}-failed.log"
                    shutil.copy(Path(tmp) / "spreeze.log", kept)  # the run folder goes with the temp dir
                    print(f"[compare] seed {seed}: {label} failed; its log is in {kept}", flush=True)
                    raise
                if args.keep_runs:
                    keep_run(Path(tmp), out / f"{args.name}-{args.env}-{label}-seed{seed}")
            if args.axis == "steps" and summary.get("stopped_by") != "total_steps":
                # the clock (--seconds, or the run's own --minutes) ended it before its steps: on a loaded machine
                # its curve over env steps is then shorter, and no longer a function of the seed alone
                print(f"[compare] warning: {label} seed {seed} was stopped by {summary.get('stopped_by')}, not its "
                      "--total-steps: its figures over env steps cover a shorter run", file=sys.stderr, flush=True)
            for point in curve:
                point.update(framework=label, seed=seed)
            curves[label][seed], summaries[label][seed] = curve, {k: v for k, v in summary.items() if k != "log"}
    rows = [summarize(label, curves[label][seed], args.levels, seed, args.axis)
            for label in labels for seed in curves[label]]
    for row in rows:
        summary = summaries[row["framework"]][row["seed"]]
        row["startup_s"] = summary["startup_s"]
        row["critic_noise_scale"] = summary.get("critic_noise_scale")
    report(args, out, curves, rows, settings)
    return 0


KEPT_FILES = ("autotune.json", "config.json", "evaluations.csv", "metrics.csv", "summary.json", "events.log")


def keep_run(workdir: Path, folder: Path) -> None:
    """``--keep-runs``: the console log and the run folder's text files (not its checkpoints) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(workdir / "spreeze.log", folder / "spreeze.log")
    for name in KEPT_FILES:
        if (workdir / "spreeze-run" / name).exists():
            shutil.copy(workdir / "spreeze-run" / name, folder / name)


def report(args, out: Path, curves: dict, rows: list[dict], settings: dict | None) -> None:
    """The medians, the files (curves, summary, medians, settings when known, plot) and the printed tables."""
    medians = [aggregate(label, [r for r in rows if r["framework"] == label]) for label in curves]
    stem = f"{args.name}-{args.env}"
    write_csv(out / f"{stem}.csv", [p for label in curves for seed in curves[label] for p in curves[label][seed]])
    write_csv(out / f"{stem}-summary.csv", rows)
    write_csv(out / f"{stem}-median.csv", medians)
    if settings is not None:
        (out / f"{stem}-settings.json").write_text(
            json.dumps({label: shlex.join(flags) for label, flags in settings.items()}, indent=2))
    plot(curves, args.levels, args.env, args.seconds, out / f"{stem}.png", f"{args.env}: spreeze settings, same machine",
         args.axis)
    print(markdown_table(rows))
    print(markdown_table(medians))
    for row in medians:
        label = row["framework"].split(" (median")[0]
        for key in [f"best_mean{ROLLING}", f"final_mean_last{ROLLING}"] + [
                f"mean{ROLLING}_{level:g}_{AXES[args.axis][1]}" for level in args.levels]:
            print(f"{label}_{key}_median: {row[key]}  (range {row[key + '_range']})")
    print(f"[compare] wrote {out / (stem + '.csv')}, {out / (stem + '-median.csv')} and {out / (stem + '.png')}")


def merge(args) -> int:
    """``--from-csv``: one summary, median table and plot from the curves of several invocations; a setting and
    seed found in two files is refused (their curves would be joined)."""
    curves: dict[str, dict[int, list[dict]]] = {}
    for path in args.from_csv:
        for label, seeds in read_curves(path).items():
            if twice := set(seeds) & set(curves.get(label, {})):
                raise SystemExit(f"--from-csv: {label} seed {min(twice)} is in {path} and an earlier file")
            curves.setdefault(label, {}).update(seeds)
    if args.axis == "seconds":  # on --axis steps the budget is the runs' steps, not this clock
        curves = cut_at(curves, args.seconds)
    rows = [summarize(label, curves[label][seed], args.levels, seed, args.axis)
            for label in curves for seed in sorted(curves[label])]
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    report(args, out, curves, rows, None)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
