"""Reproducible mode (``--deterministic``): the same Sampler, Learner and Evaluator, driven in lock-step rounds
(:mod:`spreeze.rounds`). Nothing depends on timing: env ``e`` has its own seeds and streams and runs its actor on
a batch of one; updates per round follow from the collect:update ratio; tests run at fixed env-step points from
fixed seeds; each round appends a timing-free row to ``rounds.csv``. ``--serial`` runs the same rounds here.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import queue
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from spreeze import evaluator as evaluator_mod
from spreeze import stats as S
from spreeze.algos import make_actor
from spreeze.evaluator import Evaluator
from spreeze.learner import Learner
from spreeze.messages import Evaluation, Info
from spreeze.replay import SharedReplay
from spreeze.rounds import WAIT_S, RoundLink, RoundPlan, RoundProtocolError, use_deterministic_torch
from spreeze.sampler import Sampler
from spreeze.stats import SharedStats
from spreeze.supervisor import ChildFailed, ChildSpec
from spreeze.weights import SharedWeights

EVAL_QUEUE_SIZE = 32
FINAL_EVAL_TIMEOUT_S = 120.0


# ----- a round, as each worker plays it -------------------------------------------------------------------------
def collect_round(sampler: Sampler, plan: RoundPlan, slots, k: int) -> None:
    """Every env of ``sampler`` in turn (they are independent) stages a round of rows with ``pi_k``; a step lost
    to an env fault is stepped again, so each region gets exactly one round; then one write per region."""
    sampler.policy_version = slots[k % 2].pull(sampler.actor, sampler.policy_version)
    if sampler.policy_version != k:
        raise RoundProtocolError(f"round {k} found policy version {sampler.policy_version} in weight slot {k % 2}")
    for i in range(len(sampler.envs)):
        t = 0
        while sampler.n_staged[i] < plan.steps_per_round:
            sampler.step_env(i, sampler.act_one(i, plan.random_actions(k, t)))
            t += 1
    sampler.flush()
    sampler.stats.env_steps[sampler.index] += len(sampler.envs) * plan.steps_per_round


def train_round(learner: Learner, plan: RoundPlan, slots, k: int) -> None:
    """The plan's updates on round ``k``'s window, then ``pi_{k+1}`` published into the other slot, after the
    learner's finiteness check; the round's mean losses (NaN without updates) stay in the shared stats, where its
    ``rounds.csv`` row reads them."""
    learner.schedule_learning_rates(k * plan.round_env_steps)  # the rows collected before this round, no clock
    learner.last_losses = learner.train_until(plan.updates_after(k), learner.round_source(plan, k))
    learner.publish(slots[(k + 1) % 2])


def _round_sampler(index, config, env_info, plan, replay, slots, stats, link, env_indices=None) -> Sampler:
    sampler = Sampler(index, config, env_info, replay, slots[0], stats, block_rows=plan.steps_per_round,
                      env_indices=plan.sampler_envs(index) if env_indices is None else env_indices)
    sampler.on_episode = link.record_episode
    return sampler


# ----- the children (the supervisor spawns them; child_main runs them) ------------------------------------------
@dataclass
class _Side:
    """A sampler's or the learner's process: its worker, what it plays in round ``k``, its start semaphore."""
    worker: Sampler | Learner
    play: object
    link: RoundLink
    slot: int

    def close(self) -> None:
        self.worker.close()


def _build(config, env_info, plan: RoundPlan, handles, link: RoundLink, run_dir: str, started_at: float,
           child) -> _Side:
    """A sampler or the learner (one torch thread whatever ``--learner-threads`` says: another split of a sum
    over threads changes the last bits of an update) with the replay and both weight slots."""
    use_deterministic_torch()
    replay_handle, slot_handles, stats_handle = handles
    replay = child.keep(SharedReplay.attach(replay_handle))
    slots = tuple(child.keep(SharedWeights.attach(h)) for h in slot_handles)
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    if child.role.kind == "sampler":
        sampler = _round_sampler(child.role.index, config, env_info, plan, replay, slots, stats, link)
        return _Side(sampler, partial(collect_round, sampler, plan, slots), link, child.role.index)
    learner = Learner(config, env_info, replay, slots[0], stats, Path(run_dir), started_at, prefetch=False)
    return _Side(learner, partial(train_round, learner, plan, slots), link, plan.samplers)


def _round_loop(side: _Side, child) -> None:
    """Every round the coordinator opens; the learner checkpoints while the others already run the next one, and
    writes the final checkpoint at the end (not after its parent died)."""
    learner = side.worker if isinstance(side.worker, Learner) else None
    for k in side.link.rounds(side.slot, child.should_stop):
        side.play(k)
        side.link.done.release()
        if learner is not None:
            learner.maybe_checkpoint(child.messages)
    if learner is not None and not child.parent.gone() and learner.finish(child.messages):
        child.send(Info("learner", f"final checkpoint written after {learner.algo.updates} updates"))


def _evaluator_loop(requests, evaluator: Evaluator, child) -> None:
    """The tests it is sent, in order, until it gets None."""
    while not child.should_stop():
        try:
            request = requests.get(timeout=WAIT_S)
        except queue.Empty:
            continue
        if request is None or (result := evaluator.evaluate(child.should_stop, request)) is None:
            break
        child.send(Evaluation(result))


# ----- the coordinator (in the supervisor's process) -------------------------------------------------------------
class _InProcessRounds:
    """``--serial``: the three workers in this process, one after the other."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink, stack: contextlib.ExitStack):
        sup, c = run.sup, run.config
        self.run = run
        sampler = stack.enter_context(contextlib.closing(_round_sampler(
            0, c, sup.env_info, plan, sup.replay, slots, sup.stats, link, env_indices=range(plan.num_envs))))
        self.evaluator = stack.enter_context(contextlib.closing(Evaluator(c, sup.env_info, None, None,
                                                                          sup.started_at)))
        # last: the learner seeds torch's global generator, which its updates draw from and which
        # building any other network here would advance
        self.learner = stack.enter_context(contextlib.closing(Learner(
            c, sup.env_info, sup.replay, slots[0], sup.stats, sup.run_dir, sup.started_at, prefetch=False,
            messages=sup.messages)))
        self.plays = (partial(collect_round, sampler, plan, slots), partial(train_round, self.learner, plan, slots))

    def run_round(self, k: int, idle) -> None:
        for play in self.plays:
            play(k)

    def evaluate(self, request: dict) -> None:
        self.run.evaluated(self.evaluator.evaluate(request=request))

    def finish(self) -> None:
        self.learner.finish()


