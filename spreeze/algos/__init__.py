"""Off-policy actor-critic algorithms. Each reads like CleanRL: update_critic, update_actor, soft_update."""
from spreeze.algos.base import TorchBatch, to_torch_batch
from spreeze.algos.crossq import CrossQ
from spreeze.algos.sac import SAC
from spreeze.algos.td3 import TD3

ALGOS = {"sac": SAC, "td3": TD3, "crossq": CrossQ}


def make_algo(config, obs_dim: int, act_dim: int, actor_device, critic_device):
    return ALGOS[config.algo](config, obs_dim, act_dim, actor_device, critic_device)


def make_actor(config, obs_dim: int, act_dim: int):
    """The actor alone, on CPU, as samplers and the evaluator hold it."""
    return ALGOS[config.algo].actor_class(obs_dim, act_dim, config.hidden_size, config.hidden_layers,
                                          normalize=config.normalize_obs)


__all__ = ["ALGOS", "CrossQ", "SAC", "TD3", "TorchBatch", "make_actor", "make_algo", "to_torch_batch"]
