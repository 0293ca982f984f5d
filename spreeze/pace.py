"""Run-time rules of pace that read the resolved config: how far the samplers may run ahead of the learner
(the collect:update ratio) and the learning rates over the budget (``--lr-schedule``)."""
from __future__ import annotations


def learner_allowance(config, updates: int, rows: int | None = None) -> float:
    """Env steps past the warm-up that the learner's work so far lets the samplers collect: ``collect_per_update``
    per critic update, or (with -1) one per ``replay_ratio`` rows it sampled, which stays right when the batch
    changes during the run. ``rows`` defaults to ``updates x batch_size``."""
    if config.collect_per_update >= 0:
        return config.collect_per_update * updates
    if rows is None:
        rows = updates * config.batch_size
    return rows / config.replay_ratio


def lr_scale(config, env_steps: int, elapsed_s: float | None = None) -> float:
    """``--lr-schedule linear``: the share of the budget left (1 at the start, 0 at its end) by env steps of
    ``--total-steps`` or seconds of ``--minutes``, whichever is further on; 1 for ``constant`` or without a
    budget. ``elapsed_s`` None: steps only (lock-step rounds must not depend on the clock)."""
    if config.lr_schedule == "constant":
        return 1.0
    used = [env_steps / config.total_steps] if config.total_steps else []
    if config.minutes and elapsed_s is not None:
        used.append(elapsed_s / (60.0 * config.minutes))
    return min(1.0, max(0.0, 1.0 - max(used))) if used else 1.0
