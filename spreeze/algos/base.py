"""What SAC and TD3 share: the batch on its devices, target updates and checkpoint state."""
from __future__ import annotations

import contextlib
import copy
from typing import NamedTuple

import torch
from torch.nn import functional as F

from spreeze.algos.distributional import DistributionalTwinQ, distributional_td_loss
from spreeze.algos.networks import TwinQ
from spreeze.replay import Batch


class TorchBatch(NamedTuple):
    """A batch placed for the actor/critic split (Spreeze 3.1): each tensor only where it is used.

    Observations go to both devices (the actor needs them for its actions, the critics for Q); actions,
    rewards and terminations only to the critic device. With one device both fields are the same tensor.
    """
    obs_actor: torch.Tensor
    next_obs_actor: torch.Tensor
    obs_critic: torch.Tensor
    next_obs_critic: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor


def to_torch_batch(batch: Batch, actor_device: torch.device, critic_device: torch.device) -> TorchBatch:
    def put(array, device):  # numpy rows from shared memory, or device tensors from the replay mirror
        tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
        return tensor if tensor.device == device else tensor.to(device, non_blocking=True)

    obs_c, next_obs_c = put(batch.obs, critic_device), put(batch.next_obs, critic_device)
    if actor_device == critic_device:
        obs_a, next_obs_a = obs_c, next_obs_c
    else:
        obs_a, next_obs_a = put(batch.obs, actor_device), put(batch.next_obs, actor_device)
    return TorchBatch(obs_a, next_obs_a, obs_c, next_obs_c, put(batch.actions, critic_device),
                      put(batch.rewards, critic_device), put(batch.terminated, critic_device))


