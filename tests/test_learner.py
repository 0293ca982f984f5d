"""The learner's batch source: the prefetch thread used with GPU learners, tested on CPU."""
import multiprocessing as mp
import threading

import numpy as np
import pytest

from spreeze.learner import BatchPrefetcher
from spreeze.replay import SharedReplay

CTX = mp.get_context("spawn")


@pytest.fixture
def filled_replay():
    replay = SharedReplay.create(3, 1, capacity=400, n_regions=4, mp_context=CTX)
    for region in range(4):
        codes = np.arange(50, dtype=np.float32) + 1000 * region
        replay.write(region, np.repeat(codes[:, None], 3, 1), np.zeros((50, 1), np.float32), codes,
                     np.repeat(codes[:, None], 3, 1), np.zeros(50, np.float32))
    yield replay
    replay.close()


def test_prefetched_batches_are_whole_rows_of_the_replay(filled_replay):
    prefetcher = BatchPrefetcher(filled_replay, 128, np.random.default_rng(0))
    try:
        seen = set()
        for _ in range(20):
            batch = prefetcher.next()
            assert batch.obs.shape == (128, 3) and np.all(np.isfinite(batch.obs))
            assert np.all(batch.obs == batch.rewards[:, None])
            seen.update(batch.rewards.tolist())
        assert len(seen) == 200  # every stored transition turns up
    finally:
        prefetcher.close()
    assert not any(t.name == "spreeze-prefetch" for t in threading.enumerate())


def test_a_failure_in_the_prefetch_thread_reaches_the_learner():
    class Broken:
        def sample(self, batch_size, rng):
            raise ValueError("cannot sample from an empty replay")

    prefetcher = BatchPrefetcher(Broken(), 8, np.random.default_rng(0))
    try:
        with pytest.raises(ValueError, match="empty replay"):
            prefetcher.next(timeout=5)
    finally:
        prefetcher.close()
