import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from spreeze.weights import SharedWeights

CTX = mp.get_context("spawn")


def make_module():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def publish_loop(handle, n_versions: int) -> None:
    torch.set_num_threads(1)
    weights = SharedWeights.attach(handle)
    module = make_module()
    try:
        for version in range(1, n_versions + 1):
            with torch.no_grad():
                for p in module.parameters():
                    p.fill_(float(version))  # every value of version v equals v: a torn read mixes values
            weights.publish(module, version)
    finally:
        weights.close()


def test_reader_never_sees_a_torn_set_and_versions_only_grow():
    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        writer = CTX.Process(target=publish_loop, args=(weights.handle, 3000))
        writer.start()
        reads, last_version = 0, 0
        deadline = time.monotonic() + 120
        while writer.is_alive() or reads == 0:
            if time.monotonic() > deadline:
                writer.kill()
                writer.join(timeout=10)
                raise AssertionError(f"no published version read within 120 s (writer exit code {writer.exitcode}, "
                                     f"{reads} reads)")
            if not writer.is_alive() and weights.current_version() == 0:
                writer.join(timeout=10)
                raise AssertionError(f"the writer exited with code {writer.exitcode} before its first publish")
            flat, version = weights.read()
            if version > 0:
                assert np.all(flat == flat[0]), f"torn read at version {version}"
                assert flat[0] == version
                reads += 1
            assert version >= last_version
            last_version = version
        writer.join(timeout=30)
        assert writer.exitcode == 0
        assert reads > 10
        reader = make_module()
        assert weights.pull(reader, have_version=-1) == 3000
        assert all(torch.all(p == 3000.0) for p in reader.parameters())
    finally:
        weights.close()


def test_pull_is_a_no_op_for_the_held_version():
    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        reader = make_module()
        assert weights.pull(reader, -1) == 0
        for a, b in zip(module.parameters(), reader.parameters()):
            assert torch.equal(a, b)
        # the shared values change without a new version: a pull that copied anyway would load them
        weights.flat[:] = 7.0
        for _ in range(1000):
            assert weights.pull(reader, 0) == 0
        for a, b in zip(module.parameters(), reader.parameters()):
            assert torch.equal(a, b), "a pull of the held version copied the weights"
        # ... and took no lock: it does not wait for a holder that never lets go
        assert weights.lock.acquire(timeout=5)
        try:
            assert weights.pull(reader, 0) == 0
        finally:
            weights.lock.release()
        weights.version[0] = 1  # a new version is loaded
        assert weights.pull(reader, 0) == 1
        assert all(torch.all(p == 7.0) for p in reader.parameters())
    finally:
        weights.close()


class _StuckCopy(np.ndarray):
    """The weights array of a reader that gets killed inside its copy: copy() says so, then hangs."""

    inside = None

    def copy(self, *args, **kwargs):
        _StuckCopy.inside.set()
        time.sleep(600)


def read_and_hang(handle, inside) -> None:
    weights = SharedWeights.attach(handle)
    _StuckCopy.inside = inside
    weights.flat = weights.flat.view(_StuckCopy)
    weights.read()  # takes the lock, then hangs in the copy until it is killed


def test_audit_5_weights_lock_of_a_reader_killed_inside_its_copy_is_recovered(monkeypatch):
    """Audit point 5: a sampler or evaluator SIGKILLed while copying the weights left their lock held, and
    the learner's next publish timed out and ended the run."""
    import spreeze.weights as weights_mod

    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        inside = CTX.Event()
        reader = CTX.Process(target=read_and_hang, args=(weights.handle, inside))
        reader.start()
        assert inside.wait(timeout=60), "the reader never reached its copy"
        reader.kill()
        reader.join(timeout=30)
        assert reader.exitcode == -9
        monkeypatch.setattr(weights_mod, "LOCK_TIMEOUT_S", 0.2)
        with pytest.raises(TimeoutError):  # what the learner met before the fix
            weights.publish(module, version=1)
        assert weights.recover_lock(wait_s=0.2) is True
        weights.publish(module, version=2)
        assert weights.current_version() == 2
        assert weights.recover_lock(wait_s=0.2) is False  # a free lock is left free
        weights.publish(module, version=3)
    finally:
        weights.close()


def test_a_lock_a_live_process_holds_is_never_freed_by_recovery():
    """Recovery frees a lock only when its recorded holder is dead: a slow live holder keeps it."""
    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        weights.lock.acquire()
        weights.holder[0] = os.getpid()  # held by a live process (this one), for longer than the wait
        assert weights.recover_lock(wait_s=0.1) is False
        assert not weights.lock.acquire(timeout=0.1)  # still held
        assert weights.recover_lock(wait_s=0.1, dead_pid=os.getpid()) is True  # told that holder died
        weights.publish(module, version=4)
        assert weights.current_version() == 4 and int(weights.holder[0]) == 0
    finally:
        weights.close()


def test_a_live_holder_not_yet_recorded_keeps_the_weights_lock():
    """A live holder between its acquire and the write of its pid is recorded as none: descheduled there for more
    than the recovery's 50 ms, its lock was freed under it (and its own release then raised)."""
    import threading

    module = make_module()
    weights = SharedWeights.create(module, CTX)
    errors = []

    acquired = threading.Event()

    def slow_holder():
        weights.lock.acquire()
        acquired.set()
        time.sleep(0.3)  # descheduled before its pid is written
        weights.holder[0] = os.getpid()
        time.sleep(0.2)
        weights.holder[0] = 0
        try:
            weights.lock.release()
        except ValueError as err:  # released too many times: the recovery had freed it
            errors.append(err)

    try:
        holder = threading.Thread(target=slow_holder)
        holder.start()
        assert acquired.wait(10)
        assert weights.recover_lock(wait_s=0.1, dead_pid=-1) is False
        holder.join(timeout=10)
        assert errors == []
    finally:
        weights.close()
