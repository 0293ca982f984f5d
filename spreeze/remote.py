"""Sampler actors on a Ray cluster (``--ray``), driven by the ingest process; imported only with ``--ray``.

The ingest process is the run's one Ray driver. It starts ``--remote-samplers`` actors (spread over the
cluster's nodes), each wrapping the same :class:`spreeze.sampler.Sampler` around block stand-ins
(:mod:`spreeze.ingest`), and keeps at most ``--remote-inflight`` requests open per actor, each for one or more
blocks (as many as the collect:update ratio allows, up to about ``REQUEST_S`` of sampling): an actor steps its
envs only when asked, so an ingest that falls behind slows the actors instead of dropping their blocks. Every
new actor version is put in the object store once and sent with the next request to each actor (only that
one); an actor loads it only if it is newer than the one it holds. A dead actor (killed, or its node gone) is
replaced within ``--max-restarts-per-minute``; its blocks in flight are counted as lost, its regions keep their
rows. The actors belong to this driver, so Ray removes them when it ends, whatever ends it.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import ray

from spreeze.ingest import BlockSink, BlockStats, BlockWeights, ForeignBlock, Ingest, make_block, pack
from spreeze.messages import Event, GaveUp
from spreeze.proc import child_setup, flush_denormals
from spreeze.replay import SharedReplay
from spreeze.sampler import SamplerGaveUp
from spreeze.stats import INGEST_ALIVE, INGEST_IN_FLIGHT, INGEST_RESTARTS, INGEST_RTT_SECONDS, SharedStats
from spreeze.weights import SharedWeights

CONNECT_TIMEOUT_S = 5.0
GET_TIMEOUT_S = 30.0
FIRST_BLOCK_S = 120.0   # a new actor: placement, a worker process, torch and the envs built
SILENT_MIN_S = 10.0     # a running actor with a request open this long (and 20 typical round trips) is dead
# Blocks per request: as many as about REQUEST_S of the actor's sampling, at most MAX_BLOCKS_PER_REQUEST. Ray's
# fixed cost per request (a task to submit, a result to fetch; about a millisecond of CPU on each side) is then
# spread over hundreds of rows for a cheap env; an expensive one (a block takes longer) keeps one per request.
# The weights a request samples with stay at most about 2 x REQUEST_S older than the newest (2 requests open).
REQUEST_S = 0.05
MAX_BLOCKS_PER_REQUEST = 8


class ClusterError(ValueError):
    """The cluster cannot be used (unreachable, another Ray version); one line for the user."""


def runtime_env() -> dict:
    """Workers import spreeze from this checkout when its path exists on their node (a local cluster, a shared
    file system); elsewhere from their own install of the same version."""
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def _reachable(address: str) -> None:
    """A TCP connect to host:port with a short timeout: ray.init may retry an unreachable address for long."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ClusterError(f"--ray {address}: cannot reach it ({err.strerror or err})") from None


def namespace(run_pid: int) -> str:
    """The run's Ray namespace (its actors are named ``sampler-<r>.<incarnation>`` in it, for ``ray.kill``)."""
    return f"spreeze-{run_pid}"


def connect(address: str, run_pid: int | None = None) -> None:
    """Join the cluster as a driver, or raise :class:`ClusterError` with one line."""
    if address != "auto":
        _reachable(address)
    # ray.init installs a SIGTERM handler that exits at once: in the ingest that would stop it mid-write on a
    # group SIGTERM (its regions left half-written) instead of through the stop Event; ours is put back
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env=runtime_env(),
                 namespace=namespace(run_pid or os.getpid()))
    except Exception as err:  # ConnectionError (no cluster), RuntimeError (version mismatch), ...
        ray.shutdown()  # whatever ray.init had set up before it failed
        raise ClusterError(f"--ray {address}: {_one_line(err)}") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _one_line(err: Exception) -> str:
    """Ray's error as one line; its version mismatch (several lines, the versions past the first) as the two
    versions and what to do."""
    text = str(err).strip()
    versions = re.findall(r"Ray: (\S+)\s+Python: (\S+)", text)
    if text.startswith("Version mismatch") and len(versions) == 2:
        (ray_there, py_there), (ray_here, py_here) = versions
        return (f"Ray version mismatch: the cluster runs Ray {ray_there} (Python {py_there}), this machine Ray "
                f"{ray_here} (Python {py_here}); install the same versions on every node")
    return (text.splitlines() or [type(err).__name__])[0]


