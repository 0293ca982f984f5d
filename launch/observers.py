"""The observers a run gets from its flags: the reward curve (live window, else curve.png), the ``--render``
process and the CPU governor. Built here, so that ``spreeze/`` imports neither ``viz`` nor ``autotune``."""
from __future__ import annotations

import os

from spreeze.observers import Observer, RunContext

JOIN_TIMEOUT_S = 5.0


def build_observers(config) -> list[Observer]:
    """The window process, the render process and the governor run beside processes only; ``--serial`` writes
    the final curve.png alone, and lock-step rounds are not governed (every sampler takes part in each)."""
    observers: list[Observer] = [CurveObserver(live=not config.serial)]
    if config.render and not config.serial:
        observers.append(RenderObserver())
    if not config.serial and not config.deterministic:
        observers.append(GovernorObserver())
    return observers


class CurveObserver(Observer):
    """The reward-curve window process (``viz.live``), never fatal to training; ``curve.png`` at the end."""

    def __init__(self, live: bool = True):
        self.live = live
        self.view = None
        self.title = self.run_dir = None
        self.evaluations: list[dict] = []
        self.metrics: list[dict] = []

    def on_start(self, run: RunContext) -> None:
        c = run.config
        self.title, self.run_dir = f"{c.env_id} · {c.algo.upper()} · {run.run_dir.name}", run.run_dir
        self.evaluations, self.metrics = list(run.evaluations), list(run.metrics)  # a resumed run's past
        if self.live:
            from viz.live import LiveView

            self.view = LiveView(run.supervisor.ctx, run.run_dir, self.title, window=c.window, log=run.log)
            self.view.start()
            for kind, rows in (("eval", self.evaluations), ("metrics", self.metrics)):
                for row in rows:
                    self.view.feed(kind, row)

    def on_metrics(self, row: dict) -> None:
        self.metrics.append(row)
        if self.view is not None:
            self.view.feed("metrics", row)

    def on_evaluation(self, row: dict) -> None:
        self.evaluations.append(row)
        if self.view is not None:
            self.view.feed("eval", row)

    def poll(self) -> None:
        if self.view is not None:
            self.view.poll()

    def close(self) -> None:
        if self.view is not None:
            self.view.close(final=True)
        elif self.run_dir is not None:
            from viz.figure import write_curve_png

            write_curve_png(self.run_dir / "curve.png", self.title, self.evaluations, self.metrics)


class RenderObserver(Observer):
    """``--render``: plays the newest policy now and then; not restarted, never fatal to training."""

    def __init__(self):
        self.process = self.supervisor = None

    def on_start(self, run: RunContext) -> None:
        from viz.render import start_render

        sup = self.supervisor = run.supervisor
        self.process = start_render(sup.ctx, run.config, run.env_info, sup.weights.handle, sup.stats.handle,
                                    run.run_dir, sup.stop_event, os.getpid())

    def poll(self) -> None:
        """One that died inside a weights copy left their lock held: free it."""
        process = self.process
        if process is not None and process.exitcode is not None:
            self.process = None
            self.supervisor.recover_weights_lock("spreeze-render", process.pid)

    def close(self) -> None:
        if self.process is not None:
            self.process.join(timeout=JOIN_TIMEOUT_S)
            if self.process.is_alive():  # it ignores SIGTERM while we live
                self.process.kill()
                self.process.join(timeout=2)


class GovernorObserver(Observer):
    """Pauses or resumes samplers at each metrics row so that CPU use stays near ``--cpu-target-percent``."""

    def __init__(self):
        self.governor = self.supervisor = None

    def on_start(self, run: RunContext) -> None:
        from autotune import governor

        c = run.config
        self.supervisor = run.supervisor
        self.governor = governor.CpuGovernor(target_percent=c.cpu_target_percent, min_active=1,
                                             max_active=c.sampler_processes)

    def on_metrics(self, row: dict) -> None:
        self.supervisor.govern(self.governor, row["cpu_percent"])
