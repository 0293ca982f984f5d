"""Reproducible mode (``--deterministic``): the same Sampler, Learner and Evaluator, driven in lock-step rounds
(:mod:`spreeze.rounds`). Nothing depends on timing: env ``e`` has its own seeds and streams and runs its actor on
a batch of one; updates per round follow from the collect:update ratio; tests run at fixed env-step points from
fixed seeds; each round appends a timing-free row to ``rounds.csv``. ``--serial`` runs the same rounds here.
"""
from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from spreeze import stats as S
from spreeze.algos import make_actor
from spreeze.evaluator import Evaluator
from spreeze.learner import Learner, NonFiniteLoss
from spreeze.messages import Evaluation, Info
from spreeze.replay import SharedReplay
from spreeze.rounds import OUT, WAIT_S, RoundLink, RoundPlan, RoundProtocolError, use_deterministic_torch
from spreeze.sampler import Sampler
from spreeze.stats import SharedStats
from spreeze.supervisor import ChildFailed, ChildSpec
from spreeze.weights import SharedWeights, load_flat

EVAL_QUEUE_SIZE = 32
FINAL_EVAL_TIMEOUT_S = 120.0


# ----- a round, as each worker plays it -------------------------------------------------------------------------
def collect_round(sampler: Sampler, plan: RoundPlan, slots, k: int) -> None:
    """Every env of ``sampler`` in turn (they are independent) stages a round of rows with ``pi_k``; a step lost
    to an env fault is stepped again, so each region gets exactly one round; then one write per region."""
    flat, version = slots[k % 2].read()
    if version != k:
        raise RoundProtocolError(f"round {k} found policy version {version} in weight slot {k % 2}")
    load_flat(sampler.actor, flat)
    for i in range(len(sampler.envs)):
        t = 0
        while sampler.n_staged[i] < plan.steps_per_round:
            sampler.step_env(i, sampler.act_one(i, plan.random_actions(k, t)))
            t += 1
    sampler.flush()
    sampler.stats.env_steps[sampler.index] += len(sampler.envs) * plan.steps_per_round


def train_round(learner: Learner, plan: RoundPlan, slots, link: RoundLink, k: int) -> None:
    """The plan's updates on round ``k``'s window, a finiteness check, then ``pi_{k+1}`` published."""
    algo = learner.algo
    means = learner.train_until(plan.updates_after(k), learner.round_source(plan, k))
    summary = {**dict.fromkeys(OUT[:3], math.nan), **means, "updates": algo.updates,
               "actor_updates": algo.actor_updates}
    if means and not (math.isfinite(means["critic_loss"]) and math.isfinite(means["actor_loss"])
                      and algo.parameters_finite()):
        raise NonFiniteLoss(f"non-finite loss or weights in round {k} (update {algo.updates})")
    link.out[:] = [summary[key] for key in OUT]
    slots[(k + 1) % 2].publish(algo.actor, k + 1)
    learner.policy_version = k + 1
    s = learner.stats.learner
    s[S.POLICY_VERSION] = k + 1
    s[S.CRITIC_LOSS], s[S.ACTOR_LOSS], s[S.ALPHA] = link.out[:3]


def _round_sampler(index, config, env_info, plan, replay, slots, stats, link, env_indices=None) -> Sampler:
    sampler = Sampler(index, config, env_info, replay, slots[0], stats, block_rows=plan.steps_per_round,
                      env_indices=plan.sampler_envs(index) if env_indices is None else env_indices)
    sampler.on_episode = link.record_episode
    return sampler


# ----- the children (child_main runs them) ----------------------------------------------------------------------
@dataclass
class _Side:
    """A worker with the round state it plays with; ``child_main`` closes it."""
    worker: object
    plan: RoundPlan
    slots: tuple = ()
    link: object = None   # the RoundLink, or the evaluator's request queue

    def close(self) -> None:
        self.worker.close()


def _build(config, env_info, plan: RoundPlan, handles, run_dir: str, started_at: float, child) -> _Side:
    """A sampler or the learner (one torch thread whatever ``--learner-threads`` says: another split of a sum
    over threads changes the last bits of an update) with the replay, both weight slots and the link."""
    use_deterministic_torch()
    replay_handle, slot_handles, stats_handle, link_handle = handles
    replay = child.keep(SharedReplay.attach(replay_handle))
    slots = tuple(child.keep(SharedWeights.attach(h)) for h in slot_handles)
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    link = child.keep(RoundLink.attach(link_handle))
    if child.role.kind == "sampler":
        return _Side(_round_sampler(child.role.index, config, env_info, plan, replay, slots, stats, link), plan, slots,
                     link)
    return _Side(Learner(config, env_info, replay, slots[0], stats, Path(run_dir), started_at, prefetch=False), plan,
                 slots, link)


def _sampler_loop(side: _Side, child) -> None:
    while (k := side.link.wait_for_round(side.worker.index, child.should_stop)) is not None:
        collect_round(side.worker, side.plan, side.slots, k)
        side.link.done.release()


def _learner_loop(side: _Side, child) -> None:
    learner = side.worker
    try:
        while (k := side.link.wait_for_round(side.plan.samplers, child.should_stop)) is not None:
            train_round(learner, side.plan, side.slots, side.link, k)
            side.link.done.release()
            learner.maybe_checkpoint(child.messages)  # while the others already run the next round
        if not child.parent.gone() and learner.finish(child.messages):
            child.send(Info("learner", f"final checkpoint written after {learner.algo.updates} updates"))
    finally:
        learner.stats.learner[S.LEARNER_DONE] = 1