@ray.remote
def _echo(block: dict) -> int:
    return len(block["regions"])


def check_cluster(config, env_info) -> dict:
    """The setup's look at the cluster before anything starts: reachable, same Ray version, how many CPUs, and
    the round trip of one block of this run's size; raises :class:`ClusterError`."""
    connect(config.ray)
    try:
        resources = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per, rows = config.envs_per_sampler, config.write_block
        part = (0, *(np.zeros((rows, d), np.float32) for d in (env_info.obs_dim, env_info.act_dim)),
                np.zeros(rows, np.float32), np.zeros((rows, env_info.obs_dim), np.float32), np.zeros(rows, np.float32))
        block = pack([(region, *part[1:]) for region in range(per)])
        ray.get(_echo.remote(block), timeout=GET_TIMEOUT_S)  # a worker started (seconds), not timed
        times = []
        for _ in range(10):
            began = time.perf_counter()
            ray.get(_echo.remote(block), timeout=GET_TIMEOUT_S)
            times.append(time.perf_counter() - began)
    except Exception as err:
        raise ClusterError(f"--ray {config.ray}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    finally:
        ray.shutdown()
    return {"address": config.ray, "ray_version": ray.__version__, "cluster_cpus": float(resources.get("CPU", 0.0)),
            "nodes": len(nodes), "block_rows": per * rows, "block_round_trip_ms": 1e3 * float(np.median(times))}


class RemoteSampler:
    """One sampler actor: the Sampler class over a block sink, stepped for the blocks each request asks for."""

    def __init__(self, index: int, config, env_info, incarnation: int):
        from spreeze.sampler import Sampler

        child_setup(1)
        self.sink, self.weights = BlockSink(), BlockWeights()
        self.stats = BlockStats(config.sampler_processes, config.remote_samplers, index)
        self.sampler = Sampler(index, config, env_info, self.sink, self.weights, self.stats, incarnation)

    def collect(self, total_env_steps: int, blocks: int, version: int = -1, flat=None) -> dict:
        """``blocks`` blocks as one; ``flat``: the actor weights of version ``version``, sent only to an actor
        that has not been sent that version yet (a top-level argument: Ray fetches it before the call)."""
        if flat is not None:
            self.weights.offer(version, flat)
        flush_denormals(True)  # set in __init__'s thread: this call may run in another (docs/pitfalls.md)
        self.stats.base = total_env_steps
        return make_block(self.sampler, self.sink, self.stats, blocks)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def describe_error(err: Exception, limit: int = 300) -> str:
    """One line for events.log: Ray's actor errors open with a generic line ("The actor died because of an
    error raised in its creation task, ...") and give the cause (a module missing on a node, an OOM kill) on the
    last one, so both are kept."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def request_overdue(now: float, sent: float, blocks: int, delivered: bool, last_arrival: float,
                    typical_rtt: float, block_s: float) -> float | None:
    """Seconds a request has gone unanswered when that is long enough to call its actor dead, else None.

    An actor works its requests one after the other, so one queued behind another starts when the one before it
    arrives: it is timed from the later of its sending and the actor's last arrival. (Timed from its sending,
    the second of the two opening requests, sent with the first, counted the actor's whole start-up, and a
    healthy actor that took over 10 s to start was replaced after its first block, again and again.) The limit:
    ``FIRST_BLOCK_S`` until the actor has delivered, then 20 typical round trips or 20 times this request's own
    sampling time (an expensive env), at least ``SILENT_MIN_S``."""
    if not delivered:
        since, limit = sent, FIRST_BLOCK_S
    else:
        since, limit = max(sent, last_arrival), max(SILENT_MIN_S, 20 * max(typical_rtt, block_s * blocks))
    return now - since if now - since > limit else None


class Fleet:
    """The ingest process's side: start, feed, read and replace the sampler actors."""

    def __init__(self, config, env_info, ingest: Ingest, weights: SharedWeights, send, incarnation: int = 0):
        self.config, self.env_info, self.ingest, self.weights, self.send = config, env_info, ingest, weights, send
        self.stats = ingest.stats
        self.actor_class = ray.remote(num_cpus=1, max_restarts=0)(RemoteSampler)
        n = config.remote_samplers
        self.actors: list = [None] * n
        self.generation = [0] * n
        self.base_incarnation = incarnation * 1000  # a restarted ingest process starts new seed streams too
        self.inflight: dict = {}                     # ref -> (remote index, generation, sent at, blocks)
        self.requested = 0
        self.next_turn = 0                           # where request() starts among actors with as few open
        self.block_s = [0.0] * n                     # an actor's seconds of sampling per block (moving average)
        self.sent_version = [-1] * n                 # the newest weights sent to the actor's current generation
        self.restarts: dict[int, list[float]] = {}
        self.retired: set[int] = set()
        self.died_at: dict[int, float] = {}
        self.delivered = [False] * n                # a block of the current generation arrived
        self.last_arrival = [0.0] * n               # when the current generation's newest request arrived
        self.typical_rtt = 0.0
        self.box, self.put_version = None, -1
        for r in range(n):
            self.start(r)
        self.event(f"joined the Ray cluster {config.ray} through node {ray.get_runtime_context().get_node_id()}; "
                   f"{n} remote sampler(s) starting")

    @property
    def requested(self) -> int:
        """Blocks asked for and not yet arrived (all actors)."""
        return self._requested

    @requested.setter
    def requested(self, blocks: int) -> None:
        # in shared memory at every change: an ingest killed outright cannot count its own lost requests
        self._requested = blocks
        self.stats.ingest[INGEST_IN_FLIGHT] = blocks

    def event(self, text: str) -> None:
        self.send(Event("spreeze-ingest", text))

    def start(self, r: int) -> None:
        incarnation = self.base_incarnation + self.generation[r]
        self.actors[r] = self.actor_class.options(scheduling_strategy="SPREAD", name=f"sampler-{r}.{incarnation}").remote(
            self.config.sampler_processes + r, self.config, self.env_info, incarnation)
        self.delivered[r] = False
        self.last_arrival[r] = 0.0
        self.sent_version[r] = -1
        self.stats.ingest[INGEST_ALIVE] = sum(a is not None for a in self.actors)

    def publish(self) -> None:
        """Put a newer actor version in the object store, once (the previous one is freed with its refs)."""
        if self.weights.current_version() > self.put_version:
            flat, version = self.weights.read()
            self.box, self.put_version = ray.put(flat), version

    def request_blocks(self, r: int) -> int:
        """Blocks per request for actor ``r``: about ``REQUEST_S`` of its sampling (one until it has delivered),
        so that Ray's cost per request is spread over more rows when its env is cheap."""
        if not self.block_s[r]:
            return 1
        return max(1, min(MAX_BLOCKS_PER_REQUEST, int(REQUEST_S / self.block_s[r])))

    def request(self) -> None:
        """Requests up to what the collect:update ratio allows, each to the actor with the fewest open, taking turns
        among equals: walking from actor 0 each time gave what the learner frees to the first actors alone, while
        the others sat idle (their regions ageing in the replay, their noise range unused, and never checked)."""
        n = len(self.actors)
        open_ = [0] * n
        for rr, *_ in self.inflight.values():
            open_[rr] += 1
        turn = self.next_turn
        while True:
            waiting = [r for r in range(n) if self.actors[r] is not None and open_[r] < self.config.remote_inflight]
            if not waiting:
                return
            r = min(waiting, key=lambda j: (open_[j], (j - turn) % n))
            actor = self.actors[r]
            k = self.ingest.blocks_allowed(self.requested, self.request_blocks(r))
            if not k:
                return
            turn = self.next_turn = (r + 1) % n
            if self.sent_version[r] < self.put_version:
                ref = actor.collect.remote(self.stats.total_env_steps(), k, self.put_version, self.box)
                self.sent_version[r] = self.put_version
            else:
                ref = actor.collect.remote(self.stats.total_env_steps(), k)
            self.inflight[ref] = (r, self.generation[r], time.monotonic(), k)
            self.requested += k
            open_[r] += 1

    def poll(self, timeout_s: float) -> int:
        """Write every request that arrived (waiting up to ``timeout_s`` for one); returns the requests that came back
        ready, written or counted as lost."""
        if not self.inflight:
            time.sleep(timeout_s)
            return 0
        refs = list(self.inflight)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)  # all that are ready, without waiting
        if not ready:
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        try:
            blocks = ray.get(ready, timeout=GET_TIMEOUT_S)  # one call for all
        except ray.exceptions.RayError:
            blocks = None  # one of them failed: each on its own below
        for i, ref in enumerate(ready):
            if ref not in self.inflight:  # its actor died on an earlier ref of this batch: counted as lost then
                continue
            r, generation, sent, k = self.inflight.pop(ref)
            self.requested -= k
            if blocks is not None:
                block = blocks[i]
            else:
                try:
                    block = ray.get(ref, timeout=GET_TIMEOUT_S)
                except ray.exceptions.RayActorError as err:
                    self.ingest.lost(k)
                    self.died(r, generation, err)
                    continue
                except ray.exceptions.RayTaskError as err:
                    self.ingest.lost(k)
                    if isinstance(err.cause, SamplerGaveUp):  # its env keeps failing: stopped for good
                        self.retire(r, f"raised {str(err).strip().splitlines()[-1]}")
                    else:  # any other error in collect: replaced within the budget, as a local sampler is
                        self.died(r, generation, err)
                    continue
                except ray.exceptions.RayError as err:  # its worker or node died, its block was lost, out of memory
                    self.ingest.lost(k)
                    self.died(r, generation, err)
                    continue
            try:
                self.ingest.write(r, block)
            except ForeignBlock as err:  # outside the sampler's own regions (counted lost): a faulty actor
                self.retire(r, f"sent a block it may not write ({err})")
                continue
            except Exception:
                # this process ends here (the supervisor restarts it) and its requests still in flight with it:
                # lost, and counted so, with the one that failed
                self.ingest.lost(self.requested + k)
                self.inflight.clear()
                self.requested = 0  # counted: neither close() nor the supervisor counts them again
                raise
            now = time.monotonic()
            self.stats.ingest[INGEST_RTT_SECONDS] = now - sent
            per_block = block["sample_s"] / max(block["blocks"], 1)
            self.block_s[r] = 0.8 * self.block_s[r] + 0.2 * per_block if self.block_s[r] else per_block
            if generation == self.generation[r]:
                if self.delivered[r]:
                    self.typical_rtt = 0.9 * self.typical_rtt + 0.1 * (now - sent) if self.typical_rtt else now - sent
                self.delivered[r] = True
                self.last_arrival[r] = now
            if r in self.died_at and generation == self.generation[r]:
                self.event(f"remote sampler {r} is back: first block {now - self.died_at.pop(r):.1f} s after it died")
        self.watch_silent()
        return len(ready)

    def watch_silent(self) -> None:
        """An actor whose node stopped may not be declared dead by Ray for a minute: one that leaves a request
        unanswered far longer than usual is treated as dead here (replaced, within the same budget)."""
        now = time.monotonic()
        for r, generation, sent, k in list(self.inflight.values()):
            if generation != self.generation[r] or self.actors[r] is None:
                continue
            silent = request_overdue(now, sent, k, self.delivered[r], self.last_arrival[r], self.typical_rtt,
                                     self.block_s[r])
            if silent is not None:
                self.died(r, generation, TimeoutError(f"no block for {silent:.0f} s"))

    def died(self, r: int, generation: int, err: Exception) -> None:
        """Replace a dead actor once per death (its other refs in flight fail too), within the restart budget."""
        if generation != self.generation[r] or r in self.retired:
            return
        now = time.monotonic()
        self.died_at.setdefault(r, now)
        why = describe_error(err)
        recent = [t for t in self.restarts.get(r, []) if now - t < 60.0]
        if len(recent) >= self.config.max_restarts_per_minute:
            self.retire(r, f"died ({why}); {len(recent)} restarts in the last minute")
            return
        self._kill(r)
        self.generation[r] += 1
        self.restarts[r] = recent + [now]
        self.stats.ingest[INGEST_RESTARTS] += 1
        self.start(r)
        self.event(f"remote sampler {r} died ({why}); restarted ({len(recent) + 1} in the last minute)")

    def retire(self, r: int, why: str) -> None:
        self._kill(r)
        self.retired.add(r)
        self.stats.ingest[INGEST_ALIVE] = sum(a is not None for a in self.actors)
        self.event(f"remote sampler {r} {why}; not restarting it")

    def _kill(self, r: int, count_lost: bool = True) -> None:
        actor, self.actors[r] = self.actors[r], None
        for ref in [ref for ref, (rr, *_) in self.inflight.items() if rr == r]:
            k = self.inflight.pop(ref)[3]
            if count_lost:
                self.requested -= k
                self.ingest.lost(k)
            else:  # closing: the shared count stays, for the supervisor to count as lost if this process gave up
                self._requested -= k
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone with its node
                pass

    def close(self) -> None:
        """Kill every actor, then leave the cluster: nothing of the run stays on it (the blocks asked for and
        not yet arrived are not lost data when the run is over; after a give-up they are, and the count in
        flight is left in shared memory for the supervisor to add)."""
        try:
            for r in range(len(self.actors)):
                self._kill(r, count_lost=False)
        finally:
            self.stats.ingest[INGEST_ALIVE] = 0
            ray.shutdown()


