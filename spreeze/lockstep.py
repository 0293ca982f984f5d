"""Reproducible mode (``--deterministic``): collection and learning in lock-step rounds.

Hardware should change the speed, not the learning curve. Free-running samplers and learner interleave as the
machine allows, so the data an update sees and the policy a step uses depend on timing (Cleanba, section 3).
Here nothing does:

* The number of environments is a setting of its own (``--num-envs``), not a product of the sampler processes
  (Cleanba, section 4.1). Env ``e`` has a fixed seed, its own numpy generator (warm-up actions) and torch
  generator (exploration noise), runs its actor on a batch of one, and its ``n``-th transition lands in replay
  region ``e`` at ring slot ``n % capacity``, whichever process stepped it. The batch of one matters: CPU
  kernels may give outputs differing in the last bits for batches of different sizes, so a forward pass shared
  by "the envs of this sampler" would tie the curve to the sampler count (docs/pitfalls.md). It costs one
  small forward pass per env step.
* Round ``k``: every env steps ``--steps-per-round`` times with policy ``pi_k`` while the learner trains on the
  data of rounds ``<= k-1`` and produces ``pi_{k+1}``: a policy lag of exactly one round (HTS-RL's two
  storages, section 4.1; Cleanba's "second latest policy", section 4.2). Both sides wait
  for each other at the end of a round, so the slower one sets the pace.
* Two weight slots: the learner writes ``pi_{k+1}`` into slot ``(k+1) % 2`` while a sampler that starts round
  ``k`` late still finds ``pi_k`` in slot ``k % 2``; each read checks the version it expects.
* The learner samples, with its own seeded generator, from a window of each region that round ``k``'s writes
  cannot reach: the newest ``min(k * steps_per_round, capacity - steps_per_round)`` entries (one round of every
  ring is kept free for the round being written). No lock and no timing decide what it reads.
* Updates per round follow from the collect:update ratio alone; test evaluations run at fixed env-step points
  with the policy of that round on their own seeded env (``evaluations.csv``), and every round appends one
  timing-free row to ``rounds.csv``.

With one learner thread and ``torch.use_deterministic_algorithms`` a CPU run is a function of its config: 1, 2
or 4 samplers give byte-identical ``rounds.csv`` files and the same test returns. On a GPU, runs match only as
far as CUDA's kernels are deterministic: the learner asks for deterministic kernels (``CUBLAS_WORKSPACE_CONFIG``
is set), an op without one only warns, and results differ between GPU models, software versions and from CPU
runs.

``--serial --deterministic`` runs the same rounds in this one process: the reference the processes must match.
"""
from __future__ import annotations

import math
import os
import queue
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from spreeze import stats as S
from spreeze.algos import make_actor
from spreeze.envs import ActionScaler, EnvInfo, make_env
from spreeze.evaluator import eval_episode_seed
from spreeze.learner import Learner, NonFiniteLoss
from spreeze.replay import Batch, SharedReplay
from spreeze.sampler import env_seed, make_envs, mixed_noise_sigmas
from spreeze.shm import ArraySpec, SegmentHandle, SharedArrays
from spreeze.stats import SharedStats
from spreeze.messages import Evaluation, Info
from spreeze.supervisor import ChildFailed, ChildSpec
from spreeze.weights import SharedWeights, load_flat

WAIT_S = 0.1                 # every blocking wait re-checks the stop Event and the parent this often
EVAL_QUEUE_SIZE = 32
FINAL_EVAL_TIMEOUT_S = 120.0

# Slots of the learner's per-round summary in the shared link.
OUT_CRITIC_LOSS, OUT_ACTOR_LOSS, OUT_ALPHA, OUT_UPDATES, OUT_ACTOR_UPDATES = range(5)
_OUT_SLOTS = 5


class RoundProtocolError(RuntimeError):
    """A process found state another round should have left: a bug, never a timing matter."""


