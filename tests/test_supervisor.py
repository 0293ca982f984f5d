"""The process lifecycle: the governor's pauses during the warm-up, locks freed for a child that is not restarted."""
import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SMALL_SERIAL as BASE


def shared_supervisor(tmp_path, **overrides):
    """A supervisor with its shared state made and no process started (Pendulum's sizes, one env per sampler),
    for a test to drive by hand."""
    from spreeze.envs import EnvInfo
    from spreeze.supervisor import Supervisor

    config = dataclasses.replace(BASE, **{"serial": False, "envs_per_sampler": 1, **overrides})
    sup = Supervisor(config, EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200), tmp_path, log=lambda line: None)
    sup.create_shared()
    return sup


def test_governor_does_not_pause_the_samplers_the_replay_is_sized_for_during_warm_up(tmp_path):
    """The replay's regions are sized for --samplers active envs; while the replay holds less than the
    warm-up, the CPU looks idle and a pause below --samplers could leave it unreachable (audit point 1)."""

    class WantsOne:
        resets = 0

        def decide(self, now, cpu, active):
            return 1, "CPU above target"

        def reset(self):
            WantsOne.resets += 1

    sup = shared_supervisor(tmp_path, samplers=2, spare_samplers=1)
    try:
        sup.stats.paused[:] = [0, 0, 1]
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1] and WantsOne.resets == 1
        sup.stats.paused[:] = [0, 0, 0]  # above --samplers: it may come down to them, not below
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1]
        assert "not below --samplers during the warm-up" in (tmp_path / "events.log").read_text()
        rows = np.zeros((sup.config.learning_begins_at, 3), np.float32)  # the warm-up is over
        for region in range(2):
            for start in range(0, len(rows), 100):
                block = rows[start:start + 100]
                sup.replay.write(region, block, block[:, :1], block[:, 0], block, block[:, 0])
        sup.govern(WantsOne(), cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 1, 1]
        assert "samplers active 2 -> 1" in (tmp_path / "events.log").read_text()
    finally:
        sup.close_shared()


def test_a_spare_steps_in_for_a_sampler_stopped_for_good_during_the_warm_up(tmp_path):
    """The warm-up guard only limited a pause the governor proposed: a sampler that gave up during the warm-up left
    fewer than --samplers active while the CPU read inside the governor's band, so the spare stayed paused and the
    live regions could hold less than the warm-up: a run that never learned."""

    class Content:
        def decide(self, now, cpu, active):
            return active, None

        def reset(self):
            pass

    sup = shared_supervisor(tmp_path, samplers=2, spare_samplers=1)
    try:
        sup.stats.paused[:] = [0, 0, 1]
        sup.govern(Content(), cpu_percent=70.0)
        assert list(sup.stats.paused) == [0, 0, 1]  # nothing to change
        sup.retired.add("spreeze-sampler-0")
        sup.govern(Content(), cpu_percent=70.0)
        assert list(sup.stats.paused) == [0, 0, 0]  # the spare took its place
        assert "a sampler stopped for good during the warm-up" in (tmp_path / "events.log").read_text()
    finally:
        sup.close_shared()


def test_a_retired_sampler_is_not_counted_active(tmp_path):
    """metrics.csv's active_samplers counted a sampler that gave up (its pause flag stayed 0)."""
    import types


    sup = shared_supervisor(tmp_path, samplers=2, spare_samplers=0)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        for i in range(2):
            sup.processes[f"spreeze-sampler-{i}"] = types.SimpleNamespace(pid=dead.pid)
        assert sup.stats.snapshot()["active_samplers"] == 2
        sup.sampler_failures["spreeze-sampler-0"] = "its env failed 5 times in a row"
        sup.restart("spreeze-sampler-0", "exited with code 3")
        assert "spreeze-sampler-0" in sup.retired and sup.stats.snapshot()["active_samplers"] == 1
    finally:
        sup.close_shared()


