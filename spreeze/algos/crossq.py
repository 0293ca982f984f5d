"""CrossQ (Bhatt et al., ICLR 2024): SAC without target networks, with batch-renormalised critics.

The critic sees (s, a) and (s', pi(s')) in one joint forward pass in train mode, so its normalisation
statistics cover the mixture of both; the bootstrap then comes from the live critic itself (no target, no
Polyak step). The actor and the temperature are updated every ``effective_policy_delay`` (3 by default)
critic updates, asking the critic in eval mode. Adam uses beta1 = 0.5 as the authors do.

The actor is SAC's plain Gaussian policy (the authors' actor is batch-normalised too): samplers and the
evaluator then act with the same network and weight path as SAC."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from spreeze.algos.base import ActorCritic, TorchBatch, adam
from spreeze.algos.networks import BatchRenormTwinQ, GaussianActor
from spreeze.algos.sac import SAC

ADAM_BETAS = (0.5, 0.999)


class CrossQ(SAC):
    actor_class = GaussianActor

    def __init__(self, config, obs_dim: int, act_dim: int, actor_device, critic_device):
        ActorCritic.__init__(self, config, actor_device, critic_device)
        self.actor = GaussianActor(obs_dim, act_dim, config.hidden_size, config.hidden_layers, normalize=config.normalize_obs).to(self.actor_device)
        self.critic = BatchRenormTwinQ(obs_dim, act_dim, config.critic_width, config.hidden_layers).to(self.critic_device)
        self.log_alpha = torch.tensor([math.log(config.initial_alpha)], device=self.actor_device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.actor_optimizer = adam(self.actor.parameters(), lr=config.actor_lr, betas=ADAM_BETAS)
        self.critic_optimizer = adam(self.critic.parameters(), lr=config.critic_lr, betas=ADAM_BETAS)
        self.alpha_optimizer = adam([self.log_alpha], lr=config.alpha_lr)
        self._last_actor_stats = {"actor_loss": torch.zeros((), device=self.actor_device),
                                  "alpha": self.log_alpha.detach().exp()[0]}

    def critic_loss(self, batch: TorchBatch, actor: torch.nn.Module | None = None,
                    alpha: torch.Tensor | None = None) -> torch.Tensor:
        """Twin-critic TD loss with the bootstrap from the same forward pass (mean over the batch, summed
        over the twins); updates the normalisation statistics with the joint batch. ``actor``/``alpha`` as SAC's."""
        return self.critic_row_losses(batch, actor, alpha).mean()

    def critic_row_losses(self, batch: TorchBatch, actor: torch.nn.Module | None = None,
                          alpha: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's TD loss (summed over the twins), shape [B]: :meth:`critic_loss` is their mean."""
        next_actions, next_log_prob, alpha = self.next_actions(batch, actor, alpha)
        rows = batch.obs_critic.shape[0]
        self.critic.train()
        both = self.critic(torch.cat([batch.obs_critic, batch.next_obs_critic]),
                           torch.cat([batch.actions, next_actions]))
        q, next_q = both[:, :rows], both[:, rows:]
        with torch.no_grad():
            soft_next_q = next_q.min(0).values - alpha * next_log_prob
            # bootstrap through time-limit truncation: only a true termination cuts the return
            target_q = batch.rewards + self.gamma_n * (1.0 - batch.terminated) * soft_next_q
        return F.mse_loss(q, target_q.expand_as(q), reduction="none").sum(0)

    def update_actor(self, batch: TorchBatch) -> dict:
        self.critic.eval()  # dQ/da from the running statistics; the actor's batch must not move them
        try:
            return super().update_actor(batch)
        finally:
            self.critic.train()

    def critic_gradients(self, batch: TorchBatch, small: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As for SAC, but from one forward pass over the whole batch: a pass over the first rows alone would
        normalise them by their own statistics, so their gradient would not be a sample of the whole batch's
        (McCandlish et al.'s estimate needs it to be). Leaves the normalisation statistics as they were:
        measuring must not train."""
        params = [p for p in self.critic.parameters() if p.requires_grad]
        saved = [b.clone() for b in self.critic.buffers()]
        try:
            with self.autocast():
                losses = self.critic_row_losses(batch)
                big = torch.autograd.grad(losses.mean(), params, retain_graph=True)
                first = torch.autograd.grad(losses[:small].mean(), params)
            return tuple(torch.cat([g.reshape(-1) for g in grads]) for grads in (big, first))
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.critic.buffers(), saved):
                    buffer.copy_(value)

    def soft_update(self) -> None:
        """No target network: the bootstrap already comes from the live critic."""

    def modules(self) -> dict:
        return {"actor": self.actor, "critic": self.critic, "actor_optimizer": self.actor_optimizer,
                "critic_optimizer": self.critic_optimizer, "alpha_optimizer": self.alpha_optimizer}