class ClusterLost(RuntimeError):
    """The driver lost the cluster's head: the remote part ends, local training goes on."""


def build(config, env_info, replay_handle, weights_handle, stats_handle, child, incarnation: int = 0) -> Fleet:
    """``spreeze-ingest`` in its process: attach the replay, join the cluster, start the actors."""
    replay = child.keep(SharedReplay.attach(replay_handle))
    weights = child.keep(SharedWeights.attach(weights_handle))
    stats = child.stats = child.keep(SharedStats.attach(stats_handle))
    try:
        connect(config.ray, run_pid=os.getppid())
    except ClusterError as err:
        _give_up(child, f"lost the Ray cluster; remote sampling ends, {_what_goes_on(config)} ({err})")
    return Fleet(config, env_info, Ingest(config, replay, stats), weights, child.send, incarnation)


def loop(fleet: Fleet, child) -> None:
    """Publish new weights, keep requests open, write what arrived, until stopped or the cluster is gone."""
    try:
        while not child.should_stop():
            fleet.publish()
            fleet.request()
            fleet.poll(0.05)
            if not fleet.retired.isdisjoint(range(len(fleet.actors))) and all(a is None for a in fleet.actors):
                _give_up(child, f"every remote sampler has failed; {_what_goes_on(fleet.config)}")
    except (ray.exceptions.RaySystemError, ConnectionError, ray.exceptions.GetTimeoutError) as err:
        _give_up(child, f"lost the Ray cluster ({type(err).__name__}: {str(err).strip()[:200]}); remote sampling "
                        f"ends, {_what_goes_on(fleet.config)}")


def _what_goes_on(config) -> str:
    return ("and with it this --remote-only run (no local sampler)" if config.remote_only else
            "local training goes on")


def _give_up(child, text: str):
    """Tell the supervisor not to restart us, say why once, and exit (3, as a sampler that gave up)."""
    child.send(GaveUp(child.role.source, text))
    print(f"[spreeze] {child.role.name} stopped: {text}", file=sys.stderr, flush=True)
    sys.exit(3)
