"""The critic's gradient noise scale (McCandlish et al. 2018, "An empirical model of large-batch training").

``B_noise = tr(Sigma) / |G|^2``: the batch size at which the gradient's noise and its signal are equal.
Estimate (their appendix A.1): with ``|g_B|^2`` the squared gradient norm on a batch of ``B`` rows,
``E|g_B|^2 = |G|^2 + tr(Sigma) / B``; two batch sizes give unbiased estimates of both terms. Single
estimates are very noisy, so numerator and denominator are averaged separately (exponential moving
averages) before their ratio is taken, as the paper recommends.

In their model the optimisation steps needed to reach a given loss are ``S_min * (1 + B_noise / B)``, so
the wall time is proportional to ``seconds_per_update(B) * (1 + B_noise / B)``: a larger batch pays only
while it cuts the steps needed faster than it slows each step (:func:`batch_for_noise_scale`). The learner
measures ``B_noise`` and re-decides its batch with it; the autotuner uses a value cached from an earlier
run at launch. The seconds per update are those the run can sustain (:func:`fed_sweep`): the probe times the
learner alone, but at a collect:update ratio that grows with the batch a large batch also needs its samplers to
collect that many more steps per update. Pure functions of plain numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


# What shapes the critic's gradient noise scale beyond the algorithm and the networks: the targets (gamma, n-step,
# tau, the value range, TD3's target smoothing noise) and how far each update moves (the learning rates and their
# schedule). An estimate made under other values is not this run's: a launch does not start its batch from it,
# and a resumed run with other values measures afresh.
LEARNING_SETTINGS = ("gamma", "n_step", "tau", "q_range", "target_noise", "target_noise_clip", "critic_lr",
                     "actor_lr", "alpha_lr", "lr_schedule")


def learning_settings(config) -> dict:
    """The values of :data:`LEARNING_SETTINGS` in ``config`` (a Config or its ``to_dict()``; those it has)."""
    get = config.get if isinstance(config, dict) else (lambda name, default=None: getattr(config, name, default))
    return {name: value for name in LEARNING_SETTINGS if (value := get(name, None)) is not None}


def changed_settings(then: dict, now: dict) -> str:
    """``name (old then, new now), ...`` for the learning settings that differ; empty when none does."""
    return ", ".join(f"{name} ({then.get(name)} then, {now.get(name)} now)"
                     for name in sorted(set(then) | set(now)) if then.get(name) != now.get(name))


def noise_terms(small_sq: float, big_sq: float, b_small: int, b_big: int) -> tuple[float, float]:
    """Unbiased estimates of ``(|G|^2, tr(Sigma))`` from ``|g|^2`` measured at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclass
class NoiseScaleTracker:
    """Running ``B_noise`` from a stream of two-batch measurements: the ratio of two exponentially weighted
    means (bias-corrected), ``decay`` the weight kept by the older ones at each new measurement."""
    decay: float = 0.9
    grad_sq: float | None = None
    trace: float | None = None
    measurements: int = 0

    def update(self, small_sq: float, big_sq: float, b_small: int, b_big: int) -> float:
        grad_sq, trace = noise_terms(small_sq, big_sq, b_small, b_big)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return self.b_noise
        # averages started at zero, as Adam's moments: their ratio is the bias-corrected one (the correction
        # 1 - decay^n divides both), and each measurement weighs by its age alone. Started at the first value
        # instead, the first one (made right after the warm-up, on a critic still fitting random-policy data)
        # would outweigh the nine after it at the first re-decision.
        self.grad_sq = self.decay * (self.grad_sq or 0.0) + (1 - self.decay) * grad_sq
        self.trace = self.decay * (self.trace or 0.0) + (1 - self.decay) * trace
        self.measurements += 1
        return self.b_noise

    @property
    def b_noise(self) -> float:
        """NaN until the averages say something: no measurement yet, or a signal not (yet) above zero."""
        if self.grad_sq is None or self.grad_sq <= 0 or self.trace is None or self.trace < 0:
            return math.nan
        return self.trace / self.grad_sq


