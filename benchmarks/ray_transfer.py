"""Remote samplers on a Ray cluster against the same samplers as local processes (``--ray``), on one machine.

    python -m benchmarks.ray_transfer                  # sampling efficiency: remote Hz / local Hz
    python -m benchmarks.ray_transfer --ingest         # how many rows/s one ingest process takes in
    python -m benchmarks.ray_transfer --learn          # Pendulum-v1 with remote samplers, 3 minutes
    python -m benchmarks.ray_transfer --learn --local-samplers 0   # the same with --remote-only
    python -m benchmarks.ray_transfer --faults         # ray.kill of an actor, a worker node stopped, Ctrl-C
    python -m benchmarks.ray_transfer --head-loss      # the cluster's head stopped: the message, local training
    python -m benchmarks.ray_transfer --cpu            # CPU time per row of the remote path (ingest, actors)

Every mode starts its own local multi-node cluster (``ray.cluster_utils.Cluster``: a head with no CPUs for
actors and one-CPU worker nodes, all on this machine) and shuts it down. The efficiency mode runs ``--samplers``
samplers free-running (no learner, so only sampling and transfer count) for ``--seconds``, once as local
processes writing the shared replay and once as Ray actors whose blocks an ingest in this process writes into
it, and divides the rows/s. ``--ingest`` feeds one ingest as fast as it can, first blocks handed to it directly
(its replay writes alone), then blocks coming through the object store from actors that return a ready block.
Prints a markdown table; writes CSV under benchmarks/results/<machine>/.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil

from benchmarks.common import markdown_table, results_dir, spreeze_command, write_csv

CTX = mp.get_context("spawn")


@contextlib.contextmanager
def local_cluster(workers: int = 2, cpus_per_worker: int = 1):
    """A head (no CPUs: actors go to the workers) and ``workers`` one-CPU nodes on this machine; shut down
    whatever happens. Yields the ``Cluster`` (``.address`` for ``--ray``)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus_per_worker)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def bench_config(env_id: str, samplers: int, envs: int, write_block: int, ray_address: str = ""):
    from spreeze.config import Config

    return Config(env_id=env_id, samplers=samplers, spare_samplers=0, envs_per_sampler=envs,
                  write_block=write_block, learning_starts=0, batch_size=256, buffer_size=200_000,
                  collect_per_update=0.0, hidden_size=256, actor_device="cpu", critic_device="cpu")


def shared_state(config, info):
    from spreeze.algos import make_actor
    from spreeze.replay import SharedReplay
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    replay = SharedReplay.create(info.obs_dim, info.act_dim, config.buffer_size, config.total_envs, CTX,
                                 active_regions=config.active_envs)
    weights = SharedWeights.create(make_actor(config, info.obs_dim, info.act_dim), CTX)
    stats = SharedStats.create(config.sampler_processes, config.remote_samplers)
    return replay, weights, stats


def _local_sampler(index, config, info, handles, ready, stop) -> None:
    """One local sampler process: the product's Sampler over the shared replay, stepping until told to stop."""
    from spreeze.proc import child_setup
    from spreeze.replay import SharedReplay
    from spreeze.sampler import Sampler
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    child_setup(1)
    replay, weights, stats = (SharedReplay.attach(handles[0]), SharedWeights.attach(handles[1]),
                              SharedStats.attach(handles[2]))
    sampler = Sampler(index, config, info, replay, weights, stats)
    ready.wait(timeout=300)  # every sampler built: all start together
    while not stop.is_set():
        sampler.step()
    sampler.close()
    del sampler
    for shared in (replay, weights, stats):
        shared.close()


def measure_local(config, info, seconds: float, warmup_s: float) -> tuple[float, float]:
    """Rows/s written by ``config.samplers`` local processes, counted after ``warmup_s``, and their CPU
    microseconds per row."""
    replay, weights, stats = shared_state(config, info)
    try:
        ready, stop = CTX.Barrier(config.samplers + 1), CTX.Event()
        procs = [CTX.Process(target=_local_sampler, args=(i, config, info, (replay.handle, weights.handle, stats.handle),
                                                         ready, stop)) for i in range(config.samplers)]
        for p in procs:
            p.start()
        ready.wait(timeout=300)
        time.sleep(warmup_s)
        handles = [psutil.Process(p.pid) for p in procs]
        n0, t0, cpu0 = replay.written(), time.time(), sum(_cpu_s(h) for h in handles)
        time.sleep(seconds)
        n1, t1, cpu1 = replay.written(), time.time(), sum(_cpu_s(h) for h in handles)
        stop.set()
        for p in procs:
            p.join(timeout=60)
        return (n1 - n0) / (t1 - t0), 1e6 * (cpu1 - cpu0) / max(n1 - n0, 1)
    finally:
        for shared in (replay, weights, stats):
            shared.close()