@torch.no_grad()
def soft_update(target: torch.nn.Module, source: torch.nn.Module, tau: float) -> None:
    """Polyak averaging target <- (1 - tau) target + tau source, one fused call over all parameters; buffers
    (the observation statistics of --normalize-obs) are statistics, not weights: copied as they are."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)
    for target_buffer, source_buffer in zip(target.buffers(), source.buffers()):
        target_buffer.copy_(source_buffer)


def adam(params, lr: float, **kwargs) -> torch.optim.Adam:
    """Adam with torch's fused kernel where it has one for the parameters' device (CPU, CUDA): one call per step
    instead of about ten small ops per tensor (the default on a CPU), which a one-thread learner of small networks
    feels. The same update rule up to rounding, and the same checkpointed state."""
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float64) for p in params)
    return torch.optim.Adam(params, lr=lr, fused=True if fused else None, **kwargs)


class FrozenCopy:
    """A copy of a module without parameter gradients, brought up to date with it in place by :meth:`refresh`: what
    one thread reads while another updates the original (the overlapped learner update)."""

    def __init__(self, module: torch.nn.Module):
        self.module = copy.deepcopy(module).requires_grad_(False)
        # loading a checkpoint copies into these same tensors, so the pairs are taken once, not at every step
        self._params = (list(self.module.parameters()), list(module.parameters()))
        self._buffers = list(zip(self.module.buffers(), module.buffers()))

    @torch.no_grad()
    def refresh(self) -> torch.nn.Module:
        torch._foreach_copy_(*self._params)
        for own, source in self._buffers:
            own.copy_(source)
        return self.module


def twin_q(config, obs_dim: int, act_dim: int) -> torch.nn.Module:
    """SAC's and TD3's twin critics: scalar, or categorical with ``--critic-atoms`` > 0."""
    if not getattr(config, "critic_atoms", 0):
        return TwinQ(obs_dim, act_dim, config.critic_width, config.hidden_layers, config.critic_layer_norm)
    return DistributionalTwinQ(obs_dim, act_dim, config.critic_width, config.hidden_layers, config.critic_atoms,
                               config.q_range_bounds, config.critic_layer_norm)


class ActorCritic:
    """Common bookkeeping; subclasses define the networks and the two updates."""
    actor_class: type
    actor: torch.nn.Module

    def __init__(self, config, actor_device, critic_device):
        self.config = config
        self.actor_device = torch.device(actor_device)
        self.critic_device = torch.device(critic_device)
        # a row's rewards span --n-step steps (spreeze/sampler.py), so its bootstrap discounts by gamma**n
        self.gamma_n = config.gamma ** getattr(config, "n_step", 1)
        self.updates = 0        # critic updates
        self.actor_updates = 0  # actor updates: one per ``effective_policy_delay`` critic updates
        self._last_actor_stats: dict = {}  # what the last actor update reported, merged into critic-only steps' stats
        self._graphs = None  # --cuda-graphs: the update's CUDA graphs (spreeze/algos/graphs.py), made at the first update

    def autocast(self, cache: bool = True):
        """bf16 autocast on the critics' device type when ``--bf16`` (an actor on another type, a CPU actor beside
        CUDA critics, stays float32: torch autocasts one device type per context); a no-op otherwise. ``cache=False``
        while a CUDA graph is captured (PyTorch's rule: cached casts would outlive the capture)."""
        if not getattr(self.config, "bf16", False):
            return contextlib.nullcontext()  # not torch.autocast(enabled=False): that one costs a few ops an update
        return torch.autocast(device_type=self.critic_device.type, dtype=torch.bfloat16, cache_enabled=cache)

    def update(self, batch: TorchBatch) -> dict:
        """One critic update, the actor's (and SAC's temperature) every ``effective_policy_delay`` of them, the
        target step; then the counters. The stats are tensors (no host sync here); critic-only steps repeat the
        last actor update's. With ``--cuda-graphs`` the tensor work replays as a CUDA graph."""
        actor_due = self.updates % self.config.effective_policy_delay == 0
        if getattr(self.config, "cuda_graphs", False):
            if self._graphs is None:
                from spreeze.algos.graphs import CudaGraphSteps
                self._graphs = CudaGraphSteps(self)
            stats = self._graphs.step(batch, actor_due)
        else:
            with self.autocast():
                stats = self.step(batch, actor_due)
        if actor_due:
            self._last_actor_stats = {k: v for k, v in stats.items() if k != "critic_loss"}
            self.actor_updates += 1
        self.updates += 1
        return {**self._last_actor_stats, **stats}

    def step(self, batch: TorchBatch, actor_due: bool) -> dict:
        """The update's tensor work and nothing else (no counters, no host sync): what a CUDA graph records."""
        raise NotImplementedError

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [m for m in self.modules().values() if isinstance(m, torch.optim.Optimizer)]

    def batch(self, batch: Batch) -> TorchBatch:
        """The batch on its devices. With ``--normalize-obs`` the sampled rows also update the observation
        statistics; the actor normalises its raw observations itself, the critics get them normalised."""
        placed = to_torch_batch(batch, self.actor_device, self.critic_device)
        norm = getattr(self.actor, "obs_norm", None)
        if not isinstance(norm, torch.nn.Module) or not hasattr(norm, "update"):
            return placed
        norm.update(placed.obs_actor)
        with torch.no_grad():
            return placed._replace(obs_critic=norm(placed.obs_critic), next_obs_critic=norm(placed.next_obs_critic))

    def modules(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Stop what the algorithm started beside the learner's thread (nothing, unless it overlaps updates)."""

    def critic_loss(self, batch: TorchBatch) -> torch.Tensor:
        raise NotImplementedError

    def td_loss(self, batch: TorchBatch, next_actions: torch.Tensor, bonus: torch.Tensor | float) -> torch.Tensor:
        """Twin-critic TD loss towards r + gamma^n (1 - terminated) (min of the target twins at (s', a') + bonus),
        mean over the batch, summed over the twins: squared error, or cross-entropy for a categorical critic.
        Truncated rows bootstrap: only a true termination cuts the return."""
        if isinstance(self.critic, DistributionalTwinQ):  # full_like: a number made a tensor is a host copy
            bonus = bonus.expand_as(batch.rewards) if torch.is_tensor(bonus) else torch.full_like(batch.rewards, bonus)
            return distributional_td_loss(self.critic, self.critic_target, batch, next_actions, bonus, self.gamma_n)
        with torch.no_grad():
            next_q = self.critic_target(batch.next_obs_critic, next_actions).min(0).values + bonus
            target_q = batch.rewards + self.gamma_n * (1.0 - batch.terminated) * next_q
        q = self.critic(batch.obs_critic, batch.actions)
        return F.mse_loss(q, target_q.expand_as(q), reduction="none").mean(1).sum()

    def critic_gradient_sq_norms(self, batch: TorchBatch, small: int) -> tuple[float, float]:
        """|g|^2 of the critic loss's gradient on the whole batch and on its first ``small`` rows, without
        changing any weight: the two batch sizes of McCandlish et al.'s (2018) noise-scale estimate."""
        return tuple(float((g.float() ** 2).sum()) for g in self.critic_gradients(batch, small))

    def critic_gradients(self, batch: TorchBatch, small: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic loss's gradient (flattened) on the whole batch and on its first ``small`` rows. The rows'
        losses are independent here, so the first rows' loss is the same function on fewer rows."""
        params = [p for p in self.critic.parameters() if p.requires_grad]
        grads = []
        with self.autocast():
            for rows in (None, small):
                part = batch if rows is None else TorchBatch(*(t[:rows] for t in batch))
                grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(self.critic_loss(part), params)]))
        return grads[0], grads[1]

    def scale_learning_rates(self, scale: float) -> None:
        """Every optimizer's rate set to ``scale`` x its configured rate (``--lr-schedule``); from the config, not
        the optimizer, whose rate a resumed checkpoint brings back already scaled."""
        rates = {"actor_optimizer": self.config.actor_lr, "critic_optimizer": self.config.critic_lr,
                 "alpha_optimizer": self.config.alpha_lr}
        for name, obj in self.modules().items():
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    group["lr"] = rates[name] * scale

    def state_dict(self) -> dict:
        state = {name: obj.state_dict() for name, obj in self.modules().items()}
        state["updates"] = self.updates
        state["actor_updates"] = self.actor_updates
        return state

    def load_state_dict(self, state: dict) -> None:
        self._graphs = None  # captured graphs hold the optimizers' state tensors, which loading replaces
        for name, obj in self.modules().items():
            saved = state[name]
            if isinstance(obj, torch.optim.Optimizer):  # torch keeps a saved group's flags: keep this run's kernel
                saved = dict(saved, param_groups=[
                    dict(group, **{k: live[k] for k in ("fused", "foreach", "capturable") if k in live})
                    for group, live in zip(saved["param_groups"], obj.param_groups)])
            obj.load_state_dict(saved)
        self.updates = int(state["updates"])
        self.actor_updates = int(state.get("actor_updates", 0))

    def parameters_finite(self) -> bool:
        tensors = [p for name, m in self.modules().items() if isinstance(m, torch.nn.Module) for p in m.parameters()]
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def state_finite(self) -> bool:
        """Every float tensor of the checkpoint state, optimizer moments included: an update whose loss
        overflowed can leave the weights finite (Adam's step is 0 with an infinite second moment) while its
        optimizer state is not, and a checkpoint would carry that into every resume."""
        def tensors(value):
            if torch.is_tensor(value):
                if value.is_floating_point():
                    yield value
            elif isinstance(value, dict):
                for item in value.values():
                    yield from tensors(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    yield from tensors(item)
        return all(bool(torch.isfinite(t).all()) for t in tensors(self.state_dict()))
