"""Helpers shared by the benchmarks: machine description, result folders, printing."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
# in a checkout the results sit beside the code that made them; an installed copy (spreeze bench) writes to
# the current directory instead of into site-packages
IN_CHECKOUT = (REPO / "run.py").is_file()
RESULTS = REPO / "benchmarks" / "results" if IN_CHECKOUT else Path.cwd() / "benchmark-results"


def spreeze_command() -> list[str]:
    """How a user starts training: ``python run.py`` in a checkout, the installed ``spreeze train`` elsewhere."""
    if IN_CHECKOUT:
        return [sys.executable, str(REPO / "run.py")]
    return [sys.executable, "-m", "launch", "train"]


def machine(speed: bool = True) -> dict:
    """This machine as results record it; ``speed``: time one thread's matmul (:func:`cpu_gflops`, about 0.3 s;
    call it on the idle machine, once)."""
    from spreeze.gpu import gpu_utilization

    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        gpus = []
    from autotune.probe import cpu_model

    return {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpu_id": cpu_id(), "cpu_flags": cpu_flags(),
            "cpu_gflops": cpu_gflops() if speed else None,
            "logical_cores": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": gpus or "none", "gpu_monitor": gpu_utilization() is not None}


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # what decides CPU update rates here


def cpu_flags() -> list[str]:
    """The CPU features among SPEED_FLAGS (bf16 autocast's speed depends on them): two hosts that both read
    "2 cores" can differ here, so every result records them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in SPEED_FLAGS if flag in present]
    except OSError:
        pass
    return []


def cpu_id() -> str | None:
    """"family F model M stepping S" of an x86 CPU (None elsewhere): hosts that name the same model ("AMD EPYC")
    can be different parts."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break  # the first CPU's block
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model", "stepping"):
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    if len(fields) < 3:
        return None
    return f"family {fields['cpu family']} model {fields['model']} stepping {fields['stepping']}"


def cpu_gflops(seconds: float = 0.3, size: int = 256) -> float | None:
    """One thread's float32 matmul rate at the width of a learner's layers, in GFLOP/s (the best of three short
    timings; run on an idle machine): two VMs that report the same CPU can differ twofold here (the share of
    their host they get), and curves measured on the faster are no fair opponent on the slower."""
    try:
        import torch
    except Exception:  # as machine() does: a result is still recorded without torch
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        best = 0.0
        for _ in range(3):
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 3:
                torch.mm(a, b)
                count += 1
            best = max(best, 2 * size ** 3 * count / elapsed / 1e9)
    finally:
        torch.set_num_threads(threads)
    return round(best, 1)


def machine_tag() -> str:
    m = machine(speed=False)
    gpu = "nogpu" if m["gpus"] == "none" else f"{len(m['gpus'])}gpu"
    return f"{m['usable_cores']}core-{gpu}"


def results_dir(tag: str | None = None) -> Path:
    path = RESULTS / (tag or machine_tag())
    path.mkdir(parents=True, exist_ok=True)
    return path


def parser_for(doc: str, seconds_help: str):
    """The arguments every benchmark takes: --env, --seconds and --out."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--env", required=True)
    parser.add_argument("--seconds", type=float, required=True, help=seconds_help)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/<machine>)")
    return parser


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])  # no rows: an empty table
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]) for k in keys) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def figure(summary: dict, key: str) -> float:
    """A run summary's figure as a number: NaN where it has none (``summary.json`` writes a figure that is not a
    number, such as the fetch share of a run without updates, as null)."""
    value = summary.get(key)
    return float("nan") if value is None else float(value)


def run_py_settings(args: list[str]) -> dict:
    """The Config fields that run.py flags set, with their values, whatever the spelling (``--env-id`` or ``--env``,
    ``--config-file`` or ``--config``, ``--flag=value``, a ``--no-`` form): asked of run.py's own parser, so a
    benchmark's guard on what a setting may change cannot be passed by another spelling."""
    from spreeze.flags import suppressed_parser

    try:
        namespace, _ = suppressed_parser().parse_known_args([a for a in args if a not in ("-h", "--help")])
    except SystemExit:  # run.py's parser has printed why: a benchmark's own message says whose flags
        raise ValueError(f"run.py flags {shlex.join(args)!r} do not parse") from None
    return vars(namespace)


def flag(field: str) -> str:
    """A Config field's run.py flag, for messages."""
    from spreeze.values import flag_name

    return f"--{flag_name(field)}"


def run_spreeze(env_id: str, seconds: float, eval_interval_s: float, eval_episodes: int, seed: int,
                extra_args: list[str], workdir: Path) -> tuple[list[dict], dict]:
    """Train with ``run.py`` in a child process, exactly as a user starts it, with the wall-clock budget as the
    only limit; return its test curve (seconds from launch, so start-up counts) and its ``summary.json``."""
    run_dir = workdir / "spreeze-run"
    command = [*spreeze_command(), "--env", env_id, "--minutes", f"{seconds / 60:.6f}",
               "--seed", str(seed), "--eval-interval-s", str(eval_interval_s), "--eval-episodes", str(eval_episodes),
               "--total-steps", "0", "--no-window", "--run-dir", str(run_dir), *extra_args]
    print("[benchmark] spreeze:", shlex.join(command[1:]), flush=True)
    launched_at = time.time()
    with open(workdir / "spreeze.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=seconds + 300).returncode
    if code != 0:
        raise RuntimeError(f"spreeze exited with {code}; see {workdir / 'spreeze.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    offset = summary["started_at_unix"] - launched_at
    curve = []
    tests = run_dir / "evaluations.csv"  # written at the first test: a short run on a loaded machine may have none
    with open(tests) if tests.exists() else contextlib.nullcontext([]) as f:
        for row in csv.DictReader(f):
            t = float(row["time_s"]) + offset
            if t <= seconds:
                curve.append({"framework": "spreeze", "time_s": t, "env_steps": int(row["env_steps"]),
                              "updates": int(row["updates"]), "test_return": float(row["test_return"])})
    summary["startup_s"] = offset
    # summary.json's own counts run to the run's stop, which its --minutes puts the start-up past the budget (it
    # counts from its own start): the counts within the budget are the last test's, as the race's figures read
    summary["within_budget"] = ({k: curve[-1][k] for k in ("time_s", "env_steps", "updates")} if curve else None)
    summary["log"] = (workdir / "spreeze.log").read_text()
    return curve, summary
