"""--ray end to end on a local two-node Ray cluster: remote samplers feed the learner, a killed actor comes back,
Ctrl-C leaves nothing on the cluster; and bad --ray input ends in one line with exit 2 before anything starts."""
import json
import signal
import time

import psutil
import pytest

from conftest import PENDULUM_FAST, read_csv, signal_group_and_check_clean_exit, start

ray = pytest.importorskip("ray")  # the optional extra: .ci/run installs it (requirements-ray.txt)

from benchmarks.ray_transfer import local_cluster, remote_actor_pids  # noqa: E402
from launch.compose import main  # noqa: E402


def _raylets() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if "raylet" in " ".join(p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module's tests (starting one takes seconds)."""
    before = set(_raylets())
    with local_cluster(workers=2) as c:
        yield c
    deadline = time.monotonic() + 15
    while set(_raylets()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_raylets()) - before, "the test cluster left raylets behind"


def _wait(predicate, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run.py exited early while waiting for {what}: {proc.stdout.read()}")
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_remote_samplers_train_survive_a_dead_actor_and_leave_nothing(cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*PENDULUM_FAST, "--ray", cluster.address, "--remote-samplers", "1", "--samplers", "1",
                  "--envs-per-sampler", "2", "--learning-starts", "300", "--batch-size", "64", "--log-interval-s", "1",
                  "--no-window", "--no-tensorboard", "--run-dir", str(run_dir)], tmp_path)
    try:
        metrics = run_dir / "metrics.csv"

        def remote_and_learning():
            rows = read_csv(metrics) if metrics.exists() else []
            return any(float(r["remote_sampling_hz"]) > 0 and float(r["local_sampling_hz"]) > 0
                       and int(r["updates"]) > 0 for r in rows)
        _wait(remote_and_learning, 90, "remote and local rows with the learner updating", proc)
        actors = remote_actor_pids()
        assert len(actors) == 1
        psutil.Process(actors[0]).kill()  # the actor's worker dies as with a crash or ray kill
        events = run_dir / "events.log"
        _wait(lambda: events.exists() and "remote sampler 0 is back" in events.read_text(), 60,
              "the replacement actor's first block", proc)
        assert "remote sampler 0 died" in events.read_text()
    finally:
        out = signal_group_and_check_clean_exit(proc, signal.SIGINT)
    _wait(lambda: not remote_actor_pids(), 15, "the actors to be gone from the cluster")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["remote_sampling_frame_rate_hz"] > 0 and summary["local_sampling_frame_rate_hz"] > 0
    assert summary["remote_restarts"] == 1 and summary["ingest_rows_per_s"] > 0, out
    assert summary["remote_policy_version"] > 0  # the actors sampled with the learner's weights, not only the first
    assert json.loads((run_dir / "autotune.json").read_text())["ray"]["cluster_cpus"] == 2


def test_remote_only_learns_from_the_cluster_alone(cluster, tmp_path):
    """--remote-only: no local sampler process; the learner's ratio runs on the remote rows alone."""
    run_dir = tmp_path / "run"
    proc = start([*PENDULUM_FAST, "--ray", cluster.address, "--remote-only", "--remote-samplers", "1",
                  "--envs-per-sampler", "2", "--learning-starts", "300", "--batch-size", "64", "--collect-per-update",
                  "8", "--log-interval-s", "0.5", "--no-window", "--no-tensorboard", "--run-dir", str(run_dir)], tmp_path)
    try:
        metrics = run_dir / "metrics.csv"

        def steps_while_learning():  # the summary's rates count from the first update on
            steps = [int(r["env_steps"]) for r in (read_csv(metrics) if metrics.exists() else [])
                     if int(r["updates"]) > 0]
            return len(steps) > 1 and steps[-1] > steps[0]
        _wait(steps_while_learning, 90, "remote rows arriving while the learner updates", proc)
        names = []
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                names.append(" ".join(child.cmdline()))
            except psutil.Error:  # gone meanwhile
                pass
        assert not [n for n in names if "spreeze-sampler" in n] and any("spreeze-ingest" in n for n in names), names
    finally:
        out = signal_group_and_check_clean_exit(proc, signal.SIGINT)
    assert "0 sampler(s) (+0 paused spare)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["local_sampling_frame_rate_hz"] == 0 and summary["remote_sampling_frame_rate_hz"] > 0
    rows = read_csv(run_dir / "metrics.csv")
    assert all(float(r["local_sampling_hz"]) == 0 for r in rows)
    # the collect:update ratio (--collect-per-update 8) held on remote steps alone: past the warm-up, at most
    # the slack (2 x (write block + n-step - 1) x 2 envs) and one block of 2 x 32 steps ahead of the updates
    last = rows[-1]
    assert int(last["env_steps"]) - 300 <= 8 * int(last["updates"]) + 2 * 32 * 2 + 64, last


@pytest.mark.parametrize("args, message", [
    (["--ray", "127.0.0.1:9"], "cannot reach it"),
    (["--ray", "auto", "--deterministic"], "--deterministic"),
])
def test_bad_ray_input_is_one_line_and_exit_2(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--env", "Pendulum-v1", "--no-window", *args])
    except SystemExit as exit_:  # a flag the parser refuses
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # no run directory, nothing started


def test_another_ray_version_on_the_cluster_is_one_line_and_exit_2(cluster, tmp_path, capsys, monkeypatch):
    """Ray's own check at ray.init compares the cluster's versions with this process's: make this process's
    Ray look older than the cluster's."""
    import ray._private.utils as ray_utils

    real = ray_utils.compute_version_info
    monkeypatch.setattr(ray_utils, "compute_version_info", lambda: ("2.9.0", real()[1]))
    monkeypatch.chdir(tmp_path)
    code = main(["--env", "Pendulum-v1", "--no-window", "--ray", cluster.address])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"the cluster runs Ray {ray.__version__}" in err and "this machine Ray 2.9.0" in err, err
    assert not ray.is_initialized() and not list(tmp_path.iterdir())  # no run directory, nothing started


def test_a_request_queued_behind_another_is_timed_from_the_arrival_before_it():
    """The two opening requests go out together; the second waits in the actor's queue while the first covers
    the actor's start-up. Timed from its sending, an actor that took 15 s to start was declared dead right after
    its first block (and so again after every restart)."""
    from spreeze.remote import FIRST_BLOCK_S, SILENT_MIN_S, request_overdue

    assert request_overdue(20.0, 0.0, 1, True, 16.0, 0.0, 1.0) is None  # 4 s after the first block arrived
    assert request_overdue(17.0 + SILENT_MIN_S, 0.0, 1, True, 16.0, 0.0, 0.1) == pytest.approx(SILENT_MIN_S + 1)
    assert request_overdue(100.0, 0.0, 2, True, 0.0, 0.0, 5.0) is None  # 5 s a block: 20 x 10 s allowed
    assert request_overdue(201.0, 0.0, 2, True, 0.0, 0.0, 5.0) == pytest.approx(201.0)
    assert request_overdue(45.0, 0.0, 1, True, 0.0, 2.0, 0.1) == pytest.approx(45.0)  # 20 typical round trips
    assert request_overdue(FIRST_BLOCK_S - 1, 0.0, 1, False, 0.0, 0.0, 0.0) is None  # not started yet
    assert request_overdue(FIRST_BLOCK_S + 1, 0.0, 1, False, 0.0, 0.0, 0.0) is not None


def test_an_ingest_write_that_fails_retires_a_faulty_sampler_or_counts_every_block_in_flight_lost(monkeypatch):
    """A block naming another sampler's regions ended the ingest process (all remote sampling restarted for one
    faulty actor); any other failing write ended it without counting the requests still in flight as lost."""
    import types

    import spreeze.remote as remote
    from spreeze.ingest import ForeignBlock
    from spreeze.replay import LockTimeout

    monkeypatch.setattr(remote.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(remote.ray, "get", lambda refs, timeout: [{"for": ref, "sample_s": 0.1, "blocks": 1}
                                                                   for ref in refs])
    monkeypatch.setattr(remote.ray, "kill", lambda actor, no_restart: None)

    class Ingest:
        def __init__(self, failure):
            self.failure, self.lost_blocks, self.written = failure, 0, []

        def write(self, r, block):
            if r == 0:
                raise self.failure
            self.written.append(block["for"])

        def lost(self, blocks=1):
            self.lost_blocks += blocks

    def fleet(failure):
        f = remote.Fleet.__new__(remote.Fleet)
        f.ingest, f.events = Ingest(failure), []
        f.stats = types.SimpleNamespace(ingest={remote.INGEST_ALIVE: 2, remote.INGEST_RTT_SECONDS: 0.0})
        f.inflight = {"a": (0, 0, 0.0, 2), "b": (1, 0, 0.0, 3)}  # sampler 0's 2 blocks, then sampler 1's 3
        f.requested, f.actors, f.retired = 5, ["actor-0", "actor-1"], set()
        f.generation, f.delivered, f.last_arrival = [0, 0], [True, True], [0.0, 0.0]
        f.block_s, f.typical_rtt, f.died_at = [0.0, 0.0], 0.0, {}
        f.event = f.events.append
        f.watch_silent = lambda: None
        return f

    foreign = fleet(ForeignBlock("a block of remote sampler 0 names regions outside [4, 5]"))
    foreign.poll(0.1)
    assert 0 in foreign.retired and foreign.actors[0] is None and foreign.ingest.written == ["b"]
    assert any("remote sampler 0 sent a block it may not write" in e for e in foreign.events)
    monkeypatch.setattr(remote.ray, "shutdown", lambda: None)
    for failure in (LockTimeout("region 4"), ValueError("could not broadcast")):  # any other: the process ends
        stuck = fleet(failure)
        with pytest.raises(type(failure)):
            stuck.poll(0.1)
        assert stuck.ingest.lost_blocks == 5 and not stuck.retired  # the failed request's 2, sampler 1's 3 in flight
        stuck.close()  # as the process's exit does
        assert stuck.stats.ingest[remote.INGEST_IN_FLIGHT] == 0  # counted here: the supervisor counts none again
    # a process that gives up (the cluster lost) closes with its requests in flight: the count stays for the
    # supervisor, which adds it to the lost blocks
    gave_up = fleet(None)
    gave_up.requested = 5
    gave_up.close()
    assert gave_up.stats.ingest[remote.INGEST_IN_FLIGHT] == 5 and gave_up.ingest.lost_blocks == 0


def test_a_remote_sampler_that_gives_up_is_retired_and_one_that_raises_otherwise_is_replaced(monkeypatch):
    """Every exception from a remote ``collect`` retired its actor for good, where a local sampler that crashes is
    restarted within the budget: only ``SamplerGaveUp`` (its env keeps failing) retires one now."""
    import types

    import spreeze.remote as remote
    from spreeze.sampler import SamplerGaveUp

    def failing(refs, timeout):
        if isinstance(refs, list):
            raise ray.exceptions.RayError("one of them failed")
        raise ray.exceptions.RayTaskError("collect", f"Traceback\n{type(cause).__name__}: {cause}", cause)

    monkeypatch.setattr(remote.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(remote.ray, "get", failing)
    for cause, retired in ((SamplerGaveUp("env failed 5 times in a row"), True), (ValueError("a bad action"), False)):
        f = remote.Fleet.__new__(remote.Fleet)
        f.ingest, f.stats = types.SimpleNamespace(lost_blocks=0), types.SimpleNamespace(ingest={})
        f.ingest.lost = lambda k, i=f.ingest: setattr(i, "lost_blocks", i.lost_blocks + k)
        f.inflight, f.requested, f.generation = {"a": (0, 0, 0.0, 2)}, 2, [0]
        f.watch_silent = lambda: None
        gone, replaced = [], []
        f.retire = lambda r, why: gone.append((r, why))
        f.died = lambda r, generation, err: replaced.append((r, generation, err.cause))
        assert f.poll(0.1) == 1
        assert f.ingest.lost_blocks == 2 and f.requested == 0 == f.stats.ingest[remote.INGEST_IN_FLIGHT]
        assert (gone, replaced) == (([(0, "raised SamplerGaveUp: env failed 5 times in a row")], []) if retired
                                    else ([], [(0, 0, cause)]))


def test_requests_take_turns_among_the_remote_samplers_when_the_learner_sets_the_pace():
    """The collect:update ratio frees a block or two at a time when the learner sets the pace: each must go to the
    actor with the fewest open requests, taking turns, not always to actor 0 (the others sat idle, their regions
    ageing in the replay and never checked for life)."""
    import types

    import spreeze.remote as remote

    asked = []

    class Actor:
        def __init__(self, r):
            self.collect = types.SimpleNamespace(remote=lambda *args, r=r: asked.append(r) or object())

    class Ingest:
        def blocks_allowed(self, requested, want):
            return 1 if requested < self.allowance else 0

    f = remote.Fleet.__new__(remote.Fleet)
    f.actors, f.ingest = [Actor(r) for r in range(4)], Ingest()
    f.actors[2] = None  # retired: never asked
    f.config = types.SimpleNamespace(remote_inflight=2)
    f.stats = types.SimpleNamespace(total_env_steps=lambda: 0, ingest={})
    f.inflight, f.requested, f.next_turn = {}, 0, 0
    f.block_s, f.sent_version, f.put_version, f.generation = [0.0] * 4, [0] * 4, 0, [0] * 4
    for _ in range(30):  # one block freed per round: the request made, then answered
        f.ingest.allowance = f.requested + 1
        f.request()
        f.inflight.clear()
        f.requested = 0
    assert 2 not in asked and {asked.count(r) for r in (0, 1, 3)} == {10}
    f.ingest.allowance = 100  # room for all: each live actor filled to --remote-inflight, fewest open first
    asked.clear()
    f.request()
    assert sorted(asked) == [0, 0, 1, 1, 3, 3] and sorted(asked[:3]) == [0, 1, 3]
    assert f.stats.ingest[remote.INGEST_IN_FLIGHT] == 6  # in shared memory, for the supervisor if the ingest dies


def test_more_remote_samplers_than_cluster_cpus_is_warned_about(monkeypatch):
    """Actors beyond the cluster's CPUs stay unplaced and are replaced every FIRST_BLOCK_S: said at launch."""
    import spreeze.remote as remote
    from launch.compose import check_ray
    from spreeze.config import Config

    fake = {"address": "10.0.0.1:6379", "ray_version": ray.__version__, "cluster_cpus": 2.0, "nodes": 1,
            "block_rows": 128, "block_round_trip_ms": 1.0}
    monkeypatch.setattr(remote, "check_cluster", lambda config, env_info: dict(fake))
    for wanted, warned in ((4, True), (2, False)):
        lines = []
        config = Config(env_id="Pendulum-v1", ray="10.0.0.1:6379", remote_samplers=wanted)
        check_ray(config, None, {"remote_samplers"}, lines.append)
        assert any("4 remote samplers on a cluster of 2 CPUs" in line for line in lines) == warned, lines


def test_an_actor_error_is_described_by_its_first_and_last_lines():
    from spreeze.remote import describe_error

    err = RuntimeError("The actor died because of an error raised in its creation task, ...\n  File x\n"
                       "ModuleNotFoundError: No module named 'my_envs'\n")
    assert describe_error(err) == ("The actor died because of an error raised in its creation task, ... ... "
                                   "ModuleNotFoundError: No module named 'my_envs'")
    assert describe_error(TimeoutError("no block for 12 s")) == "no block for 12 s"
    assert describe_error(ValueError()) == "ValueError"
    assert len(describe_error(RuntimeError("x" * 1000))) == 300


def test_joining_the_cluster_keeps_this_process_sigterm_handler(monkeypatch):
    """ray.init installs a handler that exits at once; the ingest's own (stop through the stop Event, regions
    never left half-written) must stay."""
    import signal as signal_mod

    import spreeze.remote as remote

    def ours(signum, frame):
        pass

    monkeypatch.setattr(remote.ray, "init", lambda **kwargs: signal_mod.signal(signal_mod.SIGTERM, signal_mod.SIG_DFL))
    previous = signal_mod.signal(signal_mod.SIGTERM, ours)
    try:
        remote.connect("auto")
        assert signal_mod.getsignal(signal_mod.SIGTERM) is ours
    finally:
        signal_mod.signal(signal_mod.SIGTERM, previous)
