"""What watches a run from the main process: the live window or curve PNG, the render process, the CPU governor,
and later a TensorBoard writer or user callbacks. The composition root (``launch/``) builds them; the runner
calls their hooks, none of which may block for long."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunContext:
    """What an observer may use, handed to :meth:`Observer.on_start` once the children run."""
    config: object
    env_info: object
    run_dir: Path
    log: object
    supervisor: object          # spreeze.supervisor.Supervisor: ctx, handles, stop Event, pause/resume, lock recovery
    evaluations: list = field(default_factory=list)   # a resumed run's earlier rows, oldest first
    metrics: list = field(default_factory=list)


class Observer:
    """No-op hooks; subclasses override what they need."""

    def on_start(self, run: RunContext) -> None:
        pass

    def on_metrics(self, row: dict) -> None:
        """A ``metrics.csv`` row, every ``--log-interval-s``."""

    def on_evaluation(self, row: dict) -> None:
        """An ``evaluations.csv`` row (with ``test_return_mean5``)."""

    def on_checkpoint(self, path: Path) -> None:
        """The learner wrote ``checkpoints/latest.pt``."""

    def poll(self) -> None:
        """Called about ten times a second by the process runners, between rounds by lock-step."""

    def close(self) -> None:
        """At the end, after the children stopped and before the shared segments are unlinked."""
