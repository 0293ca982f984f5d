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