def measure_remote(config, info, address: str, seconds: float, warmup_s: float) -> tuple[float, dict]:
    """Rows/s that ``config.remote_samplers`` actors deliver into the replay through an ingest in this process."""
    import ray

    from spreeze.ingest import Ingest
    from spreeze.remote import Fleet, connect

    replay, weights, stats = shared_state(config, info)
    events = []
    try:
        connect(address)
        fleet = Fleet(config, info, Ingest(config, replay, stats), weights, events.append)

        def pump(until: float) -> None:
            while time.time() < until:
                fleet.publish()
                fleet.request()
                fleet.poll(0.05)

        pump(time.time() + 1.0)
        while stats.ingest[0] < config.remote_samplers:  # every actor delivered once: started
            pump(time.time() + 0.5)
        pump(time.time() + warmup_s)
        requests0 = stats.snapshot().get("ingest_requests", 0)
        actors = [psutil.Process(pid) for pid in remote_actor_pids()]
        actor_cpu0 = sum(_cpu_s(p) for p in actors)
        n0, t0, cpu0 = replay.written(), time.time(), time.process_time()
        pump(t0 + seconds)
        n1, t1, cpu1 = replay.written(), time.time(), time.process_time()
        actor_cpu1 = sum(_cpu_s(p) for p in actors)
        snap = stats.snapshot()
        fleet.close()
        rows = max(n1 - n0, 1)
        return (n1 - n0) / (t1 - t0), {"lost_blocks": snap["remote_lost_blocks"], "rtt_ms": 1e3 * snap["remote_block_rtt_s"],
                                       "events": [str(e) for e in events], "rows": n1 - n0,
                                       "ingest_cpu_us_per_row": 1e6 * (cpu1 - cpu0) / rows,
                                       "actor_cpu_us_per_row": 1e6 * (actor_cpu1 - actor_cpu0) / rows,
                                       "rows_per_request": rows / max(snap["ingest_requests"] - requests0, 1)
                                       if "ingest_requests" in snap else None}
    finally:
        ray.shutdown()
        for shared in (replay, weights, stats):
            shared.close()


def _cpu_s(proc) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def cpu_per_row(args) -> list[dict]:
    """CPU time per row of the remote path alone: the ingest (this process: Ray calls, deserializing, replay
    writes) and the actors (env steps, policy, packing, Ray's task handling). CPU time, not wall time: it holds
    on a loaded machine, where rates do not. ``--samplers`` actors on as many one-CPU worker nodes."""
    from spreeze.envs import check_env

    info = check_env(args.env)
    config = replace(bench_config(args.env, 1, args.envs_per_sampler, args.write_block),
                     remote_samplers=args.samplers, remote_inflight=args.inflight)
    rows = []
    with local_cluster(args.samplers) as cluster:
        for repeat in range(args.repeats):
            _, local_cpu = measure_local(replace(config, samplers=args.samplers, remote_samplers=0), info,
                                         args.seconds, args.warmup)
            hz, extra = measure_remote(replace(config, ray=cluster.address), info, cluster.address, args.seconds,
                                       args.warmup)
            rows.append({"env": args.env, "repeat": repeat, "samplers": args.samplers,
                         "envs_per_sampler": args.envs_per_sampler, "write_block": args.write_block,
                         "remote_hz": hz, "rows_per_request": extra["rows_per_request"],
                         "ingest_cpu_us_per_row": extra["ingest_cpu_us_per_row"],
                         "actor_cpu_us_per_row": extra["actor_cpu_us_per_row"],
                         "local_sampler_cpu_us_per_row": local_cpu, "lost_blocks": extra["lost_blocks"],
                         "load_avg_1min": os.getloadavg()[0]})
    return rows


