"""Reproducible mode (``--deterministic``): the same Sampler, Learner and Evaluator driven in the lock-step rounds
of :mod:`spreeze.rounds`, placed in this process (``--serial``) or in the supervisor's children. Nothing depends on
timing; each round appends a timing-free row to ``rounds.csv``.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import queue
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import torch

from spreeze import evaluator as evaluator_mod
from spreeze import stats as S
from spreeze.algos import make_actor
from spreeze.evaluator import Evaluator
from spreeze.learner import Learner
from spreeze.messages import Evaluation, Info
from spreeze.proc import Role
from spreeze.replay import SharedReplay
from spreeze.rounds import WAIT_S, RoundLink, RoundPlan, RoundProtocolError, use_deterministic_torch
from spreeze.sampler import Sampler
from spreeze.stats import SharedStats
from spreeze.supervisor import ChildSpec
from spreeze.weights import SharedWeights

EVAL_QUEUE_SIZE = 32
FINAL_EVAL_TIMEOUT_S = 120.0


# ----- a round, as each worker plays it -------------------------------------------------------------------------
def collect_round(sampler: Sampler, plan: RoundPlan, slots, k: int) -> None:
    """Each env in turn (they are independent) stages a round of rows with ``pi_k``, a step lost to an env fault
    stepped again; then one write per region."""
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
    """The plan's updates on round ``k``'s window, then ``pi_{k+1}`` (checked finite) into the other slot; the
    round's mean losses stay in the shared stats for its ``rounds.csv`` row."""
    learner.schedule_learning_rates(k * plan.round_env_steps)  # the rows collected before this round, no clock
    learner.last_losses = learner.train_until(plan.updates_after(k), learner.round_source(plan, k))
    learner.publish(slots[(k + 1) % 2])


@dataclass
class Part:
    """A sampler or the learner, and its part of round ``k``."""
    worker: Sampler | Learner
    play: Callable[[int], None]

    def close(self) -> None:
        self.worker.close()


def make_part(c, env_info, plan: RoundPlan, replay, slots, stats, link: RoundLink, run_dir, started_at: float,
              role: Role, messages=None) -> Part:
    if role.kind == "learner":
        learner = Learner(c, env_info, replay, slots[0], stats, run_dir, started_at, prefetch=False,
                          messages=messages)
        return Part(learner, partial(train_round, learner, plan, slots))
    sampler = Sampler(role.index, c, env_info, replay, slots[0], stats, block_rows=plan.steps_per_round,
                      env_indices=plan.sampler_envs(role.index))
    sampler.on_episode = link.record_episode
    return Part(sampler, partial(collect_round, sampler, plan, slots))


# ----- in a child process (spawned by the supervisor, run by child_main) -----------------------------------------
def _build(c, env_info, plan: RoundPlan, handles, link: RoundLink, run_dir: str, started_at: float, child) -> Part:
    """A sampler or the learner on one torch thread, whatever ``--learner-threads`` says: another split of a sum
    over threads changes the last bits of an update."""
    use_deterministic_torch()
    replay_handle, slot_handles, stats_handle = handles
    replay = child.keep(SharedReplay.attach(replay_handle))
    slots = tuple(child.keep(SharedWeights.attach(h)) for h in slot_handles)
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    return make_part(c, env_info, plan, replay, slots, stats, link, run_dir, started_at, child.role)


