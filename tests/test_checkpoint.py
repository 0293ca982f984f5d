"""Checkpoints: safe loading, the learner's random streams, and the replay saved beside them (--save-replay)."""
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import time

import numpy as np
import pytest
import torch

from spreeze.checkpoint import CHECKPOINT_NAME, load_checkpoint, load_policy
from spreeze.config import Config, ConfigError
from spreeze.replay import REPLAY_FILE, ReplayFileError, SharedReplay, load_replay, save_replay

CTX = mp.get_context("spawn")
OBS, ACT = 3, 1


class _RunsCode:
    """Unpickling this object opens (creates) a file: what a booby-trapped checkpoint could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_audit_8_checkpoints_and_policies_load_without_running_code(tmp_path):
    """Audit point 8: `torch.load(weights_only=False)` ran arbitrary code from a checkpoint file."""
    from pathlib import Path

    from viz.play import load as play_load

    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "final").mkdir()
    torch.save({"algo": {}, "counters": {}, "config": {}, "payload": _RunsCode(marker)},
               run / "checkpoints" / CHECKPOINT_NAME)
    torch.save({"actor": {}, "config": {}, "obs_dim": 3, "act_dim": 1, "payload": _RunsCode(marker)},
               run / "final" / "actor.pt")
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        load_checkpoint(run / "checkpoints" / CHECKPOINT_NAME)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        load_policy(run)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        play_load(run, Path(CHECKPOINT_NAME))
    assert not marker.exists()


# ----- --save-replay ------------------------------------------------------------------------------------
def _filled(n_regions=4, capacity=400, rows=150, active=None, offset=0):
    replay = SharedReplay.create(OBS, ACT, capacity, n_regions, CTX, active_regions=active)
    for start in range(0, rows, 50):
        for r in range(n_regions):
            code = (offset + r * 10_000 + np.arange(start, min(start + 50, rows))).astype(np.float32)
            replay.write(r, np.repeat(code[:, None], OBS, 1), np.repeat(code[:, None], ACT, 1), code,
                         np.repeat(code[:, None], OBS, 1) + 0.5, np.zeros(len(code), np.float32))
    return replay


def _rows(replay) -> set:
    _, live = replay.live_sizes()
    out = set()
    cap = replay.region_capacity
    for r in range(replay.n_regions):
        ptr = int(replay.counters[r, 0])
        slots = r * cap + (ptr - live[r] + np.arange(live[r])) % cap
        out |= {float(x) for x in replay.rewards[slots]}
    return out


def test_audit_9_saved_replay_round_trips_into_the_same_or_another_layout(tmp_path):
    source = _filled()
    same = SharedReplay.create(OBS, ACT, 400, 4, CTX)
    other = SharedReplay.create(OBS, ACT, 300, 3, CTX)
    try:
        path = tmp_path / REPLAY_FILE
        assert save_replay(source, path) == 400  # each 100-slot ring keeps its newest 100 of 150 rows
        assert not list(tmp_path.glob(".*.tmp"))
        assert load_replay(same, path) == 400
        assert _rows(same) == _rows(source) and same.size() == 400
        assert load_replay(other, path) == 300  # 4 saved regions into 3 of 100 slots: the rows that stayed
        batch = other.sample(2048, np.random.default_rng(0))
        assert np.all(np.isfinite(batch.rewards)) and np.all(batch.obs[:, 0] == batch.rewards)
        assert other.size() == 300 and _rows(other) <= _rows(source)
    finally:
        for r in (source, same, other):
            r.close()


def test_a_restored_replay_ages_as_the_saved_one_did(tmp_path):
    """Restored rows were written in turns from each region's oldest, so a region that saved few rows (the newest
    of the run: a spare resumed late) got the first stamps and aged out of sampling first. They go back in the
    order of their saved stamps; a file from before stamps were saved is still read, in turns."""
    source = SharedReplay.create(OBS, ACT, 128, 2, CTX)
    target = SharedReplay.create(OBS, ACT, 128, 2, CTX)
    try:
        for region, rows in ((0, 64), (1, 8)):
            code = np.arange(rows, dtype=np.float32) + 1000 * region
            source.write(region, np.repeat(code[:, None], OBS, 1), np.repeat(code[:, None], ACT, 1), code,
                         np.repeat(code[:, None], OBS, 1), np.zeros(rows, np.float32))
        path = tmp_path / REPLAY_FILE
        assert save_replay(source, path) == 72
        assert load_replay(target, path) == 72
        newest = [int(target.stamps[r * 64: r * 64 + int(target.counters[r, 1])].max()) for r in (0, 1)]
        oldest = [int(target.stamps[r * 64: r * 64 + int(target.counters[r, 1])].min()) for r in (0, 1)]
        assert oldest[1] > newest[0], (oldest, newest)  # region 1's rows came after all of region 0's, as saved
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in saved.files if name != "stamps"}
        np.savez(tmp_path / "no-stamps.npz", **arrays)
        fresh = SharedReplay.create(OBS, ACT, 128, 2, CTX)
        try:
            assert load_replay(fresh, tmp_path / "no-stamps.npz") == 72
        finally:
            fresh.close()
    finally:
        source.close()
        target.close()


def test_audit_9_bad_replay_files_are_refused_before_anything_is_restored(tmp_path, monkeypatch):
    source = _filled()
    target = SharedReplay.create(OBS, ACT, 400, 4, CTX)
    wider = SharedReplay.create(OBS + 1, ACT, 400, 4, CTX)
    try:
        path = tmp_path / REPLAY_FILE
        save_replay(source, path)
        data = path.read_bytes()
        truncated = tmp_path / "truncated.npz"
        truncated.write_bytes(data[: len(data) // 2])
        garbage = tmp_path / "garbage.npz"
        garbage.write_bytes(b"not a zip file")
        for bad in (truncated, garbage, tmp_path / "missing.npz"):
            with pytest.raises(ReplayFileError):
                load_replay(target, bad)
        with pytest.raises(ReplayFileError, match="does not match"):
            load_replay(wider, path)
        # a rewards column of shape (n, 1) passed the checks and failed mid-restore, outside ReplayFileError
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in saved.files}
        arrays["rewards"] = arrays["rewards"][:, None]
        column = tmp_path / "rewards-column.npz"
        np.savez(column, **arrays)
        with pytest.raises(ReplayFileError, match="does not match"):
            load_replay(target, column)
        assert target.size() == 0 and wider.size() == 0
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
        with pytest.raises(OSError, match="free"):
            save_replay(source, tmp_path / "full-disk.npz")
        assert not (tmp_path / "full-disk.npz").exists()
    finally:
        for r in (source, target, wider):
            r.close()


def test_saving_a_large_region_lets_its_writer_in_between_chunks(tmp_path, monkeypatch):
    """A region is copied in chunks, each under the lock, so its sampler waits for a chunk at most; a writer
    that goes on between chunks leaves whole rows in the file, and a region emptied meanwhile (a dead
    writer's recovery, even written again since) keeps only the rows copied before, never NaN."""
    import spreeze.replay as replay_mod

    monkeypatch.setattr(replay_mod, "SAVE_CHUNK_ROWS", 30)
    source = _filled(n_regions=2, capacity=200, rows=100)  # two full rings of 100
    holds, real_acquire, writing = [], source._acquire, []

    def acquire(region):
        real_acquire(region)
        if writing:
            return
        holds.append(region)
        if len(holds) == 3:  # between region 0's first and second chunk: its sampler writes 40 new rows
            source._release(region)
            code = np.arange(500, 540, dtype=np.float32)
            writing.append(1)
            source.write(0, np.repeat(code[:, None], OBS, 1), np.repeat(code[:, None], ACT, 1), code,
                         np.repeat(code[:, None], OBS, 1) + 0.5, np.zeros(40, np.float32))
            writing.clear()
            real_acquire(region)
        if len(holds) == 8:  # region 1 emptied after its first chunk, and its restarted writer wrote again
            source.counters[1, replay_mod.SIZE] = source.counters[1, replay_mod.PTR] = 0
            source.rewards[100:200] = np.nan
            source.counters[1, replay_mod.EPOCH] += 1
            source.rewards[100:105] = np.arange(20_000, 20_005)
            source.counters[1, replay_mod.SIZE] = source.counters[1, replay_mod.PTR] = 5

    monkeypatch.setattr(source, "_acquire", acquire)
    target = SharedReplay.create(OBS, ACT, 200, 2, CTX)
    try:
        path = tmp_path / REPLAY_FILE
        assert save_replay(source, path) == 130
        # one hold for the counters and four chunks for region 0; one and one (then emptied) for region 1
        assert holds == [0, 0, 0, 0, 0, 1, 1, 1]
        with np.load(path) as data:
            assert list(data["region_rows"]) == [100, 30]
            rewards = data["rewards"]
            assert np.isfinite(rewards).all() and np.all(data["obs"][:, 0] == rewards)
            assert {float(x) for x in rewards[:30]} == set(range(0, 30))  # copied before the writer went on
            assert {float(x) for x in rewards[30:100]} == set(range(40, 100)) | set(range(530, 540))
            assert {float(x) for x in rewards[100:]} == set(range(10_000, 10_030))
        assert load_replay(target, path) == 130
    finally:
        source.close()
        target.close()


def test_save_replay_needs_the_shared_replay():
    with pytest.raises(ConfigError, match="--save-replay"):
        Config(save_replay=True, experience_transport="queue", collect_per_update=0).validate()


def _serial_run(run_dir, **overrides):
    from spreeze.envs import check_env
    from launch.compose import train

    config = Config(env_id="Pendulum-v1", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=2,
                    total_steps=2400, minutes=3.0, learning_starts=1000, batch_size=64, buffer_size=20_000,
                    hidden_size=32, collect_per_update=4.0, eval_interval_s=60.0, log_interval_s=60.0,
                    checkpoint_interval_s=600.0, actor_device="cpu", critic_device="cpu", window=False,
                    run_dir=str(run_dir))
    config = dataclasses.replace(config, **overrides)
    config.validate()
    lines = []
    result = train(config, check_env("Pendulum-v1"), log=lines.append)
    assert result.exit_code == 0, lines
    return result, lines


@pytest.mark.slow
def test_audit_9_resume_continues_with_the_saved_replay_and_the_learner_streams(tmp_path):
    """--save-replay writes the replay beside the checkpoint; --resume then learns at once from it (no
    refill), the learner's generators continue where they stopped (audit point 3), and a damaged file
    is a warning and a refill, never a crash (audit point 9)."""
    from spreeze.learner import Learner
    from spreeze.envs import check_env
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights
    from spreeze.algos import make_actor

    run = tmp_path / "run"
    first, _ = _serial_run(run, save_replay=True)
    saved = run / "checkpoints" / REPLAY_FILE
    assert saved.is_file()
    checkpoint = load_checkpoint(run / "checkpoints" / CHECKPOINT_NAME)
    assert checkpoint["counters"]["resumes"] == 0
    numpy_state = json.loads(checkpoint["generators"]["numpy"])

    # the learner of a resumed run takes up the saved streams, not the seed's
    config = dataclasses.replace(Config.from_dict(checkpoint["config"]), resume=str(run))
    info = check_env("Pendulum-v1")
    replay = SharedReplay.create(info.obs_dim, info.act_dim, 1000, 2, CTX)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(1)
    try:
        learner = Learner(config, info, replay, weights, stats, tmp_path / "scratch", 0.0)
        assert learner.rng.bit_generator.state == numpy_state
        assert torch.equal(torch.get_rng_state(), checkpoint["generators"]["torch"])
        assert learner.resumes == 1
        fresh = np.random.default_rng(config.seed + 12_345).bit_generator.state
        assert fresh != numpy_state
    finally:
        for s in (replay, weights, stats):
            s.close()

    resumed, _ = _serial_run(run, resume=str(run), total_steps=2600)
    events = (run / "events.log").read_text()
    assert "restored 2,400 transitions" in events
    # learning went on at once: updates grew by the ratio over the 200 new steps, no second warm-up
    assert resumed.summary["updates"] - first.summary["updates"] >= 200 // 4 - 16
    assert load_checkpoint(run / "checkpoints" / CHECKPOINT_NAME)["counters"]["resumes"] == 1

    saved.write_bytes(saved.read_bytes()[:1000])  # truncated: a warning and a refill
    again, _ = _serial_run(run, resume=str(run), total_steps=3800)
    assert "saved replay not used" in (run / "events.log").read_text()
    assert again.exit_code == 0 and again.summary["env_steps"] >= 3800


def test_restored_rows_interleave_across_regions_and_foreign_files_are_refused(tmp_path):
    """Rows restored region after region would stamp one region oldest and make it age out of sampling
    ahead of the others; a file saved for another env, n-step or discount would mislabel every row."""
    source = _filled(rows=100)
    target = SharedReplay.create(OBS, ACT, 400, 4, CTX)
    try:
        path = tmp_path / REPLAY_FILE
        meta = {"env_id": "Pendulum-v1", "n_step": 3, "gamma": 0.98}
        save_replay(source, path, meta)
        with pytest.raises(ReplayFileError, match="n_step"):
            load_replay(target, path, expect={**meta, "n_step": 1})
        assert target.size() == 0
        assert load_replay(target, path, expect=meta) == 400
        cap = target.region_capacity
        newest = [int(target.stamps[r * cap: (r + 1) * cap].max()) for r in range(4)]
        oldest = [int(target.stamps[r * cap: (r + 1) * cap].min()) for r in range(4)]
        assert max(oldest) < min(newest)  # every region holds old and new stamps: they interleave
    finally:
        source.close()
        target.close()


def test_a_long_replay_save_keeps_the_learner_s_heartbeat_beating(tmp_path, monkeypatch):
    """--save-replay of gigabytes on a slow disk can outlast the supervisor's silence limit: the learner beats its
    heartbeat from a thread while it saves (and only then), or a healthy run would end as a hung learner."""
    import functools
    import time
    import types

    import spreeze.learner as learner_mod
    from spreeze import proc

    beats, saved = [], []

    def slow_save(replay, path, meta):
        time.sleep(0.5)
        saved.append(len(beats))
        return 0

    monkeypatch.setattr(learner_mod, "save_replay", slow_save)
    monkeypatch.setattr(learner_mod, "beating", functools.partial(proc.beating, every_s=0.05))
    source = SharedReplay.create(OBS, ACT, 100, 1, CTX)
    try:
        learner = types.SimpleNamespace(config=Config(save_replay=True), replay=source, beat=lambda: beats.append(1))
        learner_mod.Learner.write_replay(learner, None, tmp_path)
    finally:
        source.close()
    assert saved and saved[0] >= 2  # about one beat per 0.05 s of the 0.5 s save (a loaded machine: fewer)
    after = len(beats)
    time.sleep(0.2)
    assert len(beats) == after  # the beating stops with the save


def test_a_replay_save_without_memory_for_its_copy_is_a_warning_not_the_end_of_the_run(tmp_path, monkeypatch):
    """The save copies the live rows once; where even that does not fit, the MemoryError ended the learner (and the
    run) at a checkpoint: it is a warning, as a full disk is, and the previous file is kept."""
    import types

    import spreeze.learner as learner_mod

    def no_memory(replay, path, meta):
        raise MemoryError("Unable to allocate 6.1 GiB")

    monkeypatch.setattr(learner_mod, "save_replay", no_memory)
    source = SharedReplay.create(OBS, ACT, 100, 1, CTX)
    said = []
    try:
        learner = types.SimpleNamespace(config=Config(save_replay=True), replay=source, beat=lambda: None,
                                        _warn=lambda messages, text: said.append(text))
        learner_mod.Learner.write_replay(learner, None, tmp_path)
    finally:
        source.close()
    assert said == ["replay not saved (MemoryError: Unable to allocate 6.1 GiB); the previous file is kept"]


class _Box:
    """A learner's message listener that keeps what it hears."""

    def __init__(self):
        self.said = []

    def put(self, message, timeout=None):
        self.said.append(message)


def _bare_learner(tmp_path, messages):
    """A Learner without its networks or shared memory: the checkpoint-writing paths only."""
    from spreeze.learner import Learner

    learner = object.__new__(Learner)
    learner.messages, learner.run_dir, learner.config = messages, tmp_path, Config(env_id="Pendulum-v1")
    learner.session_began = time.time()
    return learner


def test_a_serial_run_s_unwritten_checkpoint_is_said_on_the_learner_s_own_messages(tmp_path):
    """--serial (and lock-step) call maybe_checkpoint()/finish() without a listener: a full disk there dropped the
    warning, and a run without its final checkpoint said nothing of why; an earlier session's final/actor.pt then
    stood as this one's."""
    from spreeze.checkpoint import FINAL_ACTOR_NAME, FINAL_DIR
    from spreeze.messages import Warn

    box = _Box()
    learner = _bare_learner(tmp_path, box)

    def full_disk():
        raise OSError(28, "No space left on device")

    learner.checkpoint = full_disk
    stale = tmp_path / FINAL_DIR / FINAL_ACTOR_NAME
    stale.parent.mkdir()
    stale.write_bytes(b"an earlier session's actor")
    os.utime(stale, (learner.session_began - 60, learner.session_began - 60))
    assert learner.write_checkpoint(None) is None
    assert learner.finish() is False
    assert not stale.exists()  # it would have passed for this session's policy (load_policy(run) reads it)
    assert [type(m) for m in box.said] == [Warn, Warn] and "checkpoint not written" in box.said[0].text


def test_a_final_actor_that_cannot_be_written_is_a_warning_and_no_earlier_one_stands_for_it(tmp_path, monkeypatch):
    """The final checkpoint written, then final/actor.pt failing (a full disk) made a clean stop an error; and an
    earlier session's final/actor.pt would have stood as this session's."""
    import types

    import spreeze.learner as learner_mod
    from spreeze.checkpoint import FINAL_ACTOR_NAME, FINAL_DIR
    from spreeze.messages import Checkpointed, Warn

    box = _Box()
    learner = _bare_learner(tmp_path, box)
    stale = tmp_path / FINAL_DIR / FINAL_ACTOR_NAME
    stale.parent.mkdir()
    stale.write_bytes(b"an earlier session's actor")
    os.utime(stale, (learner.session_began - 60, learner.session_began - 60))
    learner.write_checkpoint = lambda messages: tmp_path / "checkpoints" / CHECKPOINT_NAME
    learner.write_replay = lambda messages, folder: None
    learner.algo, learner.env_info = types.SimpleNamespace(actor=None), None

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(learner_mod, "save_final_actor", full_disk)
    assert learner.finish() is True  # the checkpoint, which resume and load_policy(..., "latest") read, is there
    assert not stale.exists()
    assert [type(m) for m in box.said] == [Warn, Checkpointed]
    assert "final actor not written" in box.said[0].text and '"latest"' in box.said[0].text


def test_a_resume_whose_env_no_longer_fits_the_checkpoint_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A --wrapper or --env-kwargs given at a resume that changed the observation size passed the launch, rewrote
    config.json, and failed in the learner's load, so every later plain resume failed too; an unreadable
    checkpoint failed there as well. Both are one line before the profile now, and config.json is kept."""
    import autotune
    from launch.compose import SetupError, resolve
    from spreeze.envs import EnvInfo
    from spreeze.settings import config_record, parse

    from conftest import fake_checkpoint

    monkeypatch.setattr(autotune, "tune", lambda *args, **kwargs: pytest.fail("profiled before the refusal"))
    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, window=False, run_dir=str(run))
    fake_checkpoint(run, saved, obs_dim=4)  # as if made with a wrapper that added an observation
    record = json.dumps(config_record(saved, {}))
    (run / "config.json").write_text(record)
    parsed = parse(["--resume", str(run)])
    with pytest.raises(SetupError, match=r"actor does not fit the one this launch builds for Pendulum-v1 "
                                         r"\(3 observations, 1 actions\)"):
        resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
    (run / "checkpoints" / CHECKPOINT_NAME).write_bytes(b"torn")
    with pytest.raises(SetupError, match="unreadable checkpoint latest.pt"):
        resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
    assert (run / "config.json").read_text() == record
