"""The gradient noise scale: estimator on synthetic gradients, the tracker, the batch rule on fake sweeps,
and the measurement on a real critic."""
import dataclasses
import math
import time

import numpy as np
import pytest

from spreeze.messages import Event
from spreeze.noise_scale import (SWITCH_GAIN, NoiseScaleTracker, batch_for_noise_scale, fed_sweep, noise_terms,
                                 time_to_progress)

from conftest import fake_checkpoint


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


def test_tracker_weighs_each_measurement_by_its_age_alone():
    """The averages are bias-corrected: one measurement is taken whole, and at the first re-decision (the tenth)
    the first one (just after the warm-up) weighs as the exponential weights say, not more than the nine after it."""
    def measure(tracker, grad_sq, trace, small=32, big=256):
        tracker.update(grad_sq + trace / small, grad_sq + trace / big, small, big)

    tracker = NoiseScaleTracker(decay=0.9)
    measure(tracker, 1.0, 10_000.0)
    assert tracker.b_noise == pytest.approx(10_000.0)
    for _ in range(9):
        measure(tracker, 1.0, 100.0)
    weights = 0.1 * 0.9 ** np.arange(9, -1, -1)  # oldest first
    expected = (weights[0] * 10_000.0 + weights[1:].sum() * 100.0) / weights.sum()
    assert tracker.b_noise == pytest.approx(expected) and tracker.b_noise < 700  # started at 10,000: about 3,900
    assert tracker.measurements == 10


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


# the learner sweep of a 2-core CPU profile (an Intel Xeon, Walker2D's preset): batch 512 at 0.58x the rate
XEON_SWEEP = [(256, 114.6), (512, 66.3)]


def test_a_running_batch_changes_only_for_a_predicted_gain_of_at_least_switch_gain():
    """Running Walker2D estimates of B_noise swung 1,847 -> 175 and 6,661 -> 676 between two decisions 30 s
    apart; at gains of 1.02-1.03x the batch flipped 256 -> 512 -> 256. A change now needs SWITCH_GAIN."""
    assert batch_for_noise_scale(XEON_SWEEP, 1_847.0)[0] == 512  # the best, 1.03x: chosen afresh (at launch)
    batch, reason = batch_for_noise_scale(XEON_SWEEP, 1_847.0, current=256)
    assert batch == 256 and "1.03x" in reason and "kept" in reason
    assert batch_for_noise_scale(XEON_SWEEP, 7_049.0, current=256)[0] == 512  # 1.12x: worth a change
    assert batch_for_noise_scale(XEON_SWEEP, 175.0, current=512)[0] == 256  # 1.38x back
    for b_noise in np.geomspace(1, 1e6, 40):  # the choice never predicts slower progress than the running batch
        batch, _ = batch_for_noise_scale(SWEEP, b_noise, current=1024)
        cost = {b: time_to_progress(1 / u, b, b_noise) for b, u in SWEEP}
        assert cost[batch] <= cost[1024] and (batch == 1024 or cost[1024] >= SWITCH_GAIN * cost[batch])
    assert batch_for_noise_scale(SWEEP, 1e7, current=3000)[0] == 16384  # a batch not swept is not kept


def test_batch_rule_without_a_noise_scale_or_beyond_the_buffer():
    assert batch_for_noise_scale(SWEEP, math.nan)[0] == 256
    assert batch_for_noise_scale(SWEEP, 1e7, max_batch=3000)[0] == 2048
    with pytest.raises(ValueError):
        batch_for_noise_scale([], 100.0)


# the learner sweep of a GPU profile: the update costs about the same at any batch (an H200, Walker2d-v5)
FLAT_GPU_SWEEP = [(256, 132.0), (1024, 136.5), (4096, 133.7), (8192, 133.2), (16384, 131.5), (65536, 89.0)]