def _round_loop(link: RoundLink, part: Part, child) -> None:
    """Every round the coordinator opens; the learner checkpoints while the others already run the next one, and
    writes the final checkpoint at the end (not after its parent died)."""
    learner = part.worker if isinstance(part.worker, Learner) else None
    for k in link.rounds(-1 if learner else child.role.index, child.should_stop):
        part.play(k)
        link.done.release()
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
class Rounds:
    """The workers, placed in this process and played one after the other (``--serial``), or in the supervisor's
    children, which the round link starts and which report each round done."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink, stack: contextlib.ExitStack):
        sup, c = run.sup, run.config
        self.run, self.sup, self.link, self.serial = run, sup, link, c.serial
        roles = [*(Role("sampler", i) for i in range(plan.samplers)), Role("learner")]
        if c.serial:  # the learner last: it seeds torch's global generator, which building a network advances
            place = partial(make_part, c, sup.env_info, plan, sup.replay, slots, sup.stats, link, sup.run_dir,
                            sup.started_at)
            self.parts = [stack.enter_context(contextlib.closing(place(role))) for role in roles[:-1]]
            self.evaluator = stack.enter_context(contextlib.closing(Evaluator(c, sup.env_info, None, None,
                                                                              sup.started_at)))
            self.parts.append(stack.enter_context(contextlib.closing(place(roles[-1], messages=sup.inbox.local))))
            return
        self.requests = sup.ctx.Queue(maxsize=EVAL_QUEUE_SIZE)
        stack.callback(self.requests.close)
        stack.callback(self.requests.cancel_join_thread)  # the evaluator is gone: requests it never read may drop
        stack.callback(sup.stop_children)
        build = partial(_build, c, sup.env_info, plan, (sup.replay.handle, tuple(s.handle for s in slots),
                                                         sup.stats.handle), link, str(sup.run_dir), sup.started_at)
        # fatal: a restarted child could not rejoin a round; no heartbeat limit: a round takes what it takes
        spec = partial(ChildSpec, fatal=True, silent_after_s=math.inf)
        specs = {role.name: spec(build, partial(_round_loop, link)) for role in roles}
        specs["spreeze-evaluator"] = spec(partial(evaluator_mod.build, c, sup.env_info, sup.weights.handle,
                                                  sup.stats.handle, sup.started_at),
                                          partial(_evaluator_loop, self.requests))
        sup.start(specs)

    def run_round(self, k: int) -> None:
        if self.serial:
            for part in self.parts:
                part.play(k)
            self.parts[-1].worker.maybe_checkpoint()  # as the learner process does after each round
            self.sup.drain_messages()  # its checkpoint (observers' on_checkpoint) and warnings now, not at the end
            return
        for start in self.link.start:
            start.release()
        for _ in self.link.start:
            while not self.link.done.acquire(timeout=WAIT_S):
                self.sup.watch()
                self.run.poll()
        # once per round too: rounds that never wait WAIT_S would leave the tests (--target-return, best/actor.pt,
        # the live curve) and a child's death unread until the end
        self.sup.watch()

    def evaluate(self, request: dict | None) -> None:
        if self.serial:
            self.run.evaluated(self.evaluator.evaluate(request=request))
            return
        while True:
            try:
                return self.requests.put(request, timeout=WAIT_S)
            except queue.Full:
                self.sup.watch()

    def finish(self) -> None:
        """The learner's final checkpoint here; in processes the learner writes it when the supervisor sets the
        stop Event, and the evaluator first finishes the evaluations already requested."""
        if self.serial:
            self.parts[-1].worker.finish()
            return
        evaluator = self.sup.processes["spreeze-evaluator"]
        self.evaluate(None)
        # FINAL_EVAL_TIMEOUT_S from the last test that arrived, not for the whole queue: tests slower than the
        # rounds (a GPU learner, several episodes each) queue up, and the last of them is the final policy's
        evaluations = self.run.runlog.evaluations
        done, deadline = len(evaluations), time.monotonic() + FINAL_EVAL_TIMEOUT_S
        while evaluator.is_alive() and time.monotonic() < deadline:
            self.sup.drain_messages()
            if len(evaluations) > done:
                done, deadline = len(evaluations), time.monotonic() + FINAL_EVAL_TIMEOUT_S
            evaluator.join(timeout=WAIT_S)
        self.sup.drain_messages()
        if evaluator.is_alive():
            self.sup.log(f"[spreeze] the evaluator delivered no test for {FINAL_EVAL_TIMEOUT_S:.0f} s; the tests it had "
                         "left are not in evaluations.csv")


def run_lockstep(run) -> None:
    """Set up the rounds (this process restores its torch settings and closes everything afterwards), then drive
    them; a Ctrl-C in ``--serial`` still writes the final checkpoint, as the learner process would."""
    sup, c = run.sup, run.config
    plan = RoundPlan.from_config(c)
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
        sup.log(f"[spreeze] deterministic: {plan.num_envs} env(s) over {plan.samplers} sampler "
                f"process(es), rounds of {plan.steps_per_round} steps per env ({plan.round_env_steps} env steps), "
                f"collect:update {plan.collect_ratio:g}, policy lag one round")
        rounds = Rounds(run, plan, slots, link, stack)
        run.runlog.open_rounds()
        run.start_observers()
        try:
            _drive(run, plan, slots, link, rounds)
        except KeyboardInterrupt:
            if c.serial:
                rounds.finish()
            raise


def _drive(run, plan: RoundPlan, slots, link: RoundLink, rounds: Rounds) -> None:
    """Open round ``k`` for every worker, wait until all are done, then act at the boundary, where every count
    is exact: a ``rounds.csv`` row, a test when due (policy ``pi_{k+1}``), the budget check."""
    stats, tests = run.sup.stats, itertools.count()

    def request_test(version: int, env_steps: int, updates: int) -> None:
        flat, found = slots[version % 2].read()
        if found != version:
            raise RoundProtocolError(f"expected policy version {version} in weight slot {version % 2}, found {found}")
        rounds.evaluate({"index": next(tests), "flat": flat, "policy_version": version, "env_steps": env_steps,
                         "updates": updates, "time": time.time()})  # when the round made it: tests may queue

    request_test(0, 0, 0)
    for k in itertools.count():
        rounds.run_round(k)
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
