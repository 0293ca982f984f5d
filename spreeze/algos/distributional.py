"""A categorical distributional twin critic (C51, Bellemare et al. 2017), as FastTD3 (Seo et al. 2025) pairs
with large batches and many parallel envs: each critic outputs a distribution over ``atoms`` fixed returns and
is trained by cross-entropy against the projected Bellman target, which keeps gradients bounded whatever the
scale of the returns.

``forward`` returns the expected values ``[2, B]``, so the actor's update reads it like a scalar critic; the
TD loss is :func:`distributional_td_loss`. The support spans ``--q-range``; with ``auto`` it is set once, at
the first loss, from that batch (see :func:`auto_bound`), and then travels in the critic's state (a buffer)."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from spreeze.algos.networks import EnsembleMLP

AUTO_MARGIN = 3.0        # the auto range covers returns of this many times the largest per-step reward seen
MAX_HORIZON = 1000.0     # 1/(1 - gamma) for gamma = 1
EDGE_WARN_SHARE = 0.75   # a mean Q this far from the support's centre towards an end: its targets are clipped


class DistributionalTwinQ(EnsembleMLP):
    """Two categorical Q networks in one batched matmul per layer: ``logits`` ``[2, B, atoms]``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int, hidden_layers: int, atoms: int,
                 q_range: tuple[float, float] | None = None, layer_norm: bool = False):
        super().__init__(2, obs_dim + act_dim, atoms, hidden_size, hidden_layers, layer_norm)
        self.register_buffer("support", torch.linspace(-1.0, 1.0, atoms))
        self.register_buffer("support_set", torch.zeros((), dtype=torch.bool))
        self._support_known = False  # support_set read once as True: no host read of it on later updates
        if q_range is not None:
            self.set_support(*q_range)

    @property
    def atoms(self) -> int:
        return self.support.numel()

    @torch.no_grad()
    def set_support(self, q_min: float, q_max: float) -> None:
        self.support.copy_(torch.linspace(q_min, q_max, self.atoms, device=self.support.device))
        self.support_set.fill_(True)
        self._support_known = True

    def support_ready(self) -> bool:
        """Whether the support is set; the flag lives on the device (it travels in checkpoints), so it is read
        from there only until it is seen set: a read per update would stall a GPU learner on every update and
        cannot be captured in a CUDA graph."""
        if not self._support_known:
            self._support_known = bool(self.support_set)
        return self._support_known

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._support_known = False  # the loaded flag decides, read at the next loss

    def logits(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([obs, actions], dim=-1))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Expected values ``[2, B]``."""
        return (F.softmax(self.logits(obs, actions), dim=-1) * self.support).sum(-1)


def categorical_projection(probs: torch.Tensor, atoms: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Project the distribution putting mass ``probs[b, i]`` on return ``atoms[b, i]`` onto the evenly spaced
    ``support`` (Bellemare et al.'s projection): each mass is split between its two nearest support points in
    proportion to closeness, so the mean is kept exactly for returns inside the support; outside, they are
    clipped to its ends. ``probs``, ``atoms``: ``[B, N]``; returns ``[B, len(support)]``. A row with a non-finite
    return (a NaN actor's log-probability in SAC's bonus) comes out NaN, so the loss is non-finite and the learner
    stops as with scalar critics: its NaN positions would otherwise become out-of-range indices (a traceback on
    a CPU, a device-side assert on a GPU). Without a host sync, so that CUDA graphs can capture it."""
    n = support.numel()
    q_min, q_max = support[0], support[-1]
    position = (atoms.clamp(q_min, q_max) - q_min) / ((q_max - q_min) / (n - 1))  # in [0, n-1]
    position = torch.nan_to_num(position, nan=0.0)
    lower = position.floor().clamp(max=n - 2)  # the top end falls on (n-2, n-1) with all its mass on n-1
    upper_weight = (position - lower).clamp(0.0, 1.0)  # float32 can put the top end a hair past n - 1
    projected = torch.zeros(probs.shape[0], n, dtype=probs.dtype, device=probs.device)
    lower = lower.long()
    projected.scatter_add_(1, lower, probs * (1.0 - upper_weight))
    projected.scatter_add_(1, lower + 1, probs * upper_weight)
    return torch.where(torch.isfinite(atoms).all(1, keepdim=True), projected, torch.full_like(projected, math.nan))