def test_governor_never_pauses_the_last_working_sampler_when_others_were_stopped_for_good(tmp_path):
    """Sampler 0 gave up on its env: the governor pausing "one of two" must pause neither it (it is gone) nor the
    only sampler left, or the run would stall with no env stepped (seen under load in test_faults)."""
    from autotune.governor import CpuGovernor

    sup = shared_supervisor(tmp_path, samplers=2, spare_samplers=1, learning_starts=0, batch_size=1)
    try:
        sup.replay.write(0, np.zeros((1, 3), np.float32), np.zeros((1, 1), np.float32), np.zeros(1, np.float32),
                         np.zeros((1, 3), np.float32), np.zeros(1, np.float32))  # the warm-up is over
        sup.stats.paused[:] = [0, 0, 1]
        sup.retired.add("spreeze-sampler-0")
        governor = CpuGovernor(target_percent=50.0, sustain_s=0.0, min_active=1, max_active=3)
        sup.govern(governor, cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1]  # one live sampler is active, the governor's minimum: it stays
        sup.stats.paused[:] = [0, 0, 0]
        sup.govern(governor, cpu_percent=99.0)
        assert list(sup.stats.paused) == [0, 0, 1]  # two live ones: the higher-numbered one is paused
    finally:
        sup.close_shared()


@pytest.mark.parametrize("transport", ["shm", "queue"])
def test_a_retired_sampler_still_frees_the_locks_it_died_holding(tmp_path, transport):
    """A child that is not restarted (restart cap) may have died inside a region write or a weights copy:
    its locks are freed all the same, or the learner would time out on them. The repair is the same call for
    both experience paths (the queue's has no region to repair: it raised a TypeError there)."""
    import types

    from spreeze.supervisor import ChildFailed

    sup = shared_supervisor(tmp_path, samplers=1, spare_samplers=0, envs_per_sampler=2, max_restarts_per_minute=1,
                            experience_transport=transport)
    shm = transport == "shm"
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        sup.processes["spreeze-sampler-0"] = types.SimpleNamespace(pid=dead.pid)
        sup.restarts["spreeze-sampler-0"] = [time.monotonic()]  # the cap is reached: it will be retired
        if shm:
            sup.replay.locks[1].acquire()
        sup.weights.lock.acquire()
        sup.weights.holder[0] = dead.pid
        with pytest.raises(ChildFailed, match="every sampler has failed"):
            sup.restart("spreeze-sampler-0", "was killed by SIGKILL")
        events = (tmp_path / "events.log").read_text()
        assert "freed the weights lock" in events and ("freed replay region lock(s) [1]" in events) is shm
        assert sup.weights.lock.acquire(timeout=1)
        sup.weights.lock.release()
        if shm:
            assert sup.replay.locks[1].acquire(timeout=1)
            sup.replay.locks[1].release()
    finally:
        sup.close_shared()


def supervisor_with_a_live_learner(tmp_path):
    """A supervisor whose learner is a stand-in that is alive (fatal, silent after 30 s) and has just beaten."""
    import types

    sup = shared_supervisor(tmp_path, samplers=1, spare_samplers=0)
    role = sup.roles["spreeze-learner"]
    sup.specs["spreeze-learner"] = types.SimpleNamespace(fatal=True, silent_after_s=30.0)
    sup.processes["spreeze-learner"] = types.SimpleNamespace(pid=0, exitcode=None)  # alive
    sup.stats.beat(role.heartbeat)
    return sup, role


def test_a_step_of_the_wall_clock_silences_no_child_and_a_silent_learner_still_ends_the_run(tmp_path, monkeypatch):
    """Heartbeats are read on the monotonic clock: the wall clock stepped an hour forward (NTP at boot, a resumed
    VM) must not make a healthy learner look silent for an hour and end the run; a learner that really stopped
    beating still does."""
    from spreeze.supervisor import ChildFailed

    sup, role = supervisor_with_a_live_learner(tmp_path)
    try:
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 3600.0)
        sup.check_children()  # no ChildFailed: it beat a moment ago
        sup.stats.heartbeats[role.heartbeat] -= 120.0
        with pytest.raises(ChildFailed, match="spreeze-learner sent no heartbeat for 12[0-9] s"):
            sup.check_children()
    finally:
        monkeypatch.undo()
        sup.close_shared()


def test_a_stopped_job_resumed_later_is_not_taken_for_a_silent_learner(tmp_path, monkeypatch):
    """Ctrl-Z then fg (or docker pause): every process stood still while the monotonic clock went on, and the
    supervisor, scheduled first at the resume, saw the learner silent for the whole pause and ended the run.
    Silence now counts from the end of a gap in the watcher's own checks; a learner still silent after that ends it."""
    from spreeze.supervisor import ChildFailed

    sup, role = supervisor_with_a_live_learner(tmp_path)
    try:
        clock = [time.monotonic()]
        monkeypatch.setattr(time, "monotonic", lambda: clock[0])
        sup.check_children()
        clock[0] += 45.0  # the whole job stopped for 45 s: no beat, no check
        sup.check_children()  # no ChildFailed
        for _ in range(31):  # resumed, and the learner never beats again: checked every 0.1 s... here every 1 s
            clock[0] += 1.0
            if clock[0] - sup._silence_from > 30.0:
                with pytest.raises(ChildFailed, match="spreeze-learner sent no heartbeat for 3[01] s"):
                    sup.check_children()
                break
            sup.check_children()
        else:
            pytest.fail("a learner silent for 31 s after the resume was not taken for hung")
    finally:
        monkeypatch.undo()
        sup.close_shared()