def test_fed_sweep_caps_the_rates_the_samplers_cannot_feed():
    ratios = [b / 32 for b, _ in FLAT_GPU_SWEEP]  # --collect-per-update -1 at replay ratio 32
    fed = dict(fed_sweep(FLAT_GPU_SWEEP, 27_900.0, ratios))
    assert fed[256] == 132.0 and fed[4096] == 133.7  # 27,900 / 128 = 218 updates/s: not a limit
    assert fed[8192] == pytest.approx(27_900 / 256) and fed[65536] == pytest.approx(27_900 / 2048)
    assert fed_sweep(FLAT_GPU_SWEEP, 27_900.0, [0.0] * 6) == FLAT_GPU_SWEEP  # running free: nothing to feed
    assert fed_sweep(FLAT_GPU_SWEEP, None, ratios) == FLAT_GPU_SWEEP
    with pytest.raises(ValueError):
        fed_sweep(FLAT_GPU_SWEEP, 27_900.0, ratios[:2])
    # the rule on the fed rates: the batch samplers can keep up with, not the largest "free" one
    assert batch_for_noise_scale(FLAT_GPU_SWEEP, 446.0)[0] == 16384
    assert batch_for_noise_scale(list(fed.items()), 446.0)[0] == 4096
    assert batch_for_noise_scale(list(fed.items()), 37.0)[0] == 4096


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
    torch.manual_seed(0)
    norms = []
    for _ in range(20):  # one draw is noisy; in expectation |g_B|^2 = |G|^2 + tr(Sigma)/B
        order = torch.randperm(n)
        norms.append(algo.critic_gradient_sq_norms(type(batch)(*(t[order] for t in batch)), 32))
    big, small = np.mean(norms, axis=0)
    assert big > 0 and small > big  # a smaller batch has the larger norm on average
    assert all(torch.equal(a, b) for a, b in zip(before, algo.critic.parameters()))
    assert all(p.grad is None for p in algo.critic.parameters())


# ----- the batch the run uses: at launch and re-decided by the learner -----------------------------------
def test_launch_takes_the_smallest_batch_without_a_noise_scale_and_the_rule_with_one():
    from autotune import decide

    sweep = [decide.Measurement(b, u, None) for b, u in SWEEP]
    batch, reason = decide.choose_batch_by_noise(sweep, None, buffer_size=1_000_000)
    assert batch == 256 and "re-decides" in reason
    batch, reason = decide.choose_batch_by_noise(sweep, 20_000.0, buffer_size=1_000_000)
    assert batch == 4096 and "last run" in reason
    assert decide.choose_batch_by_noise(sweep, 1e7, buffer_size=3000)[0] == 2048
    assert decide.choose_batch_by_noise(sweep, 1e7, buffer_size=100)[0] == 256  # none fits: the smallest, no error


def test_tune_uses_the_noise_scale_the_last_run_left_in_the_profile(tmp_path):
    from autotune import remember_noise_scale, tune
    from test_autotune import FAST, WALKER, FakeProbe

    from spreeze.config import Config

    config = Config(buffer_size=100_000, batch_rule="noise")
    tuned, profile = tune(config, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                          progress=False, probe=FakeProbe())
    assert tuned.batch_size == min(p["batch"] for p in profile["measurements"]["learner"]["sweep"])
    assert remember_noise_scale(profile, 1e9, config) is None
    tuned2, profile2 = tune(config, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                            progress=False, probe=FakeProbe())
    assert profile2["source"] == "cache" and "last run" in profile2["chosen"]["batch_size"]["reason"]
    largest = max(p["batch"] for p in profile2["measurements"]["learner"]["sweep"] if p["batch"] <= 100_000)
    assert tuned2.batch_size == largest
    # measured under another discount or n-step, the noise scale is not this run's: the smallest batch again
    for other in (dataclasses.replace(config, gamma=0.99), dataclasses.replace(config, n_step=3)):
        tuned3, profile3 = tune(other, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                                progress=False, probe=FakeProbe())
        reason = profile3["chosen"]["batch_size"]["reason"]
        assert profile3["source"] == "cache" and tuned3.batch_size == tuned.batch_size < largest, reason
        assert "left out" in reason and ("gamma (0.98 then, 0.99 now)" in reason or "n_step (1 then, 3 now)" in reason)
        assert profile3["measurements"]["learner"]["noise_scale"] == 1e9  # kept in the profile all the same
    # one an older version remembered, without its settings: not used either
    assert remember_noise_scale(profile, 1e9) is None
    tuned4, profile4 = tune(config, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                            progress=False, probe=FakeProbe())
    assert tuned4.batch_size == tuned.batch_size and "not recorded" in profile4["chosen"]["batch_size"]["reason"]
    assert remember_noise_scale(profile, 1e9, config) is None  # remembered again with them: used again
    tuned5, _ = tune(config, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                     progress=False, probe=FakeProbe())
    assert tuned5.batch_size == largest
    for gamma in (0.98, 0.99):  # the knee rule reads no noise scale, so says nothing of one left out
        _, knee = tune(Config(buffer_size=100_000, batch_rule="knee", gamma=gamma), WALKER, set(),
                       cache_dir=str(tmp_path), log=lambda s: None, settings=FAST, progress=False, probe=FakeProbe())
        assert "noise" not in knee["chosen"]["batch_size"]["reason"]  # the frame-rate knee, as before