def auto_bound(rewards: torch.Tensor, bonus: torch.Tensor, gamma_n: float) -> float:
    """Half-width of the ``auto`` support: AUTO_MARGIN x the largest per-row reward (or entropy bonus) of the
    first batch, at least 1, over (1 - gamma^n). Projection keeps the mean inside the range, so a wide range
    costs resolution of the distribution's shape only, while a narrow one would clip returns."""
    per_step = max(1.0, float(rewards.abs().max()), float(bonus.abs().max()) if bonus.numel() else 0.0)
    horizon = MAX_HORIZON if gamma_n >= 1.0 else min(MAX_HORIZON, 1.0 / (1.0 - gamma_n))
    return AUTO_MARGIN * per_step * horizon


def support_edge_warning(q_value: float, low: float, high: float) -> str | None:
    """A line when the critics' mean Q (of the actor's actions) is more than EDGE_WARN_SHARE of the way from the
    support's centre to an end: the projection clips returns beyond the ends, so Q can no longer follow the
    returns (an ``auto`` range comes from the first batch's rewards, which a learning policy may outgrow)."""
    centre, half = (low + high) / 2.0, (high - low) / 2.0
    if not math.isfinite(q_value) or abs(q_value - centre) <= EDGE_WARN_SHARE * half:
        return None
    return (f"the critics' mean Q {q_value:.4g} is near an end of the C51 support [{low:.4g}, {high:.4g}]: "
            f"returns beyond it are clipped, so if the env's returns can go further, give a wider "
            f"--q-range=MIN,MAX")


def distributional_target(critic_target: DistributionalTwinQ, batch, next_actions: torch.Tensor,
                          bonus: torch.Tensor, gamma_n: float) -> torch.Tensor:
    """The projected Bellman target ``[B, atoms]``: per row, the target twin whose expected value is lower
    (clipped double Q, as FastTD3), its atoms shifted by ``bonus`` (SAC's entropy bonus; 0 for TD3) and
    discounted by gamma^n; a true termination leaves the reward alone."""
    support = critic_target.support
    next_probs = F.softmax(critic_target.logits(batch.next_obs_critic, next_actions).float(), dim=-1)
    lower_twin = (next_probs * support).sum(-1).argmin(0)  # [B]
    probs = next_probs.gather(0, lower_twin.view(1, -1, 1).expand(1, *next_probs.shape[1:]))[0]
    atoms = batch.rewards.unsqueeze(1) + (gamma_n * (1.0 - batch.terminated)).unsqueeze(1) * (
        support.unsqueeze(0) + bonus.unsqueeze(1))
    return categorical_projection(probs, atoms, support)


def distributional_td_loss(critic: DistributionalTwinQ, critic_target: DistributionalTwinQ, batch,
                           next_actions: torch.Tensor, bonus: torch.Tensor, gamma_n: float) -> torch.Tensor:
    """Cross-entropy of both critics against one projected target (mean over the batch, summed over the twins).
    An ``auto`` support is set here, on the first call, for both the critic and its target."""
    if not critic.support_ready():
        bound = auto_bound(batch.rewards, bonus, gamma_n)
        critic.set_support(-bound, bound)
        critic_target.set_support(-bound, bound)
    with torch.no_grad():
        target = distributional_target(critic_target, batch, next_actions, bonus, gamma_n)
    log_probs = F.log_softmax(critic.logits(batch.obs_critic, batch.actions).float(), dim=-1)
    return -(target * log_probs).sum(-1).mean(1).sum()
