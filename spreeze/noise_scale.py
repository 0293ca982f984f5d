"""The critic's gradient noise scale (McCandlish et al. 2018, "An empirical model of large-batch training").

``B_noise = tr(Sigma) / |G|^2``: the batch size at which the gradient's noise and its signal are equal.
Estimate (their appendix A.1): with ``|g_B|^2`` the squared gradient norm on a batch of ``B`` rows,
``E|g_B|^2 = |G|^2 + tr(Sigma) / B``; two batch sizes give unbiased estimates of both terms. Single
estimates are very noisy, so numerator and denominator are averaged separately (exponential moving
averages) before their ratio is taken, as the paper recommends. The learner measures it; the autotuner's
batch rule (``autotune.noise_scale``) uses it. Pure functions of plain numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def noise_terms(small_sq: float, big_sq: float, b_small: int, b_big: int) -> tuple[float, float]:
    """Unbiased estimates of ``(|G|^2, tr(Sigma))`` from ``|g|^2`` measured at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclass
class NoiseScaleTracker:
    """Running ``B_noise`` from a stream of two-batch measurements; ``decay`` weighs the newest one."""
    decay: float = 0.9
    grad_sq: float | None = None
    trace: float | None = None
    measurements: int = 0

    def update(self, small_sq: float, big_sq: float, b_small: int, b_big: int) -> float:
        grad_sq, trace = noise_terms(small_sq, big_sq, b_small, b_big)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return self.b_noise
        if self.grad_sq is None:
            self.grad_sq, self.trace = grad_sq, trace
        else:
            self.grad_sq = self.decay * self.grad_sq + (1 - self.decay) * grad_sq
            self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.measurements += 1
        return self.b_noise

    @property
    def b_noise(self) -> float:
        """NaN until the averages say something: no measurement yet, or a signal not (yet) above zero."""
        if self.grad_sq is None or self.grad_sq <= 0 or self.trace is None or self.trace < 0:
            return math.nan
        return self.trace / self.grad_sq
