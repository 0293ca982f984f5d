"""Sampler process: steps its envs with the latest actor and writes experience straight into the replay.

Each sampler holds ``envs_per_sampler`` envs and picks their actions in one batched forward pass
(rlpyt's trick). Transitions are staged per env and written as a block under that env's region lock
(a locked block write costs far less than one env step: docs/pitfalls.md). Exploration:
SAC samples its Gaussian policy; TD3 adds Gaussian noise with one sigma per env spread over
[noise_min, noise_max] (PQL's mixed exploration), interleaved so that active samplers cover the range.
"""
from __future__ import annotations

import collections
import sys
import time

import numpy as np
import torch

from spreeze.algos import make_actor
from spreeze.pace import learner_allowance
from spreeze.envs import ActionScaler, EnvInfo, make_env
from spreeze.replay import SharedReplay
from spreeze.transport import QueueReplay, attach_replay
from spreeze.messages import GaveUp
from spreeze.stats import SharedStats
from spreeze.weights import SharedWeights


MAX_CONSECUTIVE_FAULTS = 5


class SamplerGaveUp(RuntimeError):
    """The env keeps failing; this sampler stops instead of feeding bad data to training."""


def env_seed(config, env_index: int, incarnation: int = 0) -> int:
    """Seed of env ``env_index``'s streams. ``incarnation`` counts the sampler's restarts and the run's
    resumes: a replacement draws new random numbers instead of writing the same warm-up transitions again."""
    base = config.seed * 100_003 + 1_000 * (env_index + 1)
    if incarnation == 0:
        return base
    return int(np.random.SeedSequence([base, incarnation]).generate_state(1)[0] % (2**31 - 1))


def make_envs(config, env_indices: list[int], incarnation: int = 0) -> tuple[list, np.ndarray]:
    """Build the envs of these global indices in this process, each with its fixed seed; stacked first obs."""
    envs, first_obs = [], []
    for e in env_indices:
        env, obs = make_env(config, env_seed(config, e, incarnation))
        envs.append(env)
        first_obs.append(finite_first_obs(obs))
    return envs, np.stack(first_obs).astype(np.float32)


def finite_first_obs(obs):
    """``obs``, an episode's first; a non-finite one raises: it would be the next row's obs, which no check sees."""
    if not np.all(np.isfinite(obs)):
        raise ValueError("reset returned a non-finite observation")
    return obs


def spread_order(n: int) -> np.ndarray:
    """0..n-1 in farthest-point order: both ends first, then always the point farthest from those taken
    (ties to the lower), so that every prefix of the order is spread over the whole range."""
    if n <= 2:
        return np.arange(n)
    order, distance = [0, n - 1], np.minimum(np.arange(n), n - 1 - np.arange(n))
    while len(order) < n:
        pick = int(np.argmax(distance))
        order.append(pick)
        distance = np.minimum(distance, np.abs(np.arange(n) - pick))
    return np.array(order)


def mixed_noise_sigmas(config, total_envs: int) -> np.ndarray:
    """PQL mixed exploration: the N envs together get sigmas ``linspace(noise_min, noise_max, N)``.

    Env ``e`` gets the ``e``-th of them in :func:`spread_order`, not the ``e``-th smallest: envs are
    numbered sampler by sampler and the governor pauses the highest-numbered samplers first (spares start
    paused), so any active set, a prefix of the envs, still covers the whole range."""
    if total_envs == 1:
        return np.array([0.5 * (config.noise_min + config.noise_max)], dtype=np.float32)
    values = np.linspace(config.noise_min, config.noise_max, total_envs, dtype=np.float32)
    return values[spread_order(total_envs)]


def ratio_allows_collect(config, env_steps: int, updates: int, slack: int, rows: int | None = None) -> bool:
    """PQL's collect:update control: samplers may lead the learner by ``collect_per_update`` steps per update
    (or by one step per ``replay_ratio`` rows sampled: :func:`spreeze.pace.learner_allowance`)."""
    begins = config.learning_begins_at
    if config.collect_ratio <= 0 or env_steps < begins:
        return True
    return env_steps - begins <= learner_allowance(config, updates, rows) + slack