def _build_evaluator(config, env_info, requests, started_at: float, child) -> _Side:
    return _Side(Evaluator(config, env_info, None, None, started_at), None, link=requests)


def _evaluator_loop(side: _Side, child) -> None:
    """The policies it is sent, in order, until it gets None."""
    while not child.should_stop():
        try:
            request = side.link.get(timeout=WAIT_S)
        except queue.Empty:
            continue
        if request is None or (result := side.worker.evaluate(child.should_stop, request)) is None:
            break
        child.send(Evaluation(result))


# ----- the coordinator (in the supervisor's process) -------------------------------------------------------------
class _InProcessRounds:
    """``--serial``: the three workers in this process, one after the other."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink):
        sup, c = run.sup, run.config
        self.run, self.plan, self.slots, self.link = run, plan, slots, link
        self.sampler = self.learner = self.evaluator = None
        try:
            self.sampler = _round_sampler(0, c, sup.env_info, plan, sup.replay, slots, sup.stats, link,
                                          env_indices=range(plan.num_envs))
            self.evaluator = Evaluator(c, sup.env_info, None, None, sup.started_at)
            # last: the learner seeds torch's global generator, which its updates draw from and which
            # building any other network here would advance
            self.learner = Learner(c, sup.env_info, sup.replay, slots[0], sup.stats, sup.run_dir, sup.started_at,
                                   prefetch=False, messages=sup.messages)
        except BaseException:
            self.close()
            raise

    def run_round(self, k: int, idle) -> None:
        collect_round(self.sampler, self.plan, self.slots, k)
        train_round(self.learner, self.plan, self.slots, self.link, k)

    def evaluate(self, request: dict) -> None:
        self.run.evaluated(self.evaluator.evaluate(request=request))

    def finish(self) -> None:
        self.learner.finish()

    def close(self) -> None:
        for part in (self.sampler, self.evaluator, self.learner):
            if part is not None:
                part.close()
        self.sampler = self.learner = self.evaluator = None


class _ProcessRounds:
    """Sampler, learner and evaluator processes driven through the round link."""

    def __init__(self, run, plan: RoundPlan, slots, link: RoundLink):
        sup, c = run.sup, run.config
        self.sup, self.link, self.workers = sup, link, plan.samplers + 1
        self.requests = sup.ctx.Queue(maxsize=EVAL_QUEUE_SIZE)
        build = partial(_build, c, sup.env_info, plan, (sup.replay.handle, tuple(s.handle for s in slots),
                                                         sup.stats.handle, link.handle), str(sup.run_dir),
                        sup.started_at)
        specs = {f"spreeze-sampler-{i}": ChildSpec(build, _sampler_loop, fatal=True) for i in range(plan.samplers)}
        specs["spreeze-learner"] = ChildSpec(build, _learner_loop, fatal=True)
        specs["spreeze-evaluator"] = ChildSpec(partial(_build_evaluator, c, sup.env_info, self.requests,
                                                       sup.started_at), _evaluator_loop)
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
        self.link.round[0] = k
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
    """Open round ``k`` for every worker, wait until all are done, then act at the boundary, where every count
    is exact: a ``rounds.csv`` row, a test when due (policy ``pi_{k+1}``), the budget check."""
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
        run.start_observers()
        try:
            _drive(run, plan, slots, link, rounds)
        except KeyboardInterrupt:
            if c.serial:  # the learner process writes its final checkpoint on the stop Event; here it is us
                rounds.finish()
            raise
    finally:
        for part in (rounds, slot1, link):
            if part is not None:
                part.close()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)


def _drive(run, plan: RoundPlan, slots, link: RoundLink, rounds) -> None:
    tests = 0

    def request_test(version: int, env_steps: int, updates: int) -> None:
        nonlocal tests
        flat, found = slots[version % 2].read()
        if found != version:
            raise RoundProtocolError(f"expected policy version {version} in weight slot {version % 2}, found {found}")
        rounds.evaluate({"index": tests, "flat": flat, "policy_version": version, "env_steps": env_steps,
                         "updates": updates})
        tests += 1

    def idle() -> None:
        run.poll()
        if run.metrics_due():
            run.metrics()

    request_test(0, 0, 0)
    k = 0
    while True:
        rounds.run_round(k, idle)
        env_steps = plan.env_steps_after(k)
        if run.sup.stats.total_env_steps() != env_steps:
            raise RoundProtocolError(f"round {k} ended at {run.sup.stats.total_env_steps()} env steps, not {env_steps}")
        out = dict(zip(OUT, link.out))
        returns = link.env_returns
        run.runlog.write_round({"round": k, "env_steps": env_steps, "updates": int(out["updates"]),
                                "actor_updates": int(out["actor_updates"]), "policy_version": k + 1,
                                "critic_loss": float(out["critic_loss"]), "actor_loss": float(out["actor_loss"]),
                                "alpha": float(out["alpha"]),
                                "train_return": float(np.nanmean(returns)) if np.isfinite(returns).any() else math.nan,
                                "episodes": int(link.env_episodes.sum())})
        reason = run.budget_reached()
        if plan.eval_due(k) or reason:
            request_test(k + 1, env_steps, int(out["updates"]))
        idle()
        if reason:
            run.sup.log(f"[spreeze] {reason}")
            break
        k += 1
    rounds.finish()
    run.metrics(progress=False)