def efficiency(args) -> list[dict]:
    from spreeze.envs import check_env

    info = check_env(args.env)
    local_cfg = bench_config(args.env, args.samplers, args.envs_per_sampler, args.write_block)
    rows = []
    with local_cluster(args.samplers) as cluster:
        for repeat in range(args.repeats):  # local and remote in turns, so that a drifting load hits both
            local_hz, local_cpu = measure_local(local_cfg, info, args.seconds, args.warmup)
            remote_cfg = replace(local_cfg, samplers=1, ray=cluster.address, remote_samplers=args.samplers)
            remote_hz, extra = measure_remote(remote_cfg, info, cluster.address, args.seconds, args.warmup)
            rows.append({"env": args.env, "repeat": repeat, "samplers": args.samplers,
                         "envs_per_sampler": args.envs_per_sampler, "write_block": args.write_block,
                         "local_hz": local_hz, "remote_hz": remote_hz, "remote_efficiency": remote_hz / local_hz,
                         "lost_blocks": extra["lost_blocks"], "request_rtt_ms": extra["rtt_ms"],
                         "rows_per_request": extra["rows_per_request"], "local_cpu_us_per_row": local_cpu,
                         "actor_cpu_us_per_row": extra["actor_cpu_us_per_row"],
                         "ingest_cpu_us_per_row": extra["ingest_cpu_us_per_row"],
                         "load_avg_1min": os.getloadavg()[0]})
    return rows


class _BlockServer:
    """An actor that hands out the same ready block on every call: the object store's cost alone."""

    def __init__(self, block):
        self.block = block

    def collect(self, *args):
        return self.block


def ingest_rate(args) -> list[dict]:
    """Rows/s one ingest writes: blocks handed over directly, then through the object store."""
    import ray

    from spreeze.envs import check_env
    from spreeze.ingest import Ingest, pack, remote_regions

    results = []
    for env_id in args.ingest_envs:
        info = check_env(env_id)
        config = replace(bench_config(env_id, 1, args.envs_per_sampler, args.write_block), ray="auto",
                         remote_samplers=args.samplers)
        replay, weights, stats = shared_state(config, info)
        try:
            ingest = Ingest(config, replay, stats)
            blocks, rows = [], config.write_block
            for r in range(config.remote_samplers):
                parts = [(region, *(np.random.rand(*shape).astype(np.float32) for shape in
                                    ((rows, info.obs_dim), (rows, info.act_dim), (rows,), (rows, info.obs_dim), (rows,))))
                         for region in remote_regions(config, r) for _ in range(args.blocks_per_request)]
                blocks.append({**pack(parts), "blocks": args.blocks_per_request, "env_steps": len(parts) * rows,
                               "episodes": 0, "dropped_episodes": 0, "train_return": float("nan")})
            began, n = time.perf_counter(), 0
            while time.perf_counter() - began < args.seconds / 2:
                for r, block in enumerate(blocks):
                    n += ingest.write(r, block)
            direct = n / (time.perf_counter() - began)
            with local_cluster(args.samplers) as cluster:
                ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
                servers = [ray.remote(num_cpus=1)(_BlockServer).remote(block) for block in blocks]
                inflight = {s.collect.remote(): r for r, s in enumerate(servers) for _ in range(args.inflight)}
                ray.wait(list(inflight), num_returns=len(inflight), timeout=60)
                began, cpu, n = time.perf_counter(), time.process_time(), 0
                while time.perf_counter() - began < args.seconds / 2:
                    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
                    for ref in ready:
                        r = inflight.pop(ref)
                        n += ingest.write(r, ray.get(ref))
                        inflight[servers[r].collect.remote()] = r
                through_store = n / (time.perf_counter() - began)
                cpu_per_row = (time.process_time() - cpu) / max(n, 1)
            row_bytes = 4 * (2 * info.obs_dim + info.act_dim + 2)
            results.append({"env": env_id, "request_rows": config.envs_per_sampler * rows * args.blocks_per_request,
                            "row_bytes": row_bytes, "direct_rows_per_s": direct,
                            "object_store_rows_per_s": through_store,
                            "object_store_mb_per_s": through_store * row_bytes / 1e6,
                            "object_store_ingest_cpu_us_per_row": 1e6 * cpu_per_row})
        finally:
            for shared in (replay, weights, stats):
                shared.close()
    return results


