"""The gradient noise scale: estimator on synthetic gradients, the tracker, the batch rule on fake sweeps,
and the measurement on a real critic."""
import math

import numpy as np
import pytest

from autotune.noise_scale import batch_for_noise_scale, time_to_progress
from spreeze.noise_scale import NoiseScaleTracker, noise_terms


def synthetic_sq_norm(rng, true_grad, sigma, batch):
    """|mean of `batch` per-sample gradients|^2, per-sample gradient = G + N(0, sigma^2 I)."""
    samples = true_grad + sigma * rng.standard_normal((batch, true_grad.size))
    return float((samples.mean(0) ** 2).sum())


def test_estimator_recovers_the_noise_scale_of_synthetic_gradients():
    rng = np.random.default_rng(0)
    dim, sigma = 50, 2.0
    true_grad = np.full(dim, 0.1)  # |G|^2 = 0.5, tr(Sigma) = dim * sigma^2 = 200: B_noise = 400
    tracker = NoiseScaleTracker(decay=0.99)
    for _ in range(2000):
        tracker.update(synthetic_sq_norm(rng, true_grad, sigma, 32), synthetic_sq_norm(rng, true_grad, sigma, 256),
                       32, 256)
    assert tracker.b_noise == pytest.approx(400, rel=0.25)
    grad_sq, trace = noise_terms(small_sq=0.5 + 200 / 32, big_sq=0.5 + 200 / 256, b_small=32, b_big=256)
    assert grad_sq == pytest.approx(0.5) and trace == pytest.approx(200)  # exact on expected values


def test_tracker_says_nothing_before_it_has_a_signal():
    tracker = NoiseScaleTracker()
    assert math.isnan(tracker.b_noise)
    tracker.update(small_sq=1.0, big_sq=2.0, b_small=8, b_big=64)  # |G|^2 estimate > 0 but trace < 0
    assert math.isnan(tracker.b_noise)
    with pytest.raises(ValueError):
        noise_terms(1.0, 1.0, 64, 64)


SWEEP = [(256, 400.0), (512, 380.0), (1024, 340.0), (2048, 260.0), (4096, 160.0), (8192, 90.0), (16384, 48.0)]


@pytest.mark.parametrize("b_noise, expected", [(10.0, 256), (300.0, 1024), (2_000.0, 2048), (20_000.0, 4096),
                                               (1e7, 16384)])
def test_batch_rule_follows_the_noise_scale_on_a_fake_sweep(b_noise, expected):
    batch, reason = batch_for_noise_scale(SWEEP, b_noise)
    assert batch == expected, reason
    cost = {b: time_to_progress(1 / u, b, b_noise) for b, u in SWEEP}
    assert cost[batch] == min(cost.values())
    assert f"{b_noise:,.0f}" in reason


def test_batch_rule_never_shrinks_as_the_noise_grows():
    chosen = [batch_for_noise_scale(SWEEP, b)[0] for b in np.geomspace(1, 1e8, 60)]
    assert chosen == sorted(chosen) and chosen[0] == 256 and chosen[-1] == 16384


def test_batch_rule_without_a_noise_scale_or_beyond_the_buffer():
    assert batch_for_noise_scale(SWEEP, math.nan)[0] == 256
    assert batch_for_noise_scale(SWEEP, 1e7, max_batch=3000)[0] == 2048
    with pytest.raises(ValueError):
        batch_for_noise_scale([], 100.0)


def test_critic_gradient_norms_shrink_with_the_batch_and_leave_the_weights_alone():
    import torch

    from spreeze.algos import make_algo
    from spreeze.config import Config
    from spreeze.replay import Batch

    config = Config(algo="sac", hidden_size=32)
    algo = make_algo(config, 4, 2, "cpu", "cpu")
    rng = np.random.default_rng(0)
    n = 1024
    batch = algo.batch(Batch(rng.standard_normal((n, 4), dtype=np.float32), rng.uniform(-1, 1, (n, 2)).astype(np.float32),
                             rng.standard_normal(n).astype(np.float32), rng.standard_normal((n, 4), dtype=np.float32),
                             np.zeros(n, np.float32)))
    before = [p.detach().clone() for p in algo.critic.parameters()]
    big, small = algo.critic_gradient_sq_norms(batch, 32)
    assert big > 0 and small > big  # noise adds tr(Sigma)/B: a smaller batch has the larger norm
    assert all(torch.equal(a, b) for a, b in zip(before, algo.critic.parameters()))
    assert all(p.grad is None for p in algo.critic.parameters())
