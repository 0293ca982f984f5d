import multiprocessing as mp

import numpy as np
import pytest

from spreeze.algos import make_actor
from spreeze.config import Config
from spreeze.envs import check_env
from spreeze.learner import ratio_allows_update
from spreeze.replay import SharedReplay
from spreeze.sampler import Sampler, mixed_noise_sigmas, ratio_allows_collect
from spreeze.stats import SharedStats
from spreeze.weights import SharedWeights

CTX = mp.get_context("spawn")


@pytest.fixture
def shared(request):
    config = request.param
    info = check_env(config.env_id)
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 4000, config.samplers * config.envs_per_sampler, CTX)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(config.samplers)
    yield config, info, replay, weights, stats
    for s in (replay, weights, stats):
        s.close()


TERMINATING = Config(env_id="SpreezeTestTerminating-v0", samplers=1, envs_per_sampler=2, learning_starts=10_000,
                     write_block=4, batch_size=8)
TRUNCATING = Config(env_id="SpreezeTestTruncating-v0", samplers=1, envs_per_sampler=1, learning_starts=10_000,
                    write_block=4, batch_size=8)


@pytest.mark.parametrize("shared", [TERMINATING], indirect=True)
def test_sampler_stores_terminations(shared):
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    for _ in range(20):
        sampler.step()
    sampler.close()
    assert stats.total_env_steps() == 40 and replay.size() == 40
    region0 = slice(0, 20)
    # obs[0] is the step index before the action: the step from 4 to 5 terminates
    assert np.array_equal(replay.terminated[region0], (replay.obs[region0, 0] == 4).astype(np.float32))
    assert replay.terminated[region0].sum() == 4
    assert np.all(np.abs(replay.actions[region0]) <= 1.0)
    assert stats.episodes[0] == 8


@pytest.mark.parametrize("algo", ["td3", "sac"])
def test_the_policy_s_exploring_actions_are_stored_within_the_bounds(algo):
    """The bound above is checked on warm-up actions, which are uniform in [-1, 1] by construction: here the actor
    acts (no warm-up) from the edge of its range, where TD3's added noise must be clipped, not stored past it."""
    import torch

    config = Config(env_id="SpreezeTestTerminating-v0", algo=algo, samplers=1, envs_per_sampler=4,
                    learning_starts=0, batch_size=1, write_block=4, noise_min=0.8, noise_max=0.8)
    info = check_env(config.env_id)
    actor = make_actor(config, info.obs_dim, info.act_dim)
    with torch.no_grad():  # every output at the top of its range: the mean's bias far up
        last = [m for m in actor.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.weight.zero_()
        last.bias.fill_(5.0)
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 4000, 4, CTX)
    weights, stats = SharedWeights.create(actor, CTX), SharedStats.create(1)
    try:
        sampler = Sampler(0, config, info, replay, weights, stats)
        for _ in range(40):
            sampler.step()
        sampler.close()
        actions = np.concatenate([replay.actions[r * 1000: r * 1000 + 40] for r in range(4)])
        assert len(actions) == 160 and np.all(np.abs(actions) <= 1.0)
        assert np.mean(actions > 0.99) > 0.4  # the actor's actions (at the top), not uniform warm-up ones
    finally:
        for shared_part in (replay, weights, stats):
            shared_part.close()