def run_cmd(address: str, run_dir: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [*spreeze_command(), "--env", "Pendulum-v1", "--ray", address, "--no-window", "--no-tensorboard",
           "--run-dir", str(run_dir), "--batch-size", "256", "--spare-samplers", "0", *extra]
    env = {**os.environ, "SPREEZE_CACHE_DIR": str(run_dir.parent / "cache")}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def learn(args) -> list[dict]:
    """The issue's target: remote samplers learn Pendulum-v1 to a mean of the last 3 tests >= -300 in 3 min."""
    with tempfile.TemporaryDirectory() as tmp, local_cluster(args.samplers) as cluster:
        run_dir = Path(tmp) / "run"
        began = time.time()
        local = ["--samplers", str(args.local_samplers)] if args.local_samplers else ["--remote-only"]
        proc = run_cmd(cluster.address, run_dir, [*local, "--remote-samplers", str(args.samplers),
                                                  "--minutes", str(args.minutes), "--eval-interval-s", "5"])
        out, _ = proc.communicate(timeout=args.minutes * 60 + 300)
        wall = time.time() - began
        evals = read_rows(run_dir / "evaluations.csv")
        summary = json.loads((run_dir / "summary.json").read_text())
    print(out[-3000:])
    returns = [float(e["test_return"]) for e in evals]
    last3 = float(np.mean(returns[-3:]))
    # wall time since launch (run.py's start-up included) when the mean of the last 3 tests first reached -300
    reached = next((float(e["time_s"]) for i, e in enumerate(evals) if i >= 2 and np.mean(returns[i - 2: i + 1]) >= -300),
                   None)
    return [{"env": "Pendulum-v1", "local_samplers": args.local_samplers, "remote_samplers": args.samplers,
             "minutes": args.minutes,
             "end_to_end_s": wall, "tests": len(evals), "mean_last3_test_return": last3,
             "mean3_reached_-300_at_s": reached,
             "local_hz": summary["local_sampling_frame_rate_hz"], "remote_hz": summary["remote_sampling_frame_rate_hz"],
             "ingest_rows_per_s": summary["ingest_rows_per_s"], "lost_blocks": summary["remote_lost_blocks"],
             "exit_code": proc.returncode}]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_remote_rows(metrics: Path, timeout_s: float) -> bool:
    """True once ``metrics.csv`` has a row with remote samplers delivering and the learner updating."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if any(float(r["remote_sampling_hz"] or 0) > 0 and int(r["updates"]) > 0 for r in read_rows(metrics)):
            return True
        time.sleep(0.5)
    return False


def remote_actor_pids() -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [""])[0].startswith("ray::RemoteSampler"):
            found.append(p.pid)
    return found


def wait_for(path: Path, pattern: str, timeout_s: float, after: int = 0) -> float | None:
    """Seconds until ``pattern`` appears in ``path`` past its first ``after`` matches, or None."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        text = path.read_text() if path.exists() else ""
        if len(re.findall(pattern, text)) > after:
            return time.monotonic() - began
        time.sleep(0.2)
    return None


def faults(args) -> list[dict]:
    """ray.kill of a remote sampler actor, a worker node stopped, then Ctrl-C: timings and what is left."""
    import ray

    from spreeze.remote import namespace
    from spreeze.shm import live_segments

    rows = []
    with tempfile.TemporaryDirectory() as tmp, local_cluster(args.samplers + 1) as cluster:
        run_dir = Path(tmp) / "run"
        events = run_dir / "events.log"
        proc = run_cmd(cluster.address, run_dir, ["--samplers", "1", "--remote-samplers", str(args.samplers),
                                                  "--log-interval-s", "1", "--learning-starts", "1000"])
        try:
            metrics = run_dir / "metrics.csv"
            if not wait_remote_rows(metrics, 180):
                raise RuntimeError("the remote samplers delivered nothing in 180 s")
            ray.init(address=cluster.address, namespace=namespace(proc.pid), logging_level="ERROR", log_to_driver=False)
            actor = ray.get_actor("sampler-0.0")
            ray.kill(actor, no_restart=True)
            killed = time.monotonic()
            died = wait_for(events, r"remote sampler 0 died", 120)
            back = wait_for(events, r"remote sampler 0 is back", 120)
            rows.append({"fault": "ray.kill of remote sampler 0", "detected_and_restarted_s": died,
                         "first_block_after_s": back and time.monotonic() - killed})
            # a worker node that hosts remote sampler 1 but not the ingest's own raylet (on one machine every node
            # has the same IP, and the driver may have joined through a worker node; on a real cluster it joins
            # through the learner machine's node, which is not the one that fails)
            driver_node = re.search(r"through node (\w+)", events.read_text()).group(1)
            node_id = ray.get(ray.get_actor("sampler-1.0").node_id.remote(), timeout=30)
            if node_id == driver_node:
                raise RuntimeError("remote sampler 1 shares the ingest's node; run the drill again")
            node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
            ray.shutdown()
            cluster.remove_node(node)
            stopped = time.monotonic()
            died = wait_for(events, r"remote sampler 1 died", 180)
            back = wait_for(events, r"remote sampler 1 is back", 180)
            rows.append({"fault": "worker node of remote sampler 1 stopped", "detected_and_restarted_s": died,
                         "first_block_after_s": back and time.monotonic() - stopped})
            time.sleep(5)
            updates = int(read_rows(metrics)[-1]["updates"])
            time.sleep(6)
            training_goes_on = int(read_rows(metrics)[-1]["updates"]) > updates
        finally:
            stop = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        time.sleep(3)
        left = remote_actor_pids()
        rows.append({"fault": "Ctrl-C", "detected_and_restarted_s": None, "first_block_after_s": None,
                     "exit_s": time.monotonic() - stop, "exit_code": proc.returncode, "actors_left": len(left),
                     "segments_left": len(live_segments(proc.pid)), "training_went_on": training_goes_on})
        print(events.read_text() if events.exists() else out[-3000:])
    return rows


def head_loss(args) -> list[dict]:
    """The cluster's head stopped under a running run (1 local + ``--samplers`` remote samplers): how long until
    the ingest says so, whether local training goes on, then Ctrl-C. On one machine the ingest joins through one
    of the nodes' raylets; the head's is the one the README's layout puts on the learner's machine."""
    from spreeze.shm import live_segments

    with tempfile.TemporaryDirectory() as tmp, local_cluster(args.samplers) as cluster:
        run_dir = Path(tmp) / "run"
        events, metrics = run_dir / "events.log", run_dir / "metrics.csv"
        proc = run_cmd(cluster.address, run_dir, ["--samplers", "1", "--remote-samplers", str(args.samplers),
                                                  "--log-interval-s", "1", "--learning-starts", "1000"])
        try:
            if not wait_remote_rows(metrics, 180):
                raise RuntimeError("the remote samplers delivered nothing in 180 s")
            joined_head = re.search(r"through node (\w+)", events.read_text()).group(1) == cluster.head_node.node_id
            stopped = time.monotonic()
            cluster.remove_node(cluster.head_node)  # its processes killed: seconds
            said = wait_for(events, r"spreeze-ingest exited with code 3; not restarting it", 180)
            said = said and time.monotonic() - stopped
            time.sleep(1)
            before = read_rows(metrics)[-1]
            time.sleep(5)
            after = read_rows(metrics)[-1]
            text = events.read_text()
        finally:
            stop = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        print(text if events.exists() else out[-3000:])
        lines = [line for line in text.splitlines() if "spreeze-ingest" in line]
        return [{"fault": "head node stopped (cluster.remove_node)", "ingest_joined_through_head": joined_head,
                 "message_after_s": said, "ingest_restarts": sum("restarted" in line for line in lines),
                 "message": lines[-1].split("not restarting it: ", 1)[-1] if lines else "",
                 "updates_in_5s_after": int(after["updates"]) - int(before["updates"]),
                 "local_hz_after": float(after["local_sampling_hz"]), "exit_s": time.monotonic() - stop,
                 "exit_code": proc.returncode, "segments_left": len(live_segments(proc.pid)),
                 "actors_left": len(remote_actor_pids())}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--samplers", type=int, default=2, help="remote samplers (and local ones to compare)")
    parser.add_argument("--envs-per-sampler", type=int, default=4)
    parser.add_argument("--write-block", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--inflight", type=int, default=2)
    parser.add_argument("--blocks-per-request", type=int, default=1, help="--ingest: blocks in each request")
    parser.add_argument("--repeats", type=int, default=2, help="efficiency: local/remote measurement pairs")
    parser.add_argument("--minutes", type=float, default=3.0, help="--learn: the run's budget")
    parser.add_argument("--local-samplers", type=int, default=1, help="--learn: local sampler processes beside "
                        "the remote ones; 0: --remote-only")
    parser.add_argument("--ingest-envs", nargs="+", default=["Pendulum-v1", "Walker2DBulletEnv-v0"])
    mode = parser.add_mutually_exclusive_group()
    for flag in ("--ingest", "--learn", "--faults", "--head-loss", "--cpu"):
        mode.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    name = next((m for m in ("ingest", "learn", "faults", "head_loss", "cpu") if getattr(args, m)), "efficiency")
    rows = {"ingest": ingest_rate, "learn": learn, "faults": faults, "head_loss": head_loss, "cpu": cpu_per_row,
            "efficiency": efficiency}[name](args)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    rows = [{k: row.get(k, "") for k in keys} for row in rows]
    print(markdown_table(rows))
    path = results_dir() / f"ray_transfer-{name}.csv"
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