def test_a_run_s_noise_scale_survives_a_reprofile_keeps_the_profile_s_date_and_is_never_infinite(tmp_path,
                                                                                                  monkeypatch):
    """The noise scale describes the env under its learning settings, not the machine: measuring the machine again
    (--reprofile) keeps it. Remembering it does not make the profile look newer than its measurements (the console
    names that date when it reuses the profile). An infinite estimate (|G|^2 averaged to ~0) is not kept: it would
    replace a usable one with JSON the next launch refuses."""
    import json

    from autotune import remember_noise_scale, tune
    from test_autotune import FAST, WALKER, FakeProbe, the_cache_file

    from spreeze.config import Config

    config = Config(buffer_size=100_000, batch_rule="noise")

    def launch(**kw):
        return tune(config, WALKER, set(), cache_dir=str(tmp_path), log=lambda s: None, settings=FAST,
                    progress=False, probe=FakeProbe(), **kw)

    _, profile = launch()
    path = the_cache_file(tmp_path)
    measured = json.loads(path.read_text())
    monkeypatch.setattr(time, "time", lambda: measured["created_unix"] + 86_400)
    assert remember_noise_scale(profile, 1e9, config) is None
    record = json.loads(path.read_text())
    assert record["measurements"]["learner"]["noise_scale"] == 1e9
    assert (record["created"], record["created_unix"]) == (measured["created"], measured["created_unix"])
    assert remember_noise_scale(profile, math.inf, config) is None
    assert json.loads(path.read_text())["measurements"]["learner"]["noise_scale"] == 1e9  # the finite one stays
    monkeypatch.undo()

    tuned, again = launch(reprofile=True)
    assert again["source"] == "measured" and "last run" in again["chosen"]["batch_size"]["reason"]
    largest = max(p["batch"] for p in again["measurements"]["learner"]["sweep"] if p["batch"] <= 100_000)
    assert tuned.batch_size == largest
    assert json.loads(path.read_text())["measurements"]["learner"]["noise_scale"] == 1e9
    path.write_text(path.read_text().replace('"noise_scale": 1000000000.0', '"noise_scale": "bad"'))
    tuned, fresh = launch(reprofile=True)  # an unreadable one is not carried over
    assert "noise_scale" not in json.loads(path.read_text())["measurements"]["learner"]
    assert "re-decides" in fresh["chosen"]["batch_size"]["reason"] and tuned.batch_size < largest


def test_a_replay_smaller_than_every_measured_batch_gets_a_batch_of_its_size():
    """Both rules fall back to the smallest swept batch when none fits the replay; the plan then clamps it, so a
    tiny --buffer-size is not refused over a --batch-size nobody typed."""
    from test_autotune import measurements, plan_for

    from autotune import decide

    m = measurements(2, 2)
    for rule in ("knee", "noise"):
        chosen = decide.plan(m, samplers_given=None, batch_given=None, buffer_size=200, collect_per_update=0.0,
                             mem_available=m["memory"]["available"], replay_bytes=1 << 20, batch_rule=rule)
        assert chosen["batch_size"]["value"] == 200 and "holds only 200 rows" in chosen["batch_size"]["reason"]
        assert chosen["expected"]["update_frame_rate"] > 0
    assert plan_for(m, batch_given=256, buffer_size=200)["batch_size"]["value"] == 256  # given: validate says no


