"""Actor weight broadcast from the learner to samplers and evaluator through shared memory.

The learner copies the actor's flat parameters into one shared float32 array and bumps a version
number, both under one ``mp.Lock``; readers poll the version (a single int64 read) and, when it moved,
copy the array under the same lock. Unprotected reads were measurably torn on this machine
(../shared/pitfalls.md: 125 of 31,911); the lock around a ~100 us copy is the portable fix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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

    @classmethod
    def create(cls, module: torch.nn.Module, mp_context) -> "SharedWeights":
        specs = (ArraySpec("version", (1,), "int64", 0), ArraySpec("flat", (flat_size(module),), "float32", 0.0))
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
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError("weights lock not released in time")
        try:
            self.flat[:] = flat
            self.version[0] = version
        finally:
            self.lock.release()

    def read(self) -> tuple[np.ndarray, int]:
        """A consistent copy of the flat weights and their version."""
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError("weights lock not released in time")
        try:
            return self.flat.copy(), int(self.version[0])
        finally:
            self.lock.release()

    def pull(self, module: torch.nn.Module, have_version: int) -> int:
        """Load the published weights into ``module`` if newer than ``have_version``; return the version held."""
        if self.current_version() == have_version:
            return have_version
        flat, version = self.read()
        load_flat(module, flat)
        return version

    def recover_lock(self, wait_s: float = 1.0) -> bool:
        """After a reader (sampler, evaluator) died: free the lock if it died holding it, inside its copy.

        Live holders keep the lock for one copy of the flat weights (well under a millisecond), so a lock
        still held after ``wait_s`` belongs to the dead reader. ``mp.Lock`` is a semaphore, so another
        process may release it. Returns True if the lock had been left held.
        """
        left_held = not self.lock.acquire(timeout=wait_s)
        self.lock.release()
        return left_held

    def close(self) -> None:
        self.flat = self.version = None
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
