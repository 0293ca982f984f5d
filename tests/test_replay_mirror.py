"""The GPU replay mirror (spreeze/mirror.py), exercised on CPU tensors (``--replay-mirror on``): the rows it
draws from, its copies after ring wrap-around and after a dead writer's repair, and lock-step identity with the
shared-memory gather. The CUDA path: the ``gpu`` tests at the end."""
import dataclasses
import multiprocessing as mp

import numpy as np
import pytest
import torch

from spreeze import mirror as mirror_mod
from spreeze import replay as replay_mod
from spreeze.config import Config, ConfigError
from spreeze.mirror import HEADROOM_BYTES as HEADROOM, ReplayMirror, open_mirror
from spreeze.replay import PENDING, PTR, SIZE, SharedReplay

CTX = mp.get_context("spawn")
OBS, ACT = 3, 2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def write(replay, region: int, codes) -> None:
    """Rows whose every field encodes one number, so a torn or misplaced row is detectable."""
    codes = np.asarray(codes, np.float32)
    replay.write(region, np.repeat(codes[:, None], OBS, 1), np.repeat(codes[:, None], ACT, 1) * 2, codes,
                 np.repeat(codes[:, None], OBS, 1) + 0.5, np.zeros(len(codes), np.float32))


def assert_whole_rows(batch) -> np.ndarray:
    codes = batch.rewards.cpu().numpy()
    for field, scale, shift in ((batch.obs, 1, 0), (batch.actions, 2, 0), (batch.next_obs, 1, 0.5)):
        assert np.array_equal(field.cpu().numpy(), np.repeat(codes[:, None] * scale + shift, field.shape[1], 1))
    return codes


def assert_mirror_holds_the_replay(mirror: ReplayMirror, replay: SharedReplay) -> None:
    """Every stored slot of every region is in the mirror as it is in shared memory."""
    for region in range(replay.n_regions):
        size = int(replay.counters[region, SIZE])
        slots = region * replay.region_capacity + np.arange(size)
        rows = mirror.rows[torch.from_numpy(slots).to(mirror.device)].cpu().numpy()
        assert np.array_equal(rows[:, 0], replay.obs[slots, 0]), f"region {region}"
        assert np.array_equal(rows[:, OBS + ACT], replay.rewards[slots]), f"region {region}"


@pytest.fixture
def replay():
    r = SharedReplay.create(OBS, ACT, capacity=800, n_regions=4, mp_context=CTX)  # rings of 200
    yield r
    r.close()


def fill_with_stale_rows(replay) -> None:
    """Region 3 writes early, then the others wrap their rings: part of every ring is older than the newest
    ``capacity`` writes (plus margin), which neither path may draw."""
    write(replay, 3, 30_000 + np.arange(100))
    for start in range(0, 200, 20):
        for region in range(3):
            write(replay, region, 10_000 * region + start + np.arange(20))
    write(replay, 3, 30_100 + np.arange(100))
    for start in range(200, 280, 20):
        for region in range(3):
            write(replay, region, 10_000 * region + start + np.arange(20))


def chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square statistic of equal-total histograms, and its degrees of freedom."""
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    return float(((a - b) ** 2 / (a + b)).sum()), int(keep.sum()) - 1


def draw_histograms(replay, mirror, draws: int = 10):
    rng = np.random.default_rng(7)
    shared = np.concatenate([replay.sample(4096, rng).rewards for _ in range(draws)])
    mirrored = np.concatenate([assert_whole_rows(mirror.sample(4096, rng)) for _ in range(draws)])
    codes = np.union1d(shared, mirrored)
    return codes, shared, mirrored


def check_same_distribution(replay, device) -> None:
    fill_with_stale_rows(replay)
    mirror = ReplayMirror(replay, device)
    try:
        codes, shared, mirrored = draw_histograms(replay, mirror)
    finally:
        mirror.close()
    assert set(shared) == set(mirrored), "the two paths draw from different rows"
    _, live = replay.live_sizes()
    assert len(codes) == live.sum() < replay.capacity  # stale rows were left out, by both
    assert not np.isin(30_000 + np.arange(100), codes).any()  # region 3's early block aged out
    counts = [np.bincount(np.searchsorted(codes, drawn), minlength=len(codes)) for drawn in (shared, mirrored)]
    statistic, dof = chi_square(*counts)
    assert statistic < dof + 4 * np.sqrt(2 * dof), f"chi-square {statistic:.0f} with {dof} degrees of freedom"


def test_mirror_draws_uniformly_from_the_rows_shared_sample_draws_from(replay):
    check_same_distribution(replay, "cpu")


def test_sync_copies_new_rows_once_per_region_and_twice_at_a_wrap(replay):
    write(replay, 0, np.arange(20))
    mirror = ReplayMirror(replay, "cpu")
    try:
        assert mirror.sync() == 20 and mirror.copies == 1  # the empty regions need no copy
        write(replay, 0, 100 + np.arange(190))  # slots 20..199, then 0..9: the ring wraps
        assert mirror.sync() == 190 and mirror.copies == 3
        assert mirror.sync() == 0 and mirror.copies == 3  # nothing new: nothing copied, no lock taken
        for start in range(0, 600, 200):  # three rings' worth between two syncs: the newest ring, from PTR
            write(replay, 1, 1000 + start + np.arange(200))
        write(replay, 1, 2000 + np.arange(50))
        assert mirror.sync() == 200 and mirror.copies == 5
        assert_mirror_holds_the_replay(mirror, replay)
        codes = assert_whole_rows(mirror.sample(8192, np.random.default_rng(0)))
        # 860 writes: those before the newest 800 + 25 (ring 0's first 20 rows and codes 100..114) are left out
        assert set(codes) == set(range(115, 290)) | set(replay.rewards[200:400].tolist())
    finally:
        mirror.close()


def test_a_dead_writers_rows_are_not_copied_and_the_repaired_region_is_copied_again(replay, monkeypatch):
    monkeypatch.setattr(replay_mod, "LOCK_TIMEOUT_S", 0.2)
    write(replay, 2, np.arange(200))   # a full ring
    write(replay, 3, 500 + np.arange(5))  # a ring that is not full yet
    mirror = ReplayMirror(replay, "cpu")
    try:
        mirror.sync()
        for region, pending in ((2, 10), (3, 200)):  # each writer dies holding its lock, half a block written
            replay.locks[region].acquire()
            replay.counters[region, PENDING] = pending
            first = int(replay.counters[region, PTR])
            replay.obs[region * 200 + first: region * 200 + first + 5] = -7.0
        write(replay, 0, 900 + np.arange(10))
        assert mirror.sync() == 10  # the other regions go on; the locked ones have nothing finished to copy
        assert (mirror.rows[:, 0] != -7.0).all()
        assert replay.recover_region(3, wait_s=0.05) is True
        assert int(replay.counters[3, SIZE]) == 0  # nothing intact was left in region 3: emptied
        assert mirror.sync() == 0  # no row to copy, but region 3 leaves the rows batches come from
        codes = assert_whole_rows(mirror.sample(4096, np.random.default_rng(0)))
        assert not np.isin(500 + np.arange(5), codes).any() and np.isin(900 + np.arange(10), codes).all()
        assert replay.recover_region(2, wait_s=0.05) is True
        assert mirror.sync() == 200  # region 2 again, whole: its torn rows now hold copies of intact ones
        assert_mirror_holds_the_replay(mirror, replay)
        assert_whole_rows(mirror.sample(4096, np.random.default_rng(0)))
    finally:
        mirror.close()


def test_a_writer_killed_between_its_pointer_and_its_size_leaves_the_mirror_whole_rows(replay, monkeypatch):
    """A writer killed after its rows and the ring's pointer, before its size: the ring's pointer ran ahead of
    its size, the restarted writer went on from the pointer, and the mirror, which copies what WRITTEN says
    is new, never copied the rows between (uninitialised memory in its batches)."""
    monkeypatch.setattr(replay_mod, "LOCK_TIMEOUT_S", 0.2)
    write(replay, 1, np.arange(50))  # a ring not yet full
    mirror = ReplayMirror(replay, "cpu")
    try:
        mirror.sync()
        replay.locks[1].acquire()  # the writer's block of 10: its rows, then PTR, then killed
        base = 1 * 200
        for array, value in ((replay.obs, 100.0), (replay.actions, 200.0), (replay.rewards, 100.0),
                             (replay.next_obs, 100.5), (replay.terminated, 0.0)):
            array[base + 50: base + 60] = value
        replay.stamps[base + 50: base + 60] = np.arange(50, 60)
        replay.counters[1, PTR] = 60
        assert replay.recover_region(1, wait_s=0.05) is True
        write(replay, 1, 500 + np.arange(20))  # the restarted writer
        mirror.sync()
        assert_mirror_holds_the_replay(mirror, replay)
        codes = assert_whole_rows(mirror.sample(4096, np.random.default_rng(0)))
        assert set(codes) == set(range(50)) | set(range(500, 520))
    finally:
        mirror.close()


def test_the_mirror_is_opened_only_when_wanted_and_when_it_fits(replay, monkeypatch):
    warnings = []
    assert open_mirror(Config(replay_mirror="auto"), replay, "cpu", warnings.append) is None  # auto: CUDA only
    assert open_mirror(Config(replay_mirror="off"), replay, "cpu", warnings.append) is None
    opened = open_mirror(Config(replay_mirror="on"), replay, "cpu", warnings.append)
    assert isinstance(opened, ReplayMirror) and not warnings
    opened.close()
    monkeypatch.setattr(mirror_mod, "free_bytes", lambda device: HEADROOM)  # the headroom alone takes it all
    assert open_mirror(Config(replay_mirror="on"), replay, "cpu", warnings.append) is None
    assert len(warnings) == 1 and "replay mirror off" in warnings[0] and "shared memory" in warnings[0]
    with pytest.raises(ConfigError, match="--replay-mirror on needs --experience-transport shm"):
        Config(replay_mirror="on", experience_transport="queue", collect_per_update=0).validate()
    with pytest.raises(ConfigError, match="--replay-mirror must be"):
        Config(replay_mirror="gpu").validate()


def test_the_learner_draws_from_the_mirror_or_warns_once_and_gathers_from_shared_memory(tmp_path, monkeypatch):
    """Learner.batch_source, the one place that chooses: the mirror through the prefetch thread, as on a GPU, or
    (too little free memory) one Warn for events.log and today's path."""
    from spreeze.algos import make_actor
    from spreeze.envs import check_env
    from spreeze.learner import Learner
    from spreeze.messages import Warn
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    info = check_env("Pendulum-v1")
    config = Config(env_id="Pendulum-v1", hidden_size=16, batch_size=64, actor_device="cpu", critic_device="cpu",
                    replay_mirror="on", noise_scale_interval=0, publish_interval_s=600.0)
    replay = SharedReplay.create(info.obs_dim, info.act_dim, capacity=400, n_regions=2, mp_context=CTX)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(1)
    messages = []

    class Box:
        def put(self, item, timeout=None):
            messages.append(item)

    try:
        for region in range(2):
            codes = np.arange(150, dtype=np.float32) + 1000 * region
            replay.write(region, np.repeat(codes[:, None], 3, 1), np.zeros((150, 1), np.float32), codes,
                         np.repeat(codes[:, None], 3, 1), np.zeros(150, np.float32))
        for fits in (True, False):
            if not fits:
                monkeypatch.setattr(mirror_mod, "free_bytes", lambda device: HEADROOM)
            learner = Learner(config, info, replay, weights, stats, tmp_path, 0.0, prefetch=fits, messages=Box())
            try:
                for _ in range(3):
                    learner.step()
                assert learner.algo.updates == 3
                assert isinstance(learner.batch_source(), ReplayMirror if fits else SharedReplay)
                assert isinstance(learner.next_batch().obs, torch.Tensor if fits else np.ndarray)
            finally:
                learner.close()
        warned = [m for m in messages if isinstance(m, Warn)]
        assert len(warned) == 1 and "replay mirror off" in warned[0].text
    finally:
        for part in (replay, weights, stats):
            part.close()


