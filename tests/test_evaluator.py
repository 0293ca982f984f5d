"""The evaluator: test i starts from seeded states that depend on the run's seed and i only."""
import multiprocessing as mp
import time

import numpy as np

from spreeze.algos import make_actor
from spreeze.config import Config
from spreeze.envs import check_env, make_env
from spreeze.evaluator import Evaluator, eval_episode_seed
from spreeze.stats import SharedStats
from spreeze.weights import SharedWeights

CTX = mp.get_context("spawn")


def test_test_i_starts_from_its_own_seeded_state_after_a_restart_too():
    config = Config(env_id="Pendulum-v1", hidden_size=16, eval_episodes=2, seed=3)
    info = check_env("Pendulum-v1")
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(1)
    evaluators = []
    try:
        first = Evaluator(config, info, weights, stats, time.time())
        restarted = Evaluator(config, info, weights, stats, time.time(), first_index=2)
        evaluators = [first, restarted]
        results = [first.evaluate() for _ in range(3)]
        again = restarted.evaluate()
        assert again["test_return"] == results[2]["test_return"]  # test 2, whichever process ran it
        assert results[0]["test_return"] != results[1]["test_return"]  # other tests, other start states
        env, _ = make_env("Pendulum-v1", 0)
        starts = [env.reset(seed=eval_episode_seed(3, 2, episode))[0] for episode in range(2)]
        assert not np.allclose(starts[0], starts[1])
        env.close()
    finally:
        for evaluator in evaluators:
            evaluator.close()
        weights.close()
        stats.close()


def test_nearby_seeds_and_tests_share_no_start_state():
    """With several episodes per test, seed s+1 did not repeat seed s's episodes shifted by one (averages over
    seeds had correlated test noise); a test's first episode keeps the seed earlier races recorded opponents with."""
    seeds = [eval_episode_seed(seed, index, episode)
             for seed in range(5) for index in range(20) for episode in range(10)]
    assert len(set(seeds)) == len(seeds)
    assert eval_episode_seed(3, 2, 0) == 3 + 77_777_777 + 2_000


def test_a_test_is_stamped_with_the_time_its_policy_was_taken(monkeypatch):
    """Its env steps and updates are read when the policy is taken; its time is too (a test ending later is the
    same policy: stamped at its end, every curve point sat one test late, and a resume that cuts rows logged
    after its checkpoint dropped a test begun before it)."""
    import types

    import pytest

    import spreeze.evaluator as evaluator_mod

    clock = {"now": 1000.0}
    monkeypatch.setattr(evaluator_mod, "time", types.SimpleNamespace(time=lambda: clock["now"]))
    config = Config(env_id="Pendulum-v1", hidden_size=16, eval_episodes=1, seed=3)
    info = check_env("Pendulum-v1")
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(1)
    evaluator = None
    try:
        evaluator = Evaluator(config, info, weights, stats, 990.0)
        step = evaluator.env.step

        def slow_step(action):  # each env step of the test takes 10 ms of the clock
            clock["now"] += 0.01
            return step(action)

        evaluator.env.step = slow_step
        stats.env_steps[0] = 1234
        result = evaluator.evaluate()
        assert result["episode_length"] == 200 and clock["now"] == pytest.approx(1002.0)
        assert result["time_s"] == pytest.approx(10.0) and result["env_steps"] == 1234
    finally:
        if evaluator is not None:
            evaluator.close()
        weights.close()
        stats.close()
