"""Drawing the reward and throughput curves, shared by the live window, the headless PNG and viz.plot.

The same :class:`CurveFigure` draws into a pyplot window (in the window process) and into a bare
``Figure`` + ``FigureCanvasAgg`` (headless, and in the training process at the end of a run). The
training process never imports pyplot: choosing a GUI backend there could fail headless or start a GUI
event loop where none belongs (docs/pitfalls.md, "Rendering and plotting").
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FIGSIZE = (12.0, 7.5)
MAX_POINTS = 3000  # per line; longer histories are thinned so a redraw stays cheap


def number(value) -> float:
    """A payload or CSV value as float; "" (no GPU), None and junk become NaN."""
    if value is None or value == "":
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def column(rows: list[dict], key: str) -> np.ndarray:
    return np.array([number(row.get(key)) for row in rows], dtype=float)


def thin(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every k-th point (always keeping the last) so that at most MAX_POINTS remain."""
    n = len(arrays[0])
    if n <= MAX_POINTS:
        return arrays
    index = np.unique(np.append(np.arange(0, n, math.ceil(n / MAX_POINTS)), n - 1))
    return tuple(a[index] for a in arrays)


def time_unit(max_seconds: float) -> tuple[float, str]:
    """Divisor and name of the unit that keeps wall-clock tick labels short."""
    if not math.isfinite(max_seconds) or max_seconds < 600:
        return 1.0, "s"
    return (3600.0, "h") if max_seconds >= 3 * 3600 else (60.0, "min")


def new_agg_figure(figsize=FIGSIZE) -> Figure:
    figure = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, path: Path, dpi: int = 100) -> None:
    """Write atomically (temp file, rename), so a reader never sees half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class CurveFigure:
    """Four panels: test return vs wall-clock time and vs env steps; throughput; CPU/GPU utilisation."""

    def __init__(self, figure: Figure, title: str):
        self.figure = figure
        figure.suptitle(title)
        (self.ax_time, self.ax_steps), (self.ax_rate, self.ax_util) = figure.subplots(2, 2)
        self.return_lines = {}
        for name, ax in (("time", self.ax_time), ("steps", self.ax_steps)):
            test, = ax.plot([], [], "o-", color="C0", markersize=3, label="test return (deterministic)")
            train, = ax.plot([], [], "-", color="C1", alpha=0.6, label="training return (last episodes)")
            self.return_lines[name] = (test, train)
            ax.set_ylabel("return per episode (sum of rewards)")
            ax.grid(True, alpha=0.3)
        self.waiting = self.ax_time.text(0.5, 0.5, "waiting for the first evaluation", ha="center", va="center",
                                         transform=self.ax_time.transAxes, color="0.4")
        self.ax_time.set_title("test return vs wall-clock time")
        self.ax_steps.set_title("test return vs env steps")
        self.ax_steps.set_xlabel("env steps (all samplers)")
        self.rate_lines = {
            "sampling_hz": self.ax_rate.plot([], [], color="C2", label="sampling [env steps/s]")[0],
            "update_frame_rate": self.ax_rate.plot([], [], color="C3", label="update frame rate [transitions/s]")[0],
            "update_hz": self.ax_rate.plot([], [], color="C4", linestyle="--", label="update frequency [updates/s]")[0],
            # --ray: shown once remote samplers deliver
            "local_sampling_hz": self.ax_rate.plot([], [], color="C2", linestyle=":", label="_local")[0],
            "remote_sampling_hz": self.ax_rate.plot([], [], color="C8", linestyle=":", label="_remote")[0],
            "ingest_rows_hz": self.ax_rate.plot([], [], color="C9", linestyle="-.", label="_ingest")[0],
        }
        self.remote_labels = {"local_sampling_hz": "local sampling [env steps/s]",
                              "remote_sampling_hz": "remote sampling [env steps/s]",
                              "ingest_rows_hz": "ingest [rows/s]"}
        self.ax_rate.set_title("throughput")
        self.ax_rate.set_ylabel("rate [1/s, log scale]")
        self.ax_rate.set_yscale("log")
        self.ax_rate.grid(True, which="both", alpha=0.3)
        self.util_lines = {
            "cpu_percent": self.ax_util.plot([], [], color="C5", label="CPU (all cores)")[0],
            "gpu_percent": self.ax_util.plot([], [], color="C6", label="GPU")[0],
        }
        self.ax_util.set_title("utilisation")
        self.ax_util.set_ylabel("utilisation [%]")
        self.ax_util.set_ylim(0, 105)
        self.ax_util.grid(True, alpha=0.3)

    def update(self, evals: list[dict], metrics: list[dict]) -> None:
        """Replace every line's data by the given rows (lists of evaluator / metrics payloads)."""
        e_time, e_steps, e_return = thin(*(column(evals, key) for key in ("time_s", "env_steps", "test_return")))
        m_time, m_steps = column(metrics, "time_s"), column(metrics, "env_steps")
        times = np.concatenate([e_time, m_time])
        scale, unit = time_unit(times[np.isfinite(times)].max() if np.isfinite(times).any() else math.nan)
        m_cols = {key: column(metrics, key) for key in ("train_return", *self.rate_lines, *self.util_lines)}
        m_time_t, m_steps_t, *rest = thin(m_time, m_steps, *m_cols.values())
        m_cols = dict(zip(m_cols, rest))

        for name, x_eval, x_metric in (("time", e_time / scale, m_time_t / scale), ("steps", e_steps, m_steps_t)):
            test, train = self.return_lines[name]
            test.set_data(x_eval, e_return)
            train.set_data(x_metric, m_cols["train_return"])
        for key, line in self.rate_lines.items():
            values = m_cols[key]
            line.set_data(m_time_t / scale, np.where(values > 0, values, np.nan))
        for key, line in self.util_lines.items():
            line.set_data(m_time_t / scale, m_cols[key])
        remote = bool((m_cols["remote_sampling_hz"] > 0).any())
        for key, label in self.remote_labels.items():
            self.rate_lines[key].set_label(label if remote else f"_{key}")
        self.waiting.set_visible(len(evals) == 0)
        has_gpu = bool(np.isfinite(m_cols["gpu_percent"]).any())
        self.util_lines["gpu_percent"].set_label("GPU" if has_gpu else "GPU (none found)")

        for ax in (self.ax_time, self.ax_rate, self.ax_util):
            ax.set_xlabel(f"wall-clock time [{unit}]")
        for ax in (self.ax_time, self.ax_steps, self.ax_rate, self.ax_util):
            ax.relim()
            ax.autoscale_view(scaley=ax is not self.ax_util)
            ax.legend(loc="best", fontsize="small")
        self.ax_util.set_ylim(0, 105)


def write_curve_png(path: Path, title: str, evals: list[dict], metrics: list[dict]) -> Path:
    """The four-panel figure as a PNG, drawn with Agg in the calling process."""
    figure = new_agg_figure()
    CurveFigure(figure, title).update(evals, metrics)
    save_png(figure, path)
    return Path(path)