def test_a_sampler_that_gave_up_just_before_it_exited_is_retired_not_restarted(tmp_path, monkeypatch):
    """Its GaveUp still sat in its pipe when its exit was seen (sent between the supervisor's drain of messages and
    its check of exit codes): restart reads the dead child's last messages before it decides, so it is retired
    (its env keeps failing) instead of replaced, and the reason is not left over for the replacement's next death."""
    import types

    from spreeze.messages import GaveUp

    sup = shared_supervisor(tmp_path, samplers=2, spare_samplers=0)
    spawned = []
    monkeypatch.setattr(sup, "spawn", spawned.append)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        for i in range(2):
            sup.processes[f"spreeze-sampler-{i}"] = types.SimpleNamespace(pid=dead.pid)
        outbox = sup.inbox.open("spreeze-sampler-0")
        outbox.put(GaveUp("spreeze-sampler-0", "env reset failed 5 times in a row"))
        outbox.close()
        sup.restart("spreeze-sampler-0", "exited with code 3")
        assert "spreeze-sampler-0" in sup.retired and spawned == [] and not sup.sampler_failures
        assert "not restarting it: env reset failed 5 times" in (tmp_path / "events.log").read_text()
    finally:
        sup.close_shared()


@pytest.mark.parametrize("local", [1, 0])
def test_an_ingest_that_gave_up_ends_the_run_only_without_local_samplers(tmp_path, local):
    """--ray: the ingest stands for the remote samplers. Once it gave up (the cluster lost), local samplers
    carry the run on; with --remote-only nothing would feed the learner, so the run ends with one reason. The
    blocks it had asked for went with it: counted lost (they were not, for an ingest that did not count them)."""
    import types

    from spreeze.envs import EnvInfo
    from spreeze.stats import INGEST_ALIVE, INGEST_IN_FLIGHT, INGEST_LOST_BLOCKS
    from spreeze.supervisor import ChildFailed, Supervisor

    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    config = dataclasses.replace(BASE, serial=False, samplers=local, spare_samplers=0, envs_per_sampler=1,
                                 ray="auto", remote_samplers=2, remote_only=not local)
    assert config.sampler_processes == local and config.total_envs == local + 2
    sup = Supervisor(config, info, tmp_path, log=lambda line: None)
    sup.create_shared()
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        for i in range(local):
            sup.processes[f"spreeze-sampler-{i}"] = types.SimpleNamespace(pid=dead.pid)
        sup.processes["spreeze-ingest"] = types.SimpleNamespace(pid=dead.pid)
        sup.sampler_failures["spreeze-ingest"] = "lost the Ray cluster"
        sup.stats.ingest[INGEST_ALIVE] = 2  # what the ingest last counted; its actors went with it
        sup.stats.ingest[INGEST_LOST_BLOCKS], sup.stats.ingest[INGEST_IN_FLIGHT] = 3, 4
        if local:
            sup.restart("spreeze-ingest", "exited with code 3")
            assert "spreeze-ingest" in sup.retired and sup.stats.snapshot()["remote_alive"] == 0
        else:
            with pytest.raises(ChildFailed, match=r"every sampler has failed \(--remote-only"):
                sup.restart("spreeze-ingest", "exited with code 3")
        assert "not restarting it: lost the Ray cluster" in (tmp_path / "events.log").read_text()
        assert sup.stats.snapshot()["remote_lost_blocks"] == 7 and sup.stats.ingest[INGEST_IN_FLIGHT] == 0
    finally:
        sup.close_shared()


