"""Helpers shared by the benchmarks: machine description, result folders, printing."""
from __future__ import annotations

import csv
import os
import platform
import socket
from pathlib import Path

import psutil

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    from spreeze.gpu import gpu_utilization

    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        gpus = []
    return {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
            "logical_cores": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": gpus or "none", "gpu_monitor": gpu_utilization() is not None}


def machine_tag() -> str:
    m = machine()
    gpu = "nogpu" if m["gpus"] == "none" else f"{len(m['gpus'])}gpu"
    return f"{m['usable_cores']}core-{gpu}"


def results_dir(tag: str | None = None) -> Path:
    path = RESULTS / (tag or machine_tag())
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
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