def test_only_a_batch_the_profile_chose_may_be_re_decided():
    from spreeze.config import Config
    from spreeze.runners import profile_batch_sweep

    measured = {"measurements": {"learner": {"sweep": [{"batch": 256, "updates_per_s": 90.0},
                                                       {"batch": 512, "updates_per_s": 60.0}]}}}
    chose = {**measured, "chosen": {"batch_size": {"by": "profile"}}}
    assert profile_batch_sweep(chose, Config()) == [(256, 90.0), (512, 60.0)]  # no sampler rate: nothing to cap
    for by in ("user", "config", "deterministic", "default"):
        assert profile_batch_sweep({**measured, "chosen": {"batch_size": {"by": by}}}, Config()) is None
    assert profile_batch_sweep(None, Config()) is None


def test_the_learner_gets_the_rates_the_run_s_samplers_can_feed():
    from spreeze.config import Config
    from spreeze.runners import capped_note, profile_batch_sweep

    profile = {"chosen": {"batch_size": {"by": "profile"}},
               "measurements": {"sampler": {"env_step_s": 1 / 2_790},  # one sampler: 2,790 steps/s
                                "learner": {"sweep": [{"batch": b, "updates_per_s": u} for b, u in FLAT_GPU_SWEEP]}}}
    two = dict(profile_batch_sweep(profile, Config(samplers=2)))
    ten = dict(profile_batch_sweep(profile, Config(samplers=10)))
    assert two[256] == ten[256] == 132.0
    assert two[16384] == pytest.approx(2 * 2_790 / 512) and ten[16384] == pytest.approx(10 * 2_790 / 512)
    free = dict(profile_batch_sweep(profile, Config(samplers=2, collect_per_update=0.0)))
    assert free == dict(FLAT_GPU_SWEEP)
    fixed = dict(profile_batch_sweep(profile, Config(samplers=2, collect_per_update=64.0)))
    assert fixed[4096] == fixed[65536] == pytest.approx(2 * 2_790 / 64)
    remote = dict(profile_batch_sweep(profile, Config(samplers=2, remote_samplers=8, ray="auto")))
    assert remote == ten  # remote samplers (--ray) feed the learner too
    remote_only = dict(profile_batch_sweep(profile, Config(samplers=0, remote_samplers=10, remote_only=True, ray="auto")))
    assert remote_only == ten
    # what the run's log says about it
    assert "from batch 4096 on" in capped_note(profile, list(two.items())) and "134 -> 44 updates/s" in \
        capped_note(profile, list(two.items()))
    assert capped_note(profile, FLAT_GPU_SWEEP) is None


def _learner(tmp_path, batch_rule="noise", sweep=SWEEP[:4], **overrides):
    import multiprocessing as mp

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import EnvInfo
    from spreeze.learner import Learner
    from spreeze.replay import SharedReplay
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    ctx = mp.get_context("spawn")
    config = Config(hidden_size=16, batch_size=256, batch_rule=batch_rule, learning_starts=256,
                    buffer_size=8192, noise_scale_interval=1, **overrides)
    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    replay = SharedReplay.create(3, 1, 8192, 2, ctx)
    rng = np.random.default_rng(0)
    for region in range(2):
        for _ in range(8):
            n = 512
            obs = rng.standard_normal((n, 3)).astype(np.float32)
            replay.write(region, obs, rng.uniform(-1, 1, (n, 1)).astype(np.float32),
                         rng.standard_normal(n).astype(np.float32), obs, np.zeros(n, np.float32))
    weights = SharedWeights.create(make_actor(config, 3, 1), ctx)
    stats = SharedStats.create(1)
    messages = []

    class Box:
        def put(self, item, timeout=None):
            messages.append(item)

    learner = Learner(config, info, replay, weights, stats, tmp_path, 0.0, prefetch=False,
                      batch_sweep=sweep, messages=Box())
    return learner, (replay, weights, stats), messages


