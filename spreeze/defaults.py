"""Plain defaults for this machine, for what neither the user nor a profile set: devices, samplers, batch and
learner threads are decided here and nowhere else in ``spreeze/``."""
from __future__ import annotations

from dataclasses import replace

import torch

from spreeze.algos.graphs import one_cuda_device
from spreeze.config import DETERMINISTIC_BATCH_SIZE
from spreeze.proc import usable_cores


def default_samplers(cores: int) -> int:
    """Without a profile: one sampler per core left after the learner, at least one."""
    return max(1, cores - 1)


def default_batch_size(actor_device: str) -> int:
    return 256 if actor_device == "cpu" else 4096


def cuda_graphs_default(config, actor_device: str, critic_device: str) -> tuple[bool, str]:
    """``--cuda-graphs`` unset: on for a learner on one GPU, where launching an update's hundreds of small kernels
    one by one, not the GPU, sets the pace; off where a capture cannot work. Returns the value and why."""
    if not one_cuda_device(actor_device, critic_device):
        where = "the CPU" if "cpu" in (actor_device, critic_device) else f"{actor_device} and {critic_device}"
        return False, f"the learner is on {where}, not on one GPU"
    if torch.device(critic_device).index not in (None, 0):
        return False, f"the learner is on {critic_device}: measured on cuda:0 only (--cuda-graphs asks for them)"
    for flag, refused in (("--deterministic", config.deterministic),
                          ("--lr-schedule linear", config.lr_schedule != "constant"),
                          ("--learner-overlap", config.learner_overlap)):
        if refused:
            return False, f"not with {flag}"
    return True, f"the learner is on one GPU ({critic_device}): each update replays as one launch"


def resolve(config):
    """Fill the automatic settings (samplers, batch size, CUDA graphs) with plain defaults; a resolved config is
    unchanged."""
    actor_device, critic_device = resolve_devices(config)
    updates = {}
    if config.cuda_graphs is None:
        updates["cuda_graphs"] = cuda_graphs_default(config, actor_device, critic_device)[0]
    if config.samplers == 0 and not config.remote_only:  # --remote-only: none on this machine
        updates["samplers"] = default_samplers(usable_cores())
    if config.batch_size == 0:
        batch = DETERMINISTIC_BATCH_SIZE if config.deterministic else default_batch_size(actor_device)
        updates["batch_size"] = min(batch, config.buffer_size)
    return replace(config, **updates)


def learner_threads(config) -> int:
    """Torch threads of the learner: one with --deterministic (another split of a sum over threads changes the
    last bits of an update, and in time the curve), else --learner-threads, else the cores the samplers leave
    (one in --serial, where this process is every role), halved with --learner-overlap, whose actor update thread
    runs as many as the critics' thread."""
    if config.deterministic:
        return 1
    if config.learner_threads:
        return config.learner_threads
    left = max(1, usable_cores() - config.samplers)
    return 1 if config.serial else max(1, left // 2 if getattr(config, "learner_overlap", False) else left)


def resolve_devices(config) -> tuple[str, str]:
    """Spreeze 3.1 placement: actor on cuda:0, critics on cuda:1 with 2+ GPUs, both on the one GPU, else CPU."""
    n_gpus = torch.cuda.device_count()
    actor = config.actor_device
    if actor == "auto":
        actor = "cuda:0" if n_gpus >= 1 else "cpu"
    critic = config.critic_device
    if critic == "auto":
        critic = "cuda:1" if n_gpus >= 2 else actor
    for device in (actor, critic):
        if device.startswith("cuda"):
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= n_gpus:
                raise ValueError(f"device {device} requested but this machine has {n_gpus} CUDA GPU(s)")
    if getattr(config, "cuda_graphs", False) and not one_cuda_device(actor, critic):
        hint = f"--critic-device {actor}" if actor.startswith("cuda") else "a CUDA GPU, which this machine lacks"
        raise ValueError(f"--cuda-graphs captures the whole update on one GPU: the actor and the critics must share "
                         f"a CUDA device (here {actor} and {critic}; needs {hint})")
    return actor, critic