@pytest.mark.parametrize("shared", [TERMINATING], indirect=True)
def test_a_flush_cut_short_by_ctrl_c_writes_no_block_twice_when_flushed_again(shared, monkeypatch):
    """--serial's clean-up flushes again after a Ctrl-C; a Ctrl-C rises after a whole write (the lock's release),
    so the env written before it must count as flushed."""
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    for _ in range(3):  # 3 rows staged per env, under the write block of 4
        sampler.step()
    assert replay.size() == 0
    real_write, writes = replay.write, []

    def write_then_ctrl_c(*args):
        real_write(*args)
        writes.append(args[0])
        if len(writes) == 1:
            raise KeyboardInterrupt  # as the first env's write rises once its lock is released

    monkeypatch.setattr(replay, "write", write_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sampler.flush()
    sampler.flush()
    from spreeze.replay import SIZE

    assert writes[0] == 0 and [int(replay.counters[r, SIZE]) for r in (0, 1)] == [3, 3]  # each env's rows once
    sampler.close()


@pytest.mark.parametrize("shared", [TRUNCATING], indirect=True)
def test_sampler_never_stores_truncation_as_terminal(shared):
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    for _ in range(12):
        sampler.step()
    sampler.close()
    assert replay.size() == 12
    assert replay.terminated[:12].sum() == 0  # four time-limit ends, none stored as terminal
    assert stats.episodes[0] == 4
    # the transition at the time limit keeps its real next observation (step 3), not the reset one
    ends = replay.obs[:12, 0] == 2
    assert np.all(replay.next_obs[:12][ends, 0] == 3)


def test_mixed_noise_spreads_sigmas_over_the_range():
    sigmas = mixed_noise_sigmas(Config(algo="td3"), 8)
    assert np.allclose(np.sort(sigmas), np.linspace(0.05, 0.8, 8))  # PQL's set of sigmas, each once


@pytest.mark.parametrize("samplers,spares,per", [(1, 1, 4), (2, 2, 4), (3, 1, 2), (4, 4, 1), (1, 3, 8)])
def test_audit_2_td3_noise_every_active_set_covers_the_range(samplers, spares, per):
    """Audit point 2: the governor pauses the highest-numbered samplers first, so each active set is a
    prefix of the samplers; each one must cover [noise_min, noise_max], not only its low end."""
    config = Config(algo="td3", samplers=samplers, spare_samplers=spares, envs_per_sampler=per,
                    noise_min=0.05, noise_max=0.8)
    sigmas = mixed_noise_sigmas(config, config.total_envs)
    for active in range(1, samplers + spares + 1):
        mine = np.sort(sigmas[: active * per])
        if mine.size >= 2:
            assert mine[0] == pytest.approx(0.05) and mine[-1] == pytest.approx(0.8), (active, mine)
        else:
            assert 0.05 <= mine[0] <= 0.8
        # no big hole either: the widest gap is at most twice that of an even spread of this many values
        if mine.size >= 3:
            assert np.diff(mine).max() <= 2 * (0.8 - 0.05) / (mine.size - 1) + 1e-6, (active, mine)


@pytest.mark.parametrize("shared", [PENDULUM_WARMUP := Config(env_id="Pendulum-v1", samplers=1, envs_per_sampler=2,
                                                               learning_starts=10_000, write_block=4, batch_size=8,
                                                               hidden_size=16)], indirect=True)
def test_audit_3_restarted_sampler_draws_new_random_numbers(shared):
    """Audit point 3: a restarted sampler (or one of a resumed run) must not write the same warm-up
    transitions again; its first incarnation stays reproducible."""
    config, info, replay, weights, stats = shared

    def first_actions(incarnation: int) -> np.ndarray:
        sampler = Sampler(0, config, info, replay, weights, stats, incarnation=incarnation)
        try:
            return np.stack([sampler.actions() for _ in range(5)]), sampler.obs.copy()
        finally:
            sampler.close()

    first, first_obs = first_actions(0)
    again, again_obs = first_actions(0)
    restarted, restarted_obs = first_actions(1)
    later, _ = first_actions(2)
    assert np.array_equal(first, again) and np.array_equal(first_obs, again_obs)
    assert not np.allclose(first, restarted) and not np.allclose(restarted, later)
    assert not np.allclose(first_obs, restarted_obs)  # the envs are reseeded too


def test_collect_and_update_ratio_never_deadlock():
    config = Config(collect_per_update=4.0, learning_starts=100, batch_size=50)
    for steps in range(0, 2000, 7):
        for updates in range(0, 500, 3):
            assert ratio_allows_collect(config, steps, updates, slack=8) or ratio_allows_update(config, steps, updates)
    assert ratio_allows_collect(config, 105, 0, slack=8) and not ratio_allows_collect(config, 120, 0, slack=8)
    assert ratio_allows_collect(config, 120, 3, slack=8)
    assert not ratio_allows_update(config, 100, 30) and ratio_allows_update(config, 400, 30)
    free = Config(collect_per_update=0)
    assert ratio_allows_collect(free, 10**9, 0, slack=0) and ratio_allows_update(free, 0, 10**9)


def test_default_ratio_scales_with_the_batch():
    assert Config(batch_size=256).collect_ratio == pytest.approx(8.0)
    assert Config(batch_size=8192).collect_ratio == pytest.approx(256.0)
    assert Config(batch_size=8192, collect_per_update=4).collect_ratio == 4.0
    assert Config(collect_per_update=0).collect_ratio == 0.0


PENDULUM = Config(env_id="Pendulum-v1", samplers=1, envs_per_sampler=2, learning_starts=0, write_block=4,
                  batch_size=8, hidden_size=16)


WARMUP = Config(env_id="SpreezeTestTruncating-v0", samplers=1, envs_per_sampler=1, learning_starts=4, write_block=4,
                batch_size=8)


@pytest.mark.parametrize("shared", [WARMUP], indirect=True)
def test_actions_stay_uniform_until_the_learner_can_start(shared):
    """The learner starts after --learning-starts steps and one full batch (Config.learning_begins_at): until
    then the samplers take uniform actions, not the untrained actor's, even when the batch is the larger."""
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    acted_at = []
    act = sampler.actor.act
    sampler.actor.act = lambda *args, **kwargs: acted_at.append(stats.total_env_steps()) or act(*args, **kwargs)
    try:
        for _ in range(12):
            sampler.step()
    finally:
        sampler.close()
    assert config.learning_begins_at == 8 and acted_at and min(acted_at) == 8, acted_at


@pytest.mark.parametrize("shared", [PENDULUM], indirect=True)
def test_sampler_and_evaluator_act_with_a_new_version_at_their_next_step(shared):
    """Weights published by the learner are in use at the sampler's next env step (well under 1 s)."""
    import time

    import torch

    from spreeze.evaluator import Evaluator

    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    evaluator = Evaluator(config, info, weights, stats, started_at=time.time())
    try:
        while stats.total_env_steps() < config.learning_begins_at:  # uniform actions: no weights read yet
            sampler.step()
        sampler.step()
        assert sampler.policy_version == 0
        new_actor = make_actor(config, info.obs_dim, info.act_dim)
        with torch.no_grad():
            for p in new_actor.parameters():
                p.fill_(0.01)
        weights.publish(new_actor, version=7)
        sampler.step()
        assert sampler.policy_version == 7
        assert all(torch.equal(a, b) for a, b in zip(sampler.actor.parameters(), new_actor.parameters()))
        result = evaluator.evaluate()
        assert result["policy_version"] == 7
    finally:
        sampler.close()
        evaluator.close()


NSTEP_TERMINATING = Config(env_id="SpreezeTestTerminating-v0", samplers=1, envs_per_sampler=1, learning_starts=10_000,
                           write_block=4, batch_size=8, n_step=3, gamma=0.5)
NSTEP_TRUNCATING = Config(env_id="SpreezeTestTruncating-v0", samplers=1, envs_per_sampler=1, learning_starts=10_000,
                          write_block=4, batch_size=8, n_step=3, gamma=0.5)


@pytest.mark.parametrize("shared", [NSTEP_TERMINATING], indirect=True)
def test_n_step_rows_sum_discounted_rewards_and_end_at_a_termination(shared):
    """Episodes of 5 steps, reward 1 each, gamma 0.5, n 3: starts 0-2 bootstrap from 3 steps later;
    starts 3 and 4 end at the termination with the rest of the return and no bootstrap."""
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    for _ in range(10):  # two whole episodes
        sampler.step()
    sampler.flush()
    sampler.close()
    n = replay.size()
    assert n == 10  # every step of a terminating episode starts one row
    start = replay.obs[:n, 0]
    end = replay.next_obs[:n, 0]
    assert list(start) == [0, 1, 2, 3, 4] * 2
    assert list(end) == [3, 4, 5, 5, 5] * 2
    assert list(replay.rewards[:n]) == [1.75, 1.75, 1.75, 1.5, 1.0] * 2
    assert list(replay.terminated[:n]) == [0, 0, 1, 1, 1] * 2


@pytest.mark.parametrize("shared", [NSTEP_TRUNCATING], indirect=True)
def test_n_step_rows_shorter_than_n_at_a_time_limit_are_dropped(shared):
    """Truncated every 3 steps: only the start whose whole window fits is kept, bootstrapping with gamma**3."""
    config, info, replay, weights, stats = shared
    sampler = Sampler(0, config, info, replay, weights, stats)
    for _ in range(9):
        sampler.step()
    sampler.flush()
    sampler.close()
    assert replay.size() == 3 and stats.episodes[0] == 3
    assert list(replay.obs[:3, 0]) == [0, 0, 0] and list(replay.next_obs[:3, 0]) == [3, 3, 3]
    assert list(replay.rewards[:3]) == [1.75] * 3 and not replay.terminated[:3].any()


def test_n_step_is_refused_where_it_cannot_work():
    from spreeze.config import ConfigError

    with pytest.raises(ConfigError, match="--n-step 1"):
        Config(deterministic=True, n_step=3).validate()
    with pytest.raises(ConfigError, match="--n-step"):
        Config(n_step=0).validate()


def _faulting_sampler(monkeypatch, make_env):
    """A sampler of one env whose reset always fails (so each fault rebuilds it with ``make_env``), built by hand."""
    import types

    import spreeze.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "make_env", make_env)
    s = object.__new__(sampler_mod.Sampler)
    s.config, s.index, s.incarnation, s.env_indices = Config(env_id="Pendulum-v1"), 0, 0, [0]
    s.n_staged, s.episode_start, s.episode_returns = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1)
    s.pending, s.obs = [[]], np.zeros((1, 3), np.float32)
    s.stats = types.SimpleNamespace(dropped_episodes=np.zeros(1, np.int64))
    s.consecutive_faults, s.rebuilds = np.zeros(1, np.int64), np.zeros(1, np.int64)
    s.envs = [types.SimpleNamespace(close=lambda: None)]

    def reset_fails(i):
        raise RuntimeError("simulated reset failure")

    s._reset = reset_fails
    return s


