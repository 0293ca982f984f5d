"""The observers launch/ hands to the runner: TensorBoard, Weights & Biases (offline) and the API's callbacks,
each checked against the CSVs the same run wrote."""
import csv
import dataclasses
import json

import pytest

from spreeze.config import Config

BASE = Config(env_id="Pendulum-v1", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=1,
              learning_starts=300, batch_size=32, buffer_size=10_000, hidden_size=16, collect_per_update=8.0,
              total_steps=1_500, minutes=2.0, eval_interval_s=0.05, log_interval_s=0.2, checkpoint_interval_s=0.5,
              actor_device="cpu", critic_device="cpu", window=False, preset="none")


def serial_run(tmp_path, callbacks=(), **overrides):
    from launch.compose import train
    from spreeze.envs import check_env

    config = dataclasses.replace(BASE, run_dir=str(tmp_path / "run"), **overrides)
    config.validate()
    lines = []
    result = train(config, check_env(config), log=lines.append, callbacks=callbacks)
    return result, lines


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tensorboard_event_files_hold_the_run_s_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = serial_run(tmp_path)
    assert result.exit_code == 0
    run = tmp_path / "run"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/test_return", "eval/test_return_mean5", "train/critic_loss", "throughput/update_hz",
            "utilisation/cpu_percent", "train/entropy_temperature"} <= tags
    evaluations = csv_rows(run / "evaluations.csv")
    logged = events.Scalars("eval/test_return")
    assert [e.step for e in logged] == [int(float(r["env_steps"])) for r in evaluations]
    assert [e.value for e in logged] == pytest.approx([float(r["test_return"]) for r in evaluations], rel=1e-5)
    metrics = [r for r in csv_rows(run / "metrics.csv") if r["critic_loss"] not in ("", "nan")]
    losses = events.Scalars("train/critic_loss")
    assert len(losses) == len(metrics) > 0  # rows without a loss yet (warm-up) are left out, not logged as 0
    assert losses[-1].value == pytest.approx(float(metrics[-1]["critic_loss"]), rel=1e-4)


def test_a_resume_purges_tensorboard_past_its_checkpoint_not_past_the_last_metrics_row(tmp_path):
    """A test taken after the last kept metrics row but before the checkpoint stays in evaluations.csv, so it
    stays in TensorBoard; what the earlier session logged past the checkpoint is hidden."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from launch.observers import TensorBoardObserver
    from spreeze.observers import RunContext

    earlier = SummaryWriter(str(tmp_path / "tensorboard"))
    for step in (100, 500, 800, 1200):  # 800: a kept test after the last kept metrics row (500)
        earlier.add_scalar("eval/test_return", float(step), step)
    earlier.close()
    resumed = SimpleNamespace(resumed={"counters": {"env_steps": 1000, "time_s": 9.0}})
    context = RunContext(config=BASE, env_info=None, run_dir=tmp_path, log=print, supervisor=resumed,
                         metrics=[{"env_steps": 100}, {"env_steps": 500}])
    observer = TensorBoardObserver()
    observer.on_start(context)
    observer.on_evaluation({"env_steps": 1100, "test_return": -1.0, "test_return_mean5": -1.0})
    observer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/test_return")] == [100, 500, 800, 1100]


@pytest.mark.parametrize("ray", ["", "auto"])
def test_tensorboard_logs_local_and_remote_sampling_apart_with_ray(tmp_path, ray):
    import types

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.observers import TensorBoardObserver
    from spreeze.config import Config

    observer = TensorBoardObserver()
    observer.on_start(types.SimpleNamespace(config=Config(ray=ray), run_dir=tmp_path, metrics=[], supervisor=None))
    row = {"env_steps": 1000, "sampling_hz": 300.0, "local_sampling_hz": 100.0, "remote_sampling_hz": 200.0,
           "ingest_rows_hz": 200.0, "ingest_mb_s": 0.0072, "remote_alive": 2, "remote_lost_blocks": 0}
    observer.on_metrics(row)
    observer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    remote = {"throughput/local_sampling_hz", "throughput/remote_sampling_hz", "throughput/ingest_rows_hz",
              "throughput/ingest_mb_s", "remote/alive_samplers", "remote/lost_blocks"}
    assert "throughput/sampling_hz" in tags and (remote <= tags if ray else not remote & tags)
    if ray:
        assert events.Scalars("throughput/remote_sampling_hz")[0].value == 200.0


def test_no_tensorboard_writes_no_event_files(tmp_path):
    result, _ = serial_run(tmp_path, tensorboard=False, total_steps=400)
    assert result.exit_code == 0 and not (tmp_path / "run" / "tensorboard").exists()


class Recorder:
    def __init__(self):
        self.evaluations, self.metrics, self.checkpoints = [], [], []

    def on_evaluation(self, row):
        self.evaluations.append(row)

    def on_metrics(self, row):
        self.metrics.append(row)

    def on_checkpoint(self, path):
        self.checkpoints.append(path)


class Broken:
    def on_evaluation(self, row):
        raise RuntimeError("a bug in the user's callback")


def test_callbacks_see_every_row_and_a_raising_one_does_not_stop_training(tmp_path):
    recorder = Recorder()
    result, lines = serial_run(tmp_path, callbacks=[Broken(), recorder], tensorboard=False)
    assert result.exit_code == 0 and result.summary["stopped_by"] == "total_steps"
    run = tmp_path / "run"
    evaluations = csv_rows(run / "evaluations.csv")
    assert len(recorder.evaluations) == len(evaluations) >= 3  # called after the broken one, every time
    assert [r["test_return"] for r in recorder.evaluations] == pytest.approx(
        [float(r["test_return"]) for r in evaluations], rel=1e-5)
    assert len(recorder.metrics) == len(csv_rows(run / "metrics.csv"))
    assert recorder.checkpoints and recorder.checkpoints[-1] == run / "checkpoints" / "latest.pt"
    complaints = [line for line in lines if "Broken.on_evaluation raised, training goes on" in line]
    assert len(complaints) == len(evaluations) and "a bug in the user's callback" in complaints[0]


def test_api_passes_callbacks_through(tmp_path, monkeypatch):
    import spreeze

    monkeypatch.chdir(tmp_path)
    recorder = Recorder()
    run = spreeze.train("Pendulum-v1", callbacks=[recorder], samplers=1, spare_samplers=0, envs_per_sampler=1,
                        batch_size=32, learning_starts=300, hidden_size=16, total_steps=800, minutes=1.0,
                        collect_per_update=8.0, eval_interval_s=0.2, window=False, serial=True,
                        cache_dir=str(tmp_path / "cache"), run_dir=str(tmp_path / "run"))
    assert run.exit_code == 0 and len(recorder.evaluations) == len(run.evaluations) > 0


def wandb_history(path):
    """The logged rows of an offline ``run-*.wandb`` file: W&B's record log (a 7-byte file header, then records
    of checksum, length and type in 32 KiB blocks, LevelDB's log layout) of protobuf ``Record``s."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, pos, pending, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_logs_the_same_test_returns(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result, _ = serial_run(tmp_path, wandb=True, tensorboard=False, total_steps=800)
    assert result.exit_code == 0
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    tests = [row for row in wandb_history(files[0]) if "eval/test_return" in row]
    evaluations = csv_rows(tmp_path / "run" / "evaluations.csv")
    assert [row["env_steps"] for row in tests] == [int(float(r["env_steps"])) for r in evaluations]
    assert [row["eval/test_return"] for row in tests] == pytest.approx(
        [float(r["test_return"]) for r in evaluations], rel=1e-5)


