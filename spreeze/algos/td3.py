"""TD3 (Fujimoto et al. 2018): twin critics, target policy smoothing, delayed actor and target updates,
written after CleanRL's td3_continuous_action.py, with the actor and the critics on their own devices.
Exploration noise is applied by the samplers (PQL's mixed per-env sigma), not here."""
from __future__ import annotations

import copy

import torch
from spreeze.algos.base import ActorCritic, TorchBatch, adam, soft_update, twin_q
from spreeze.algos.networks import DeterministicActor


class TD3(ActorCritic):
    actor_class = DeterministicActor

    def __init__(self, config, obs_dim: int, act_dim: int, actor_device, critic_device):
        super().__init__(config, actor_device, critic_device)
        hidden = (config.hidden_size, config.hidden_layers)
        self.actor = DeterministicActor(obs_dim, act_dim, *hidden, normalize=config.normalize_obs).to(self.actor_device)
        self.actor_target = copy.deepcopy(self.actor).requires_grad_(False)
        # --normalize-obs: the target policy reads the online statistics, which every batch updates; a copy would
        # lag them between the delayed target updates
        self.actor_target.obs_norm = self.actor.obs_norm
        self.critic = twin_q(config, obs_dim, act_dim).to(self.critic_device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_optimizer = adam(self.actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = adam(self.critic.parameters(), lr=config.critic_lr)
        self._last_actor_stats = {"actor_loss": torch.zeros((), device=self.actor_device)}

    def critic_loss(self, batch: TorchBatch) -> torch.Tensor:
        """Twin-critic TD loss at the target actor's smoothed next action."""
        with torch.no_grad():
            next_actions = self.actor_target(batch.next_obs_actor)
            noise = (torch.randn_like(next_actions) * self.config.target_noise).clamp(
                -self.config.target_noise_clip, self.config.target_noise_clip)
            next_actions = (next_actions + noise).clamp(-1.0, 1.0).to(self.critic_device)
        return self.td_loss(batch, next_actions, 0.0)

    def update_critic(self, batch: TorchBatch) -> dict:
        critic_loss = self.critic_loss(batch)
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()
        return {"critic_loss": critic_loss.detach()}

    def update_actor(self, batch: TorchBatch) -> dict:
        self.critic.requires_grad_(False)
        try:
            actions = self.actor(batch.obs_actor).to(self.critic_device)
            actor_loss = -self.critic(batch.obs_critic, actions)[0].mean().to(self.actor_device)
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
        finally:
            self.critic.requires_grad_(True)
        return {"actor_loss": actor_loss.detach(), "q_value": -actor_loss.detach()}

    def soft_update(self) -> None:
        soft_update(self.critic_target, self.critic, self.config.tau)
        soft_update(self.actor_target, self.actor, self.config.tau)

    def step(self, batch: TorchBatch, actor_due: bool) -> dict:
        """The critics every step; the actor and both targets every ``effective_policy_delay`` steps (TD3's delay)."""
        stats = self.update_critic(batch)
        if actor_due:
            stats.update(self.update_actor(batch))
            self.soft_update()
        return stats

    def load_state_dict(self, state: dict) -> None:
        """The target policy's statistics are the actor's: a checkpoint from before they were shared keeps a lagging
        copy, which, loaded after the actor's, would overwrite them."""
        statistics = {k: v for k, v in state["actor"].items() if k.startswith("obs_norm.")}
        super().load_state_dict(dict(state, actor_target={**state["actor_target"], **statistics}))

    def modules(self) -> dict:
        return {"actor": self.actor, "actor_target": self.actor_target, "critic": self.critic,
                "critic_target": self.critic_target, "actor_optimizer": self.actor_optimizer,
                "critic_optimizer": self.critic_optimizer}
