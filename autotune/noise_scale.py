"""Batch size from the critic's gradient noise scale (McCandlish et al. 2018).

In their model the optimisation steps needed to reach a given loss are ``S_min * (1 + B_noise / B)``, so
the wall time is proportional to ``seconds_per_update(B) * (1 + B_noise / B)``: a larger batch pays only
while it cuts the steps needed faster than it slows each step. ``B_noise`` comes from the learner
(``spreeze.noise_scale``); pure functions of plain numbers.
"""
from __future__ import annotations

import math
from typing import Sequence


def time_to_progress(seconds_per_update: float, batch: int, b_noise: float) -> float:
    """Wall time per unit of optimisation progress at this batch, in units of ``S_min`` steps."""
    return seconds_per_update * (1.0 + b_noise / batch)


def batch_for_noise_scale(sweep: Sequence[tuple[int, float]], b_noise: float,
                          max_batch: int | None = None) -> tuple[int, str]:
    """The swept batch that minimises ``seconds_per_update(B) * (1 + B_noise / B)``, and why.

    ``sweep``: ``(batch, updates_per_s)`` as the autotuner measures them. Without a usable noise scale
    (NaN or negative) the smallest batch is returned: the rule then has no evidence for larger ones."""
    points = sorted((int(b), float(u)) for b, u in sweep if u > 0 and (max_batch is None or b <= max_batch))
    if not points:
        raise ValueError("batch_for_noise_scale needs at least one measured batch")
    if not (math.isfinite(b_noise) and b_noise >= 0):
        return points[0][0], "no usable gradient noise scale yet: the smallest measured batch"
    costs = [(time_to_progress(1.0 / u, b, b_noise), b) for b, u in points]
    cost, batch = min(costs)
    smallest_cost = costs[0][0]
    return batch, (f"critic gradient noise scale B_noise {b_noise:,.0f}: batch {batch} minimises time per update "
                   f"x (1 + B_noise/B), {smallest_cost / cost:.2f}x faster progress than batch {points[0][0]}")