def test_a_copied_run_directory_gets_a_wandb_run_of_its_own(tmp_path):
    """A run is branched by copying its directory and resuming the copy: the copy must not log into the
    original's W&B run; a moved directory is the same run. An id file an older version wrote (the id alone) is
    kept."""
    import shutil

    from launch.observers import WANDB_ID_FILE, wandb_run_id

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    original = wandb_run_id(run_dir)
    assert wandb_run_id(run_dir) == original
    shutil.copytree(run_dir, tmp_path / "branch")
    branch = wandb_run_id(tmp_path / "branch")
    assert branch != original and wandb_run_id(tmp_path / "branch") == branch
    assert wandb_run_id(run_dir) == original
    shutil.move(str(run_dir), str(tmp_path / "moved"))
    assert wandb_run_id(tmp_path / "moved") == original == wandb_run_id(tmp_path / "moved")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / WANDB_ID_FILE).write_text("0123abcd\n")
    assert wandb_run_id(tmp_path / "old") == "0123abcd"


def test_a_wandb_finish_that_hangs_is_left_behind_and_one_that_fails_raises(tmp_path):
    """An online finish waits as long as the network does, and the run's clean-up (summary.json, the shared
    memory) waits behind it with Ctrl-C ignored: it gets a bounded time, then a warning."""
    import threading
    import time

    pytest.importorskip("wandb")
    from launch.observers import WandbObserver

    release = threading.Event()

    class Hanging:
        def finish(self):
            release.wait(30)

    class Broken:
        def finish(self):
            raise OSError("no network")

    lines = []
    observer = WandbObserver(finish_timeout_s=0.5)
    observer.run, observer.log = Hanging(), lines.append
    began = time.monotonic()
    try:
        observer.close()
        assert time.monotonic() - began < 10 and observer.run is None
        assert len(lines) == 1 and "W&B did not finish its upload" in lines[0] and "wandb sync" in lines[0]
    finally:
        release.set()
    observer.run, observer.finish_timeout_s = Broken(), 60.0  # time to import wandb
    with pytest.raises(OSError, match="no network"):
        observer.close()


def test_a_resumed_run_keeps_its_wandb_run_id(tmp_path, monkeypatch):
    """``--resume`` continues the W&B run its launch began (the id kept in the run directory), while another run
    directory gets a run of its own."""
    pytest.importorskip("wandb")
    from launch.observers import WANDB_ID_FILE, WandbObserver, wandb_run_id
    from spreeze.observers import RunContext

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ids = []
    for resume in ("", str(run_dir)):  # the launch, then its resume
        observer = WandbObserver()
        config = dataclasses.replace(BASE, run_dir=str(run_dir), resume=resume)
        observer.on_start(RunContext(config=config, env_info=None, run_dir=run_dir, log=print, supervisor=None))
        ids.append(observer.run.id)
        observer.close()
    assert ids[0] == ids[1] == (run_dir / WANDB_ID_FILE).read_text().splitlines()[0]
    assert wandb_run_id(tmp_path / "other") != ids[0]
    offline = list((run_dir / "wandb").glob("offline-run-*"))  # a second in the same second gets a suffix
    assert offline and all(f"-{ids[0]}" in path.name for path in offline)