def test_learner_re_decides_its_batch_from_the_measured_noise_scale(tmp_path):
    from spreeze import stats as S

    learner, shared, messages = _learner(tmp_path)
    try:
        learner.noise.grad_sq, learner.noise.trace, learner.noise.measurements = 1.0, 2_000.0, 10  # B_noise 2000
        assert learner.maybe_rebatch() == 2048
        assert learner.batch_size == 2048 and shared[2].learner[S.BATCH_SIZE] == 2048
        assert messages and isinstance(messages[-1], Event) and "batch 256 -> 2048" in messages[-1].text
        rows = learner.rows
        learner.step()
        assert learner.rows == rows + 2048  # the ratio counts rows: a larger batch earns more env steps
        learner.noise.grad_sq, learner.noise.trace = 1.0, 10.0  # the noise fell: back to the small batch
        learner.noise.measurements = 20
        assert learner.maybe_rebatch() == 256
        learner.noise.measurements = 21  # between decisions nothing changes
        learner.noise.trace = 1e6
        assert learner.maybe_rebatch() is None and learner.batch_size == 256
    finally:
        learner.close()
        for s in shared:
            s.close()


def test_the_learner_measures_on_a_batch_before_the_critic_is_updated_on_it(tmp_path):
    """Measured on the batch the critic has just been fitted to, the batch's gradient is smaller than the true one
    by what the step removed: |G|^2 comes out too small and B_noise too large. So: measure, then update."""
    learner, shared, _ = _learner(tmp_path)
    calls = []
    measure, update = learner.algo.critic_gradient_sq_norms, learner.algo.update
    learner.algo.critic_gradient_sq_norms = lambda batch, small: calls.append(("measure", id(batch))) or \
        measure(batch, small)
    learner.algo.update = lambda batch: calls.append(("update", id(batch))) or update(batch)
    try:
        learner.step()
        learner.step()
        assert [c[0] for c in calls] == ["measure", "update", "measure", "update"]  # interval 1: every update
        assert calls[0][1] == calls[1][1] and calls[2][1] == calls[3][1]  # each on the batch about to be used
        assert learner.noise.measurements == 2 and learner.algo.updates == 2
        assert learner.stats.snapshot()["noise_measurements"] == 2  # what the summary reports
    finally:
        learner.close()
        for s in shared:
            s.close()


def test_a_learner_resumed_with_other_targets_or_rates_measures_the_noise_scale_afresh(tmp_path):
    learner, shared, _ = _learner(tmp_path)
    try:
        learner.step()
        learner.checkpoint()
        assert learner.noise.measurements == 1
    finally:
        learner.close()
        for s in shared:
            s.close()
    for overrides, kept in (({}, True), ({"gamma": 0.99}, False), ({"critic_lr": 3e-4}, False)):
        resumed, shared, messages = _learner(tmp_path, resume=str(tmp_path), **overrides)
        try:
            assert resumed.noise.measurements == (1 if kept else 0), overrides
            # what the summary (and so the profile's "remember it?" check) reads: the estimate's own count
            assert resumed.stats.snapshot()["noise_measurements"] == (1 if kept else 0), overrides
            afresh = [m.text for m in messages if "measured afresh" in m.text]
            assert bool(afresh) != kept and all(("gamma (0.98 then, 0.99 now)" in t or "critic_lr" in t)
                                                for t in afresh)
        finally:
            resumed.close()
            for s in shared:
                s.close()


