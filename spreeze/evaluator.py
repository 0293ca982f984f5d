"""Evaluator process: plays the current policy deterministically for whole episodes (no exploration,
no writes to the replay) and reports the test return, giving Spreeze's dense test curve."""
from __future__ import annotations

import time

import numpy as np
import torch

from spreeze.algos import make_actor
from spreeze.envs import ActionScaler, EnvInfo, make_env
from spreeze.messages import Evaluation
from spreeze.stats import SharedStats
from spreeze.weights import SharedWeights, load_flat

EVAL_SEED_OFFSET = 77_777_777
EVAL_SEED_SCHEME = 2  # recorded with opponents' curves: scheme 1 summed every episode's seed as the first's is


def eval_episode_seed(seed: int, index: int, episode: int) -> int:
    """Reset seed of episode ``episode`` of test ``index``: a test's start states depend on the run's seed and
    the test's number only, in every mode, so another trainer's tests can start from the same states.
    A test's first episode keeps the plain sum (races reuse opponents' curves recorded with it); the others are
    hashed, so that with several episodes per test nearby seeds do not share their start states."""
    if episode == 0:
        return seed + EVAL_SEED_OFFSET + 1_000 * index
    return int(np.random.SeedSequence([seed % 2**64, EVAL_SEED_OFFSET, index, episode]).generate_state(1)[0])


class Evaluator:
    def __init__(self, config, env_info: EnvInfo, weights: SharedWeights | None, stats: SharedStats | None,
                 started_at: float, first_index: int = 0):
        """``first_index``: tests the run already has (a restarted evaluator, a resumed run), so that test ``i``
        starts from the same seeded states however the run got there. Lock-step evaluations bring their own
        weights and counts, so there ``weights`` and ``stats`` are None."""
        self.config = config
        self.weights = weights
        self.stats = stats
        self.started_at = started_at
        self.env, self.obs = make_env(config, config.seed + EVAL_SEED_OFFSET)
        self.scale = ActionScaler(env_info.action_low, env_info.action_high)
        self.actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
        self.policy_version = -1
        self.evaluations = first_index

    def evaluate(self, should_stop=lambda: False, request: dict | None = None) -> dict | None:
        """Whole deterministic episodes of the newest policy, or (lock-step) of ``request``'s weights as its
        test number ``index``; None if stopped midway. Stamped with the time the policy was taken, as its env
        steps and updates are (lock-step: when its round made it): the curve's point is when the run had that
        policy, not when its test ended."""
        if request is None:
            self.policy_version = self.weights.pull(self.actor, self.policy_version)
            index, version = self.evaluations, self.policy_version
            env_steps, updates = self.stats.total_env_steps(), self.stats.updates()
            taken = time.time()  # after the counters: a row a resume keeps by its time has counters from before
        else:
            load_flat(self.actor, request["flat"])
            index, version, env_steps, updates = (request[k] for k in ("index", "policy_version", "env_steps", "updates"))
            taken = request.get("time", time.time())
        returns, lengths = [], []
        for episode in range(self.config.eval_episodes):
            self.obs, _ = self.env.reset(seed=eval_episode_seed(self.config.seed, index, episode))
            total, length, done = 0.0, 0, False
            while not done:
                if should_stop():
                    return None
                action = self.actor.act(torch.from_numpy(np.asarray(self.obs, np.float32)), deterministic=True)
                self.obs, reward, terminated, truncated, _ = self.env.step(self.scale(action.numpy()))
                total += float(reward)
                length += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(length)
        if request is None:
            self.evaluations += 1
        return {"time_s": taken - self.started_at, "env_steps": env_steps, "updates": updates,
                "policy_version": version, "test_return": float(np.mean(returns)),
                "test_return_std": float(np.std(returns)), "episode_length": float(np.mean(lengths)),
                "actor_flat": actor_flat(self.actor) if request is None else request["flat"]}

    def close(self) -> None:
        self.env.close()


def actor_flat(actor: torch.nn.Module) -> np.ndarray:
    """The tested weights travel with the result, so the supervisor can keep the best policy exactly as tested."""
    return torch.cat([t.detach().reshape(-1).float() for t in actor.state_dict().values()]).cpu().numpy()


def build(config, env_info: EnvInfo, weights_handle, stats_handle, started_at: float, child,
          first_index: int = 0) -> Evaluator:
    """``spreeze-evaluator`` in its process; results (with the tested weights) go to the supervisor as messages."""
    weights = child.keep(SharedWeights.attach(weights_handle))
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    return Evaluator(config, env_info, weights, stats, started_at, first_index)


def loop(evaluator: Evaluator, child) -> None:
    """A test every ``--eval-interval-s``; between tests, keep up with the newest policy."""
    while not child.should_stop():
        begun = time.monotonic()
        result = evaluator.evaluate(child.should_stop)
        if result is None:
            break
        child.send(Evaluation(result))
        while time.monotonic() - begun < evaluator.config.eval_interval_s and not child.should_stop():
            evaluator.policy_version = evaluator.weights.pull(evaluator.actor, evaluator.policy_version)
            time.sleep(0.05)
