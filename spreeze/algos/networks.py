"""Actor and twin-critic networks shared by SAC and TD3."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class FullPrecisionLinear(nn.Linear):
    """An output layer kept in float32 under bf16 autocast: Q-values of ~100 have a resolution of ~0.5
    in bfloat16, too coarse for TD targets, while the hidden layers carry almost all the FLOPs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())


def mlp(in_dim: int, out_dim: int, hidden_size: int, hidden_layers: int) -> nn.Sequential:
    layers, width = [], in_dim
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, hidden_size), nn.ReLU()]
        width = hidden_size
    layers.append(FullPrecisionLinear(width, out_dim))
    return nn.Sequential(*layers)


class EnsembleLinear(nn.Module):
    """``n`` independent linear layers applied in one batched matmul (input and output ``[n, B, features]``)."""

    def __init__(self, n: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(n, 1, out_features))
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default init, per member
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class FullPrecisionEnsembleLinear(EnsembleLinear):
    """The ensemble's output layer in float32 under autocast (see FullPrecisionLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())


class EnsembleLayerNorm(nn.Module):
    """Layer normalisation over the features of each member of ``[n, B, features]``, with a gain and bias per
    member (nn.LayerNorm would share them between the twins)."""

    def __init__(self, n: int, features: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, 1, features))
        self.bias = nn.Parameter(torch.zeros(n, 1, features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, F.layer_norm(x, x.shape[-1:], eps=self.eps), self.weight)


class EnsembleMLP(nn.Module):
    """``n`` MLPs in one batched matmul per layer (``[B, in]`` -> ``[n, B, out]``); ``layer_norm`` puts a
    LayerNorm before each hidden ReLU, which bounds the features a TD target can push up (Ball et al. 2023)."""

    def __init__(self, n: int, in_dim: int, out_dim: int, hidden_size: int, hidden_layers: int,
                 layer_norm: bool = False):
        super().__init__()
        widths = [in_dim] + [hidden_size] * hidden_layers + [out_dim]
        pairs = list(zip(widths, widths[1:]))
        self.layers = nn.ModuleList([*(EnsembleLinear(n, a, b) for a, b in pairs[:-1]),
                                     FullPrecisionEnsembleLinear(n, *pairs[-1])])
        self.norms = nn.ModuleList([EnsembleLayerNorm(n, hidden_size) for _ in pairs[:-1]] if layer_norm else [])
        self.members = n

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(0).expand(self.members, -1, -1)
        *hidden, last = self.layers  # not self.layers[:-1]: slicing a ModuleList builds a new one at every call
        for i, layer in enumerate(hidden):
            x = layer(x)
            x = F.relu(self.norms[i](x) if len(self.norms) else x)
        return last(x)


class TwinQ(EnsembleMLP):
    """Two Q networks evaluated together: returns ``[2, B]``. One batched matmul per layer halves kernel launches."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int, hidden_layers: int, layer_norm: bool = False):
        super().__init__(2, obs_dim + act_dim, 1, hidden_size, hidden_layers, layer_norm)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([obs, actions], dim=-1)).squeeze(-1)


