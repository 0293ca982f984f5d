"""Learner process: samples large batches straight from the shared replay and updates the networks.

Actor and critics may sit on different devices (Spreeze section 3.1: actor on GPU0, twin critics on
GPU1 with two GPUs; one GPU: both there; no GPU: CPU) through the same code path. Weights are published
to samplers and evaluator every ``publish_interval_s``, after a finiteness check so that a NaN/Inf loss
never reaches them; checkpoints are written every ``checkpoint_interval_s`` and at the end.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from spreeze.messages import Checkpointed, Error, Event, Info, Warn
from spreeze.noise_scale import NoiseScaleTracker, batch_for_noise_scale, changed_settings, learning_settings
from spreeze import stats as S
from spreeze.algos import make_algo
from spreeze.algos.distributional import DistributionalTwinQ, support_edge_warning
from spreeze.pace import learner_allowance, lr_scale
from spreeze.proc import beating
from spreeze.defaults import resolve_devices
from spreeze.checkpoint import (CHECKPOINT_NAME, FINAL_ACTOR_NAME, FINAL_DIR, load_checkpoint, save_checkpoint,
                                save_final_actor)
from spreeze.envs import EnvInfo
from spreeze.files import hold_learner_lock
from spreeze.mirror import open_mirror, window_source
from spreeze.replay import REPLAY_FILE, LockTimeout, SharedReplay, save_replay
from spreeze.transport import QueueReplay, attach_replay
from spreeze.stats import SharedStats
from spreeze.weights import SharedWeights


class NonFiniteLoss(FloatingPointError):
    """A loss or a weight became NaN/Inf; the run stops before publishing it."""


def ratio_allows_update(config, env_steps: int, updates: int, slack_updates: int = 16, rows: int | None = None,
                        batch_size: int | None = None) -> bool:
    """The learner's side of the collect:update ratio: it waits for data instead of overfitting the replay
    (its work so far, :func:`spreeze.pace.learner_allowance`, may lead the samplers by ``slack_updates``
    updates of the current batch)."""
    if config.collect_ratio <= 0:
        return True
    batch = batch_size or config.batch_size
    slack = learner_allowance(config, slack_updates, slack_updates * batch)
    return learner_allowance(config, updates, rows) <= env_steps - config.learning_begins_at + slack


LR_SCHEDULE_EVERY = 64  # updates between two --lr-schedule steps of the free-running learner
REDECIDE_EVERY_MEASUREMENTS = 10  # noise-scale measurements between two batch decisions (and before the first)


def replay_meta(config) -> dict:
    """What rows saved with --save-replay depend on: a resumed run with other values refills instead."""
    return {"env_id": config.env_id, "n_step": config.n_step, "gamma": config.gamma}


def generator_states(rng: np.random.Generator) -> dict:
    """The learner's random streams (batch indices; torch's, which SAC's sampling and TD3's target noise
    draw from) in a form ``torch.load(weights_only=True)`` accepts: tensors and a JSON string."""
    states = {"numpy": json.dumps(rng.bit_generator.state), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_generators(states: dict, rng: np.random.Generator) -> None:
    rng.bit_generator.state = json.loads(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


class BatchPrefetcher:
    """Gathers the next batch from the replay in a thread while the device runs the current update.

    On a GPU the gather of a large batch costs about as much as the update (docs/benchmarks.md); numpy
    releases the GIL while it copies, so a thread one batch ahead hides it. Not on CPU (it would compete for
    the same cores) nor where the batch sequence must not depend on timing (the reproducible mode).
    """

    def __init__(self, replay, batch_size: int, rng: np.random.Generator):
        self.replay = replay
        self.batch_size = batch_size
        self.rng = rng
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spreeze-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = self.replay.sample(self.batch_size, self.rng)
                while not self._stop.is_set():
                    try:
                        self._ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # raised in the learner's thread by next()
            self._error = err

    def next(self, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._ready.get(timeout=0.1)
            except queue.Empty:
                if self._error is not None:
                    raise self._error from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the prefetch thread delivered no batch in {timeout} s") from None

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread before the replay it reads is closed (docs/pitfalls.md: no views of closed memory);
        False if it is still inside a read after ``timeout`` s."""
        self._stop.set()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()