def test_only_a_run_that_measured_enough_and_ended_well_leaves_its_noise_scale(tmp_path):
    import types

    from launch.compose import noise_scale_to_remember
    from spreeze.config import Config
    from spreeze.learner import REDECIDE_EVERY_MEASUREMENTS

    config = Config(noise_scale_interval=200)
    enough = REDECIDE_EVERY_MEASUREMENTS

    def result(code, measured, value=750.0):
        # a resumed run's "updates" include earlier sessions': only the estimate's own measurement count decides
        return types.SimpleNamespace(exit_code=code, summary={"updates": 200 * 10 * enough, "critic_noise_scale": value,
                                                              "critic_noise_measurements": measured})

    assert noise_scale_to_remember(result(0, enough), config) == 750.0
    assert noise_scale_to_remember(result(130, enough + 1), config) == 750.0  # Ctrl-C ends a run without a budget
    assert noise_scale_to_remember(result(0, enough - 1), config) is None  # a smoke test's few measurements
    assert noise_scale_to_remember(result(1, 10 * enough), config) is None  # e.g. a diverged critic
    assert noise_scale_to_remember(result(0, 10 * enough), Config(noise_scale_interval=0)) is None  # none measured
    assert noise_scale_to_remember(result(0, enough, None), config) is None


def test_a_resumed_learner_goes_on_from_the_batch_it_had_got_to(tmp_path):
    learner, shared, _ = _learner(tmp_path)
    try:
        learner.noise.grad_sq, learner.noise.trace, learner.noise.measurements = 1.0, 2_000.0, 10
        assert learner.maybe_rebatch() == 2048
        learner.step()
        learner.checkpoint()
        noise = (learner.noise.grad_sq, learner.noise.trace, learner.noise.measurements)
    finally:
        learner.close()
        for s in shared:
            s.close()
    # re-deciding: where it was (within this machine's sweep); a fixed batch: the config's
    for sweep, batch in ((SWEEP[:4], 2048), (SWEEP[:2], 512), (None, 256)):
        resumed, shared, messages = _learner(tmp_path, sweep=sweep, resume=str(tmp_path))
        try:
            assert resumed.batch_size == batch and resumed.algo.updates == 1
            # the running noise-scale estimate goes on too: the next decision comes at measurement 20, not 10
            assert (resumed.noise.grad_sq, resumed.noise.trace, resumed.noise.measurements) == noise
            assert noise[2] >= 10 and resumed.noise.b_noise == noise[1] / noise[0]
            assert resumed.rows == 2048  # the rows sampled before, at the batch of that time
            assert bool(messages) == (batch != 256) and all(f"resumed at batch {batch}" in m.text for m in messages)
            if sweep == SWEEP[:4]:  # resumed without the replay: fewer rows than the batch until it refills
                resumed.replay.size = lambda: 1_000
                resumed.step()
                assert resumed.batch_size == 512 and "above the 1,000 rows" in messages[-1].text
        finally:
            resumed.close()
            for s in shared:
                s.close()


def test_resume_re_decides_only_a_batch_the_profile_chose_under_the_noise_rule():
    from launch.compose import re_decides
    from spreeze.config import Config

    resumed = {"chosen": {"batch_size": {"value": 256, "by": "profile"}}}
    config = Config(batch_size=256, resume="run")
    assert re_decides(resumed, config, set())
    assert not re_decides(resumed, config, {"batch_size"})                               # --batch-size now
    assert not re_decides(resumed, Config(batch_size=256, batch_rule="knee"), set())
    assert not re_decides(resumed, Config(batch_size=256, deterministic=True), set())
    assert not re_decides({"chosen": {"batch_size": {"by": "user"}}}, config, set())
    assert not re_decides(None, config, set())                                           # no autotune.json
    # --noise-scale-interval 0 now: the learner measures nothing, so it would never re-decide what the tuner chose
    assert not re_decides(resumed, Config(batch_size=256, resume="run", noise_scale_interval=0), set())


