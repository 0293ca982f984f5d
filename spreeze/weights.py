"""Actor weight broadcast from the learner to samplers and evaluator through shared memory.

The learner copies the actor's flat parameters into one shared float32 array and bumps a version
number, both under one ``mp.Lock``; readers poll the version (a single int64 read) and, when it moved,
copy the array under the same lock. Unprotected reads can be torn while the learner publishes
(docs/pitfalls.md); a lock around one copy is the portable fix. The lock's holder writes its pid next
to the weights, so the supervisor can tell a lock left by a dead reader from one a live process holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from spreeze.proc import HOLDER_GRACE_S, give_lock, interrupts_deferred, take_lock
from spreeze.shm import ArraySpec, SegmentHandle, SharedArrays

LOCK_TIMEOUT_S = 10.0   # a publish or read waiting this long means the holder died: the run then reports it


def flat_size(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())


@dataclass(frozen=True)
class WeightsHandle:
    segment: SegmentHandle
    lock: object


class SharedWeights:
    """One published copy of a module's state: ``publish`` in the learner, ``pull`` in readers."""

    def __init__(self, arrays: SharedArrays, lock):
        self._arrays = arrays
        self.lock = lock
        self.flat = arrays["flat"]
        self.version = arrays["version"]
        self.holder = arrays["holder"]  # pid of the process inside the lock, 0 when free
        self._pid = os.getpid()

    @classmethod
    def create(cls, module: torch.nn.Module, mp_context) -> "SharedWeights":
        specs = (ArraySpec("version", (1,), "int64", 0), ArraySpec("holder", (1,), "int64", 0),
                 ArraySpec("flat", (flat_size(module),), "float32", 0.0))
        weights = cls(SharedArrays.create(specs, tag="weights"), mp_context.Lock())
        weights.publish(module, version=0)
        return weights

    @classmethod
    def attach(cls, handle: WeightsHandle) -> "SharedWeights":
        return cls(SharedArrays.attach(handle.segment), handle.lock)

    @property
    def handle(self) -> WeightsHandle:
        return WeightsHandle(self._arrays.handle, self.lock)

    def current_version(self) -> int:
        return int(self.version[0])

    def publish(self, module: torch.nn.Module, version: int) -> None:
        """Write the module's state and its version as one unit."""
        flat = torch.cat([t.detach().reshape(-1).float() for t in module.state_dict().values()]).cpu().numpy()
        if flat.shape != self.flat.shape:
            raise ValueError(f"module has {flat.size} values, the shared buffer {self.flat.size}")
        self._acquire()
        try:
            self.flat[:] = flat
            self.version[0] = version
        finally:
            self._release()

    def read(self) -> tuple[np.ndarray, int]:
        """A consistent copy of the flat weights and their version."""
        self._acquire()
        try:
            return self.flat.copy(), int(self.version[0])
        finally:
            self._release()

    def pull(self, module: torch.nn.Module, have_version: int) -> int:
        """Load the published weights into ``module`` if newer than ``have_version``; return the version held."""
        if self.current_version() == have_version:
            return have_version
        flat, version = self.read()
        load_flat(module, flat)
        return version

    def _acquire(self) -> None:
        """The lock, this process recorded as its holder; a Ctrl-C until :meth:`_release` rises after it."""
        if not take_lock(self.lock, LOCK_TIMEOUT_S, self.holder, 0, self._pid):
            raise TimeoutError("weights lock not released in time")

    def _release(self) -> None:
        give_lock(self.lock, self.holder, 0)

    def recover_lock(self, wait_s: float = 1.0, dead_pid: int | None = None) -> bool:
        """After a reader (sampler, evaluator) died: free the lock if it died holding it, inside its copy.

        Live holders keep the lock for one copy of the flat weights, so a lock still held after ``wait_s``
        most likely belongs to the dead reader; it is freed unless the recorded holder is another process
        that is still alive (a slow live holder keeps its lock). ``mp.Lock`` is a semaphore, so another
        process may release it. Returns True if a lock left held was freed.
        """
        with interrupts_deferred():  # a Ctrl-C between an acquire and its release would leave the lock held
            return self._recover_lock(wait_s, dead_pid)

    def _recover_lock(self, wait_s: float, dead_pid: int | None) -> bool:
        if self.lock.acquire(timeout=wait_s):
            self.lock.release()
            return False
        holder = int(self.holder[0])
        if holder == 0:  # none recorded: one that died before writing its pid, or a live one about to write it
            if self.lock.acquire(timeout=HOLDER_GRACE_S):
                self.lock.release()
                return False
            holder = int(self.holder[0])
        if holder and holder != dead_pid and psutil.pid_exists(holder):
            return False
        self.holder[0] = 0
        self.lock.release()
        return True

    def close(self) -> None:
        self.flat = self.version = self.holder = None
        self._arrays.close()


def load_flat(module: torch.nn.Module, flat: np.ndarray) -> None:
    state = module.state_dict()
    offset, new_state = 0, {}
    source = torch.from_numpy(flat)
    for key, tensor in state.items():
        n = tensor.numel()
        new_state[key] = source[offset: offset + n].view_as(tensor).to(tensor.dtype)
        offset += n
    module.load_state_dict(new_state)