def test_the_autotune_probe_measures_the_mirror_path_when_the_run_takes_it(monkeypatch):
    from autotune.probe import ProbeSettings, measure_learner
    from spreeze.envs import check_env

    drawn = []
    original = ReplayMirror.sample
    monkeypatch.setattr(ReplayMirror, "sample", lambda self, size, rng: drawn.append(size) or original(self, size, rng))
    settings = ProbeSettings(batch_seconds=0.03, warmup_updates=1, max_batch=256, sweep_budget_s=1.0)
    config = Config(env_id="Pendulum-v1", hidden_size=16, actor_device="cpu", critic_device="cpu")
    info = check_env("Pendulum-v1")
    measured = measure_learner(dataclasses.replace(config, replay_mirror="on"), info, settings, 1)
    assert measured["replay_mirror"] and measured["sweep"] and set(drawn) == {p["batch"] for p in measured["sweep"]}
    drawn.clear()
    assert not measure_learner(config, info, settings, 1)["replay_mirror"] and not drawn  # auto on a CPU: off


def deterministic_rounds(tmp_path, name: str, **overrides):
    from test_lockstep import deterministic_run

    small = dict(total_steps=768, learning_starts=256, eval_every_steps=384)
    rounds, returns, _ = deterministic_run(tmp_path, name, samplers=1, serial=True, **small, **overrides)
    return rounds, returns