def test_a_remote_only_run_resumes_with_its_step_count(tmp_path):
    """A resumed run's step count went into local sampler 0's counter, which a --remote-only run has none of
    (its resume was refused); it has a counter of its own, which every count of the run's steps includes."""
    pytest.importorskip("ray")  # --ray is checked for Ray first
    from spreeze.algos import make_actor
    from spreeze.checkpoint import save_checkpoint
    from spreeze.envs import EnvInfo
    from spreeze.supervisor import Supervisor

    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    config = dataclasses.replace(BASE, serial=False, samplers=0, spare_samplers=0, envs_per_sampler=1,
                                 ray="auto", remote_samplers=2, remote_only=True)
    run = tmp_path / "run"
    save_checkpoint(run, {"actor": make_actor(config, 3, 1).state_dict()},
                    {"env_steps": 12_345, "updates": 1_000, "policy_version": 7, "time_s": 60.0, "resumes": 0},
                    config.to_dict())
    resumed = dataclasses.replace(config, resume=str(run))
    resumed.validate()
    sup = Supervisor(resumed, info, tmp_path, log=lambda line: None)
    sup.create_shared()
    try:
        assert sup.config.sampler_processes == 0 and sup.resumes == 1
        assert sup.stats.total_env_steps() == 12_345 and sup.stats.snapshot()["env_steps"] == 12_345
        assert sup.weights.current_version() == 7
        sup.stats.remote_env_steps[1] += 500  # the ingest's count of what a remote sampler collected
        assert sup.stats.total_env_steps() == 12_845
    finally:
        sup.close_shared()


def test_a_restarted_evaluator_counts_its_predecessors_last_test_before_numbering_its_own(tmp_path, monkeypatch):
    """Retiring a dead child's pipe reads its last whole messages; a test result among them was handled only after
    the replacement evaluator had been numbered from the run's tests, so it repeated test i's seeded start states
    and every later test was one off."""
    from spreeze import supervisor as supervisor_mod
    from spreeze.envs import EnvInfo
    from spreeze.messages import Evaluation
    from spreeze.supervisor import ChildSpec, Supervisor

    info = EnvInfo("Pendulum-v1", 3, 1, (-2.0,), (2.0,), 200)
    sup = Supervisor(dataclasses.replace(BASE, serial=False), info, tmp_path, log=lambda line: None)
    started = []
    monkeypatch.setattr(supervisor_mod, "start_process", lambda main, role, build, *a, **k: started.append(build))
    sup.specs["spreeze-evaluator"] = ChildSpec(lambda **kw: None, lambda *a: None,
                                               fresh=lambda: {"first_index": len(sup.runlog.evaluations)})
    try:
        outbox = sup.inbox.open("spreeze-evaluator")
        for i in range(2):  # the first evaluator's two tests reach its pipe; then it dies
            outbox.put(Evaluation({"test_return": -900.0 + i, "policy_version": i, "env_steps": 100 * i,
                                   "time_s": float(i)}))
        outbox.close()
        sup.spawn("spreeze-evaluator")
        assert started[-1].keywords["first_index"] == 2
        assert [e["test_return"] for e in sup.runlog.evaluations] == [-900.0, -899.0]
    finally:
        sup.inbox.close()


def test_stopping_goes_on_past_an_error_in_the_last_messages_and_raises_it_after():
    """A handler of the children's last messages that raises (an observer's full disk) must not leave the other
    children running: the interpreter's exit joins them, and a child ignoring SIGTERM would hold it for ever."""
    import types

    from spreeze.supervisor import Supervisor

    class FakeProcess:
        def __init__(self):
            self.exitcode = None
            self.joins = 0

        def join(self, timeout=None):
            self.joins += 1
            self.exitcode = 0

        def kill(self):
            self.exitcode = -9

    drained = []

    def drain_messages():
        drained.append(1)
        if len(drained) == 1:
            raise OSError("No space left on device")

    processes = {name: FakeProcess() for name in ("spreeze-learner", "spreeze-sampler-0", "spreeze-evaluator")}
    fake = types.SimpleNamespace(stop_event=types.SimpleNamespace(set=lambda: None), processes=processes,
                                 drain_messages=drain_messages, log=lambda line: None)
    with pytest.raises(OSError, match="No space left"):
        Supervisor.stop_children(fake)
    assert all(p.exitcode == 0 and p.joins for p in processes.values()) and len(drained) >= 2


def test_every_observer_is_closed_when_one_raises_on_close_and_the_error_rises_after():
    import types

    from spreeze.runners import Run

    closed = []

    class Observer:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} could not flush")

    run = Run.__new__(Run)
    run._started = [Observer("window"), Observer("tensorboard", fails=True), Observer("render", fails=True)]
    with pytest.raises(RuntimeError, match="render could not flush"):  # the first error: last started, first closed
        run.close_observers()
    assert closed == ["render", "tensorboard", "window"] and run._started == []
