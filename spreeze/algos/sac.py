"""Soft Actor-Critic with twin Q, target critics and automatic entropy tuning (Haarnoja et al. 2018),
written after CleanRL's sac_continuous_action.py, with the actor and the critics on their own devices.

The actor (and the temperature) may be updated once per ``effective_policy_delay`` critic updates: PQL's
actor:critic ratio beta_p:v (PQL, section 3.2), 1 by default. The critic target
follows the critic after every critic update, as SAC's target does not depend on the actor's schedule.

``--learner-overlap`` runs the actor's update in a second thread beside the critics' (PQL's parallel policy and
value learners, in one process): each reads a frozen copy of what the other had at the start of the step, so the
critics' update is SAC's and the actor reads critics one update older than in SAC's order."""
from __future__ import annotations

import copy
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from spreeze.algos.base import ActorCritic, FrozenCopy, TorchBatch, adam, soft_update, twin_q
from spreeze.algos.networks import GaussianActor

OVERLAP_TIMEOUT_S = 300.0  # the actor's update in the second thread; far beyond any update, so only a hang trips it


class SAC(ActorCritic):
    actor_class = GaussianActor
    _overlap: ThreadPoolExecutor | None = None  # the actor's update thread (--learner-overlap); CrossQ has none

    def __init__(self, config, obs_dim: int, act_dim: int, actor_device, critic_device):
        super().__init__(config, actor_device, critic_device)
        hidden = (config.hidden_size, config.hidden_layers)
        self.actor = GaussianActor(obs_dim, act_dim, *hidden, normalize=config.normalize_obs).to(self.actor_device)
        self.critic = twin_q(config, obs_dim, act_dim).to(self.critic_device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = torch.tensor([math.log(config.initial_alpha)], device=self.actor_device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.actor_optimizer = adam(self.actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = adam(self.critic.parameters(), lr=config.critic_lr)
        self.alpha_optimizer = adam([self.log_alpha], lr=config.alpha_lr)
        self._last_actor_stats = {"actor_loss": torch.zeros((), device=self.actor_device),
                                  "alpha": self.log_alpha.detach().exp()[0]}
        if getattr(config, "learner_overlap", False):
            self._actor_view, self._critic_view = FrozenCopy(self.actor), FrozenCopy(self.critic)
            self._overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spreeze-actor-update")

    def critic_loss(self, batch: TorchBatch, actor: torch.nn.Module | None = None,
                    alpha: torch.Tensor | None = None) -> torch.Tensor:
        """Twin-critic TD loss towards the soft value: the next action's entropy bonus enters the target."""
        next_actions, next_log_prob, alpha = self.next_actions(batch, actor, alpha)
        return self.td_loss(batch, next_actions, -alpha * next_log_prob)

    @torch.no_grad()
    def next_actions(self, batch: TorchBatch, actor: torch.nn.Module | None = None,
                     alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bootstrap's a' ~ pi(s'), its log-probability and the temperature, on the critics' device.
        ``actor``/``alpha``: what to read instead of the live ones (the overlapped update's frozen copies)."""
        actor = self.actor if actor is None else actor
        next_actions, next_log_prob = actor.sample(batch.next_obs_actor)
        alpha = self.log_alpha.exp() if alpha is None else alpha
        device = self.critic_device
        return next_actions.to(device), next_log_prob.to(device), alpha.to(device)

    def update_critic(self, batch: TorchBatch, actor: torch.nn.Module | None = None,
                      alpha: torch.Tensor | None = None) -> dict:
        critic_loss = self.critic_loss(batch, actor, alpha)
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()
        return {"critic_loss": critic_loss.detach()}

    def update_actor(self, batch: TorchBatch, critic: torch.nn.Module | None = None) -> dict:
        """``critic``: a frozen copy to read instead of the live critics (the overlapped update)."""
        if critic is not None:
            return self._actor_step(batch, critic)
        self.critic.requires_grad_(False)  # the actor loss needs dQ/da, not gradients for the critic weights
        try:
            return self._actor_step(batch, self.critic)
        finally:
            self.critic.requires_grad_(True)

    def _actor_step(self, batch: TorchBatch, critic: torch.nn.Module) -> dict:
        actions, log_prob = self.actor.sample(batch.obs_actor)
        q = critic(batch.obs_critic, actions.to(self.critic_device)).min(0).values.to(self.actor_device)
        alpha = self.log_alpha.exp().detach()
        actor_loss = (alpha * log_prob - q).mean()
        self.actor_optimizer.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_optimizer.step()
        alpha_loss = (-self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
        self.alpha_optimizer.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_optimizer.step()
        return {"actor_loss": actor_loss.detach(), "alpha": self.log_alpha.detach().exp()[0],
                "q_value": q.detach().mean()}

    def soft_update(self) -> None:
        soft_update(self.critic_target, self.critic, self.config.tau)

    def step(self, batch: TorchBatch, actor_due: bool) -> dict:
        if actor_due and self._overlap is not None:
            stats = self._overlapped_update(batch)
        else:
            stats = self.update_critic(batch)
            if actor_due:
                stats.update(self.update_actor(batch))
        self.soft_update()
        return stats

    def _overlapped_update(self, batch: TorchBatch) -> dict:
        """The actor's (and temperature's) step in the second thread on the critics as they were before this step;
        the critics' step here on the actor and temperature as they were before theirs. Neither reads a tensor the
        other is writing."""
        actor_view, critic_view = self._actor_view.refresh(), self._critic_view.refresh()
        alpha = self.log_alpha.detach().exp()  # a new tensor: the temperature's step does not change it
        actor_job = self._overlap.submit(self._in_autocast, self.update_actor, batch, critic_view)
        try:
            stats = self.update_critic(batch, actor_view, alpha)
        finally:  # never leave the actor's step running into the next one
            try:
                actor_stats = actor_job.result(timeout=OVERLAP_TIMEOUT_S)
            except TimeoutError:
                self._overlap.shutdown(wait=False, cancel_futures=True)  # close() must not wait for a hung thread
                self._overlap = None
                raise
        return {**stats, **actor_stats}

    def _in_autocast(self, fn, *args):
        with self.autocast():  # autocast (like grad mode) is per thread
            return fn(*args)

    def close(self) -> None:
        if self._overlap is not None:
            self._overlap.shutdown(wait=True)

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
