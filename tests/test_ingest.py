"""The remote samplers' experience path without Ray: a Sampler over block stand-ins, blocks fed to the ingest."""
import multiprocessing as mp

import numpy as np
import pytest
import torch

from spreeze import replay as replay_mod
from spreeze.algos import make_actor
from spreeze.config import Config, ConfigError
from spreeze.envs import check_env
from spreeze.ingest import BlockSink, BlockStats, BlockWeights, Ingest, make_block, remote_regions
from spreeze.replay import LockTimeout, SharedReplay
from spreeze.sampler import Sampler
from spreeze.stats import INGEST_LOST_BLOCKS, INGEST_ROWS, SharedStats
from spreeze.weights import SharedWeights

CTX = mp.get_context("spawn")
# one local sampler (+ one paused spare) and two remote ones of two envs each: regions 0-3 local, 4-7 remote
CONFIG = Config(env_id="SpreezeTestTerminating-v0", ray="auto", samplers=1, spare_samplers=1, remote_samplers=2,
                envs_per_sampler=2, write_block=4, learning_starts=50, batch_size=8, buffer_size=4000,
                collect_per_update=1.0)


@pytest.fixture
def shared():
    info = check_env(CONFIG.env_id)
    replay = SharedReplay.create(info.obs_dim, info.act_dim, CONFIG.buffer_size, CONFIG.total_envs, CTX,
                                 active_regions=CONFIG.active_envs)
    stats = SharedStats.create(CONFIG.sampler_processes, CONFIG.remote_samplers)
    yield info, replay, stats
    replay.close()
    stats.close()


def remote_sampler(info, remote: int, incarnation: int = 0):
    sink, weights = BlockSink(), BlockWeights()
    stats = BlockStats(CONFIG.sampler_processes, CONFIG.remote_samplers, CONFIG.sampler_processes + remote)
    return Sampler(CONFIG.sampler_processes + remote, CONFIG, info, sink, weights, stats, incarnation), sink, stats


def one_block(info, remote: int, blocks: int = 1):
    """One request of ``blocks`` blocks collected by remote sampler ``remote`` (its sampler closed), and that
    sampler's counters."""
    sampler, sink, bstats = remote_sampler(info, remote)
    try:
        return make_block(sampler, sink, bstats, blocks), bstats
    finally:
        sampler.close()


def test_remote_envs_get_regions_of_their_own():
    assert CONFIG.total_envs == 8 and CONFIG.active_envs == 6  # the spare's regions are not active
    assert list(remote_regions(CONFIG, 0)) == [4, 5] and list(remote_regions(CONFIG, 1)) == [6, 7]


def test_blocks_land_in_the_remote_regions_and_count_for_the_ratio(shared):
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    block, bstats = one_block(info, 1)
    assert block["regions"].tolist() == [6, 7] and block["blocks"] == 1
    assert block["env_steps"] == 2 * CONFIG.write_block and bstats.env_steps.sum() == 0  # counters reset
    assert stats.snapshot()["remote_policy_version"] == -1  # no remote block yet
    rows = ingest.write(1, block)
    assert rows == 2 * CONFIG.write_block == replay.size() == stats.ingest[INGEST_ROWS]
    assert block["policy_version"] == -1 and stats.snapshot()["remote_policy_version"] == -1  # warm-up actions
    assert stats.total_env_steps() == 8 and stats.remote_env_steps.tolist() == [0, 8]
    sizes = replay.counters[:, replay_mod.SIZE]
    assert sizes[6] == sizes[7] == CONFIG.write_block and sizes[:6].sum() == 0
    # the countdown env's obs[0] is the step index: the rows are the env's own, in order
    assert replay.obs[6 * replay.region_capacity: 6 * replay.region_capacity + 4, 0].tolist() == [0, 1, 2, 3]
    batch = replay.sample(16, np.random.default_rng(0))  # the learner samples them like local rows
    assert np.isfinite(batch.obs).all()
    newer, _ = one_block(info, 1)
    newer["policy_version"] = 7
    ingest.write(1, newer)
    block["policy_version"] = 3  # a late block of an older version does not move it back
    ingest.write(1, block)
    assert stats.snapshot()["remote_policy_version"] == 7