def test_deterministic_runs_are_identical_with_and_without_the_mirror(tmp_path, monkeypatch):
    gathered = []
    original = ReplayMirror.gather
    monkeypatch.setattr(ReplayMirror, "gather", lambda self, slots: gathered.append(len(slots)) or original(self, slots))
    without = deterministic_rounds(tmp_path, "off", replay_mirror="off")
    assert not gathered
    with_mirror = deterministic_rounds(tmp_path, "on", replay_mirror="on")
    assert gathered and set(gathered) == {64}  # the mirror did serve the batches
    assert with_mirror == without


# ----- the CUDA path (skipped without a GPU) ------------------------------------------------------------------
@pytest.mark.gpu
@CUDA
def test_cuda_mirror_draws_like_shared_sample_and_follows_wraps(replay):
    check_same_distribution(replay, "cuda:0")
    write(replay, 0, 70_000 + np.arange(150))  # wraps ring 0 again
    mirror = ReplayMirror(replay, "cuda:0")
    try:
        mirror.sync()
        batch = mirror.sample(65_536, np.random.default_rng(0))
        assert batch.obs.device.type == "cuda" and batch.obs.is_contiguous()
        assert_whole_rows(batch)
        assert_mirror_holds_the_replay(mirror, replay)
    finally:
        mirror.close()


@pytest.mark.gpu
@CUDA
def test_cuda_deterministic_runs_are_identical_with_and_without_the_mirror(tmp_path):
    cuda = dict(actor_device="cuda:0", critic_device="cuda:0")
    assert (deterministic_rounds(tmp_path, "on", replay_mirror="auto", **cuda)
            == deterministic_rounds(tmp_path, "off", replay_mirror="off", **cuda))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_the_critics_gpu_holds_the_mirror_and_the_actor_gets_its_slice(replay):
    from spreeze.algos import make_algo

    fill_with_stale_rows(replay)
    config = dataclasses.replace(Config(hidden_size=16), actor_device="cuda:0", critic_device="cuda:1")
    algo = make_algo(config, OBS, ACT, "cuda:0", "cuda:1")
    mirror = open_mirror(config, replay, algo.critic_device)
    try:
        assert mirror is not None and mirror.rows.device == torch.device("cuda:1")
        batch = algo.batch(mirror.sample(1024, np.random.default_rng(0)))
        assert batch.obs_actor.device == torch.device("cuda:0") and batch.obs_critic.device == torch.device("cuda:1")
        assert torch.equal(batch.obs_actor.cpu(), batch.obs_critic.cpu())
        algo.update(batch)
    finally:
        mirror.close()