def test_an_env_rebuilt_after_a_good_episode_draws_new_start_states(monkeypatch):
    """A rebuilt env's seed counted the faults in a row, which a good episode sets back to 0: every later rebuild
    of that env had the first one's seed and replayed its start states."""
    import types

    seeds = []
    s = _faulting_sampler(monkeypatch, lambda config, seed: seeds.append(seed) or
                          (types.SimpleNamespace(close=lambda: None), np.zeros(3, np.float32)))
    for _ in range(3):
        s._env_fault(0, "reset failed")
        s.consecutive_faults[0] = 0  # a good episode in between
    assert len(seeds) == 3 and len(set(seeds)) == 3, seeds


def test_a_rebuilt_env_whose_first_obs_is_not_finite_or_that_fails_to_build_is_one_more_fault(monkeypatch):
    """A rebuilt env's first obs became the next row's obs unchecked (a NaN row the learner stops on), and a
    constructor that raised crashed the sampler instead of counting toward its give-up."""
    import types

    from spreeze.sampler import MAX_CONSECUTIVE_FAULTS, SamplerGaveUp

    firsts = [np.full(3, np.nan, np.float32), np.full(3, np.inf, np.float32), np.ones(3, np.float32)]
    s = _faulting_sampler(monkeypatch, lambda config, seed: (types.SimpleNamespace(close=lambda: None), firsts.pop(0)))
    s._env_fault(0, "reset failed")
    assert np.array_equal(s.obs[0], np.ones(3)) and s.consecutive_faults[0] == 3 and not firsts

    def fails_to_build(config, seed):
        raise OSError("simulated constructor failure")

    s = _faulting_sampler(monkeypatch, fails_to_build)
    with pytest.raises(SamplerGaveUp, match=f"{MAX_CONSECUTIVE_FAULTS} times in a row.*constructor failure"):
        s._env_fault(0, "reset failed")
    import spreeze.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "make_env", lambda config, seed: (None, np.array([0.0, np.nan, 0.0])))
    with pytest.raises(ValueError, match="non-finite"):  # the envs a sampler starts with are checked too
        sampler_mod.make_envs(Config(env_id="Pendulum-v1"), [0])
