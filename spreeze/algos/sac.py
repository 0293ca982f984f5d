"""Soft Actor-Critic with twin Q, target critics and automatic entropy tuning (Haarnoja et al. 2018),
written after CleanRL's sac_continuous_action.py, with the actor and the critics on their own devices.

The actor (and the temperature) may be updated once per ``effective_policy_delay`` critic updates: PQL's
actor:critic ratio beta_p:v (PQL, section 3.2), 1 by default. The critic target
follows the critic after every critic update, as SAC's target does not depend on the actor's schedule."""
from __future__ import annotations

import copy
import math

import torch
from spreeze.algos.base import ActorCritic, TorchBatch, soft_update, twin_q
from spreeze.algos.networks import GaussianActor


class SAC(ActorCritic):
    actor_class = GaussianActor

    def __init__(self, config, obs_dim: int, act_dim: int, actor_device, critic_device):
        super().__init__(config, actor_device, critic_device)
        hidden = (config.hidden_size, config.hidden_layers)
        self.actor = GaussianActor(obs_dim, act_dim, *hidden, normalize=config.normalize_obs).to(self.actor_device)
        self.critic = twin_q(config, obs_dim, act_dim).to(self.critic_device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = torch.tensor([math.log(config.initial_alpha)], device=self.actor_device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=config.critic_lr)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=config.alpha_lr)
        self._last_actor_stats = {"actor_loss": torch.zeros((), device=self.actor_device),
                                  "alpha": self.log_alpha.detach().exp()[0]}

    def critic_loss(self, batch: TorchBatch) -> torch.Tensor:
        """Twin-critic TD loss towards the soft value: the next action's entropy bonus enters the target."""
        with torch.no_grad():
            next_actions, next_log_prob = self.actor.sample(batch.next_obs_actor)
            alpha = self.log_alpha.exp().to(self.critic_device)
            bonus = -alpha * next_log_prob.to(self.critic_device)
        return self.td_loss(batch, next_actions.to(self.critic_device), bonus)

    def update_critic(self, batch: TorchBatch) -> dict:
        critic_loss = self.critic_loss(batch)
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()
        return {"critic_loss": critic_loss.detach()}

    def update_actor(self, batch: TorchBatch) -> dict:
        self.critic.requires_grad_(False)  # the actor loss needs dQ/da, not gradients for the critic weights
        try:
            actions, log_prob = self.actor.sample(batch.obs_actor)
            q = self.critic(batch.obs_critic, actions.to(self.critic_device)).min(0).values.to(self.actor_device)
            alpha = self.log_alpha.exp().detach()
            actor_loss = (alpha * log_prob - q).mean()
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
        finally:
            self.critic.requires_grad_(True)
        alpha_loss = (-self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
        self.alpha_optimizer.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_optimizer.step()
        return {"actor_loss": actor_loss.detach(), "alpha": self.log_alpha.detach().exp()[0]}

    def soft_update(self) -> None:
        soft_update(self.critic_target, self.critic, self.config.tau)

    def update(self, batch: TorchBatch) -> dict:
        with self.autocast():
            return self._update(batch)

    def _update(self, batch: TorchBatch) -> dict:
        stats = self.update_critic(batch)
        if self.updates % self.config.effective_policy_delay == 0:
            self._last_actor_stats = self.update_actor(batch)
            self.actor_updates += 1
        stats.update(self._last_actor_stats)
        self.soft_update()
        self.updates += 1
        return stats

    def modules(self) -> dict:
        return {"actor": self.actor, "critic": self.critic, "critic_target": self.critic_target,
                "actor_optimizer": self.actor_optimizer, "critic_optimizer": self.critic_optimizer,
                "alpha_optimizer": self.alpha_optimizer}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["log_alpha"] = self.log_alpha.detach().cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"].to(self.actor_device))