class ObsNormalizer(nn.Module):
    """``--normalize-obs``: a running mean and variance of observations (Chan et al.'s parallel update over
    batches), applied as ``(obs - mean) / std`` clipped to +-``clip`` (as SB3's VecNormalize does).

    Its statistics are buffers of the actor, so they travel with the actor's weights through the shared weights
    to every sampler and the evaluator, and into every checkpoint and saved policy (``load_policy`` applies them).
    The learner updates them from the replay rows it samples, which are stored raw."""

    def __init__(self, obs_dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(obs_dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(obs_dim, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, obs: torch.Tensor) -> None:
        x = obs.detach().reshape(-1, self.mean.shape[0]).to(self.mean)
        rows = x.shape[0]
        if rows == 0:
            return
        batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        total = self.count + rows
        delta = batch_mean - self.mean
        self.var.copy_((self.var * self.count + batch_var * rows + delta ** 2 * self.count * rows / total) / total)
        self.mean.add_(delta * rows / total)
        self.count.copy_(total)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        mean = self.mean.to(device=obs.device, dtype=obs.dtype)
        std = (self.var + self.eps).sqrt().to(device=obs.device, dtype=obs.dtype)
        return ((obs - mean) / std).clamp(-self.clip, self.clip)


def _normalizer(obs_dim: int, normalize: bool) -> nn.Module:
    return ObsNormalizer(obs_dim) if normalize else nn.Identity()


class GaussianActor(nn.Module):
    """SAC's tanh-squashed Gaussian policy; actions in [-1, 1]. Takes raw observations (``obs_norm`` normalises
    them with ``--normalize-obs``)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int, hidden_layers: int, normalize: bool = False):
        super().__init__()
        self.obs_norm = _normalizer(obs_dim, normalize)
        self.net = mlp(obs_dim, 2 * act_dim, hidden_size, hidden_layers)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(self.obs_norm(obs)).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1.0)
        return mean, log_std

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised action and its log-probability (with the tanh correction)."""
        mean, log_std = self(obs)
        std = log_std.exp()
        noise = torch.randn_like(mean)
        pre_tanh = mean + std * noise
        action = torch.tanh(pre_tanh)
        log_prob = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        # log(1 - tanh(u)^2) computed stably as 2 * (log 2 - u - softplus(-2u)) (as in SpinningUp's SAC)
        log_prob = log_prob - (2.0 * (math.log(2.0) - pre_tanh - F.softplus(-2.0 * pre_tanh))).sum(-1)
        return action, log_prob

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool, noise_sigma: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
        """``generator``: draw the sampling noise from it (the reproducible mode gives each env its own)."""
        mean, log_std = self(obs)
        if deterministic:
            return torch.tanh(mean)
        return torch.tanh(mean + log_std.exp() * _standard_normal(mean, generator))  # no log-prob needed to act


class DeterministicActor(nn.Module):
    """TD3's deterministic policy; exploration adds Gaussian noise of a per-env sigma (PQL mixed noise)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int, hidden_layers: int, normalize: bool = False):
        super().__init__()
        self.obs_norm = _normalizer(obs_dim, normalize)
        self.net = mlp(obs_dim, act_dim, hidden_size, hidden_layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(self.obs_norm(obs)))

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool, noise_sigma: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
        """``generator``: draw the exploration noise from it (the reproducible mode gives each env its own)."""
        action = self(obs)
        if deterministic or noise_sigma is None:
            return action
        return (action + noise_sigma.unsqueeze(-1) * _standard_normal(action, generator)).clamp(-1.0, 1.0)


def _standard_normal(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return torch.randn_like(like)
    return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=like.device)


class EnsembleBatchRenorm(nn.Module):
    """Batch Renormalization (Ioffe 2017) over the batch axis of ``[n, B, features]`` ensemble activations, with
    statistics per member: the normalisation CrossQ (Bhatt et al. 2024) puts before every critic layer.

    Training mode normalises with the batch's statistics and moves the running ones toward them; after
    ``warmup_steps`` training calls the batch statistics are corrected toward the running ones (r, d clipped to
    r_max, d_max). Eval mode normalises with the running statistics. Statistics are taken in float32 under
    autocast. No Python branch on tensor values, so it runs on any device (the meta device too)."""

    def __init__(self, n: int, features: int, momentum: float = 0.01, eps: float = 1e-3,
                 warmup_steps: int = 100_000, r_max: float = 3.0, d_max: float = 5.0):
        super().__init__()
        self.momentum, self.eps, self.warmup_steps, self.r_max, self.d_max = momentum, eps, warmup_steps, r_max, d_max
        self.scale = nn.Parameter(torch.ones(n, 1, features))
        self.bias = nn.Parameter(torch.zeros(n, 1, features))
        self.register_buffer("running_mean", torch.zeros(n, 1, features))
        self.register_buffer("running_var", torch.ones(n, 1, features))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            if self.training:
                # mean, then the centred squares: far faster on CPU than torch.var_mean over the middle axis
                mean = x.mean(1, keepdim=True)
                var = (x - mean).square().sum(1, keepdim=True) / max(x.shape[1] - 1, 1)
                running_std = (self.running_var + self.eps).sqrt()
                renorm = self.steps >= self.warmup_steps
                r = torch.where(renorm, ((var + self.eps).sqrt() / running_std).detach()
                                .clamp(1.0 / self.r_max, self.r_max), torch.ones_like(var))
                d = torch.where(renorm, ((mean - self.running_mean) / running_std).detach()
                                .clamp(-self.d_max, self.d_max), torch.zeros_like(mean))
                use_mean, use_var = mean - d * var.sqrt() / r, var / r ** 2
                with torch.no_grad():
                    self.running_mean.lerp_(mean.detach(), self.momentum)
                    self.running_var.lerp_(var.detach(), self.momentum)
                    self.steps += 1
            else:
                use_mean, use_var = self.running_mean, self.running_var
            return (x - use_mean) / (use_var + self.eps).sqrt() * self.scale + self.bias


class BatchRenormTwinQ(nn.Module):
    """CrossQ's twin critic: Batch Renormalization before every linear layer (the input's too), ReLU after
    each hidden one; returns ``[2, B]`` like :class:`TwinQ`. Train mode for the joint (s, a)/(s', a') pass
    that fits it, eval mode (running statistics) when the actor asks it for dQ/da."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int, hidden_layers: int):
        super().__init__()
        widths = [obs_dim + act_dim] + [hidden_size] * hidden_layers + [1]
        pairs = list(zip(widths, widths[1:]))
        self.norms = nn.ModuleList([EnsembleBatchRenorm(2, a) for a, _ in pairs])
        self.layers = nn.ModuleList([*(EnsembleLinear(2, a, b) for a, b in pairs[:-1]),
                                     FullPrecisionEnsembleLinear(2, *pairs[-1])])

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, actions], dim=-1).unsqueeze(0).expand(2, -1, -1)
        *norms, last_norm = self.norms  # iterated, not sliced (see EnsembleMLP.mlp)
        *hidden, last = self.layers
        for norm, layer in zip(norms, hidden):
            x = F.relu(layer(norm(x)))
        return last(last_norm(x)).squeeze(-1)
