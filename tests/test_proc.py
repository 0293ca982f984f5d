"""What every child process does first (spreeze/proc.py): subnormal floats flushed, in children and in a
serial run, and the caller's setting given back; and the cores a process may use."""
import math
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from spreeze.proc import (CpuUse, child_setup, cpu_quota_from, flush_denormals, start_process, stop_process,
                          usable_cores)


def subnormals_flushed() -> bool:
    return float(torch.tensor([1e-40]) * 1.0) == 0.0


@pytest.fixture
def flushing_supported():
    was = flush_denormals(False)
    supported = torch.set_flush_denormal(True)
    flush_denormals(was)
    if not supported:
        pytest.skip("this CPU has no flush-to-zero mode torch can set")


def report_flush(queue) -> None:
    child_setup(1)
    # a subnormal Adam moment, as a dead unit's gradient leaves it: flushed, the step writes zero there
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.zeros(4)
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    opt.step()
    opt.state[p]["exp_avg"].fill_(2e-39)
    opt.step()
    queue.put((subnormals_flushed(), int((opt.state[p]["exp_avg"] != 0).sum())))


@pytest.mark.usefixtures("flushing_supported")
def test_flush_denormals_reports_the_previous_setting_and_switches_it():
    was = flush_denormals(False)
    try:
        assert not subnormals_flushed()
        assert flush_denormals(True) is False
        assert subnormals_flushed()
        assert flush_denormals(True) is True
        assert flush_denormals(False) is True
        assert not subnormals_flushed()
    finally:
        flush_denormals(was)


@pytest.mark.usefixtures("flushing_supported")
def test_a_child_process_flushes_subnormals_before_it_computes():
    queue = mp.get_context("spawn").Queue()
    process = start_process(report_flush, queue, name="spreeze-test-flush")
    try:
        flushed, nonzero_moments = queue.get(timeout=60)
    finally:
        stop_process(process, timeout_s=10)
    assert flushed and nonzero_moments == 0


