import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from spreeze.config import Config, ConfigError
from spreeze.replay import PENDING, Batch, ReplayTooLarge, SharedReplay, check_fits_in_memory
from spreeze.transport import QueueReplay, attach_replay

CTX = mp.get_context("spawn")
OBS, ACT = 4, 2


@pytest.fixture
def replay():
    r = SharedReplay.create(OBS, ACT, capacity=1000, n_regions=4, mp_context=CTX)
    yield r
    r.close()


def block(writer: int, start: int, n: int):
    """Rows whose every field encodes (writer, sequence number), so a torn row is detectable."""
    seq = np.arange(start, start + n, dtype=np.float32)
    code = writer * 1_000_000 + seq
    obs = np.repeat(code[:, None], OBS, axis=1)
    actions = np.repeat(code[:, None], ACT, axis=1)
    return obs, actions, code.copy(), obs + 0.5, np.full(n, writer % 2, np.float32)


def write_many(handle, region: int, n_total: int, block_size: int) -> None:
    replay = attach_replay(handle)
    try:
        for start in range(0, n_total, block_size):
            replay.write(region, *block(region, start, min(block_size, n_total - start)))
    finally:
        replay.close()


def assert_rows_consistent(batch: Batch) -> None:
    code = batch.rewards
    assert np.all(np.isfinite(code)), "read an unwritten (NaN) slot"
    assert np.all(batch.obs == code[:, None])
    assert np.all(batch.actions == code[:, None])
    assert np.all(batch.next_obs == code[:, None] + 0.5)
    assert np.all(batch.terminated == (code // 1_000_000) % 2)


def test_fresh_storage_is_nan_and_sample_shapes(replay):
    assert np.isnan(replay.obs).all() and np.isnan(replay.rewards).all()
    replay.write(0, *block(0, 0, 10))
    batch = replay.sample(64, np.random.default_rng(0))
    assert batch.obs.shape == (64, OBS) and batch.next_obs.shape == (64, OBS)
    assert batch.actions.shape == (64, ACT) and batch.rewards.shape == (64,) and batch.terminated.shape == (64,)
    assert all(a.dtype == np.float32 for a in batch)
    assert_rows_consistent(batch)
    assert set(batch.rewards.astype(int)) <= set(range(10))


def test_a_block_whose_columns_do_not_fit_is_refused_before_any_row_changes(replay):
    """A column that failed to copy mid-block (rewards of shape (n, 1)) left the rows' first columns new and the
    rest old, marked pending, and sampled as they were: refused whole before the lock is taken."""
    replay.write(0, *block(0, 0, 10))
    obs, actions, rewards, next_obs, terminated = block(0, 10, 10)
    for bad in ((obs, actions, rewards[:, None], next_obs, terminated), (obs, actions[:, :1], rewards, next_obs,
                                                                         terminated)):
        with pytest.raises(ValueError, match="a block's (rewards|actions) has shape"):
            replay.write(0, *bad)
    assert int(replay.counters[0, PENDING]) == 0 and replay.size() == 10  # nothing marked torn, nothing moved
    assert_rows_consistent(replay.sample(256, np.random.default_rng(0)))


def test_ring_wraps_and_keeps_the_newest(replay):
    replay.write(1, *block(1, 0, 200))
    replay.write(1, *block(1, 200, 100))  # region capacity is 250: 50 oldest rows overwritten
    assert replay.size() == 250 and replay.written() == 300
    stored = sorted(replay.rewards[250:500].astype(int) - 1_000_000)
    assert stored == list(range(50, 300))


def test_sampling_covers_regions_in_proportion(replay):
    replay.write(0, *block(0, 0, 30))
    replay.write(2, *block(2, 0, 90))
    batch = replay.sample(20_000, np.random.default_rng(1))
    share_region2 = np.mean(batch.rewards >= 2_000_000)
    assert abs(share_region2 - 0.75) < 0.02


def test_concurrent_writers_store_exactly_n_untorn(replay):
    n_per_writer = 240  # fits each 250-slot region: nothing overwritten, so exactly N must be stored
    writers = [CTX.Process(target=write_many, args=(replay.handle, region, n_per_writer, 7)) for region in range(4)]
    for w in writers:
        w.start()
    rng = np.random.default_rng(2)
    reads = 0
    deadline = time.monotonic() + 120
    while any(w.is_alive() for w in writers):
        assert time.monotonic() < deadline, f"writers still running after 120 s, {replay.size()} stored"
        if replay.size() > 0:
            assert_rows_consistent(replay.sample(256, rng))
            reads += 1
    for w in writers:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert replay.size() == replay.written() == 4 * n_per_writer
    for region in range(4):
        codes = replay.rewards[region * 250: region * 250 + n_per_writer]
        assert sorted(codes.astype(np.int64) - region * 1_000_000) == list(range(n_per_writer))
    assert reads > 0


def test_memory_check_suggests_a_size():
    with pytest.raises(ReplayTooLarge, match="--buffer-size"):
        check_fits_in_memory(100, 10, 10**11, 4)
    assert check_fits_in_memory(4, 2, 1000, 4) > 0


def test_memory_check_refuses_a_replay_larger_than_the_free_shared_memory(monkeypatch):
    """A container's /dev/shm (Docker: 64 MiB) holds less than the RAM says: filling a segment past it is a SIGBUS
    that ends the run without a word, so the check refuses it first, naming --shm-size and a buffer that fits."""
    import spreeze.replay as replay_mod

    monkeypatch.setattr(replay_mod, "shm_free_bytes", lambda: 64 << 20)
    with pytest.raises(ReplayTooLarge, match=r"MiB of shared memory .*--shm-size.*--buffer-size (\d+)") as err:
        check_fits_in_memory(22, 6, 1_000_000, 4)
    suggested = int(str(err.value).rsplit(" ", 1)[1])
    assert check_fits_in_memory(22, 6, suggested, 4) <= (64 << 20)  # the suggestion fits
    monkeypatch.setattr(replay_mod, "shm_free_bytes", lambda: 64 << 20)
    # the queue transport's replay is the learner's private memory: /dev/shm does not hold it (it was refused)
    queue = QueueReplay.create(22, 6, 1_000_000, 2, CTX, 4)
    assert queue.capacity == 1_000_000
    monkeypatch.setattr(replay_mod, "shm_free_bytes", lambda: None)  # nothing to ask: the RAM check alone
    assert check_fits_in_memory(22, 6, 1_000_000, 4) > 64 << 20


def test_lock_held_by_dead_writer_times_out_instead_of_freezing(replay, monkeypatch):
    import spreeze.replay as replay_mod

    monkeypatch.setattr(replay_mod, "LOCK_TIMEOUT_S", 0.2)
    replay.write(0, *block(0, 0, 5))
    replay.locks[0].acquire()  # as if a writer died inside its critical section
    with pytest.raises(replay_mod.LockTimeout, match="for 0.2 s"):  # raised after the (patched) timeout
        replay.sample(8, np.random.default_rng(0))
    assert replay.recover_region(0, wait_s=0.1) is True
    assert_rows_consistent(replay.sample(8, np.random.default_rng(0)))
    assert replay.recover_region(0, wait_s=0.1) is False


def test_a_region_lock_a_live_process_holds_for_long_is_waited_for_not_freed(replay):
    """The learner saving a large replay holds a region lock for seconds; a sampler of that region dying then
    must not get the learner's lock freed (two processes in the region; the learner's release would raise)."""
    import threading

    from spreeze.replay import HOLDER

    replay.write(0, *block(0, 0, 5))
    replay._acquire(0)  # this process: alive, recorded as the holder
    assert int(replay.counters[0, HOLDER]) > 0
    result = {}
    recovering = threading.Thread(target=lambda: result.update(freed=replay.recover_region(0, 0.1, dead_pid=-1)))
    recovering.start()
    time.sleep(0.5)  # several of the recovery's waits
    assert recovering.is_alive()  # still waiting for the live holder
    replay._release(0)  # raises if the recovery had released the lock in the meantime
    recovering.join(timeout=10)
    assert result == {"freed": False} and int(replay.counters[0, HOLDER]) == 0
    assert_rows_consistent(replay.sample(8, np.random.default_rng(0)))


def test_a_live_holder_not_yet_recorded_is_waited_for_not_freed(replay):
    """Between its acquire and the write of its pid (and between clearing it and its release) a live holder is
    recorded as none; descheduled there for more than the recovery's 50 ms on a loaded machine, its lock was
    taken over (two processes in the region, and its own release raised)."""
    import threading

    from spreeze.replay import EPOCH, HOLDER

    replay.write(0, *block(0, 0, 5))
    epoch, errors = int(replay.counters[0, EPOCH]), []

    acquired = threading.Event()

    def slow_holder():
        replay.locks[0].acquire()
        acquired.set()
        time.sleep(0.3)  # descheduled before its pid is written
        replay.counters[0, HOLDER] = os.getpid()
        time.sleep(0.5)
        replay.counters[0, HOLDER] = 0
        try:
            replay.locks[0].release()
        except ValueError as err:  # released too many times: the recovery had taken it over
            errors.append(err)

    holder = threading.Thread(target=slow_holder)
    holder.start()
    assert acquired.wait(10)
    assert replay.recover_region(0, wait_s=0.1, dead_pid=-1) is False
    holder.join(timeout=10)
    assert errors == [] and int(replay.counters[0, EPOCH]) == epoch
    assert_rows_consistent(replay.sample(8, np.random.default_rng(0)))


def die_holding_the_lock(handle, region: int) -> None:
    replay = SharedReplay.attach(handle)
    replay._acquire(region)  # recorded as the holder, then gone
    os._exit(9)


def dead_writer(replay, die, region: int) -> int:
    """The pid of a child that ran ``die(handle, region)`` and exited inside it (code 9)."""
    writer = CTX.Process(target=die, args=(replay.handle, region))
    writer.start()
    writer.join(timeout=30)
    assert writer.exitcode == 9
    return writer.pid


def test_a_region_lock_a_dead_process_is_recorded_holding_is_freed(replay):
    dead = dead_writer(replay, die_holding_the_lock, 1)
    assert replay.recover_region(1, wait_s=0.1, dead_pid=dead) is True
    replay.write(1, *block(1, 0, 5))  # the region is usable again


def die_mid_write(handle, region: int) -> None:
    """Fill the region, then start overwriting a block and die holding the lock (SIGKILL-like _exit)."""
    import os

    from spreeze.replay import PENDING

    replay = SharedReplay.attach(handle)
    replay.write(region, *block(region, 0, 250))
    replay.locks[region].acquire()
    replay.counters[region, PENDING] = 10
    replay.obs[region * 250: region * 250 + 5] = -7.0  # half of the block written, inconsistent rows
    os._exit(9)


def test_writer_killed_mid_block_leaves_no_torn_rows_after_recovery(replay):
    dead_writer(replay, die_mid_write, 2)
    assert replay.recover_region(2, wait_s=0.2) is True
    assert replay.size() == 250
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert_rows_consistent(replay.sample(256, rng))
    replay.write(2, *block(2, 250, 3))  # the region is writable again
    assert replay.written() == 253


def test_a_ctrl_c_while_a_dead_writer_s_lock_is_taken_over_rises_after_the_repair(replay, monkeypatch):
    """The supervisor's Ctrl-C handler (spreeze/runners.py) firing inside the takeover: the repair is finished
    and the lock released before the KeyboardInterrupt rises (else the learner's final gather would wait on a
    lock nobody holds any more)."""
    import signal

    import spreeze.replay as replay_mod
    from spreeze.replay import HOLDER, PENDING
    from spreeze.runners import _raise_interrupt

    replay.counters[2, HOLDER] = dead_writer(replay, die_mid_write, 2)  # as a writer's own acquire records it
    real_pid_exists = replay_mod.psutil.pid_exists

    def pid_exists_then_ctrl_c(pid):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode, inside the takeover
        return real_pid_exists(pid)

    monkeypatch.setattr(replay_mod.psutil, "pid_exists", pid_exists_then_ctrl_c)
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            replay.recover_region(2, wait_s=0.1)  # found dead by psutil
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert replay.locks[2].acquire(timeout=0.5)  # released
    replay.locks[2].release()
    assert int(replay.counters[2, PENDING]) == 0 and replay.size() == 250
    rng = np.random.default_rng(0)
    assert_rows_consistent(replay.sample(256, rng))


class SignallingRows(np.ndarray):
    """Rows that send this process a SIGINT when the writer first copies from them (inside its locked block)."""
    fired = False

    def __getitem__(self, key):
        import signal

        if not SignallingRows.fired:
            SignallingRows.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return np.asarray(super().__getitem__(key))


def test_a_ctrl_c_inside_a_locked_write_rises_after_the_whole_block(replay):
    """--serial and lock-step write in the main process, where Ctrl-C is handled: a Ctrl-C inside the locked
    block rises after the block is whole and the lock released (else PENDING stays set: torn rows)."""
    import signal

    from spreeze.replay import PENDING
    from spreeze.runners import _raise_interrupt

    obs, actions, rewards, next_obs, terminated = block(1, 0, 5)
    SignallingRows.fired = False
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            replay.write(1, obs.view(SignallingRows), actions, rewards, next_obs, terminated)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert SignallingRows.fired
    assert replay.locks[1].acquire(timeout=0.5)
    replay.locks[1].release()
    assert int(replay.counters[1, PENDING]) == 0 and replay.size() == 5
    assert_rows_consistent(replay.sample(16, np.random.default_rng(0)))


# ----- the Queue path kept for the Fig. 3a ablation ------------------------------------------------------
def test_queue_path_delivers_every_transition_untorn_from_writer_processes():
    replay = QueueReplay.create(OBS, ACT, capacity=10_000, queue_size=4, mp_context=CTX, n_regions=3)
    try:
        writers = [CTX.Process(target=write_many, args=(replay.handle, region, 300, 7)) for region in range(3)]
        for w in writers:
            w.start()
        rng = np.random.default_rng(0)
        deadline = time.monotonic() + 120
        while any(w.is_alive() for w in writers):  # a queue of 4 blocks: writers wait on the learner
            assert time.monotonic() < deadline, f"writers still running after 120 s, {replay.size()} received"
            if replay.size() > 0:
                assert_rows_consistent(replay.sample(64, rng))
        for w in writers:
            w.join(timeout=30)
            assert w.exitcode == 0
        replay.receive()
        assert replay.received == replay.written() == replay.size() == 900
        codes = np.sort(replay.storage.rewards[:900].astype(np.int64))
        assert list(codes) == sorted(r * 1_000_000 + i for r in range(3) for i in range(300))
    finally:
        replay.close()


def test_queue_write_copies_the_block_before_the_caller_reuses_it():
    replay = QueueReplay.create(OBS, ACT, capacity=100, queue_size=8, mp_context=CTX, n_regions=1)
    try:
        staged = list(block(1, 0, 5))
        replay.write(0, *staged)
        for array in staged:
            array[:] = -7  # the sampler overwrites its staging arrays right after a write
        assert_rows_consistent(replay.sample(20, np.random.default_rng(0)))
    finally:
        replay.close()


def test_full_queue_gives_up_at_shutdown_instead_of_blocking():
    stop = CTX.Event()
    replay = QueueReplay.create(OBS, ACT, capacity=100, queue_size=1, mp_context=CTX, n_regions=1)
    writer = QueueReplay.attach(replay.handle, stop)
    try:
        writer.write(0, *block(0, 0, 3))
        time.sleep(0.2)  # let the feeder thread move it into the pipe: the queue is now full
        stop.set()
        writer.write(0, *block(0, 3, 3))  # returns (a write that waited for room would raise LockTimeout)
        assert replay.written() == 3
    finally:
        writer.close()
        replay.close()


def test_queue_transport_needs_a_free_running_process_run():
    Config(experience_transport="queue", collect_per_update=0).validate()
    for bad in (dict(), dict(collect_per_update=0, serial=True), dict(collect_per_update=-1, deterministic=True)):
        with pytest.raises(ConfigError, match="queue"):
            Config(experience_transport="queue", **bad).validate()
    with pytest.raises(ConfigError, match="shm or queue"):
        Config(experience_transport="pipe").validate()


def test_learner_drains_a_small_queue_during_warm_up():
    """Learning starts after more transitions than the queue holds: the reader must drain before sampling."""
    replay = QueueReplay.create(OBS, ACT, capacity=100, queue_size=1, mp_context=CTX, n_regions=1)
    reader = QueueReplay.attach(replay.handle, reader=True)
    try:
        for k in range(4):  # each write would wait 5 s and fail if the reader's warm-up polls did not drain
            replay.write(0, *block(0, 3 * k, 3))
            time.sleep(0.05)
            deadline = time.monotonic() + 2
            while reader.received < 3 * (k + 1) and time.monotonic() < deadline:
                reader.size()
        assert reader.size() == 12 and reader.received == 12
        assert_rows_consistent(reader.sample(8, np.random.default_rng(0)))
    finally:
        reader.close()
        replay.close()


# ----- audit fixes ---------------------------------------------------------------------------------------
def test_audit_1_spare_sampler_regions_do_not_shrink_the_replay(tmp_path):
    """Audit point 1: with 1 active sampler and 1 paused spare x 4 envs, `--buffer-size 15000` used to fill
    only 7,500 rows, below the 10,000-step warm-up, so the learner never started."""
    from spreeze.envs import EnvInfo
    from spreeze.supervisor import Supervisor

    info = EnvInfo("Pendulum-v1", OBS, ACT, (-1.0,) * ACT, (1.0,) * ACT, 200)
    config = Config(env_id="Pendulum-v1", buffer_size=15_000, samplers=1, spare_samplers=1, envs_per_sampler=4,
                    batch_size=256, learning_starts=10_000)
    config.validate()
    sup = Supervisor(config, info, tmp_path, log=lambda line: None)
    sup.create_shared()
    try:
        replay = sup.replay
        assert replay.n_regions == 8 and replay.capacity == 15_000
        for start in range(0, 5_000, 250):  # only the active sampler's envs 0-3 write
            for region in range(4):
                replay.write(region, *block(region, start, 250))
        assert replay.size() == 15_000 >= config.learning_begins_at
        assert_rows_consistent(replay.sample(4096, np.random.default_rng(0)))
    finally:
        sup.close_shared()


def test_audit_1_regions_idle_for_long_age_out_of_sampling():
    """Audit point 1: a paused sampler's regions keep old data; it must not keep its share of every batch."""
    replay = SharedReplay.create(OBS, ACT, capacity=400, n_regions=4, mp_context=CTX, active_regions=2)
    rng = np.random.default_rng(0)
    try:
        assert replay.region_capacity == 200 and replay.capacity == 400 and replay.slots == 800
        for start in range(0, 200, 20):  # a spare ran for a while (regions 2 and 3), then was paused
            for region in (2, 3):
                replay.write(region, *block(region, start, 20))
        for start in range(0, 100, 20):  # the active ones fill half of their regions
            for region in (0, 1):
                replay.write(region, *block(region, start, 20))
        batch = replay.sample(20_000, rng)
        assert_rows_consistent(batch)
        stale = np.isin(batch.rewards // 1_000_000, (2, 3)).mean()
        assert 0.3 < stale < 0.75  # still among the newest 400 writes: sampled, not dominant
        for start in range(100, 400, 20):  # 600 newer writes: every row of the paused regions is older than 400
            for region in (0, 1):
                replay.write(region, *block(region, start, 20))
        batch = replay.sample(20_000, rng)
        assert_rows_consistent(batch)
        assert not np.isin(batch.rewards // 1_000_000, (2, 3)).any()
        seq = batch.rewards % 1_000_000
        assert seq.min() >= 200 and np.unique(seq).size == 200  # exactly each active ring's 200 newest rows
        counts = np.bincount((batch.rewards // 1_000_000).astype(int), minlength=2)[:2]
        assert abs(counts[0] - counts[1]) < 0.05 * counts.sum()
    finally:
        replay.close()


class _FailingColumn(np.ndarray):
    """A storage column whose write raises: the write stops where a killed writer would have."""

    def __setitem__(self, key, value):
        raise RuntimeError("writer killed")


def test_audit_6_first_wrap_of_a_ring_not_yet_full_is_repaired():
    """Audit point 6: a writer killed inside the write that first wraps a ring leaves rows at the start of
    the ring half-written, and those rows are already sampled (they lie below the region's size)."""
    replay = SharedReplay.create(OBS, ACT, capacity=200, n_regions=2, mp_context=CTX)
    try:
        replay.write(1, *block(1, 0, 90))                       # 90 of 100 slots used
        rewards = replay.rewards
        replay.rewards = rewards.view(_FailingColumn)
        with pytest.raises(RuntimeError, match="killed"):
            replay.write(1, *block(1, 500, 20))                 # wraps: rows 90-99 then 0-9; dies after obs, actions
        replay.rewards = rewards
        assert replay.size() == 90                              # the counters never moved
        replay.recover_region(1, wait_s=0.1)
        rng = np.random.default_rng(0)
        for _ in range(10):
            assert_rows_consistent(replay.sample(512, rng))
        replay.write(1, *block(1, 90, 10))
        assert replay.size() == 100
        assert_rows_consistent(replay.sample(512, rng))
    finally:
        replay.close()


class _CountersFailingAt(np.ndarray):
    """Counters whose one column's store raises: a writer killed after its rows, before all its counters."""
    column = -1

    def __setitem__(self, key, value):
        if isinstance(key, tuple) and self.column in np.arange(self.shape[1])[key[1]].ravel():
            raise RuntimeError("writer killed")
        super().__setitem__(key, value)


def test_a_writer_killed_after_its_rows_leaves_recovery_no_intact_row_to_replace():
    """The rows of a block were whole but the counters had not all moved: recovery, finding the torn rows
    from the ring pointer, replaced the intact rows after the block with copies (and lost them)."""
    from spreeze.replay import WRITTEN

    replay = SharedReplay.create(OBS, ACT, capacity=200, n_regions=2, mp_context=CTX)
    try:
        replay.write(1, *block(1, 0, 100))                      # a full ring of 100
        counters = replay.counters
        replay.counters = counters.view(_CountersFailingAt)
        replay.counters.column = WRITTEN
        with pytest.raises(RuntimeError, match="killed"):
            replay.write(1, *block(1, 100, 10))                 # rows 100-109 into slots 0-9, then dies
        replay.counters = counters
        replay.recover_region(1, wait_s=0.1)
        kept = replay.rewards[100:200] % 1_000_000
        assert sorted(kept) == list(range(10, 110))             # every row once: the block and the 90 before it
        assert_rows_consistent(replay.sample(512, np.random.default_rng(0)))
    finally:
        replay.close()


def test_a_writer_killed_at_any_line_leaves_its_counters_all_moved_or_none():
    """A writer killed among separate stores of its ring pointer, size and write count left WRITTEN (the write
    clock every stamp is drawn from) a block short for good. Killed here at each line of write() in turn (a
    trace function raises there), the three have either all moved or none has."""
    import sys

    from spreeze import proc
    from spreeze.replay import PTR, SIZE, WRITTEN

    code = SharedReplay.write.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line is not None and line > code.co_firstlineno})
    replay = SharedReplay.create(OBS, ACT, capacity=200, n_regions=2, mp_context=CTX)
    tracer = sys.gettrace()  # a debugger's or a coverage tool's, put back after each kill
    try:
        for k, kill_at in enumerate(lines):
            before = replay.counters[1, [PTR, SIZE, WRITTEN]].copy()

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == kill_at:
                    raise RuntimeError("writer killed")
                return local

            sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
            try:
                replay.write(1, *block(1, 10 * k, 10))
            except RuntimeError:
                pass
            finally:
                sys.settrace(tracer)
            replay.locks[1].acquire(block=False)  # taken now, or still held by the killed write: freed either way
            replay.locks[1].release()
            proc._INTERRUPTS.depth = 0  # and the killed write's deferral of Ctrl-C (a real kill ends the process)
            moved = replay.counters[1, [PTR, SIZE, WRITTEN]] != before
            assert moved.all() or not moved.any(), (kill_at, before, replay.counters[1, :3])
    finally:
        replay.close()


def test_a_region_emptied_between_its_size_and_its_copy_is_drawn_again(replay, monkeypatch):
    """The sizes are read without locks; a region the recovery of a dead writer empties before the learner
    copies its share would have put NaN rows into the batch."""
    from spreeze.replay import EPOCH, PTR, SIZE

    for region in range(4):
        replay.write(region, *block(region, 0, 50))
    calls, real = [], replay.live_sizes

    def live_sizes():  # the first read races with a recovery that empties region 2
        calls.append(1)
        sizes = real()
        if len(calls) == 1:
            replay.counters[2, SIZE] = replay.counters[2, PTR] = 0   # as recover_region empties a region
            replay.obs[500:750] = replay.rewards[500:750] = np.nan
            replay.counters[2, EPOCH] += 1
        return sizes

    monkeypatch.setattr(replay, "live_sizes", live_sizes)
    batch = replay.sample(512, np.random.default_rng(0))
    assert_rows_consistent(batch)
    assert len(calls) == 2 and not np.isin(batch.rewards // 1_000_000, 2).any()


def test_a_torn_read_of_pointer_and_size_never_points_at_unwritten_slots():
    """The writer moves a ring's pointer before its size; a sampler reading both without the lock in between
    must not draw from slots a ring not yet full has never written."""
    from spreeze.replay import PTR

    replay = SharedReplay.create(OBS, ACT, capacity=200, n_regions=2, mp_context=CTX)
    try:
        replay.write(0, *block(0, 0, 10))
        replay.write(1, *block(1, 0, 10))
        replay.counters[0, PTR] = 50  # as if read between the writer's two stores
        for _ in range(20):
            assert_rows_consistent(replay.sample(256, np.random.default_rng(0)))
    finally:
        replay.close()