class Learner:
    def __init__(self, config, env_info: EnvInfo, replay: SharedReplay | QueueReplay, weights: SharedWeights,
                 stats: SharedStats, run_dir: Path, started_at: float, prefetch: bool | None = None,
                 batch_sweep: list | None = None, messages=None):
        """``prefetch``: gather batches in a thread (:class:`BatchPrefetcher`); None turns it on when the
        actor or the critics are on a GPU. ``batch_sweep``: ``(batch, updates_per_s)`` of this machine's
        profile when the batch is the tuner's to choose; with ``--batch-rule noise`` the learner then
        re-decides it from the critic's gradient noise scale as the run goes (``messages`` hears why): the
        batch is the learner's state, starting at ``config.batch_size``."""
        self.config = config
        self.env_info = env_info
        self.replay = replay
        self.weights = weights
        self.stats = stats
        self.run_dir = Path(run_dir)
        self.batch_size = config.batch_size
        self.started_at = started_at
        self.session_began = time.time()  # files older than this are an earlier session's
        torch.manual_seed(config.seed)
        self.rng = np.random.default_rng(config.seed + 12_345)
        actor_device, critic_device = resolve_devices(config)
        self.algo = make_algo(config, env_info.obs_dim, env_info.act_dim, actor_device, critic_device)
        if prefetch is None:
            prefetch = any(str(d).startswith("cuda") for d in (actor_device, critic_device))
        self.prefetch = prefetch
        self._prefetcher: BatchPrefetcher | None = None
        self._mirror, self._mirror_opened = None, False
        self.policy_version = 0
        self.resumes = 0
        self.rows = 0  # rows sampled in all
        self.messages = messages
        self.beat = None  # the learner process's heartbeat (set by loop), kept beating through a long replay save
        self.batch_sweep = [(int(b), float(u)) for b, u in (batch_sweep or [])] if config.batch_rule == "noise" else []
        self._fit_restored_batch = False
        if config.resume:
            checkpoint = load_checkpoint(Path(config.resume) / "checkpoints" / CHECKPOINT_NAME)
            self.algo.load_state_dict(checkpoint["algo"])
            self.policy_version = int(checkpoint["counters"]["policy_version"])
            self.resumes = int(checkpoint["counters"].get("resumes", 0)) + 1
            if "generators" in checkpoint:  # batches and noise go on where they stopped, not from the seed
                restore_generators(checkpoint["generators"], self.rng)
            if self.batch_sweep:  # a batch the learner was re-deciding goes on from where it had got to
                self.batch_size = self._restored_batch(int(checkpoint["counters"].get("batch_size", self.batch_size)))
                self._fit_restored_batch = True
                if self.batch_size != config.batch_size and messages is not None:
                    messages.put(Event("learner", f"resumed at batch {self.batch_size}, where the run had got to "
                                                  f"(the launch choice was {config.batch_size})"), timeout=5)
            self.rows = stats.restore_learner(checkpoint["counters"], self.algo.actor_updates, self.batch_size)
        self.last_losses: dict = {}
        self._support_warned, self._support_ends = False, None  # _check_support's state
        self._rates_stale = True  # a resumed run's optimizers bring back the rates they were saved with
        self.noise = NoiseScaleTracker()
        saved_noise = checkpoint["counters"].get("noise_scale") if config.resume else None
        if saved_noise and (changed := changed_settings(learning_settings(checkpoint.get("config") or {}),
                                                        learning_settings(config))):
            saved_noise = None  # an estimate made under other targets or rates is not this run's: measured afresh
            if messages is not None:
                messages.put(Event("learner", f"resumed with other {changed}: the critic's gradient noise scale is "
                                              "measured afresh"), timeout=5)
        if saved_noise:  # the running estimate goes on: a resume must not start over from one noisy measurement
            self.noise = NoiseScaleTracker(grad_sq=saved_noise["grad_sq"], trace=saved_noise["trace"],
                                           measurements=int(saved_noise["measurements"]))
        stats.learner[S.NOISE_SCALE] = self.noise.b_noise
        stats.learner[S.NOISE_MEASUREMENTS] = self.noise.measurements
        self._last_publish = time.monotonic()
        self._last_checkpoint = time.monotonic()
        stats.learner[S.BATCH_SIZE] = self.batch_size
        stats.learner[S.SAMPLED_ROWS] = self.rows

    def ready(self) -> bool:
        return self.replay.size() >= self.config.learning_begins_at

    def may_update(self) -> bool:
        return ratio_allows_update(self.config, self.stats.total_env_steps(), self.algo.updates, rows=self.rows,
                                   batch_size=self.batch_size)

    def batch_source(self):
        """Where batches come from, decided here only: the GPU replay mirror (spreeze/mirror.py, opened on first
        use: ``--replay-mirror``, free memory) or the shared replay itself."""
        if not self._mirror_opened:
            self._mirror_opened = True
            warn = None if self.messages is None else (lambda text: self._warn(self.messages, text))
            self._mirror = open_mirror(self.config, self.replay, self.algo.critic_device, warn)
        return self._mirror or self.replay

    def round_source(self, plan, k: int):
        """Lock-step: ``sample(batch_size, rng)`` for learner round ``k``: the mirror's or shared memory's, which
        draw the same slots."""
        self.batch_source()
        return window_source(self._mirror, self.replay, plan, k)

    def next_batch(self):
        """A batch (numpy arrays, or device tensors from the mirror): gathered now, or waiting for the prefetch
        thread's (started on first use, once the replay holds data)."""
        if not self.prefetch:
            return self.batch_source().sample(self.batch_size, self.rng)
        if self._prefetcher is None:
            self._prefetcher = BatchPrefetcher(self.batch_source(), self.batch_size, self.rng)
        return self._prefetcher.next()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        self.algo.close()

    def _restored_batch(self, saved: int) -> int:
        """A resumed run's batch: the checkpoint's, within the largest one this machine's sweep and the buffer
        allow (the run may go on on another machine)."""
        allowed = [b for b, _ in self.batch_sweep if b <= self.config.buffer_size]
        return min(saved, max(allowed)) if allowed else self.batch_size

    def fit_restored_batch(self) -> None:
        """Before a resumed learner's first update: a batch larger than the rows in the replay (resumed without
        ``--save-replay``, the replay refills from empty) drops to the largest swept batch that fits."""
        rows = self.replay.size()
        if self.batch_size <= rows:
            return
        fits = [b for b, _ in self.batch_sweep if b <= rows]
        old, self.batch_size = self.batch_size, max(fits) if fits else min(b for b, _ in self.batch_sweep)
        self.stats.learner[S.BATCH_SIZE] = self.batch_size
        if self.messages is not None:
            self.messages.put(Event("learner", f"resumed at batch {old}, above the {rows:,} rows in the replay: "
                                               f"batch {self.batch_size} until the next decision"), timeout=5)

    def step(self) -> None:
        """One update: fetch a batch from shared memory, update critics (and actor), maybe publish."""
        if self._fit_restored_batch:
            self._fit_restored_batch = False
            self.fit_restored_batch()
        if self.algo.updates % LR_SCHEDULE_EVERY == 0 or self._rates_stale:
            self.schedule_learning_rates(self.stats.total_env_steps(), time.time() - self.started_at)
            self._rates_stale = False
        fetch_begun = time.perf_counter()
        batch = self.algo.batch(self.next_batch())
        fetched = time.perf_counter()
        interval = self.config.noise_scale_interval
        measure = bool(interval) and (self.algo.updates + 1) % interval == 0 and self.batch_size >= 16
        if measure:  # before the update: see measure_noise_scale; outside the times the throughput figures read
            self.measure_noise_scale(batch)
        update_begun = time.perf_counter()
        self.last_losses = self.algo.update(batch)
        done = time.perf_counter()
        learner = self.stats.learner
        learner[S.FETCH_SECONDS] += fetched - fetch_begun
        learner[S.UPDATE_SECONDS] += done - update_begun
        self.rows += self.batch_size
        learner[S.SAMPLED_ROWS] = self.rows
        if measure:
            self.maybe_rebatch()
        learner[S.UPDATES] = self.algo.updates
        learner[S.ACTOR_UPDATES] = self.algo.actor_updates
        if time.monotonic() - self._last_publish >= self.config.publish_interval_s:
            self.publish()

    def schedule_learning_rates(self, env_steps: int, elapsed_s: float | None = None) -> None:
        """``--lr-schedule``: the rates for the part of the budget used so far (``constant`` too: a run resumed from
        a scheduled one must not keep the decayed rates its optimizers' state brought back)."""
        self.algo.scale_learning_rates(lr_scale(self.config, env_steps, elapsed_s))

    def train_until(self, target: int, sample) -> dict:
        """Lock-step: updates on ``sample(batch_size, rng)``'s batches until ``target`` updates are done; the mean
        losses with one host sync for all (a GPU keeps queueing kernels), or {} when none was due. No noise-scale
        measurement here: it draws from torch's generator."""
        algo = self.algo
        sums, alpha, q_value, n, fetch_s, update_s = {}, None, None, 0, 0.0, 0.0
        while algo.updates < target:
            begun = time.perf_counter()
            batch = algo.batch(sample(self.batch_size, self.rng))
            fetched = time.perf_counter()
            losses = algo.update(batch)
            update_s += time.perf_counter() - fetched
            fetch_s += fetched - begun
            for key in ("critic_loss", "actor_loss"):  # a new tensor: a graph's outputs change at its next replay
                sums[key] = sums[key] + losses[key] if key in sums else losses[key].clone()
            alpha, q_value = losses.get("alpha"), losses.get("q_value")
            n += 1
        learner = self.stats.learner
        learner[S.FETCH_SECONDS] += fetch_s
        learner[S.UPDATE_SECONDS] += update_s
        self.rows += n * self.batch_size  # as step() counts them: the frame rate and a resume's ratio read them
        learner[S.SAMPLED_ROWS] = self.rows
        learner[S.UPDATES] = algo.updates
        learner[S.ACTOR_UPDATES] = algo.actor_updates
        if not n:
            return {}
        means = {"critic_loss": float(sums["critic_loss"]) / n, "actor_loss": float(sums["actor_loss"]) / n}
        if q_value is not None:  # the last update's, for the C51 support check at the round's publish
            means["q_value"] = float(q_value)
        return means if alpha is None else {**means, "alpha": float(alpha)}

    def measure_noise_scale(self, batch) -> float:
        """The critic's gradient noise scale from this batch and its first eighth, kept as a running estimate in
        the shared stats. Measured before the critic is updated on this batch: after, the batch's gradient has
        just been descended, so |G|^2 comes out too small and B_noise too large. It draws from torch's generator
        (SAC's next actions), so runs with and without it differ after the first measurement."""
        small = max(2, self.batch_size // 8)
        big_sq, small_sq = self.algo.critic_gradient_sq_norms(batch, small)
        value = self.noise.update(small_sq, big_sq, small, self.batch_size)
        self.stats.learner[S.NOISE_SCALE] = value
        self.stats.learner[S.NOISE_MEASUREMENTS] = self.noise.measurements
        return value

    def maybe_rebatch(self) -> int | None:
        """``--batch-rule noise``: every few noise-scale measurements, take the swept batch that minimises
        seconds per update x (1 + B_noise/B) (McCandlish et al. 2018's time to a given progress). Returns the
        new batch when it changed."""
        if not self.batch_sweep or self.noise.measurements % REDECIDE_EVERY_MEASUREMENTS:
            return None
        limit = min(self.config.buffer_size, self.replay.size())
        batch, reason = batch_for_noise_scale(self.batch_sweep, self.noise.b_noise, max_batch=limit,
                                              current=self.batch_size)
        if batch == self.batch_size or not np.isfinite(self.noise.b_noise):
            return None
        old, self.batch_size = self.batch_size, batch
        if self._prefetcher is not None:  # it gathers batches of the old size
            if not self._prefetcher.close():  # a second reader beside it would share the mirror's staging buffers
                raise TimeoutError("the prefetch thread did not stop within 10 s of a batch change (stuck in a "
                                   "replay read)")
            self._prefetcher = None
        self.stats.learner[S.BATCH_SIZE] = batch
        if self.messages is not None:
            self.messages.put(Event("learner", f"batch {old} -> {batch} after {self.algo.updates} updates: {reason}"),
                              timeout=5)
        return batch

    def publish(self, weights: SharedWeights | None = None) -> None:
        """Check finiteness, then publish the actor as a new version (readers never see a torn set), into
        ``weights`` (lock-step: the round's weight slot) or the run's weights."""
        losses = {k: float(v) for k, v in self.last_losses.items()}
        if not all(np.isfinite(v) for v in losses.values()) or not self.algo.parameters_finite():
            raise NonFiniteLoss(f"non-finite loss or weights after update {self.algo.updates}: {losses}")
        if "q_value" in losses:
            self._check_support(losses["q_value"])
        self.policy_version += 1
        (weights or self.weights).publish(self.algo.actor, self.policy_version)
        learner = self.stats.learner
        learner[S.POLICY_VERSION] = self.policy_version
        learner[S.CRITIC_LOSS] = losses.get("critic_loss", np.nan)
        learner[S.ACTOR_LOSS] = losses.get("actor_loss", np.nan)
        learner[S.ALPHA] = losses.get("alpha", np.nan)
        self._last_publish = time.monotonic()

    def _check_support(self, q_value: float) -> None:
        """Once a run: a warning when the critics' mean Q nears an end of their C51 support (clipped targets).
        The support's ends are read to the host once, when it is set."""
        critic = self.algo.critic
        if self._support_warned or not isinstance(critic, DistributionalTwinQ) or not critic.support_ready():
            return
        if self._support_ends is None:
            self._support_ends = (float(critic.support[0]), float(critic.support[-1]))
        text = support_edge_warning(q_value, *self._support_ends)
        if text is not None:
            self._support_warned = True
            self._warn(self.messages, text)

    def maybe_checkpoint(self, messages=None) -> None:
        if time.monotonic() - self._last_checkpoint >= self.config.checkpoint_interval_s:
            self.try_checkpoint(messages)

    def try_checkpoint(self, messages=None) -> Path | None:
        """The checkpoint, then (--save-replay) the replay beside it, then observers told."""
        path = self.write_checkpoint(messages)
        if path is not None:
            self.write_replay(messages, path.parent)
            self.announce_checkpoint(messages, path)
        return path

    def write_checkpoint(self, messages=None) -> Path | None:
        """A checkpoint that cannot be written (disk full, directory gone or read-only) is a warning, not a
        reason to stop training; the atomic write leaves the previous checkpoint intact."""
        try:
            return self.checkpoint()
        except OSError as err:
            self._last_checkpoint = time.monotonic()
            self._warn(messages, f"checkpoint not written ({type(err).__name__}: {err}); training goes on")
            return None

    def write_replay(self, messages, folder: Path) -> None:
        """``--save-replay``: the replay's filled rows beside the checkpoint; a failure keeps the previous file."""
        if self.config.save_replay and isinstance(self.replay, SharedReplay):
            try:
                with beating(self.beat):  # gigabytes on a slow disk can outlast the supervisor's silence limit
                    save_replay(self.replay, folder / REPLAY_FILE, replay_meta(self.config))
            except (OSError, LockTimeout, MemoryError) as err:  # no room for its copy either: training goes on
                self._warn(messages, f"replay not saved ({type(err).__name__}: {err}); the previous file is kept")

    def announce_checkpoint(self, messages, path: Path) -> None:
        """Observers' ``on_checkpoint``."""
        listener = messages if messages is not None else self.messages
        if listener is not None:
            listener.put(Checkpointed("learner", str(path)), timeout=5)

    def _warn(self, messages, text: str) -> None:
        """To ``messages``, else to the learner's own (a --serial run's checkpoints pass none)."""
        listener = messages if messages is not None else self.messages
        if listener is not None:
            listener.put(Warn("learner", text), timeout=5)

    def counters(self) -> dict:
        return {"env_steps": self.stats.total_env_steps(), "updates": self.algo.updates,
                "policy_version": self.policy_version, "time_s": time.time() - self.started_at,
                "resumes": self.resumes, "sampled_rows": self.rows, "batch_size": self.batch_size,
                "noise_scale": {"grad_sq": self.noise.grad_sq, "trace": self.noise.trace,
                                "measurements": self.noise.measurements}}

    def checkpoint(self) -> Path:
        if not self.algo.state_finite():
            raise NonFiniteLoss(f"non-finite weights or optimizer state after update {self.algo.updates}; "
                                "the last good checkpoint is kept")
        path = save_checkpoint(self.run_dir, self.algo.state_dict(), self.counters(), self.config.to_dict(),
                               generators=generator_states(self.rng))
        self._last_checkpoint = time.monotonic()
        return path

    def save_after_error(self, messages=None) -> None:
        """The learner failed with its weights finite (a lock or a prefetch that timed out): the training since the
        last checkpoint is kept in one, best effort; and an earlier session's ``final/actor.pt`` is removed, which
        would otherwise pass for this one's (``load_policy(run)`` reads it)."""
        self.drop_stale_final_actor()
        try:
            if self.algo.state_finite() and self.write_checkpoint(messages) is not None:
                self._warn(messages, f"the learner failed; its training up to update {self.algo.updates} is in the "
                                     "checkpoint")
        except Exception:  # the error that brought us here is the one to report
            pass

    def drop_stale_final_actor(self, any_age: bool = False) -> None:
        """Remove ``final/actor.pt`` if an earlier session wrote it; ``any_age``: whoever wrote it (``finish``, its
        only writer, failed to write this session's, so whatever is there is not this session's policy)."""
        stale = self.run_dir / FINAL_DIR / FINAL_ACTOR_NAME
        try:
            if any_age or stale.stat().st_mtime < self.session_began:
                stale.unlink()
        except OSError:
            pass

    def finish(self, messages=None) -> bool:
        """Final checkpoint and the final actor, loadable with ``spreeze.load_policy(run_dir)``; False (with a
        warning) when the checkpoint could not be written."""
        path = self.write_checkpoint(messages)
        if path is None:  # nor the final actor: an earlier session's must not pass for this one's
            self.drop_stale_final_actor(any_age=True)
            return False
        # the final actor before a --save-replay replay (hundreds of MB): a slow disk that outlasts the
        # supervisor's wait then costs the replay file, not the policy
        try:
            save_final_actor(self.run_dir, self.algo.actor, self.config.to_dict(), self.env_info)
        except OSError as err:  # the checkpoint holds the actor too: a warning, as for a checkpoint
            self.drop_stale_final_actor(any_age=True)  # an earlier session's must not pass for this one's
            self._warn(messages, f"final actor not written ({type(err).__name__}: {err}); "
                                 "load_policy(run, checkpoint=\"latest\") reads it from the final checkpoint")
        self.write_replay(messages, path.parent)
        self.announce_checkpoint(messages, path)
        return True


def build(config, env_info: EnvInfo, replay_handle, weights_handle, stats_handle, run_dir: str, started_at: float,
          batch_sweep: list | None, child) -> Learner:
    """``spreeze-learner`` in its process."""
    lock = hold_learner_lock(Path(run_dir))  # until this process ends: after its final checkpoint
    if lock is not None:
        child.keep(lock)
    replay = child.keep(attach_replay(replay_handle, reader=True))
    weights = child.keep(SharedWeights.attach(weights_handle))
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    return Learner(config, env_info, replay, weights, stats, Path(run_dir), started_at, batch_sweep=batch_sweep,
                   messages=child.messages)


def loop(learner: Learner, child) -> None:
    """Update while data and the ratio allow; at the end (also when the parent died: a killed terminal) the
    final checkpoint, which --resume continues from."""
    learner.beat = partial(learner.stats.beat, child.role.heartbeat)
    try:
        while not child.should_stop():
            if learner.ready() and learner.may_update():
                learner.step()
                learner.maybe_checkpoint(child.messages)
            else:
                waited = time.perf_counter()
                time.sleep(0.001)
                learner.stats.learner[S.WAIT_SECONDS] += time.perf_counter() - waited
        if learner.finish(child.messages):
            child.send(Info("learner", f"final checkpoint written after {learner.algo.updates} updates"))
    except NonFiniteLoss as err:
        # the last good checkpoint stays: NaN/Inf is caught before publishing or checkpointing; the message
        # says it all, a traceback would only bury it
        learner.drop_stale_final_actor()
        child.send(Error("learner", f"{type(err).__name__}: {err}"))
        sys.exit(1)
    except Exception:
        learner.save_after_error(child.messages)
        raise
    finally:
        learner.stats.learner[S.LEARNER_DONE] = 1