# ----- cores a process may use -------------------------------------------------------------------------------
V1_MOUNTS = """cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"


def reader(files: dict):
    return lambda path: files.get(path)


def test_container_cpu_quota_is_read_from_cgroup_v1_and_v2():
    """``docker --cpus 2.5`` writes a quota: cgroup v2 ``cpu.max`` "250000 100000", v1 cfs quota/period. The
    tightest quota on the way to the hierarchy's root counts; "max" or -1 is no quota."""
    v2_own = "0::/system.slice/docker-abc.scope\n"
    assert cpu_quota_from(v2_own, V2_MOUNTS, reader({
        "/sys/fs/cgroup/system.slice/docker-abc.scope/cpu.max": "250000 100000\n",
        "/sys/fs/cgroup/system.slice/cpu.max": "max 100000\n"})) == 2.5
    assert cpu_quota_from(v2_own, V2_MOUNTS, reader({  # a parent's quota binds too
        "/sys/fs/cgroup/system.slice/docker-abc.scope/cpu.max": "max 100000\n",
        "/sys/fs/cgroup/system.slice/cpu.max": "150000 100000\n"})) == 1.5
    # inside the container's namespace the path is "/": the file at the mount itself
    assert cpu_quota_from("0::/\n", V2_MOUNTS, reader({"/sys/fs/cgroup/cpu.max": "200000 100000"})) == 2.0
    assert cpu_quota_from("0::/\n", V2_MOUNTS, reader({"/sys/fs/cgroup/cpu.max": "max 100000"})) is None
    v1_own = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cpu_quota_from(v1_own, V1_MOUNTS, reader({
        "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})) == 3.0
    assert cpu_quota_from(v1_own, V1_MOUNTS, reader({
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})) is None
    assert cpu_quota_from(v1_own, V1_MOUNTS, reader({})) is None  # unreadable: no quota known


def test_a_container_s_memory_limit_is_read_from_cgroup_v1_and_v2():
    """psutil reads /proc/meminfo, the host's memory inside a container: a pod limited to 4 GiB on a 256 GiB node
    got samplers and a replay for the node's memory, and the OOM killer ended the run. The tightest limit on the
    way to the root counts, less its usage but for the inactive page cache; "max" or v1's 2**63 is no limit."""
    from spreeze.proc import memory_available_from

    gib = 2**30
    v2_own = "0::/kubepods/pod1\n"
    assert memory_available_from(v2_own, V2_MOUNTS, reader({
        "/sys/fs/cgroup/kubepods/pod1/memory.max": f"{4 * gib}\n",
        "/sys/fs/cgroup/kubepods/pod1/memory.current": f"{gib}\n",
        "/sys/fs/cgroup/kubepods/pod1/memory.stat": f"anon 123\ninactive_file {gib // 2}\n",
        "/sys/fs/cgroup/kubepods/memory.max": "max\n"})) == 4 * gib - gib // 2
    assert memory_available_from(v2_own, V2_MOUNTS, reader({  # a parent's limit binds too
        "/sys/fs/cgroup/kubepods/pod1/memory.max": "max\n",
        "/sys/fs/cgroup/kubepods/memory.max": f"{2 * gib}\n", "/sys/fs/cgroup/kubepods/memory.current": "0\n"})) \
        == 2 * gib
    assert memory_available_from("0::/\n", V2_MOUNTS, reader({"/sys/fs/cgroup/memory.max": "max\n"})) is None
    v1_own = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert memory_available_from(v1_own, V1_MOUNTS, reader({
        "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{3 * gib}\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{gib}\n"})) == 2 * gib
    assert memory_available_from(v1_own, V1_MOUNTS, reader({
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})) is None
    assert memory_available_from(v1_own, V1_MOUNTS, reader({})) is None


def test_usable_cores_are_capped_by_the_quota(monkeypatch):
    import spreeze.proc as proc

    pinned = len(__import__("os").sched_getaffinity(0))
    monkeypatch.setattr(proc, "cgroup_cpu_limit", lambda: None)
    assert usable_cores() == pinned
    monkeypatch.setattr(proc, "cgroup_cpu_limit", lambda: 0.5)
    assert usable_cores() == 1  # at least one
    monkeypatch.setattr(proc, "cgroup_cpu_limit", lambda: pinned + 10.0)
    assert usable_cores() == pinned  # a quota above the pinned cores changes nothing
    if pinned >= 2:
        monkeypatch.setattr(proc, "cgroup_cpu_limit", lambda: 1.5)
        assert usable_cores() == 2  # rounded up: 1.5 CPUs keep two processes busy 75 % of the time


def test_cpu_use_under_a_quota_is_the_cgroups_cpu_time_over_the_quota():
    """``docker --cpus 2`` on a larger host: 1.5 CPU-seconds used in one second is 75 % of what the run may use,
    whatever the host's other cores do (cgroup v2 ``cpu.stat``); a reading that fails is NaN, not a guess."""
    files = {"/proc/self/cgroup": "0::/\n", "/proc/self/mounts": V2_MOUNTS,
             "/sys/fs/cgroup/cpu.max": "200000 100000\n",
             "/sys/fs/cgroup/cpu.stat": "usage_usec 1000000\nuser_usec 800000\nsystem_usec 200000\n"}
    now = [100.0]
    use = CpuUse(read=files.get, clock=lambda: now[0], pinned=64)
    assert use.quota_cpus == 2.0
    assert CpuUse(read=files.get, pinned=1).quota_cpus == 1.0  # --cpus 2 --cpuset-cpus 0: one CPU usable
    files["/sys/fs/cgroup/cpu.stat"], now[0] = "usage_usec 2500000\n", 101.0
    assert use.percent() == pytest.approx(75.0)
    now[0] = 103.0
    assert use.percent() == 0.0  # nothing used since
    del files["/sys/fs/cgroup/cpu.stat"]
    now[0] = 104.0
    assert math.isnan(use.percent())
    files["/sys/fs/cgroup/cpu.stat"], now[0] = "usage_usec 3500000\n", 105.0
    assert math.isnan(use.percent())  # no earlier reading to measure from
    files["/sys/fs/cgroup/cpu.stat"], now[0] = "usage_usec 4500000\n", 106.0
    assert use.percent() == pytest.approx(50.0)


def test_cpu_use_reads_cgroup_v1_cpuacct_and_falls_back_to_the_host_without_a_quota(monkeypatch):
    import spreeze.proc as proc

    own = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    base = "/sys/fs/cgroup/cpu,cpuacct/docker/abc"
    files = {"/proc/self/cgroup": own, "/proc/self/mounts": V1_MOUNTS, f"{base}/cpu.cfs_quota_us": "150000\n",
             f"{base}/cpu.cfs_period_us": "100000\n", f"{base}/cpuacct.usage": "0\n"}
    now = [0.0]
    use = CpuUse(read=files.get, clock=lambda: now[0], pinned=64)
    assert use.quota_cpus == 1.5
    files[f"{base}/cpuacct.usage"], now[0] = f"{3 * 10 ** 9}\n", 4.0
    assert use.percent() == pytest.approx(50.0)  # 3 CPU-seconds in 4 s of a 1.5-CPU quota

    monkeypatch.setattr(proc.psutil, "cpu_percent", lambda *a, **k: 42.0)
    for unquoted in ({"/proc/self/cgroup": "0::/\n", "/proc/self/mounts": V2_MOUNTS},  # no quota
                     {**files, f"{base}/cpuacct.usage": None}):  # a quota whose usage cannot be read
        host = CpuUse(read=unquoted.get, clock=lambda: now[0])
        assert host.quota_cpus is None and host.percent() == 42.0


def test_the_profile_counts_busy_cores_of_the_quota_not_of_the_host(monkeypatch):
    """Under a quota, other tenants' load on the host's cores is not load on this run's CPUs."""
    from autotune import probe

    class HalfBusyQuota:
        quota_cpus = 2.0

        def percent(self):
            return 50.0

    monkeypatch.setattr(probe, "CpuUse", HalfBusyQuota)
    monkeypatch.setattr(probe.psutil, "cpu_percent", lambda *a, **k: [100.0] * 64 if k.get("percpu") else 100.0)
    assert probe.cpu_load(0.05)["background_cores"] == pytest.approx(1.0)


STUCK_CHILD_PARENT = '''
import sys, time
from spreeze.proc import ChildLink, Role, child_main, start_process


def build(child):
    return None


def loop(worker, child):
    while True:  # a stuck child: it never asks child.should_stop()
        time.sleep(0.05)


if __name__ == "__main__":
    import multiprocessing as mp
    link = ChildLink(None, mp.get_context("spawn").Event(), __import__("os").getpid(), orphan_grace_s=1.0)
    process = start_process(child_main, Role("sampler", 0), build, loop, link, name="spreeze-sampler-0", daemon=False)
    print(process.pid, flush=True)
    time.sleep(600)
'''


def ended(process) -> bool:
    """Gone, or a zombie its new parent (an init that does not reap, in some containers) leaves unreaped."""
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_stuck_child_exits_after_its_supervisor_was_killed(tmp_path):
    """A child whose loop never looks at its stop flag still ends once its parent has been SIGKILLed (the grace
    shortened here to 1 s); nothing else would ever stop it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "parent.py"
    script.write_text(STUCK_CHILD_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))})
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(1.5)
        assert not ended(child)  # a live parent's child is not touched
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not ended(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(child), "the orphan never ended"
    finally:
        parent.kill()
        if child is not None and not ended(child):
            child.kill()  # an orphan is no longer ours to find among our children


def test_an_interrupt_during_a_deferred_block_rises_at_its_end():
    from spreeze.proc import interrupt, interrupt_if_pending, interrupts_deferred

    with pytest.raises(KeyboardInterrupt):
        interrupt()  # outside a block: at once
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            with interrupts_deferred():
                interrupt()
                done.append("inner")
            done.append("outer")  # the inner block's end is not the outermost's
    assert done == ["inner", "outer"]
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            interrupt()
            interrupt_if_pending()  # a safe point inside the block: now
            done.append("never")
    assert "never" not in done
    with pytest.raises(KeyboardInterrupt) as raised:  # an error leaving the block: the noted interrupt is not lost
        with interrupts_deferred():
            interrupt()
            raise ValueError("the repair failed")
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(ValueError):  # without an interrupt noted, the error as it is
        with interrupts_deferred():
            raise ValueError("the repair failed")
    with interrupts_deferred():
        pass  # nothing noted from before


def read_flag_forever(flag, reading) -> None:
    reading.value = 1
    while True:  # what a child's should_stop() does, as often as it can
        flag.is_set()


def test_a_child_killed_while_it_reads_the_stop_flag_blocks_nobody():
    """A SIGKILL landing inside multiprocessing.Event.is_set() left the Event's lock held: every other process's
    next is_set() waited forever (a fault drill that killed evaluators stalled the samplers). The stop flag has no
    lock to leave held: killed readers, again and again, and set() and is_set() still answer at once."""
    import threading

    from spreeze.proc import StopFlag

    ctx = mp.get_context("spawn")
    flag = StopFlag(ctx)
    for _ in range(4):
        reading = ctx.RawValue("b", 0)
        reader = ctx.Process(target=read_flag_forever, args=(flag, reading), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not reading.value and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # reading in a tight loop
        reader.kill()
        reader.join(timeout=30)
        answered = []
        probe = threading.Thread(target=lambda: answered.append(flag.is_set()), daemon=True)
        probe.start()
        probe.join(timeout=2)
        assert answered == [False], "is_set() blocked after a reader was killed"
    assert flag.wait(0.05) is False
    threading.Timer(0.1, flag.set).start()
    assert flag.wait(10) is True and flag.is_set() and flag.wait() is True  # no timeout, as an Event's


def test_a_taken_lock_records_its_holder_and_its_give_ends_the_stretch_even_when_the_release_fails():
    import threading

    import numpy as np

    from spreeze import proc

    lock, holder = threading.Lock(), np.zeros((2, 3), np.int64)
    assert proc.take_lock(lock, 1.0, holder, (1, 2), 4321)
    assert holder[1, 2] == 4321 and lock.locked() and proc._INTERRUPTS.depth == 1
    proc._pending = True  # a Ctrl-C during the hold rises at its end, with the lock free and no holder left
    with pytest.raises(KeyboardInterrupt):
        proc.give_lock(lock, holder, (1, 2))
    assert holder[1, 2] == 0 and not lock.locked() and proc._INTERRUPTS.depth == 0

    lock.acquire()  # held by someone else: nothing recorded, no stretch left open
    assert proc.take_lock(lock, 0.1, holder, (0, 0), 4321) is False
    assert holder[0, 0] == 0 and proc._INTERRUPTS.depth == 0
    lock.release()

    assert proc.take_lock(lock, 1.0, holder, (0, 0), 4321)
    lock.release()  # a give whose release fails (released twice) still ends the stretch
    with pytest.raises(RuntimeError):
        proc.give_lock(lock, holder, (0, 0))
    assert holder[0, 0] == 0 and proc._INTERRUPTS.depth == 0


def test_a_lock_wait_lets_a_noted_interrupt_rise_and_only_the_main_thread_raises_it():
    import threading

    from spreeze import proc

    held = threading.Lock()
    held.acquire()  # a holder that does not let go
    proc._pending = True  # as the Ctrl-C handler notes it inside a stretch
    with pytest.raises(KeyboardInterrupt):
        proc.acquire_deferring(held, timeout_s=5.0, slice_s=0.05)  # nothing held yet: it rises while waiting
    assert proc._INTERRUPTS.depth == 0 and not proc._pending
    with pytest.raises(KeyboardInterrupt):
        with proc.interrupts_deferred():  # an outer stretch (a repair) defers it past the wait, to its end
            proc._pending = True
            assert proc.acquire_deferring(held, timeout_s=0.2, slice_s=0.05) is False
            assert proc._INTERRUPTS.depth == 1
    free = threading.Lock()
    assert proc.acquire_deferring(free, timeout_s=1.0) and proc._INTERRUPTS.depth == 1
    free.release()
    proc.release_interrupts()

    class NotedAtTheDeadline:  # a Ctrl-C noted in the wait's last slice, which then times out
        def acquire(self, timeout):
            proc._pending = True
            return False

    with pytest.raises(KeyboardInterrupt):
        proc.acquire_deferring(NotedAtTheDeadline(), timeout_s=0.0)
    assert proc._INTERRUPTS.depth == 0 and not proc._pending  # not -1, which would swallow every later Ctrl-C

    raised = []

    def worker():  # another thread's stretch neither defers the main thread's interrupt nor takes it
        assert proc.acquire_deferring(free, timeout_s=1.0)
        proc._pending = True
        free.release()
        try:
            proc.release_interrupts()
        except KeyboardInterrupt:
            raised.append("worker")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=10)
    assert raised == [] and proc._pending and proc._INTERRUPTS.depth == 0
    with pytest.raises(KeyboardInterrupt):
        proc.interrupt_if_pending()


def test_a_sighup_ignored_at_start_is_left_to_nohup():
    """nohup ignores SIGHUP so that a run outlives its terminal: that one is not taken over as a stop signal (a
    SIGINT ignored by a background shell still is)."""
    import signal

    from spreeze import proc

    was = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in proc.stop_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert signal.SIGHUP not in proc.stop_signals() and signal.SIGTERM in proc.stop_signals()
    finally:
        signal.signal(signal.SIGHUP, was)