def test_a_request_of_several_blocks_writes_the_same_rows_as_one_block_at_a_time(shared):
    """Three blocks in one request: one array per column, each region's rows together and in the env's order,
    counted as three blocks (the ratio, the lost-block count) and one request."""
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    block, _ = one_block(info, 0, blocks=3)
    assert block["blocks"] == 3 and block["regions"].tolist() == [4, 5]
    assert block["counts"].tolist() == [3 * CONFIG.write_block] * 2 and block["obs"].shape == (24, 2)
    assert ingest.write(0, block) == 24 == replay.size()
    assert stats.snapshot()["ingest_blocks"] == 3 and stats.snapshot()["ingest_requests"] == 1
    sampler, sink, bstats = remote_sampler(info, 0)  # the same seeds, one block per request
    try:
        singles = [make_block(sampler, sink, bstats) for _ in range(3)]
    finally:
        sampler.close()
    for region, start in ((4, 0), (5, 12)):
        one_at_a_time = np.concatenate([b["obs"][b["regions"].tolist().index(region) * 4:][:4] for b in singles])
        assert np.array_equal(block["obs"][start: start + 12], one_at_a_time)
        # the countdown env's obs[0] is the step index: in the replay in the env's order
        first = region * replay.region_capacity
        assert replay.obs[first: first + 12, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    ingest.lost(3)
    assert stats.snapshot()["remote_lost_blocks"] == 3


def test_a_request_carries_only_the_blocks_the_ratio_allows(shared):
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    stats.resumed_env_steps[0] = 10_000  # far past the ratio (resumed): only the replay's warm-up lets them collect
    assert ingest.blocks_allowed(0, 10) == 7  # its 50 rows: the 7th block of 8 starts at row 48
    replay.counters[0, replay_mod.SIZE] = 40
    assert ingest.blocks_allowed(0, 10) == 2 and ingest.blocks_allowed(1, 10) == 1  # one already in flight
    replay.counters[0, replay_mod.SIZE] = CONFIG.learning_begins_at
    stats.resumed_env_steps[0] = 0
    stats.env_steps[0] = CONFIG.learning_begins_at + ingest.slack - 2 * ingest.block_steps
    assert ingest.blocks_allowed(0, 5) == 3  # as three requests of one block would each be allowed
    assert ingest.blocks_allowed(1, 5) == 2 and ingest.blocks_allowed(3, 5) == 0


def test_a_request_longer_than_a_region_is_written_in_pieces(shared):
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    cap = replay.region_capacity
    n = cap + 10
    block = {"regions": np.array([4]), "counts": np.array([n]), "obs": np.arange(2 * n, dtype=np.float32).reshape(n, 2),
             "actions": np.zeros((n, 1), np.float32), "rewards": np.zeros(n, np.float32),
             "next_obs": np.zeros((n, 2), np.float32), "terminated": np.zeros(n, np.float32), "blocks": 1,
             "env_steps": n, "episodes": 0, "dropped_episodes": 0, "train_return": float("nan")}
    assert ingest.write(0, block) == n and replay.counters[4, replay_mod.WRITTEN] == n
    assert replay.obs[4 * cap: 4 * cap + 10, 0].tolist() == [2.0 * (cap + i) for i in range(10)]  # ring wrapped


def test_a_block_for_someone_elses_regions_is_refused_and_counted(shared):
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    block, _ = one_block(info, 0)
    with pytest.raises(ValueError, match="outside"):
        ingest.write(1, block)  # remote 0's regions 4-5 are not remote 1's
    assert replay.size() == 0 and stats.ingest[INGEST_LOST_BLOCKS] == 1 and stats.total_env_steps() == 0


def test_a_block_whose_columns_do_not_fit_the_replay_is_refused_and_counted(shared):
    """A faulty actor's block with a column of the wrong width failed mid-write in the ingest (rows torn, the ingest
    process ended and every remote sampler with it): refused whole as not its to write, counted lost."""
    from spreeze.ingest import ForeignBlock

    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    block, _ = one_block(info, 0)
    block["rewards"] = block["rewards"][:, None]
    with pytest.raises(ForeignBlock, match="remote sampler 0: a block's rewards has shape"):
        ingest.write(0, block)
    assert replay.size() == 0 and stats.ingest[INGEST_LOST_BLOCKS] == 1 and stats.total_env_steps() == 0


def test_ingest_writes_under_the_region_locks(shared, monkeypatch):
    info, replay, stats = shared
    monkeypatch.setattr(replay_mod, "LOCK_TIMEOUT_S", 0.3)
    ingest = Ingest(CONFIG, replay, stats)
    block, _ = one_block(info, 0)
    replay.locks[4].acquire()  # as the learner's gather would hold it
    try:
        with pytest.raises(LockTimeout):
            ingest.write(0, block)
    finally:
        replay.locks[4].release()
    ingest.write(0, block)
    assert replay.size() == 8


def test_the_ratio_holds_remote_samplers_back_counting_local_steps_too(shared):
    info, replay, stats = shared
    ingest = Ingest(CONFIG, replay, stats)
    assert ingest.may_collect()
    stats.env_steps[0] = CONFIG.learning_begins_at + ingest.slack  # local steps alone use the allowance
    replay.counters[0, replay_mod.SIZE] = CONFIG.learning_begins_at  # warm-up reached
    assert ingest.may_collect()
    stats.remote_env_steps[0] = 1
    assert not ingest.may_collect()
    stats.learner[0] = 9  # nine updates at --collect-per-update 1
    assert ingest.may_collect()
    assert ingest.block_steps == 8 and ingest.may_collect(requested=1)  # a block in flight counts as collected
    assert not ingest.may_collect(requested=2)


def test_block_weights_never_go_back_to_an_older_version():
    info = check_env("Pendulum-v1")
    config = Config(env_id="Pendulum-v1", hidden_size=8)
    torch.manual_seed(0)
    source = make_actor(config, info.obs_dim, info.act_dim)
    shared = SharedWeights.create(source, CTX)
    try:
        flat_new, _ = shared.read()
    finally:
        shared.close()
    weights = BlockWeights()
    assert weights.offer(3, flat_new)
    assert not weights.offer(2, np.zeros_like(flat_new))  # a stale version arrives late
    target = make_actor(config, info.obs_dim, info.act_dim)
    assert weights.pull(target, -1) == 3
    flat_read_only = flat_new.copy()
    flat_read_only.setflags(write=False)  # as ray.get hands out object-store arrays
    weights.offer(4, flat_read_only)
    assert weights.pull(target, 3) == 4 and weights.pull(target, 4) == 4
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)


def test_ray_settings_are_checked_before_anything_starts(monkeypatch):
    for bad, why in ((dict(ray="auto", deterministic=True), "--deterministic"),
                     (dict(remote_samplers=2), "needs --ray"),
                     (dict(ray="auto", serial=True), "--serial"),
                     (dict(ray="no port"), "host:port"),
                     (dict(remote_only=True), "--remote-only needs --ray"),
                     (dict(ray="auto", remote_only=True, samplers=2), "no local sampler process")):
        with pytest.raises(ConfigError, match=why):
            Config(**bad).validate()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'spreeze\[ray\]'"):
        Config(ray="auto").validate()