def test_resolve_on_resume_lets_the_tuner_choose_a_re_decided_batch_again(tmp_path, monkeypatch):
    """Through ``resolve``: on resume the sampler count stays the run's, a batch the learner was re-deciding goes
    back to the tuner (so the sweep is this machine's), and a batch given now stays fixed."""
    import json

    import autotune
    from launch.compose import resolve
    from spreeze.config import Config
    from spreeze.settings import config_record, parse

    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, run_dir=str(run))
    fake_checkpoint(run, saved)
    (run / "config.json").write_text(json.dumps(config_record(saved, {})))
    (run / "autotune.json").write_text(json.dumps({"chosen": {"batch_size": {"value": 256, "by": "profile"}}}))
    calls = []

    def fake_tune(config, env_info, explicit, **kwargs):
        calls.append((config.batch_size, set(explicit) | set(kwargs.get("kept", ()))))
        batch = config.batch_size or 1024
        by = "user" if "batch_size" in explicit else "profile"
        return (dataclasses.replace(config, batch_size=batch),
                {"chosen": {"samplers": {"value": 1, "by": "user"}, "batch_size": {"value": batch, "by": by}}})

    monkeypatch.setattr(autotune, "tune", fake_tune)
    lines = []
    parsed = parse(["--resume", str(run), "--no-window"])
    resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert calls[-1][0] == 0 and "samplers" in calls[-1][1] and "batch_size" not in calls[-1][1]
    assert resolved.config.batch_size == 1024 and resolved.sources["batch_size"] == "autotune"
    assert resolved.config.samplers == 1 and any("re-deciding" in x for x in lines)
    parsed = parse(["--resume", str(run), "--no-window", "--batch-size", "512"])  # a batch given now stays fixed
    resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert calls[-1][0] == 512 and {"samplers", "batch_size"} <= calls[-1][1]
    assert resolved.config.batch_size == 512
    # a resume that stops re-deciding keeps the batch the learner had got to (its checkpoint's), not the launch
    # batch config.json holds (with --collect-per-update -1 the ratio went back with it)
    fake_checkpoint(run, saved, batch_size=768)
    for flags in (["--noise-scale-interval", "0"], ["--batch-rule", "knee"]):
        parsed = parse(["--resume", str(run), "--no-window", *flags])
        resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
        assert calls[-1][0] == 768 and {"samplers", "batch_size"} <= calls[-1][1], flags
        assert resolved.config.batch_size == 768 and "resumed at batch 768" in lines[-1], flags
        assert resolved.sources["batch_size"] == "resume", flags  # config.json: the checkpoint's, not the tuner's
    parsed = parse(["--resume", str(run), "--no-window", "--noise-scale-interval", "0", "--buffer-size", "500",
                    "--learning-starts", "100"])
    resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert resolved.config.batch_size == 500 and "as --buffer-size 500 allows" in lines[-1]


def test_knee_rule_keeps_the_launch_batch(tmp_path):
    learner, shared, messages = _learner(tmp_path, batch_rule="knee")
    try:
        learner.noise.grad_sq, learner.noise.trace, learner.noise.measurements = 1.0, 2_000.0, 10
        assert learner.maybe_rebatch() is None and learner.batch_size == 256 and not messages
    finally:
        learner.close()
        for s in shared:
            s.close()


def test_ratio_in_rows_equals_the_ratio_in_updates_for_a_fixed_batch_and_follows_a_changing_one():
    from spreeze.config import Config
    from spreeze.pace import learner_allowance
    from spreeze.learner import ratio_allows_update
    from spreeze.sampler import ratio_allows_collect

    config = Config(batch_size=256, replay_ratio=32.0, learning_starts=1000)
    for updates in (0, 10, 1000):
        assert learner_allowance(config, updates) == learner_allowance(config, updates, updates * 256) == updates * 8
    assert learner_allowance(Config(collect_per_update=4.0), 10, 10 * 9999) == 40  # explicit ratio: per update
    # 100 updates of 2048 rows earn 100 * 64 env steps, not 100 * 8
    assert ratio_allows_collect(config, 1000 + 6000, 100, slack=0, rows=100 * 2048)
    assert not ratio_allows_collect(config, 1000 + 6000, 100, slack=0, rows=100 * 256)
    assert not ratio_allows_update(config, 1000 + 6000, 100, rows=100 * 2048, batch_size=2048, slack_updates=0)
    assert ratio_allows_update(config, 1000 + 6400, 100, rows=100 * 2048, batch_size=2048, slack_updates=0)