class Sampler:
    def __init__(self, index: int, config, env_info: EnvInfo, replay: SharedReplay | QueueReplay, weights: SharedWeights,
                 stats: SharedStats, incarnation: int = 0, env_indices: list[int] | None = None,
                 block_rows: int | None = None):
        """Lock-step hooks (``--deterministic``): ``env_indices`` other than this sampler's block, ``block_rows``
        staged per env before a write (a whole round), and per-env random streams with the actor run on a
        batch of one (:meth:`act_one`), so that what an env sees does not depend on who steps it."""
        self.index = index
        self.incarnation = incarnation
        self.config = config
        self.replay = replay
        self.weights = weights
        self.stats = stats
        per = config.envs_per_sampler
        self.env_indices = list(range(index * per, (index + 1) * per)) if env_indices is None else list(env_indices)
        n = len(self.env_indices)
        total_envs = config.total_envs if config.deterministic else per * (stats.n_samplers + stats.n_remote)
        self.envs, self.obs = make_envs(config, self.env_indices, incarnation)
        self.scale = ActionScaler(env_info.action_low, env_info.action_high)
        seeds = [env_seed(config, e, incarnation) for e in self.env_indices]
        if config.deterministic:
            self.rngs = [np.random.default_rng(seed + 17) for seed in seeds]
            self.generators = [torch.Generator().manual_seed(seed + 29) for seed in seeds]
        else:
            self.rng = np.random.default_rng(seeds[0] + 17)
            torch.manual_seed(seeds[0] + 29)
        self.actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
        self.policy_version = -1
        self.sigmas = torch.from_numpy(mixed_noise_sigmas(config, total_envs)[self.env_indices])
        self.on_episode = None  # lock-step: told (env index, return) of every finished episode
        # an episode's end releases up to n_step rows at once, so a block may overrun by n_step - 1
        block = (block_rows or config.write_block) + config.n_step - 1
        self.discounts = config.gamma ** np.arange(config.n_step)
        self.pending: list[collections.deque] = [collections.deque() for _ in range(n)]  # (obs, action, reward)
        self.staged = {
            "obs": np.empty((n, block, env_info.obs_dim), np.float32),
            "actions": np.empty((n, block, env_info.act_dim), np.float32),
            "rewards": np.empty((n, block), np.float32),
            "next_obs": np.empty((n, block, env_info.obs_dim), np.float32),
            "terminated": np.empty((n, block), np.float32),
        }
        self.n_staged = np.zeros(n, dtype=np.int64)       # rows staged per env since the last write
        self.episode_start = np.zeros(n, dtype=np.int64)  # staged row where each env's episode began
        self.consecutive_faults = np.zeros(n, dtype=np.int64)
        self.rebuilds = np.zeros(n, dtype=np.int64)  # never reset: each rebuilt env draws new start states
        self.episode_returns = np.zeros(n)
        self.slack = 2 * block * total_envs

    def actions(self) -> np.ndarray:
        # uniform until the learner starts (after the warm-up and one full batch): not the untrained actor's
        # narrow actions while a batch larger than --learning-starts fills
        if self.stats.total_env_steps() < self.config.learning_begins_at:
            return self.rng.uniform(-1.0, 1.0, size=(len(self.envs), self.scale.low.size)).astype(np.float32)
        self.policy_version = self.weights.pull(self.actor, self.policy_version)
        return self.actor.act(torch.from_numpy(self.obs), deterministic=False, noise_sigma=self.sigmas).numpy()

    def act_one(self, i: int, random: bool) -> np.ndarray:
        """Lock-step: env ``i``'s action from its own streams, its actor run on a batch of one (CPU kernels may
        differ in the last bits between batch sizes: docs/pitfalls.md)."""
        if random:
            return self.rngs[i].uniform(-1.0, 1.0, size=self.scale.low.size).astype(np.float32)
        return self.actor.act(torch.from_numpy(self.obs[i: i + 1]), deterministic=False,
                              noise_sigma=self.sigmas[i: i + 1], generator=self.generators[i])[0].numpy()

    def step(self) -> None:
        """One step of every env; a full staging block is written to the replay."""
        actions = self.actions()
        for i in range(len(self.envs)):
            self.step_env(i, actions[i])
        self.stats.env_steps[self.index] += len(self.envs)
        if self.n_staged.max() >= self.config.write_block:
            self.flush()

    def step_env(self, i: int, action: np.ndarray) -> None:
        """One step of env ``i``: its row staged, or on a fault its episode dropped and the env reset."""
        try:
            next_obs, reward, terminated, truncated, _ = self.envs[i].step(self.scale(action))
        except Exception as err:  # a broken env must not take the sampler (or the run) down
            self._env_fault(i, f"step raised {type(err).__name__}: {err}")
            return
        if not (np.all(np.isfinite(next_obs)) and np.isfinite(reward)):
            self._env_fault(i, "non-finite observation or reward")
            return
        self._transition(i, action, reward, next_obs, terminated, truncated)
        self.episode_returns[i] += reward
        if terminated or truncated:
            self.stats.train_returns[self.index] = self.episode_returns[i]
            self.stats.episodes[self.index] += 1
            if self.on_episode is not None:
                self.on_episode(self.env_indices[i], self.episode_returns[i])
            self.consecutive_faults[i] = 0
            try:  # a reset is the env's code too: one that fails is a fault, as a failing step is
                next_obs = self._reset(i)
            except Exception as err:
                self._env_fault(i, f"reset failed ({type(err).__name__}: {err})")
                return
        self.obs[i] = next_obs

    def _transition(self, i: int, action, reward: float, next_obs, terminated: bool, truncated: bool) -> None:
        """Stage the transitions this step completes: n-step returns (``--n-step``) with the window ending at
        ``next_obs``. At a termination every pending start is staged with the rest of its return and no
        bootstrap; at a time-limit truncation the starts whose window is shorter than n are dropped, so every
        bootstrapped row discounts by exactly gamma**n (a handful of rows per episode)."""
        pending = self.pending[i]
        pending.append((self.obs[i].copy(), action, reward))
        if len(pending) == self.config.n_step:
            self._stage(i, pending, next_obs, terminated)
            pending.popleft()
        if terminated:
            while pending:
                self._stage(i, pending, next_obs, True)
                pending.popleft()
        elif truncated:
            pending.clear()

    def _stage(self, i: int, window, next_obs, terminated: bool) -> None:
        """One row: the window's first observation and action, its discounted rewards, where it ends.
        Only `terminated` is stored: a time-limit truncation is bootstrapped through (docs/pitfalls.md)."""
        obs, action, _ = window[0]
        slot, staged = self.n_staged[i], self.staged
        staged["obs"][i, slot] = obs
        staged["actions"][i, slot] = action
        if len(window) == 1:
            staged["rewards"][i, slot] = window[0][2]
        else:
            staged["rewards"][i, slot] = float(np.dot(self.discounts[:len(window)], [step[2] for step in window]))
        staged["next_obs"][i, slot] = next_obs
        staged["terminated"][i, slot] = float(terminated)
        self.n_staged[i] += 1

    def _reset(self, i: int) -> np.ndarray:
        """Env ``i``'s next episode's first obs; a non-finite one raises (:func:`finite_first_obs`)."""
        self.episode_returns[i] = 0.0
        self.episode_start[i] = self.n_staged[i]
        obs, _ = self.envs[i].reset()
        return finite_first_obs(obs)

    def _env_fault(self, i: int, why: str) -> None:
        """Drop the env's current episode (its rows not yet written), reset or rebuild the env, count it;
        after ``MAX_CONSECUTIVE_FAULTS`` faults with no good episode between them, give up on this sampler. A
        rebuild that fails (its constructor raises, its first obs is not finite) is one more fault in a row."""
        self.n_staged[i] = self.episode_start[i]
        self.pending[i].clear()
        self.stats.dropped_episodes[self.index] += 1
        self._count_fault(i, why)
        try:
            self.obs[i] = self._reset(i)
            return
        except Exception:
            pass
        while True:
            try:
                self.envs[i].close()
            except Exception:
                pass
            self.rebuilds[i] += 1
            seed = env_seed(self.config, self.env_indices[i], self.incarnation) + 7919 * int(self.rebuilds[i])
            try:
                self.envs[i], obs = make_env(self.config, seed)
                self.obs[i] = finite_first_obs(obs)
                break
            except Exception as err:
                self._count_fault(i, f"rebuilding it: {err}")
        self.episode_returns[i] = 0.0
        self.episode_start[i] = self.n_staged[i]

    def _count_fault(self, i: int, why: str) -> None:
        self.consecutive_faults[i] += 1
        if self.consecutive_faults[i] >= MAX_CONSECUTIVE_FAULTS:
            raise SamplerGaveUp(f"env {self.env_indices[i]} of {self.config.env_id} failed "
                                f"{self.consecutive_faults[i]} times in a row (last: {why})")

    def flush(self) -> None:
        for i, region in enumerate(self.env_indices):
            n, s = int(self.n_staged[i]), self.staged
            # counted as written before the write: a Ctrl-C rises out of a whole write (at its lock's release),
            # and --serial's clean-up flushes again, which must not write that block twice
            self.n_staged[i] = 0
            self.episode_start[i] = 0
            self.replay.write(region, s["obs"][i, :n], s["actions"][i, :n], s["rewards"][i, :n],
                              s["next_obs"][i, :n], s["terminated"][i, :n])

    def may_collect(self) -> bool:
        # an under-filled replay (a resumed run starts empty) blocks the learner, so never wait for it then;
        # the ratio check comes first: it is the cheap one and decides almost every step
        return (ratio_allows_collect(self.config, self.stats.total_env_steps(), self.stats.updates(), self.slack,
                                     self.stats.sampled_rows())
                or self.replay.size() < self.config.learning_begins_at)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def build(index: int, config, env_info: EnvInfo, replay_handle, weights_handle, stats_handle, child,
          incarnation: int = 0) -> Sampler:
    """``spreeze-sampler-<index>`` in its process (``incarnation``: restarts and resumes so far)."""
    replay = child.keep(attach_replay(replay_handle, child.stop_event))
    weights = child.keep(SharedWeights.attach(weights_handle))
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    return Sampler(index, config, env_info, replay, weights, stats, incarnation)


def loop(sampler: Sampler, child) -> None:
    """Collect while the ratio allows and the governor has not paused us; flush what is staged on the way out."""
    stats, index = sampler.stats, sampler.index
    try:
        while not child.should_stop():
            if stats.paused[index]:
                if sampler.n_staged.any():
                    sampler.flush()
                time.sleep(0.05)
                continue
            if sampler.may_collect():
                sampler.step()
                continue
            if sampler.n_staged.any():
                sampler.flush()
            waited = time.perf_counter()
            time.sleep(0.001)
            stats.sampler_wait_s[index] += time.perf_counter() - waited
        sampler.flush()
    except SamplerGaveUp as err:
        child.send(GaveUp(child.role.source, str(err)))
        print(f"[spreeze] {child.role.name} stopped: {err}", file=sys.stderr, flush=True)
        sys.exit(3)