class _ProcessRounds:
    """Sampler, learner and evaluator processes, spawned by the supervisor and driven through the round link."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink, stack: contextlib.ExitStack):
        sup, c = run.sup, run.config
        self.sup, self.link, self.workers = sup, link, plan.samplers + 1
        self.requests = sup.ctx.Queue(maxsize=EVAL_QUEUE_SIZE)
        stack.callback(self.close)
        build = partial(_build, c, sup.env_info, plan, (sup.replay.handle, tuple(s.handle for s in slots),
                                                         sup.stats.handle), link, str(sup.run_dir), sup.started_at)
        specs = {f"spreeze-sampler-{i}": ChildSpec(build, _round_loop, fatal=True) for i in range(plan.samplers)}
        specs["spreeze-learner"] = ChildSpec(build, _round_loop, fatal=True)
        specs["spreeze-evaluator"] = ChildSpec(partial(evaluator_mod.build, c, sup.env_info, sup.weights.handle,
                                                       sup.stats.handle, sup.started_at),
                                               partial(_evaluator_loop, self.requests))
        sup.start(specs)

    def check(self) -> None:
        """Any child that ended during the rounds ends the run: a restarted one could not rejoin a round."""
        self.sup.drain_messages()
        detail = f" ({self.sup.error})" if self.sup.error else ""
        for name, process in self.sup.processes.items():
            if process.exitcode is not None:
                raise ChildFailed(f"{name} exited with code {process.exitcode} during lock-step rounds{detail}")
        if self.sup.error:
            raise ChildFailed(self.sup.error)

    def run_round(self, k: int, idle) -> None:
        for start in self.link.start:
            start.release()
        for _ in range(self.workers):
            while not self.link.done.acquire(timeout=WAIT_S):
                self.check()
                idle()

    def evaluate(self, request: dict | None) -> None:
        while True:
            try:
                return self.requests.put(request, timeout=WAIT_S)
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
    """Set up the rounds (this process restores its torch settings and closes everything afterwards), then drive
    them; a Ctrl-C in ``--serial`` still writes the final checkpoint, as the learner process would."""
    sup, c = run.sup, run.config
    plan = RoundPlan.from_config(c, sup.replay.region_capacity)
    with contextlib.ExitStack() as stack:
        stack.callback(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled())
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        if c.serial:  # this process is the learner: the same settings as the learner process
            torch.set_num_threads(1)
            use_deterministic_torch()
        # slot 0 is the supervisor's weights, version 0: the learner's initial actor (same seed)
        slots = (sup.weights, stack.enter_context(contextlib.closing(
            SharedWeights.create(make_actor(c, sup.env_info.obs_dim, sup.env_info.act_dim), sup.ctx))))
        link = RoundLink.create(plan.num_envs, plan.samplers + 1, sup.ctx)
        sup.log(f"[spreeze] deterministic: {plan.num_envs} env(s) over {1 if c.serial else plan.samplers} sampler "
                f"process(es), rounds of {plan.steps_per_round} steps per env ({plan.round_env_steps} env steps), "
                f"collect:update {plan.collect_ratio:g}, policy lag one round")
        rounds = (_InProcessRounds if c.serial else _ProcessRounds)(run, plan, slots, link, stack)
        run.runlog.open_rounds()
        run.start_observers()
        try:
            _drive(run, plan, slots, link, rounds)
        except KeyboardInterrupt:
            if c.serial:
                rounds.finish()
            raise


def _drive(run, plan: RoundPlan, slots, link: RoundLink, rounds) -> None:
    """Open round ``k`` for every worker, wait until all are done, then act at the boundary, where every count
    is exact: a ``rounds.csv`` row, a test when due (policy ``pi_{k+1}``), the budget check."""
    stats, tests = run.sup.stats, itertools.count()

    def request_test(version: int, env_steps: int, updates: int) -> None:
        flat, found = slots[version % 2].read()
        if found != version:
            raise RoundProtocolError(f"expected policy version {version} in weight slot {version % 2}, found {found}")
        rounds.evaluate({"index": next(tests), "flat": flat, "policy_version": version, "env_steps": env_steps,
                         "updates": updates})

    request_test(0, 0, 0)
    for k in itertools.count():
        rounds.run_round(k, run.poll)
        env_steps, learner = plan.env_steps_after(k), stats.learner
        if stats.total_env_steps() != env_steps:
            raise RoundProtocolError(f"round {k} ended at {stats.total_env_steps()} env steps, not {env_steps}")
        returns, updates = np.array(link.env_returns[:]), int(learner[S.UPDATES])
        run.runlog.write_round({"round": k, "env_steps": env_steps, "updates": updates,
                                "actor_updates": int(learner[S.ACTOR_UPDATES]), "policy_version": k + 1,
                                "critic_loss": float(learner[S.CRITIC_LOSS]),
                                "actor_loss": float(learner[S.ACTOR_LOSS]), "alpha": float(learner[S.ALPHA]),
                                "train_return": float(np.nanmean(returns)) if np.isfinite(returns).any() else math.nan,
                                "episodes": int(stats.episodes.sum())})
        reason = run.budget_reached()
        if plan.eval_due(k) or reason:
            request_test(k + 1, env_steps, updates)
        run.poll()
        if reason:
            run.sup.log(f"[spreeze] {reason}")
            break
    rounds.finish()
    run.metrics(progress=False)