def use_deterministic_torch() -> None:
    """Deterministic kernels in this process; CUBLAS needs a fixed workspace, set before CUDA starts, and ops
    lacking a deterministic CUDA kernel warn instead of stopping a long run (docs/pitfalls.md)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass(frozen=True)
class RoundPlan:
    """What every process derives from the config alone: who steps which env, what it acts with, how many
    updates each round runs and where the learner may read."""
    num_envs: int
    samplers: int
    steps_per_round: int
    region_capacity: int
    learning_starts: int
    learning_begins_at: int
    collect_ratio: float
    eval_every_steps: int

    @classmethod
    def from_config(cls, config, region_capacity: int) -> "RoundPlan":
        num_envs = config.total_envs
        plan = cls(num_envs=num_envs, samplers=max(1, min(config.samplers, num_envs)),
                   steps_per_round=config.steps_per_round, region_capacity=region_capacity,
                   learning_starts=config.learning_starts, learning_begins_at=config.learning_begins_at,
                   collect_ratio=config.collect_ratio, eval_every_steps=config.eval_every_steps)
        if region_capacity < 2 * plan.steps_per_round:
            raise ValueError(f"replay regions of {region_capacity} slots cannot hold two rounds of "
                             f"{plan.steps_per_round} steps; raise --buffer-size or lower --steps-per-round")
        return plan

    @property
    def round_env_steps(self) -> int:
        return self.num_envs * self.steps_per_round

    def env_steps_after(self, k: int) -> int:
        return (k + 1) * self.round_env_steps

    def sampler_envs(self, index: int) -> list[int]:
        """Contiguous blocks of envs per sampler process; what an env sees does not depend on the block."""
        return [int(e) for e in np.array_split(np.arange(self.num_envs), self.samplers)[index]]

    def random_actions(self, k: int, t: int) -> bool:
        """Warm-up: uniform actions while fewer than ``learning_starts`` env steps came before this step."""
        return (k * self.steps_per_round + t) * self.num_envs < self.learning_starts

    def updates_after(self, k: int) -> int:
        """Critic updates done once learner round ``k`` ends: none until the data it may read (rounds < k) reach
        ``learning_begins_at``, then one per ``collect_ratio`` env steps collected beyond that point."""
        if k * self.round_env_steps < self.learning_begins_at:
            return 0
        return int((self.env_steps_after(k) - self.learning_begins_at) // self.collect_ratio)

    def window(self, k: int) -> tuple[int, int]:
        """Entries ``[first, end)`` of every region (counted since the start) that learner round ``k`` samples."""
        end = k * self.steps_per_round
        return end - min(end, self.region_capacity - self.steps_per_round), end

    def eval_due(self, k: int) -> bool:
        """A test evaluation after round ``k``: each time the env steps pass a multiple of ``eval_every_steps``."""
        after = self.env_steps_after(k)
        return after // self.eval_every_steps > (after - self.round_env_steps) // self.eval_every_steps


def sample_window(replay: SharedReplay, plan: RoundPlan, k: int, batch_size: int, rng: np.random.Generator) -> Batch:
    """A uniform batch from learner round ``k``'s window, lock-free: no sampler writes there during round ``k``."""
    first, end = plan.window(k)
    per_region = end - first
    picks = rng.integers(0, plan.num_envs * per_region, size=batch_size)
    slots = (picks // per_region) * replay.region_capacity + (first + picks % per_region) % replay.region_capacity
    return Batch(replay.obs[slots], replay.actions[slots], replay.rewards[slots], replay.next_obs[slots],
                 replay.terminated[slots])


@dataclass(frozen=True)
class LinkHandle:
    segment: SegmentHandle
    start: tuple   # one semaphore per worker (samplers, then the learner): released once per round
    done: object   # released by each worker when it finished its part of the round


class RoundLink:
    """The round protocol's shared state: the open round, per-env episode returns, the learner's round summary."""

    def __init__(self, arrays: SharedArrays, start: tuple, done):
        self._arrays = arrays
        self.start = start
        self.done = done
        self.round = arrays["round"]
        self.learner_out = arrays["learner_out"]
        self.env_returns = arrays["env_returns"]    # per env: return of its last finished episode
        self.env_episodes = arrays["env_episodes"]  # per env: episodes finished

    @classmethod
    def create(cls, num_envs: int, n_workers: int, ctx) -> "RoundLink":
        specs = (ArraySpec("round", (1,), "int64", -1), ArraySpec("learner_out", (_OUT_SLOTS,), "float64", 0.0),
                 ArraySpec("env_returns", (num_envs,), "float64", float("nan")),
                 ArraySpec("env_episodes", (num_envs,), "int64", 0))
        return cls(SharedArrays.create(specs, tag="lockstep"), tuple(ctx.Semaphore(0) for _ in range(n_workers)),
                   ctx.Semaphore(0))

    @classmethod
    def attach(cls, handle: LinkHandle) -> "RoundLink":
        return cls(SharedArrays.attach(handle.segment), handle.start, handle.done)

    @property
    def handle(self) -> LinkHandle:
        return LinkHandle(self._arrays.handle, self.start, self.done)

    def wait_for_round(self, worker: int, should_stop) -> int | None:
        """The round the coordinator opened for ``worker``, or None once the run stops."""
        while not should_stop():
            if self.start[worker].acquire(timeout=WAIT_S):
                return int(self.round[0])
        return None

    def close(self) -> None:
        self.round = self.learner_out = self.env_returns = self.env_episodes = None
        self._arrays.close()


class RoundSampler:
    """Steps a fixed set of envs through whole rounds and writes each env's round into its own region."""

    def __init__(self, index: int, config, env_info: EnvInfo, plan: RoundPlan, replay: SharedReplay,
                 slots: tuple[SharedWeights, SharedWeights], stats: SharedStats, link: RoundLink,
                 env_indices: list[int] | None = None):
        self.index = index
        self.plan = plan
        self.replay = replay
        self.slots = slots
        self.stats = stats
        self.link = link
        self.env_indices = plan.sampler_envs(index) if env_indices is None else env_indices
        self.envs, self.obs = make_envs(config, self.env_indices)
        self.act_dim = env_info.act_dim
        self.scale = ActionScaler(env_info.action_low, env_info.action_high)
        self.rngs = [np.random.default_rng(env_seed(config, e) + 17) for e in self.env_indices]
        self.generators = [torch.Generator().manual_seed(env_seed(config, e) + 29) for e in self.env_indices]
        sigmas = mixed_noise_sigmas(config, plan.num_envs)
        self.sigmas = [torch.tensor([float(sigmas[e])]) for e in self.env_indices]
        self.actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
        n, steps = len(self.envs), plan.steps_per_round
        self.staged = {"obs": np.empty((n, steps, env_info.obs_dim), np.float32),
                       "actions": np.empty((n, steps, env_info.act_dim), np.float32),
                       "rewards": np.empty((n, steps), np.float32),
                       "next_obs": np.empty((n, steps, env_info.obs_dim), np.float32),
                       "terminated": np.empty((n, steps), np.float32)}
        self.episode_returns = np.zeros(n)

    def collect_round(self, k: int) -> None:
        flat, version = self.slots[k % 2].read()
        if version != k:
            raise RoundProtocolError(f"round {k} found policy version {version} in weight slot {k % 2}")
        load_flat(self.actor, flat)
        for i in range(len(self.envs)):  # envs are independent: each runs its whole round in turn
            self._run_env(i, k)
        for i, region in enumerate(self.env_indices):
            s = self.staged
            self.replay.write(region, s["obs"][i], s["actions"][i], s["rewards"][i], s["next_obs"][i],
                              s["terminated"][i])
        self.stats.env_steps[self.index] += len(self.envs) * self.plan.steps_per_round

    def _run_env(self, i: int, k: int) -> None:
        env, e, staged = self.envs[i], self.env_indices[i], self.staged
        for t in range(self.plan.steps_per_round):
            if self.plan.random_actions(k, t):
                action = self.rngs[i].uniform(-1.0, 1.0, size=self.act_dim).astype(np.float32)
            else:
                action = self.actor.act(torch.from_numpy(self.obs[i: i + 1]), deterministic=False,
                                        noise_sigma=self.sigmas[i], generator=self.generators[i])[0].numpy()
            next_obs, reward, terminated, truncated, _ = env.step(self.scale(action))
            staged["obs"][i, t] = self.obs[i]
            staged["actions"][i, t] = action
            staged["rewards"][i, t] = reward
            staged["next_obs"][i, t] = next_obs
            # store `terminated` only: a time-limit truncation is bootstrapped through (docs/pitfalls.md)
            staged["terminated"][i, t] = float(terminated)
            self.episode_returns[i] += reward
            if terminated or truncated:
                self.link.env_returns[e] = self.episode_returns[i]
                self.link.env_episodes[e] += 1
                self.stats.train_returns[self.index] = self.episode_returns[i]
                self.stats.episodes[self.index] += 1
                self.episode_returns[i] = 0.0
                next_obs, _ = env.reset()
            self.obs[i] = next_obs

    def close(self) -> None:
        for env in self.envs:
            env.close()


class RoundLearner:
    """The learner's side of a round: the plan's number of updates on its window, then ``pi_{k+1}`` published."""

    def __init__(self, config, env_info: EnvInfo, plan: RoundPlan, replay: SharedReplay,
                 slots: tuple[SharedWeights, SharedWeights], stats: SharedStats, link: RoundLink, run_dir: Path,
                 started_at: float):
        self.plan = plan
        self.slots = slots
        self.stats = stats
        self.link = link
        # the free-running Learner seeds torch and its batch generator from the config and owns checkpoints
        self.learner = Learner(config, env_info, replay, slots[0], stats, run_dir, started_at, prefetch=False)
        self.algo = self.learner.algo

    def train_round(self, k: int) -> None:
        algo, learner = self.algo, self.learner
        target = self.plan.updates_after(k)
        critic_sum = actor_sum = None
        n = 0
        fetch_s = update_s = 0.0
        while algo.updates < target:
            begun = time.perf_counter()
            batch = algo.batch(sample_window(learner.replay, self.plan, k, learner.batch_size, learner.rng))
            fetched = time.perf_counter()
            losses = algo.update(batch)
            update_s += time.perf_counter() - fetched
            fetch_s += fetched - begun
            critic_sum = losses["critic_loss"] if critic_sum is None else critic_sum + losses["critic_loss"]
            actor_sum = losses["actor_loss"] if actor_sum is None else actor_sum + losses["actor_loss"]
            alpha = losses.get("alpha")
            n += 1
        out = self.link.learner_out
        if n:
            # one host sync per round, not per update (a GPU learner keeps queueing kernels)
            out[OUT_CRITIC_LOSS] = float(critic_sum) / n
            out[OUT_ACTOR_LOSS] = float(actor_sum) / n
            out[OUT_ALPHA] = float(alpha) if alpha is not None else math.nan
            if not (math.isfinite(out[OUT_CRITIC_LOSS]) and math.isfinite(out[OUT_ACTOR_LOSS])
                    and algo.parameters_finite()):
                raise NonFiniteLoss(f"non-finite loss or weights in round {k} (update {algo.updates})")
        else:
            out[[OUT_CRITIC_LOSS, OUT_ACTOR_LOSS, OUT_ALPHA]] = math.nan
        out[OUT_UPDATES] = algo.updates
        out[OUT_ACTOR_UPDATES] = algo.actor_updates
        self.slots[(k + 1) % 2].publish(algo.actor, k + 1)
        learner.policy_version = k + 1
        s = self.stats.learner
        s[S.FETCH_SECONDS] += fetch_s
        s[S.UPDATE_SECONDS] += update_s
        s[S.UPDATES] = algo.updates
        s[S.ACTOR_UPDATES] = algo.actor_updates
        s[S.POLICY_VERSION] = k + 1
        s[S.CRITIC_LOSS], s[S.ACTOR_LOSS], s[S.ALPHA] = out[OUT_CRITIC_LOSS], out[OUT_ACTOR_LOSS], out[OUT_ALPHA]

    def close(self) -> None:
        self.learner.close()


class RoundEvaluator:
    """Whole deterministic episodes of a given policy; episode ``j`` of evaluation ``i`` has its own env seed,
    so a result depends on the weights and the evaluation's index only."""

    def __init__(self, config, env_info: EnvInfo, started_at: float):
        self.config = config
        self.started_at = started_at
        self.env, _ = make_env(config, eval_episode_seed(config.seed, 0, 0))
        self.scale = ActionScaler(env_info.action_low, env_info.action_high)
        self.actor = make_actor(config, env_info.obs_dim, env_info.act_dim)

    def evaluate(self, request: dict, should_stop=lambda: False) -> dict | None:
        load_flat(self.actor, request["flat"])
        returns, lengths = [], []
        for episode in range(self.config.eval_episodes):
            obs, _ = self.env.reset(seed=eval_episode_seed(self.config.seed, request["index"], episode))
            total, length, done = 0.0, 0, False
            while not done:
                if should_stop():
                    return None
                action = self.actor.act(torch.from_numpy(np.asarray(obs, np.float32)), deterministic=True)
                obs, reward, terminated, truncated, _ = self.env.step(self.scale(action.numpy()))
                total += float(reward)
                length += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(length)
        return {"time_s": time.time() - self.started_at, "env_steps": request["env_steps"],
                "updates": request["updates"], "policy_version": request["policy_version"],
                "test_return": float(np.mean(returns)), "test_return_std": float(np.std(returns)),
                "episode_length": float(np.mean(lengths)), "actor_flat": request["flat"]}

    def close(self) -> None:
        self.env.close()


# ----- the children's builds and loops (child_main runs them) ---------------------------------------------
def _attach(child, replay_handle, slot_handles, stats_handle, link_handle):
    child.stats = SharedStats.attach(stats_handle)
    return (child.keep(SharedReplay.attach(replay_handle)),
            tuple(child.keep(SharedWeights.attach(h)) for h in slot_handles), child.keep(child.stats),
            child.keep(RoundLink.attach(link_handle)))


def build_sampler(index: int, config, env_info: EnvInfo, plan: RoundPlan, replay_handle, slot_handles, stats_handle,
                  link_handle, child) -> "RoundSampler":
    """``spreeze-sampler-<index>`` in lock-step mode (worker ``index``)."""
    use_deterministic_torch()
    replay, slots, stats, link = _attach(child, replay_handle, slot_handles, stats_handle, link_handle)
    return RoundSampler(index, config, env_info, plan, replay, slots, stats, link)


def sampler_loop(sampler: "RoundSampler", child) -> None:
    while (k := sampler.link.wait_for_round(sampler.index, child.should_stop)) is not None:
        sampler.collect_round(k)
        sampler.link.done.release()


def build_learner(config, env_info: EnvInfo, plan: RoundPlan, replay_handle, slot_handles, stats_handle, link_handle,
                  run_dir: str, started_at: float, child) -> "RoundLearner":
    """``spreeze-learner`` in lock-step mode (the worker after the samplers), one torch thread whatever
    ``--learner-threads`` says: another split of a sum over threads changes the last bits of an update."""
    use_deterministic_torch()
    replay, slots, stats, link = _attach(child, replay_handle, slot_handles, stats_handle, link_handle)
    return RoundLearner(config, env_info, plan, replay, slots, stats, link, Path(run_dir), started_at)


def learner_loop(learner: "RoundLearner", child) -> None:
    try:
        while (k := learner.link.wait_for_round(learner.plan.samplers, child.should_stop)) is not None:
            learner.train_round(k)
            learner.link.done.release()
            learner.learner.maybe_checkpoint(child.messages)  # while the others already run the next round
        if not child.parent.gone() and learner.learner.finish(child.messages):
            child.send(Info("learner", f"final checkpoint written after {learner.algo.updates} updates"))
    finally:
        learner.stats.learner[S.LEARNER_DONE] = 1


def build_evaluator(config, env_info: EnvInfo, requests, started_at: float, child) -> "RoundEvaluator":
    """``spreeze-evaluator`` in lock-step mode: evaluates the policies it is sent, in order, until it gets None."""
    evaluator = RoundEvaluator(config, env_info, started_at)
    evaluator.requests = requests
    return evaluator


def evaluator_loop(evaluator: "RoundEvaluator", child) -> None:
    while not child.should_stop():
        try:
            request = evaluator.requests.get(timeout=WAIT_S)
        except queue.Empty:
            continue
        if request is None:
            break
        result = evaluator.evaluate(request, child.should_stop)
        if result is None:
            break
        child.send(Evaluation(result))


# ----- the coordinator (in the supervisor's process) ---------------------------------------------------------
class _InProcessRounds:
    """``--serial``: sampler, learner and evaluator objects in this process, one after the other."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink):
        sup, c = run.sup, run.config
        self.run = run
        self.sampler = self.learner = self.evaluator = None
        try:
            self.sampler = RoundSampler(0, c, sup.env_info, plan, sup.replay, slots, sup.stats, link,
                                        env_indices=list(range(plan.num_envs)))
            self.evaluator = RoundEvaluator(c, sup.env_info, sup.started_at)
            # last: the learner seeds torch's global generator, which its updates draw from and which
            # building any other network here would advance
            self.learner = RoundLearner(c, sup.env_info, plan, sup.replay, slots, sup.stats, link, sup.run_dir,
                                        sup.started_at)
        except BaseException:
            self.close()
            raise

    def run_round(self, k: int, idle=None) -> None:
        self.sampler.collect_round(k)
        self.learner.train_round(k)

    def evaluate(self, request: dict) -> None:
        self.run.evaluated(self.evaluator.evaluate(request))

    def finish(self) -> None:
        self.learner.learner.finish()

    def close(self) -> None:
        for part in (self.sampler, self.evaluator):
            if part is not None:
                part.close()
        self.sampler = self.learner = self.evaluator = None


class _ProcessRounds:
    """Sampler, learner and evaluator processes driven through the round link."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink):
        sup, c = run.sup, run.config
        self.sup = sup
        self.plan = plan
        self.link = link
        self.requests = sup.ctx.Queue(maxsize=EVAL_QUEUE_SIZE)
        common = (sup.replay.handle, tuple(s.handle for s in slots), sup.stats.handle, link.handle)
        specs = {f"spreeze-sampler-{i}": ChildSpec(partial(build_sampler, i, c, sup.env_info, plan, *common),
                                                   sampler_loop, fatal=True)
                 for i in range(plan.samplers)}
        specs["spreeze-learner"] = ChildSpec(partial(build_learner, c, sup.env_info, plan, *common, str(sup.run_dir),
                                                     sup.started_at), learner_loop, fatal=True)
        specs["spreeze-evaluator"] = ChildSpec(partial(build_evaluator, c, sup.env_info, self.requests, sup.started_at),
                                               evaluator_loop)
        sup.start(specs)
        self.workers = plan.samplers + 1

    def check(self) -> None:
        """Any child that ended during the rounds ends the run: a restarted one could not rejoin a round."""
        self.sup.drain_messages()
        for name, process in self.sup.processes.items():
            if process.exitcode is not None:
                detail = f" ({self.sup.error})" if self.sup.error else ""
                raise ChildFailed(f"{name} exited with code {process.exitcode} during lock-step rounds{detail}")
        if self.sup.error:
            raise ChildFailed(self.sup.error)

    def run_round(self, k: int, idle=lambda: None) -> None:
        self.link.round[0] = k
        for start in self.link.start:
            start.release()
        for _ in range(self.workers):
            while not self.link.done.acquire(timeout=WAIT_S):
                self.check()
                idle()

    def evaluate(self, request: dict) -> None:
        while True:
            try:
                self.requests.put(request, timeout=WAIT_S)
                return
            except queue.Full:
                self.check()

    def finish(self) -> None:
        """Let the evaluator finish the evaluations already requested; the learner writes its final checkpoint
        when the supervisor sets the stop Event."""
        evaluator = self.sup.processes["spreeze-evaluator"]
        self.evaluate(None)
        deadline = time.monotonic() + FINAL_EVAL_TIMEOUT_S
        while evaluator.is_alive() and time.monotonic() < deadline:
            self.sup.drain_messages()
            evaluator.join(timeout=WAIT_S)
        self.sup.drain_messages()
        if evaluator.is_alive():
            self.sup.log(f"[spreeze] the evaluator did not finish its evaluations in {FINAL_EVAL_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        self.sup.stop_children()
        self.requests.cancel_join_thread()  # the evaluator is gone: requests it never read may be dropped
        self.requests.close()


def run_lockstep(run) -> None:
    """Drive lock-step rounds until the budget is reached (the ``--deterministic`` schedule of ``runners.train``).

    The coordinator opens round ``k`` for every worker, waits until all are done, then acts at the boundary,
    where every count is exact: a ``rounds.csv`` row, a test evaluation when due (policy ``pi_{k+1}``), the
    budget check. ``metrics.csv`` keeps its wall-clock rows for throughput.
    """
    sup, c = run.sup, run.config
    plan = RoundPlan.from_config(c, sup.replay.region_capacity)
    threads, was_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    slot1 = link = rounds = None
    try:
        if c.serial:  # this process is the learner: the same settings as the learner process
            torch.set_num_threads(1)
            use_deterministic_torch()
        # slot 0 is the supervisor's weights, version 0: the learner's initial actor (same seed)
        slot1 = SharedWeights.create(make_actor(c, sup.env_info.obs_dim, sup.env_info.act_dim), sup.ctx)
        slots = (sup.weights, slot1)
        link = RoundLink.create(plan.num_envs, plan.samplers + 1, sup.ctx)
        sup.log(f"[spreeze] deterministic: {plan.num_envs} env(s) over {1 if c.serial else plan.samplers} sampler "
                f"process(es), rounds of {plan.steps_per_round} steps per env ({plan.round_env_steps} env steps), "
                f"collect:update {plan.collect_ratio:g}, policy lag one round")
        rounds = (_InProcessRounds if c.serial else _ProcessRounds)(run, plan, slots, link)
        run.runlog.open_rounds()
        run.start_log_clock()
        try:
            _drive(run, plan, slots, link, rounds)
        except KeyboardInterrupt:
            if c.serial:  # the learner process writes its final checkpoint on the stop Event; here it is us
                rounds.finish()
            raise
    finally:
        if rounds is not None:
            rounds.close()
        run.runlog.close()
        for shared in (slot1, link):
            if shared is not None:
                shared.close()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)


def _drive(run, plan: RoundPlan, slots, link: RoundLink, rounds) -> None:
    evaluations = 0

    def request_eval(version: int, env_steps: int, updates: int) -> None:
        nonlocal evaluations
        flat, found = slots[version % 2].read()
        if found != version:
            raise RoundProtocolError(f"expected policy version {version} in weight slot {version % 2}, found {found}")
        rounds.evaluate({"index": evaluations, "flat": flat, "policy_version": version, "env_steps": env_steps,
                         "updates": updates})
        evaluations += 1

    def idle() -> None:
        run.poll()
        if run.metrics_due():
            run.metrics()

    request_eval(0, 0, 0)
    k = 0
    while True:
        rounds.run_round(k, idle)
        env_steps = plan.env_steps_after(k)
        if run.sup.stats.total_env_steps() != env_steps:
            raise RoundProtocolError(f"round {k} ended at {run.sup.stats.total_env_steps()} env steps, not {env_steps}")
        out = link.learner_out
        returns = link.env_returns
        run.runlog.write_round({"round": k, "env_steps": env_steps, "updates": int(out[OUT_UPDATES]),
                                "actor_updates": int(out[OUT_ACTOR_UPDATES]), "policy_version": k + 1,
                                "critic_loss": float(out[OUT_CRITIC_LOSS]), "actor_loss": float(out[OUT_ACTOR_LOSS]),
                                "alpha": float(out[OUT_ALPHA]),
                                "train_return": float(np.nanmean(returns)) if np.isfinite(returns).any() else math.nan,
                                "episodes": int(link.env_episodes.sum())})
        reason = run.budget_reached()
        if plan.eval_due(k) or reason:
            request_eval(k + 1, env_steps, int(out[OUT_UPDATES]))
        idle()
        if reason:
            run.sup.log(f"[spreeze] {reason}")
            break
        k += 1
    rounds.finish()
    run.metrics(progress=False)