def time_to_progress(seconds_per_update: float, batch: int, b_noise: float) -> float:
    """Wall time per unit of optimisation progress at this batch, in units of ``S_min`` steps."""
    return seconds_per_update * (1.0 + b_noise / batch)


def fed_sweep(sweep: Sequence[tuple[int, float]], sampling_steps_per_s: float | None,
              steps_per_update: Sequence[float]) -> list[tuple[int, float]]:
    """``(batch, updates_per_s)`` the samplers can feed: each probed rate capped at ``sampling_steps_per_s /
    steps_per_update[i]``, the env steps collected per update at that batch (the collect:update ratio; 0 runs
    free and caps nothing). Without a sampling rate the sweep is returned as it is.

    Why: on a GPU the update costs about the same from batch 256 to 16,384, so the rule alone would take a large
    batch as free; at ``--collect-per-update -1`` (batch / replay ratio) the samplers must then collect 64x the
    steps per update, and a learner they cannot feed runs at a fraction of its probed rate."""
    if len(steps_per_update) != len(sweep):
        raise ValueError("one collect:update ratio per swept batch")
    if not sampling_steps_per_s or not math.isfinite(sampling_steps_per_s) or sampling_steps_per_s <= 0:
        return [(int(b), float(u)) for b, u in sweep]
    return [(int(b), min(float(u), sampling_steps_per_s / r) if r > 0 else float(u))
            for (b, u), r in zip(sweep, steps_per_update)]


def first_capped(sweep: Sequence[tuple[int, float]], fed: Sequence[tuple[int, float]]) -> tuple[int, float, float] | None:
    """The first batch whose fed rate is below its probed one: ``(batch, probed, fed)``, or None when no cap binds."""
    probed = {int(b): float(u) for b, u in sweep}
    for b, u in fed:
        if u < probed.get(int(b), u) - 1e-9:
            return int(b), probed[int(b)], float(u)
    return None


SWITCH_GAIN = 1.10  # a running batch gives way only to one predicted this much faster: the estimate is noisy


def batch_for_noise_scale(sweep: Sequence[tuple[int, float]], b_noise: float,
                          max_batch: int | None = None, current: int | None = None) -> tuple[int, str]:
    """The swept batch that minimises ``seconds_per_update(B) * (1 + B_noise / B)``, and why.

    ``sweep``: ``(batch, updates_per_s)`` as the autotuner measures them. Without a usable noise scale
    (NaN or negative) the smallest batch is returned: the rule then has no evidence for larger ones.
    ``current``: the batch a run is using, kept unless another is predicted SWITCH_GAIN x faster. A running
    estimate of B_noise moves by several times within a minute, and a predicted gain of a few percent would
    flip the batch back and forth (each flip also changes what the samplers must collect per update)."""
    points = sorted((int(b), float(u)) for b, u in sweep if u > 0 and (max_batch is None or b <= max_batch))
    if not points:
        raise ValueError("batch_for_noise_scale needs at least one measured batch")
    if not (math.isfinite(b_noise) and b_noise >= 0):
        return points[0][0], "no usable gradient noise scale yet: the smallest measured batch"
    costs = [(time_to_progress(1.0 / u, b, b_noise), b) for b, u in points]
    cost, batch = min(costs)
    kept = {b: c for c, b in costs}.get(current)
    if kept is not None and batch != current and kept < SWITCH_GAIN * cost:
        return current, (f"critic gradient noise scale B_noise {b_noise:,.0f}: batch {batch} would make "
                         f"{kept / cost:.2f}x faster progress than batch {current}, under the {SWITCH_GAIN:.2f}x "
                         f"a change needs: batch {current} kept")
    smallest_cost = costs[0][0]
    return batch, (f"critic gradient noise scale B_noise {b_noise:,.0f}: batch {batch} minimises time per update "
                   f"x (1 + B_noise/B), {smallest_cost / cost:.2f}x faster progress than batch {points[0][0]}")
