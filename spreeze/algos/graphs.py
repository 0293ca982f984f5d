"""``--cuda-graphs``: the learner's update replayed as a CUDA graph instead of launched kernel by kernel.

An update of small networks is several hundred kernels of a few microseconds each, every one behind tens of
microseconds of Python and launch work, so an eager learner leaves a GPU mostly idle whatever the batch
(docs/benchmarks.md). Captured once, the whole update (both losses, their backward passes, the fused Adam steps,
the target step) replays with one launch: PyTorch's "whole network capture". What that needs, and how it is met:

- static inputs: each batch is copied into the tensors the graph was captured on;
- no host synchronisation inside a capture: Adam marked ``capturable`` (fused Adam keeps its step counts on the
  device already; the capture check wants the flag), the C51 support flag read from the device only until set
  (``DistributionalTwinQ.support_ready``), numbers that enter as tensors made on the device
  (``torch.full_like``), and the algorithms' ``step`` doing tensor work only;
- lazy state (Adam's moments, cuBLAS's workspace) made beforehand by a few eager updates on a side stream;
- one graph per batch size, actor-due flag and precision: the actor updates every ``--policy-delay`` critic
  updates, the learner may change its batch, and the profile times both precisions on one algorithm.

A captured step keeps the learning rate it was captured with, so ``--lr-schedule linear`` is refused with it
(spreeze/config.py), as is ``--deterministic``. Random draws inside (SAC's actions, TD3's target noise) come from
the device generator, whose offset a replay advances. A replay returns before the GPU has run it, so the
learner's update time then counts the launch and its fetch time the wait.
"""
from __future__ import annotations

import warnings

import torch

from spreeze.algos.base import TorchBatch

WARMUP_UPDATES = 3  # eager updates on a side stream before a capture, for each graph (PyTorch's recipe)


def one_cuda_device(actor_device, critic_device) -> bool:
    """Whether both are the same CUDA device ("cuda" is "cuda:0", the device a fresh process uses)."""
    def index(device) -> tuple:
        device = torch.device(device)
        return device.type, 0 if device.index is None else device.index
    return index(actor_device) == index(critic_device) and torch.device(actor_device).type == "cuda"


def mark_capturable(optimizers) -> None:
    """What torch's capture check asks of an optimizer (fused Adam keeps its step counts on the device already)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["capturable"] = True


def aliasing(batch: TorchBatch) -> tuple[int, ...]:
    """For each field, the first field holding the same tensor: the actor's and the critics' observations are one
    tensor on one device (unless --normalize-obs normalises the critics' copy), and the copy must stay so."""
    ids = [id(t) for t in batch]
    return tuple(ids.index(i) for i in ids)


def clone_batch(batch: TorchBatch) -> TorchBatch:
    """Tensors of the batch's shapes owned by a graph, aliased as the batch's are."""
    clones: dict[int, torch.Tensor] = {}
    for t in batch:
        if id(t) not in clones:
            clones[id(t)] = t.detach().clone()
    return TorchBatch(*(clones[id(t)] for t in batch))


def copy_batch(static: TorchBatch, batch: TorchBatch) -> None:
    """Write ``batch`` into a graph's input tensors (each distinct tensor once)."""
    done: set[int] = set()
    for target, source in zip(static, batch):
        if id(target) not in done:
            done.add(id(target))
            target.copy_(source, non_blocking=True)


class CudaGraphSteps:
    """Runs ``algo.step(batch, actor_due)`` as CUDA graph replays: eager (on a side stream) for the first
    :data:`WARMUP_UPDATES` calls of each kind, then captured once and replayed. The stats returned are the graph's
    output tensors, overwritten by its next replay."""

    def __init__(self, algo):
        if not one_cuda_device(algo.actor_device, algo.critic_device):
            raise ValueError(f"--cuda-graphs needs the actor and the critics on one CUDA device, not "
                             f"{algo.actor_device} and {algo.critic_device}")
        self.algo = algo
        self.device = algo.critic_device
        self.side_stream = torch.cuda.Stream(device=self.device)
        self.capture_stream = torch.cuda.Stream(device=self.device)
        self.graphs: dict = {}   # key -> (graph, input tensors, output stats)
        self.warmups: dict = {}  # key -> eager updates made so far
        mark_capturable(algo.optimizers())

    def key(self, batch: TorchBatch, actor_due: bool) -> tuple:
        return (batch.obs_critic.shape[0], actor_due, bool(getattr(self.algo.config, "bf16", False)), aliasing(batch))

    def step(self, batch: TorchBatch, actor_due: bool) -> dict:
        # the learner's device made current: torch captures, replays and copies on the current device's streams,
        # and a learner on cuda:1 would otherwise record cuda:0's (nothing sets the process's device)
        with torch.cuda.device(self.device):
            key = self.key(batch, actor_due)
            if key not in self.graphs:
                if self.warmups.get(key, 0) < WARMUP_UPDATES:
                    self.warmups[key] = self.warmups.get(key, 0) + 1
                    return self._eager(batch, actor_due)
                self._forget_other_batches(key[0])
                self.graphs[key] = self._capture(batch, actor_due)
            graph, inputs, outputs = self.graphs[key]
            copy_batch(inputs, batch)
            graph.replay()
            return dict(outputs)

    def _eager(self, batch: TorchBatch, actor_due: bool) -> dict:
        """A real update, eagerly on the side stream, ordered after and before the main stream's work."""
        main = torch.cuda.current_stream(self.device)
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream), self.algo.autocast(cache=False), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")  # torch's hint: these steps are few
            stats = self.algo.step(batch, actor_due)
        main.wait_stream(self.side_stream)
        return stats

    def _capture(self, batch: TorchBatch, actor_due: bool):
        """Record one update on tensors of the batch's shapes (a capture records; it runs nothing)."""
        inputs = clone_batch(batch)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the learner's prefetch thread may go on gathering batches on the GPU meanwhile
        with torch.cuda.graph(graph, stream=self.capture_stream, capture_error_mode="thread_local"), \
                self.algo.autocast(cache=False):
            outputs = self.algo.step(inputs, actor_due)
        return graph, inputs, outputs

    def _forget_other_batches(self, batch_size: int) -> None:
        """A new batch size (the learner re-decided it): the graphs of other sizes and their memory go."""
        for key in [k for k in self.graphs if k[0] != batch_size]:
            del self.graphs[key]
        self.warmups = {k: n for k, n in self.warmups.items() if k[0] == batch_size}
