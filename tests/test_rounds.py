"""The round protocol: who steps what, how many updates a round runs, and where the learner may read."""
import multiprocessing as mp

import numpy as np

from spreeze.replay import SharedReplay
from spreeze.rounds import RoundPlan, sample_window

CTX = mp.get_context("spawn")


def test_round_plan_numbers():
    plan = RoundPlan(num_envs=4, samplers=3, steps_per_round=8, region_capacity=40,
                     learning_begins_at=100, collect_ratio=4.0, eval_every_steps=64)
    assert plan.round_env_steps == 32 and plan.env_steps_after(2) == 96
    assert [plan.sampler_envs(i) for i in range(3)] == [[0, 1], [2], [3]]
    assert plan.random_actions(3, 0) and not plan.random_actions(3, 1)  # 96 then 100 steps before it
    # learner round k reads rounds < k: 96 < 100 steps at k=3; from k=4 one update per 4 steps beyond 100
    assert [plan.updates_after(k) for k in (3, 4, 5)] == [0, 15, 23]
    assert [plan.window(k) for k in (0, 2, 5, 10)] == [(0, 0), (0, 16), (8, 40), (48, 80)]
    assert [plan.eval_due(k) for k in range(4)] == [False, True, False, True]


def test_lock_step_warm_up_lasts_until_the_learner_can_start():
    """As in free-running mode: uniform actions until --learning-starts steps and one full batch are collected."""
    from spreeze.config import Config

    config = Config(env_id="Pendulum-v1", deterministic=True, samplers=1, envs_per_sampler=4, learning_starts=100,
                    batch_size=256, buffer_size=10_000)
    plan = RoundPlan.from_config(config)
    assert plan.learning_begins_at == 256
    rounds = 300 // (plan.steps_per_round * plan.num_envs) + 1
    steps_before = [(k * plan.steps_per_round + t) * plan.num_envs
                    for k in range(rounds) for t in range(plan.steps_per_round)]
    random = [plan.random_actions(k, t) for k in range(rounds) for t in range(plan.steps_per_round)]
    assert random == [n < 256 for n in steps_before] and random.count(True) == 256 // plan.num_envs


def test_window_never_reaches_the_round_being_written():
    """Each region's ring keeps one round free: what round k writes lies outside learner round k's window."""
    plan = RoundPlan(num_envs=3, samplers=1, steps_per_round=4, region_capacity=10,
                     learning_begins_at=1, collect_ratio=1.0, eval_every_steps=100)
    replay = SharedReplay.create(1, 1, 30, 3, CTX)
    try:
        rng = np.random.default_rng(0)
        for k in range(8):
            for region in range(3):  # round k in flight: entries [4k, 4k + 4) of every region
                first = plan.steps_per_round * k
                entries = np.arange(first, first + plan.steps_per_round, dtype=np.float32)
                replay.write(region, entries[:, None], np.full((4, 1), region, np.float32), entries, entries[:, None],
                             np.zeros(4, np.float32))
            if k == 0:
                continue
            start, end = plan.window(k)
            batch = sample_window(replay, plan, k, 512, rng)
            assert np.all((batch.obs[:, 0] >= start) & (batch.obs[:, 0] < end)), (k, start, end)
            assert set(np.unique(batch.actions[:, 0])) == {0.0, 1.0, 2.0}
    finally:
        replay.close()


def test_a_ratio_without_an_exact_binary_value_loses_no_update_per_round():
    """``--replay-ratio 10`` makes collect:update 256/10, and ``//`` floors the exact quotient of two floats:
    256 // (256/10) is 9, so a lock-step round whose steps were an exact multiple ran one update short."""
    from spreeze.rounds import whole_updates

    plan = RoundPlan(num_envs=8, samplers=1, steps_per_round=32, region_capacity=64, learning_begins_at=256,
                     collect_ratio=256 / 10, eval_every_steps=10_000)
    assert plan.updates_after(1) == 10 and plan.updates_after(2) == 20
    assert whole_updates(256, 0.1) == 2560 and whole_updates(257, 256 / 10) == 10 and whole_updates(255, 25.5) == 10
    assert whole_updates(254, 25.5) == 9 and whole_updates(0, 8.0) == 0
