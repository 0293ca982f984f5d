"""Autotune: decisions on fake machines, the profile cache, the CPU governor, and one real short probe."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest

from autotune import (ProbeFailed, ProbeSettings, SHORT_SETTINGS, cache, decide, probe, remember_noise_scale,
                      summary_lines, tune)
from autotune.governor import CpuGovernor
from spreeze.config import Config, ConfigError
from spreeze.envs import EnvInfo

GiB = 2**30
MiB = 2**20
WALKER = EnvInfo("Walker2DBulletEnv-v0", 22, 6, (-1.0,) * 6, (1.0,) * 6, 1000)


# ----- fake hardware --------------------------------------------------------------------------------
def sweep_model(rows_per_s: float, overhead_s: float, max_batch: int = decide.MAX_BATCH, gpu: bool = True):
    """A learner whose update costs ``overhead + batch / rows_per_s``; a GPU reports the busy share."""
    points = []
    for b in decide.batch_candidates(max_batch):
        busy = b / rows_per_s
        t = overhead_s + busy
        points.append(decide.Measurement(b, 1.0 / t, 100.0 * busy / t if gpu else None))
    return points


def sweep_until_stop(points):
    """What probe.measure_learner records: points up to the one where the rule stops."""
    taken = []
    for p in points:
        taken.append(p)
        if decide.sweep_should_stop(taken):
            break
    return taken


# GPU compute in rows per second of one SAC update at 3 ms fixed cost per update (kernel launches),
# and the largest batch that fits in the card's memory
GTX_950M = dict(rows_per_s=180e3, max_batch=16_384)    # 2 GiB laptop card
GTX_1060 = dict(rows_per_s=700e3, max_batch=65_536)    # 6 GiB
RTX_2070S = dict(rows_per_s=1.4e6, max_batch=65_536)   # 8 GiB


def measurements(logical, physical, gpus=(), cpu_rows_per_s=40e3, env_step_s=3.3e-4, rss=300 * MiB,
                 mem_available=30 * GiB):
    """The dict probe.py would record on such a machine (two GPUs: actor/critic split, ~10% faster)."""
    if gpus:
        card = gpus[0]
        rows = card["rows_per_s"] * (1.1 if len(gpus) >= 2 else 1.0)
        sweep = sweep_until_stop(sweep_model(rows, 3e-3, card["max_batch"], gpu=True))
    else:
        sweep = sweep_until_stop(sweep_model(cpu_rows_per_s, 2e-3, gpu=False))
    return {"cpu": {"logical": logical, "physical": physical, "background_cores": 0.0, "per_core_percent": []},
            "memory": {"total": mem_available + GiB, "available": mem_available},
            "sampler": {"env_step_s": env_step_s, "steps_per_s": 1 / env_step_s, "rss_bytes": rss, "envs": 1},
            "learner": {"on_gpu": bool(gpus), "threads": 1 if gpus else decide.cpu_learner_cores(physical),
                        "devices": ["cuda:0"] if gpus else ["cpu"],
                        "sweep": [{"batch": p.batch, "updates_per_s": p.updates_per_s, "gpu_util": p.gpu_util}
                                  for p in sweep], "stopped": "model"}}


def plan_for(m, collect_per_update=0.0, samplers_given=None, batch_given=None, buffer_size=1_000_000):
    return decide.plan(m, samplers_given=samplers_given, batch_given=batch_given, buffer_size=buffer_size,
                       collect_per_update=collect_per_update, mem_available=m["memory"]["available"],
                       replay_bytes=GiB // 5)


def test_the_chosen_sampler_count_leaves_a_replay_split_the_config_accepts():
    """--buffer-size 10,000 with the default warm-up of 10,000 on an 8-thread, 4-core machine: the tuner took 3
    samplers x 4 envs, whose regions hold 833 x 12 = 9,996 rows, and the config then refused the launch after
    profiling (at every relaunch: the profile is cached). It takes the most samplers whose split still fits."""
    m = measurements(8, 4, env_step_s=0.002)
    common = dict(samplers_given=None, batch_given=None, buffer_size=10_000, collect_per_update=0.0,
                  mem_available=m["memory"]["available"], replay_bytes=GiB // 5)
    free = decide.plan(m, **common)
    fitted = decide.plan(m, **common, replay_split={"envs_per_sampler": 4, "warm_up": 10_000, "min_region_rows": 32})
    assert free["samplers"]["value"] == 3 and fitted["samplers"]["value"] == 2
    assert "2, not 3: --buffer-size 10,000 split over more samplers' envs" in fitted["samplers"]["reason"]
    with pytest.raises(ConfigError, match="the warm-up needs 10,000 transitions"):
        Config(buffer_size=10_000, samplers=3, batch_size=free["batch_size"]["value"]).validate()
    Config(buffer_size=10_000, samplers=2, batch_size=fitted["batch_size"]["value"]).validate()
    # a write block per env: 5,000 slots over 40 envs are 125 each, over 160 envs 31 (under 32)
    assert decide.replay_fits(10, buffer_size=5_000, envs_per_sampler=4, min_region_rows=32)
    assert not decide.replay_fits(40, buffer_size=5_000, envs_per_sampler=4, min_region_rows=32)


def test_paused_spare_samplers_are_priced_in_the_memory_limit():
    """The spares are processes from the start (the governor may resume them): the memory limit left them out."""
    kwargs = dict(logical_cores=64, physical_cores=64, env_step_s=1e-3, mem_available=8 * GiB,
                  per_sampler_bytes=512 * MiB, learner_on_gpu=True, replay_bytes=GiB, headroom_bytes=GiB)
    without, _ = decide.choose_samplers(**kwargs)
    with_one, reason = decide.choose_samplers(**kwargs, spare_samplers=1)
    assert with_one == without - 1 and "limited by memory" in reason and "1 spare sampler(s)" in reason


# ----- batch size -----------------------------------------------------------------------------------
def test_paper_machines_get_paper_like_settings():
    """Laptop (4710MQ + GTX 950M) -> 4 samplers, batch 2048; server (20-core Xeon + RTX 2070S) -> 20, 16384."""
    laptop = plan_for(measurements(8, 4, [GTX_950M], mem_available=12 * GiB))
    assert (laptop["samplers"]["value"], laptop["batch_size"]["value"]) == (4, 2048)
    server = plan_for(measurements(40, 20, [RTX_2070S], mem_available=60 * GiB))
    assert (server["samplers"]["value"], server["batch_size"]["value"]) == (20, 16_384)
    desktop = plan_for(measurements(24, 12, [GTX_1060], mem_available=28 * GiB))  # 5900X + GTX 1060
    assert desktop["samplers"]["value"] == 12
    assert 4096 <= desktop["batch_size"]["value"] <= 16_384
    for chosen in (laptop, server, desktop):
        assert chosen["samplers"]["by"] == chosen["batch_size"]["by"] == "profile"
        assert chosen["expected"]["updates_per_s"] >= decide.MIN_UPDATES_PER_S


def h200_walker_profile(noise_scale=None):
    """What the probe measured on a lent H200 machine (16 cores, Walker2d-v5, docs/benchmarks.md): the update
    costs about the same from batch 256 to 32,768; one sampler makes about 2,790 steps/s."""
    sweep = [(256, 132.0), (512, 135.1), (1024, 136.5), (2048, 125.7), (4096, 133.7), (8192, 133.2),
             (16384, 131.5), (32768, 126.6), (65536, 89.0)]
    return {"cpu": {"logical": 16, "physical": 16, "background_cores": 0.1, "per_core_percent": []},
            "memory": {"total": 126 * GiB, "available": 125 * GiB},
            "sampler": {"env_step_s": 3.586e-4, "steps_per_s": 2_789.0, "rss_bytes": 531 * MiB, "envs": 4},
            "learner": {"on_gpu": True, "threads": 1, "devices": ["cuda:0"], "stopped": "GPU 100% busy",
                        "sweep": [{"batch": b, "updates_per_s": u, "gpu_util": None} for b, u in sweep],
                        **({"noise_scale": noise_scale} if noise_scale is not None else {})}}


def test_knee_rule_on_graphed_updates_walks_on_the_frame_rate_alone():
    """The H200's profile with CUDA graphs (Walker2d-v5, 2026-11-28): replays kept the GPU 100 % busy at every batch,
    so the 85 %-busy stop held batch 256 whatever the frame rates; timed graphed, the knee is where doubling stops
    paying (8,192 -> 16,384: +10 %)."""
    m = h200_walker_profile()
    m["learner"]["sweep"] = [{"batch": b, "updates_per_s": u, "gpu_util": 100.0} for b, u in (
        (256, 1724.0), (512, 1618.0), (1024, 1571.0), (2048, 1222.0), (4096, 891.0), (8192, 567.0), (16384, 312.0))]
    eager, graphed = (decide.plan(m, samplers_given=None, batch_given=None, buffer_size=1_000_000,
                                  collect_per_update=-1, mem_available=125 * GiB, replay_bytes=GiB // 3,
                                  batch_rule="knee", cuda_graphs=graphs) for graphs in (False, True))
    assert eager["batch_size"]["value"] == 256 and "already keeps the GPU" in eager["batch_size"]["reason"]
    assert graphed["batch_size"]["value"] == 8192 and "saturation knee" in graphed["batch_size"]["reason"]


def test_noise_rule_provisions_samplers_for_the_batch_the_learner_may_grow_to():
    """On the H200 the launch batch (256, collect:update 8) needed one sampler, and the learner then grew its batch
    to 16,384 (collect:update 512) on update rates that one or two samplers could not feed: 21 updates/s in the run
    against 132 in the probe. The samplers are now provisioned for the largest batch the rule may take, and the
    batch is chosen among the rates those samplers can feed."""
    for noise_scale, batch in ((None, 256), (37.0, 4096), (446.0, 4096), (1e6, 8192)):
        m = h200_walker_profile(noise_scale)
        chosen = decide.plan(m, samplers_given=None, batch_given=None, buffer_size=1_000_000, collect_per_update=-1,
                             mem_available=m["memory"]["available"], replay_bytes=GiB // 3, batch_rule="noise")
        assert chosen["samplers"]["value"] == 10, chosen["samplers"]["reason"]  # the CPU target, not the launch batch
        assert "limited by CPU target" in chosen["samplers"]["reason"]
        assert chosen["batch_size"]["value"] == batch, chosen["batch_size"]["reason"]
        expected = chosen["expected"]
        assert expected["learner_demand_steps_per_s"] <= expected["sampling_steps_per_s"]  # fed
    knee = decide.plan(h200_walker_profile(), samplers_given=None, batch_given=None, buffer_size=1_000_000,
                       collect_per_update=-1, mem_available=125 * GiB, replay_bytes=GiB // 3, batch_rule="knee")
    assert knee["batch_size"]["value"] == 65536  # the knee rule is unchanged: demand at its own batch
    small = decide.plan(h200_walker_profile(), samplers_given=None, batch_given=None, buffer_size=1_000_000,
                        collect_per_update=8.0, mem_available=125 * GiB, replay_bytes=GiB // 3, batch_rule="noise")
    assert small["samplers"]["value"] == 1 and "the largest learner demand among the batches" in \
        small["samplers"]["reason"] and "at batch 1024" in small["samplers"]["reason"]  # where the rate peaks
    # samplers given by hand: the batch is what they can feed, and remote samplers (--ray) feed it too
    one, one_and_remote = (decide.plan(h200_walker_profile(446.0), samplers_given=1, batch_given=None,
                                       buffer_size=1_000_000, collect_per_update=-1, mem_available=125 * GiB,
                                       replay_bytes=GiB // 3, batch_rule="noise", remote_samplers=remote)
                           for remote in (0, 9))
    assert one["batch_size"]["value"] == 512 and "capped at what 1 sampler(s) collect" in one["batch_size"]["reason"]
    assert one_and_remote["batch_size"]["value"] == 4096


def test_remote_samplers_take_their_share_of_the_learner_demand_from_the_local_ones():
    """--ray: local samplers are sized for what the learner consumes less what the remote ones collect."""
    m = measurements(40, 20)
    local = {remote: decide.plan(m, samplers_given=None, batch_given=None, buffer_size=1_000_000,
                                 collect_per_update=64.0, mem_available=m["memory"]["available"], replay_bytes=GiB // 5,
                                 remote_samplers=remote)["samplers"] for remote in (0, 2, 100)}
    assert "learner demand" in local[0]["reason"] and local[0]["value"] >= 3
    assert local[2]["value"] < local[0]["value"] and "less what 2 remote sampler(s) collect" in local[2]["reason"]
    assert local[100]["value"] == 1  # the cluster feeds it all: one local sampler still runs
    # the expected update rate is what the samplers given can feed, not the probe's rate alone (knee rule)
    one = decide.plan(m, samplers_given=1, batch_given=None, buffer_size=1_000_000, collect_per_update=64.0,
                      mem_available=m["memory"]["available"], replay_bytes=GiB // 5)
    assert one["expected"]["updates_per_s"] == pytest.approx(1 / m["sampler"]["env_step_s"] / 64.0)
    assert one["expected"]["learner_demand_steps_per_s"] <= one["expected"]["sampling_steps_per_s"] * (1 + 1e-9)


def test_the_ingest_of_remote_rows_takes_its_cores_from_the_local_samplers():
    """--ray: the ingest process (Ray's requests, and the replay write of every remote row) runs on this
    machine; it is counted for the rows the remote samplers collect, up to the one core a process can use."""
    m = measurements(16, 16, [RTX_2070S])  # free-running, GPU learner: the CPU target binds
    chosen = {remote: decide.plan(m, samplers_given=None, batch_given=None, buffer_size=1_000_000,
                                  collect_per_update=0.0, mem_available=m["memory"]["available"],
                                  replay_bytes=GiB // 5, remote_samplers=remote)["samplers"] for remote in (0, 1, 100)}
    assert "limited by CPU target" in chosen[0]["reason"] and "ingest" not in chosen[0]["reason"]
    one_row_s = 1 / m["sampler"]["env_step_s"] * decide.INGEST_CPU_S_PER_ROW  # one remote sampler's rows
    assert f"- {one_row_s:.2f} ingest of the remote samplers' rows" in chosen[1]["reason"]
    assert "- 1.00 ingest" in chosen[100]["reason"] and chosen[100]["value"] == chosen[0]["value"] - 1


@pytest.mark.parametrize("n_gpus", [0, 1, 2])
@pytest.mark.parametrize("machine", ["laptop", "desktop", "server"])
def test_every_machine_and_gpu_count_gets_a_sensible_choice(machine, n_gpus):
    logical, physical, card, mem = {"laptop": (8, 4, GTX_950M, 12 * GiB), "desktop": (24, 12, GTX_1060, 28 * GiB),
                                    "server": (40, 20, RTX_2070S, 60 * GiB)}[machine]
    m = measurements(logical, physical, [card] * n_gpus, mem_available=mem)
    chosen = plan_for(m)
    samplers, batch = chosen["samplers"]["value"], chosen["batch_size"]["value"]
    learner_cores = 1 if n_gpus else decide.cpu_learner_cores(physical)
    assert 1 <= samplers <= physical
    assert samplers + learner_cores + decide.EVALUATOR_CORES <= 0.75 * logical + 1e-9  # CPU target kept
    assert batch in decide.batch_candidates()
    assert chosen["expected"]["updates_per_s"] >= decide.MIN_UPDATES_PER_S
    if n_gpus == 0:
        assert batch <= 1024  # a CPU learner saturates early; large batches would starve the update rate
    else:
        assert batch >= 2048
        util = [p["gpu_util"] for p in m["learner"]["sweep"] if p["batch"] == batch][0]
        assert 60 <= util <= decide.TARGET_GPU_PERCENT + 1  # close below the 85 % target
    assert chosen["samplers"]["reason"] and chosen["batch_size"]["reason"]


def test_batch_grows_with_gpu_compute_and_memory():
    previous = 0
    for rows in [50e3, 100e3, 200e3, 400e3, 800e3, 1.6e6, 3.2e6, 6.4e6, 12.8e6]:
        batch, _ = decide.choose_batch_size(sweep_model(rows, 3e-3))
        assert batch >= previous, f"{rows:g} rows/s chose {batch} < {previous}"
        previous = batch
    assert previous > 2048  # it really grows
    previous = 0
    for max_batch in [256, 512, 2048, 8192, 65_536]:  # more GPU memory -> the sweep reaches further
        batch, _ = decide.choose_batch_size(sweep_model(1.4e6, 3e-3, max_batch))
        assert batch >= previous
        previous = batch
    assert previous == 16_384


def test_batch_rules_knee_floor_and_gpu_target():
    # frame rate flat from the start (saturated device): the smallest batch keeps the update rate
    flat = [(256, 400.0, None), (512, 205.0, None), (1024, 103.0, None)]
    assert decide.choose_batch_size(flat)[0] == 256
    # doubling pays until 2048, then only +5 %
    knee = [(256, 400.0, None), (512, 390.0, None), (1024, 380.0, None), (2048, 300.0, None), (4096, 157.0, None)]
    batch, reason = decide.choose_batch_size(knee)
    assert batch == 2048 and "knee" in reason
    # frame rate still growing, but 1024 would fall below the update-frequency floor
    slow = [(256, 150.0, None), (512, 90.0, None), (1024, 35.0, None)]
    batch, reason = decide.choose_batch_size(slow)
    assert batch == 512 and "floor" in reason
    # even the smallest batch is below the floor: smallest
    assert decide.choose_batch_size([(256, 20.0, None), (512, 15.0, None)])[0] == 256
    # the GPU reports 85 % busy at 4096: stop there although the frame rate still grows
    gpu = [(1024, 300.0, 50.0), (2048, 280.0, 70.0), (4096, 250.0, 86.0), (8192, 200.0, 95.0)]
    batch, reason = decide.choose_batch_size(gpu)
    assert batch == 4096 and "GPU 86%" in reason
    # never above the replay size; unsorted input is fine
    assert decide.choose_batch_size(list(reversed(gpu)), max_batch=2048)[0] == 2048
    with pytest.raises(ValueError):
        decide.choose_batch_size([])


def test_knee_rule_is_the_85_percent_busy_rule_without_nvml():
    """No utilisation reading (CPU, or a board NVML cannot read): the frame-rate knee alone lands where the
    device spends 74-85 % of an update on the batch, i.e. the paper's 85 % target."""
    t0 = 3e-3
    for rows in [60e3, 100e3, 180e3, 350e3, 700e3, 1.4e6, 2.8e6]:
        batch, _ = decide.choose_batch_size(sweep_model(rows, t0, gpu=False))
        busy = lambda b: (b / rows) / (t0 + b / rows)  # noqa: E731
        assert busy(batch) <= 0.85 < busy(2 * batch), (rows, batch)
    # a 10 % gain is not worth halving the update rate; a 20 % gain is
    assert decide.choose_batch_size([(256, 1000.0, None), (512, 550.0, None)])[0] == 256
    assert decide.choose_batch_size([(256, 1000.0, None), (512, 600.0, None)])[0] == 512


def test_cpu_learner_doubles_the_batch_only_when_frames_per_second_pay_for_the_lost_updates():
    # measured on the 2-core CPU, Walker2D: 512 adds 25 % frames/s for 38 % fewer updates, and learned worse
    walker_cpu = [(256, 90.0, None), (512, 56.0, None), (1024, 32.0, None)]
    batch, reason = decide.choose_batch_size(walker_cpu, min_gain=decide.min_gain_for(on_gpu=False))
    assert batch == 256 and "needs 50%" in reason
    # a GPU whose utilisation NVML cannot read keeps the 85 %-busy knee rule on the same numbers
    assert decide.choose_batch_size(walker_cpu, min_gain=decide.min_gain_for(on_gpu=True))[0] == 512
    # a CPU with real headroom (near-linear frames/s) still grows its batch
    roomy = [(256, 400.0, None), (512, 390.0, None), (1024, 300.0, None), (2048, 120.0, None)]
    assert decide.choose_batch_size(roomy, min_gain=decide.min_gain_for(on_gpu=False))[0] == 1024


def test_sweep_stop_rule_agrees_with_the_choice():
    for rows in [60e3, 180e3, 700e3, 1.4e6, 5e6]:
        full = sweep_model(rows, 3e-3)
        taken = sweep_until_stop(full)
        assert decide.choose_batch_size(taken)[0] == decide.choose_batch_size(full)[0]
        assert len(taken) <= len(full)
    assert decide.sweep_should_stop([]) is None
    assert decide.sweep_should_stop([(256, 500.0, None), (512, 480.0, None)]) is None  # still doubling
    # a GPU busy at the smallest batch (CUDA graphs replayed back to back): the sweep goes on while frames/s grow,
    # for the noise rule; the knee rule still takes the first busy batch from the whole sweep
    busy = [(256, 900.0, 95.0), (512, 880.0, 97.0), (1024, 800.0, 98.0), (2048, 420.0, 99.0)]
    assert decide.sweep_should_stop(busy[:3]) is None and "needs" in decide.sweep_should_stop(busy)
    assert decide.choose_batch_size(busy)[0] == 256
    # a slow learner under the floor at the smallest batch: the sweep stopped there with one point, so the noise
    # rule (which may still find a larger batch faster per second) had nothing to weigh; one doubling more
    slow = [(256, 30.0, None), (512, 22.0, None), (1024, 15.0, None)]
    assert decide.sweep_should_stop(slow[:1]) is None and "floor" in decide.sweep_should_stop(slow[:2])
    assert len(sweep_until_stop(slow)) == 2 and decide.choose_batch_size(slow)[0] == 256
    from spreeze.noise_scale import batch_for_noise_scale

    assert batch_for_noise_scale([(b, u) for b, u, _ in slow[:2]], 2000.0)[0] == 512


def test_updates_per_s_interpolation():
    points = [(256, 400.0, None), (1024, 100.0, None)]
    assert decide.updates_per_s_at(points, 256) == 400.0
    assert decide.updates_per_s_at(points, 512) == pytest.approx(200.0)
    assert decide.updates_per_s_at(points, 128) == 400.0
    assert decide.updates_per_s_at(points, 4096) == pytest.approx(25.0)  # flat frame rate beyond the sweep


# ----- samplers -------------------------------------------------------------------------------------
def samplers(**kw):
    args = dict(logical_cores=8, physical_cores=4, env_step_s=3e-4, mem_available=16 * GiB,
                per_sampler_bytes=300 * MiB, learner_on_gpu=True)
    args.update(kw)
    return decide.choose_samplers(**args)


def test_samplers_never_fewer_with_more_cores():
    for on_gpu in (True, False):
        for smt in (1, 2):
            previous = 0
            for physical in range(1, 65):
                n, reason = samplers(logical_cores=smt * physical, physical_cores=physical, learner_on_gpu=on_gpu,
                                     mem_available=1000 * GiB)
                assert n >= previous, f"{physical} cores ({smt} threads each, gpu={on_gpu}): {n} < {previous}"
                assert n >= 1 and reason
                previous = n
            assert previous >= 30  # and it really scales
        for physical in (2, 4, 8, 16):  # more logical CPUs for the same physical cores: never fewer
            counts = [samplers(logical_cores=l, physical_cores=physical, learner_on_gpu=on_gpu)[0]
                      for l in range(physical, 2 * physical + 1)]
            assert counts == sorted(counts)


def test_samplers_small_machines_and_limits():
    # this project's machine: 2 cores, CPU learner -> one sampler, one core left for the learner
    n, reason = samplers(logical_cores=2, physical_cores=2, learner_on_gpu=False)
    assert n == 1 and "at least 1" in reason
    assert samplers(logical_cores=1, physical_cores=1, learner_on_gpu=False)[0] == 1
    # memory: 4 GiB free, 2 GiB replay, 1 GiB headroom, learner+evaluator 3 x 100 MiB -> 7 samplers of 100 MiB
    n, reason = samplers(logical_cores=64, physical_cores=32, mem_available=4 * GiB, replay_bytes=2 * GiB,
                         per_sampler_bytes=100 * MiB)
    assert n == 7 and "memory" in reason
    assert samplers(logical_cores=64, physical_cores=32, mem_available=GiB, per_sampler_bytes=GiB)[0] == 1
    # more memory never means fewer samplers
    counts = [samplers(logical_cores=64, physical_cores=32, mem_available=g * GiB)[0] for g in range(1, 40)]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    # a collect:update ratio caps samplers at what the learner consumes (+25 %)
    n, reason = samplers(logical_cores=40, physical_cores=20, learner_steps_per_s=60 * 8, env_step_s=3e-4)
    assert n == 1 and "learner demand" in reason
    n, _ = samplers(logical_cores=40, physical_cores=20, learner_steps_per_s=20_000, env_step_s=3e-4)
    assert n == 8  # ceil(20000 * 1.25 * 3e-4)
    # other programs' load, when a caller passes it, leaves fewer cores
    assert samplers(logical_cores=24, physical_cores=24, background_cores=6)[0] < samplers(
        logical_cores=24, physical_cores=24)[0]


def test_values_given_by_hand_win_in_plan():
    m = measurements(8, 4, [GTX_950M])
    chosen = plan_for(m, samplers_given=7, batch_given=300)
    assert chosen["samplers"] == {"value": 7, "by": "user", "reason": "given by hand"}
    assert chosen["batch_size"]["value"] == 300 and chosen["batch_size"]["by"] == "user"
    assert plan_for(m, buffer_size=1000)["batch_size"]["value"] <= 1000
    # the ratio cap uses the user's batch: a huge batch updates rarely and needs few samplers
    capped = plan_for(m, batch_given=65_536, collect_per_update=8.0)
    assert capped["samplers"]["value"] == 1 and "learner demand" in capped["samplers"]["reason"]


def test_learner_overlap_takes_the_learners_cores_again_from_the_samplers_on_a_cpu_learner_only():
    cpu = measurements(8, 8, [])
    plain, overlapped = plan_for(cpu), decide.plan(
        cpu, samplers_given=None, batch_given=None, buffer_size=1_000_000, collect_per_update=0.0,
        mem_available=cpu["memory"]["available"], replay_bytes=GiB // 5, learner_overlap=True)
    threads = plain["learner_threads"]["value"]
    assert threads == 2 and overlapped["learner_threads"]["value"] == threads  # torch threads per thread: the same
    assert overlapped["samplers"]["value"] == plain["samplers"]["value"] - threads  # as many cores again
    assert "--learner-overlap" in overlapped["learner_threads"]["reason"]
    gpu = measurements(8, 8, [GTX_950M])
    on_gpu = decide.plan(gpu, samplers_given=None, batch_given=None, buffer_size=1_000_000, collect_per_update=0.0,
                         mem_available=gpu["memory"]["available"], replay_bytes=GiB // 5, learner_overlap=True)
    assert on_gpu["samplers"]["value"] == plan_for(gpu)["samplers"]["value"]


def test_precision_rule_takes_bf16_only_when_clearly_faster():
    def timed(fp32, bf16):
        return {"batch": 256, "fp32_updates_per_s": fp32, "bf16_updates_per_s": bf16}

    value, by, reason = decide.choose_precision(timed(80.0, 130.0), None)
    assert (value, by) == (True, "profile") and "bf16 130 updates/s against float32 80 (1.62x" in reason
    assert decide.choose_precision(timed(80.0, 80.0 * decide.BF16_MIN_SPEEDUP), None)[0] is True  # the bound
    assert decide.choose_precision(timed(80.0, 95.0), None)[:2] == (False, "profile")  # 1.19x: not worth it
    assert decide.choose_precision(timed(150.0, 130.0), None)[:2] == (False, "profile")  # slower (the H200)
    # given by hand wins either way; --deterministic keeps float32; nothing timed: float32
    assert decide.choose_precision(timed(80.0, 30.0), True)[:2] == (True, "user")
    assert decide.choose_precision(timed(80.0, 300.0), False)[:2] == (False, "user")
    assert decide.choose_precision(timed(80.0, 300.0), None, deterministic=True)[:2] == (False, "deterministic")
    assert decide.choose_precision(None, None)[:2] == (False, "default")
    assert decide.choose_precision({"batch": 256, "fp32_updates_per_s": 80.0}, None)[:2] == (False, "default")
    # bf16 raised when timed: the reason quotes the error rather than offering a new profile, which would meet it
    failed = decide.choose_precision({"batch": 256, "fp32_updates_per_s": 80.0, "bf16_updates_per_s": None,
                                      "bf16_error": "RuntimeError: no bf16 here"}, None)
    assert failed[:2] == (False, "default") and "no bf16 here" in failed[2] and "--reprofile" not in failed[2]


# ----- governor -------------------------------------------------------------------------------------
def run_governor(gov, readings, active, step=1.0):
    """Feed (seconds, cpu%) readings; return the [(time, new active, reason)] changes."""
    changes, t = [], 0.0
    for cpu in readings:
        new, reason = gov.decide(t, cpu, active)
        if new != active:
            assert reason
            changes.append((t, new, reason))
            active = new
        else:
            assert reason is None
        t += step
    return changes, active


def test_governor_pauses_after_sustained_high_load_once_per_window():
    gov = CpuGovernor(target_percent=75, band=15, sustain_s=15, min_active=1, max_active=8)
    changes, active = run_governor(gov, [97.0] * 60, active=6)
    times = [c[0] for c in changes]
    assert times[0] == 15.0 and "pausing" in changes[0][2]
    assert all(b - a >= 15.0 for a, b in zip(times, times[1:]))  # at most one change per sustain window
    assert len(changes) == 3 and active == 3
    changes, active = run_governor(CpuGovernor(max_active=8), [97.0] * 200, active=3)
    assert active == 1  # never below min_active
    assert [c[1] for c in changes] == [2, 1]


def test_governor_hysteresis_and_resume():
    gov = CpuGovernor(max_active=4)
    # inside the band (60-90 %): nothing ever changes
    assert run_governor(gov, [62.0, 89.0, 75.0, 88.0, 61.0] * 20, active=2)[0] == []
    # high for 14 s, one reading in the band, high again: the clock restarts
    gov = CpuGovernor(max_active=4)
    changes, _ = run_governor(gov, [95.0] * 14 + [80.0] + [95.0] * 16, active=3)
    assert [c[0] for c in changes] == [30.0]
    # alternating above and below the band every 5 s: no flapping
    gov = CpuGovernor(max_active=4)
    assert run_governor(gov, ([95.0] * 5 + [40.0] * 5) * 10, active=2)[0] == []
    # sustained low load resumes one sampler at a time, never beyond max_active
    gov = CpuGovernor(max_active=4)
    changes, active = run_governor(gov, [30.0] * 100, active=1)
    assert [c[1] for c in changes] == [2, 3, 4] and active == 4 and "resuming" in changes[0][2]
    # NaN readings are ignored and interrupt a running condition
    gov = CpuGovernor(max_active=4)
    assert run_governor(gov, [95.0] * 10 + [math.nan] + [95.0] * 10, active=2)[0] == []
    # an out-of-range count is clamped at once
    assert CpuGovernor(min_active=1, max_active=3).decide(0.0, 75.0, 5)[0] == 3
    with pytest.raises(ValueError):
        CpuGovernor(min_active=3, max_active=2)


# ----- tune(), cache and probe plumbing (fake probe) ------------------------------------------------
class FakeProbe:
    def __init__(self, on_gpu=False, fail=False, precision=None, stopped=None, empty=False, cores=(2, 2),
                 env_step_s=3.3e-4):
        self.calls = 0
        self.cores, self.env_step_s = cores, env_step_s  # the machine it "measures": (logical, physical)
        self.on_gpu = on_gpu
        self.fail = fail
        self.stopped = stopped  # run_probe's note when its time limit cut the sweep short
        self.empty = empty  # the sweep timed no batch (the first ran out of GPU memory)
        self.precision = precision  # (float32, bf16) updates/s the probe "timed" when bf16 is unset
        self.bf16_seen = []

    def __call__(self, config, env_info, settings, learner_threads, on_event):
        self.calls += 1
        if self.fail:
            raise ProbeFailed("simulated crash")
        m = measurements(*self.cores, [GTX_1060] if self.on_gpu else [], env_step_s=self.env_step_s)
        on_event("phase", "sampler")
        sampler = dict(m["sampler"], rss_bytes=280 * MiB, uss_bytes=200 * MiB)
        on_event("sampler", sampler)
        for point in m["learner"]["sweep"]:
            on_event("batch", point)
        learner = dict(m["learner"], threads=learner_threads)
        self.bf16_seen.append(config.bf16)
        if self.precision and config.bf16 is None:  # the real probe times both only when --bf16 is unset
            learner["precision"] = {"batch": 256, "fp32_updates_per_s": self.precision[0],
                                    "bf16_updates_per_s": self.precision[1]}
        if self.stopped:
            learner.update(sweep=learner["sweep"][:2], stopped=self.stopped, incomplete=True)
        if self.empty:
            learner.update(sweep=[], stopped="GPU memory ran out at batch 256")
        return {"sampler": sampler, "learner": learner}


FAST = ProbeSettings(load_seconds=0.05)
CONFIG = Config(buffer_size=100_000)


def run_tune(tmp_path, fake, explicit=(), config=CONFIG, **kw):
    lines = []
    tuned, profile = tune(config, WALKER, set(explicit), cache_dir=str(tmp_path), log=lines.append,
                          settings=FAST, progress=False, probe=fake, **kw)
    return tuned, profile, lines


def the_cache_file(tmp_path) -> Path:
    files = list(Path(tmp_path).glob("*.json"))
    assert len(files) == 1, files
    return files[0]


def test_tune_profiles_once_then_reuses_and_reprofile_refreshes(tmp_path):
    fake = FakeProbe()
    tuned, profile, lines = run_tune(tmp_path, fake)
    assert fake.calls == 1 and profile["source"] == "measured"
    assert tuned.samplers == profile["chosen"]["samplers"]["value"] >= 1
    assert tuned.batch_size == profile["chosen"]["batch_size"]["value"] >= 256
    text = "\n".join(lines)
    for part in ("profiling this machine", "CPU", "memory", "GPUs", "sampler", "learner", "samplers",
                 "batch size", "chosen by the profile"):
        assert part in text
    path = the_cache_file(tmp_path)
    record = json.loads(path.read_text())
    assert record["schema"] == cache.SCHEMA and record["workload"]["env_id"] == WALKER.env_id

    tuned2, profile2, lines2 = run_tune(tmp_path, fake)
    assert fake.calls == 1 and profile2["source"] == "cache"
    assert len(lines2) == 1 and "reusing" in lines2[0]
    assert (tuned2.samplers, tuned2.batch_size) == (tuned.samplers, tuned.batch_size)

    before = path.stat().st_mtime_ns
    time.sleep(0.01)
    _, profile3, lines3 = run_tune(tmp_path, fake, reprofile=True)
    assert fake.calls == 2 and profile3["source"] == "measured" and path.stat().st_mtime_ns > before
    assert any("new profile was asked for" in line for line in lines3)


def test_cache_key_separates_envs_and_algorithms(tmp_path):
    fake = FakeProbe()
    run_tune(tmp_path, fake)
    run_tune(tmp_path, fake, config=Config(buffer_size=100_000, algo="td3"))
    run_tune(tmp_path, fake, config=Config(buffer_size=100_000, hidden_size=64))
    assert fake.calls == 3 and len(list(tmp_path.glob("*.json"))) == 3
    run_tune(tmp_path, fake, config=Config(buffer_size=200_000, collect_per_update=0.0))  # choices only
    assert fake.calls == 3


@pytest.mark.parametrize("damage", ["garbage", "binary", "empty", "list", "schema", "fields", "foreign"])
def test_corrupt_cache_warns_once_and_profiles_again(tmp_path, damage):
    fake = FakeProbe()
    run_tune(tmp_path, fake)
    path = the_cache_file(tmp_path)
    record = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json at all")
    elif damage == "binary":
        path.write_bytes(b"\xff\xfe\x00\x81garbage")
    elif damage == "empty":
        path.write_text("")
    elif damage == "list":
        path.write_text("[1, 2, 3]")
    elif damage == "schema":
        path.write_text(json.dumps(dict(record, schema=999)))
    elif damage == "fields":
        del record["measurements"]["sampler"]["env_step_s"]
        record["measurements"]["learner"]["sweep"] = []
        path.write_text(json.dumps(record))
    elif damage == "foreign":
        record["hardware"]["cpu_model"] = "some other CPU"
        path.write_text(json.dumps(record))
    tuned, profile, lines = run_tune(tmp_path, fake)
    warnings = [line for line in lines if line.startswith("[spreeze] warning")]
    assert len(warnings) == 1, lines
    assert fake.calls == 2 and profile["source"] == "measured" and tuned.samplers >= 1
    rewritten = json.loads(path.read_text())  # rewritten and usable again
    assert rewritten["hardware"]["cpu_model"] != "some other CPU"
    assert cache.load(path, rewritten["hardware"], rewritten["workload"])[0] is not None
    _, profile, lines = run_tune(tmp_path, fake)
    assert profile["source"] == "cache" and fake.calls == 2 and len(lines) == 1


def test_unreadable_or_unwritable_cache_never_crashes(tmp_path, monkeypatch):
    fake = FakeProbe()
    run_tune(tmp_path, fake)
    path = the_cache_file(tmp_path)
    path.unlink()
    path.mkdir()  # a directory where the file should be: unreadable and unwritable
    tuned, profile, lines = run_tune(tmp_path, fake)
    assert fake.calls == 2 and tuned.samplers >= 1
    assert sum(line.startswith("[spreeze] warning") for line in lines) == 2  # cannot read; cannot save
    path.rmdir()
    run_tune(tmp_path, fake)
    assert fake.calls == 3 and path.is_file()

    real_read_text = Path.read_text

    def deny(self, *a, **k):
        if Path(self) == path:
            raise PermissionError(13, "Permission denied")
        return real_read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", deny)
    _, profile, lines = run_tune(tmp_path, fake)
    assert fake.calls == 4 and "cannot read" in profile["cache_problem"]
    assert sum(line.startswith("[spreeze] warning") for line in lines) == 1


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "from-env"))
    assert cache.cache_dir() == tmp_path / "from-env"
    assert cache.cache_dir(str(tmp_path / "arg")) == tmp_path / "arg"
    fake = FakeProbe()
    tune(CONFIG, WALKER, set(), log=lambda s: None, settings=FAST, progress=False, probe=fake)
    assert len(list((tmp_path / "from-env").glob("*.json"))) == 1
    monkeypatch.delenv(cache.ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "spreeze"


def test_explicit_values_win_and_are_reported(tmp_path):
    fake = FakeProbe()
    config = Config(buffer_size=100_000, samplers=5)
    tuned, profile, lines = run_tune(tmp_path, fake, explicit={"samplers"}, config=config)
    assert tuned.samplers == 5 and profile["chosen"]["samplers"]["by"] == "user"
    assert profile["chosen"]["batch_size"]["by"] == "profile"
    assert any("samplers   5 (given by hand)" in line for line in lines)
    # both given: no profiling at all
    both = Config(buffer_size=100_000, samplers=3, batch_size=1000)
    tuned, profile, lines = run_tune(tmp_path / "other", fake, explicit={"samplers", "batch_size"}, config=both)
    assert (tuned.samplers, tuned.batch_size) == (3, 1000) and profile["source"] == "none" and fake.calls == 1
    # --samplers 0 typed by hand still means "choose"
    tuned, profile, _ = run_tune(tmp_path, fake, explicit={"samplers"}, config=Config(buffer_size=100_000))
    assert profile["chosen"]["samplers"]["by"] == "profile"
    # a non-zero value that did not come from the command line is kept too, marked as from the config
    tuned, profile, _ = run_tune(tmp_path, fake, config=Config(buffer_size=100_000, batch_size=777))
    assert tuned.batch_size == 777 and profile["chosen"]["batch_size"]["by"] == "config"


class StubAlgo:
    """Updates that take ``costs[bf16]`` seconds (or raise) and record the precision each one ran in."""

    def __init__(self, costs: dict):
        self.config, self.costs, self.seen = Config(), costs, []

    def batch(self, batch):
        return batch

    def close(self):
        self.closed = True

    def update(self, batch):
        self.seen.append(self.config.bf16)
        cost = self.costs[bool(self.config.bf16)]
        if isinstance(cost, Exception):
            raise cost
        time.sleep(cost)


@pytest.mark.parametrize("bf16_cost, chosen", [(0.002, True), (0.006, False), (RuntimeError("no bf16 here"), False)])
def test_probe_times_both_precisions_then_sweeps_in_the_chosen_one(bf16_cost, chosen):
    from spreeze.replay import Batch

    rows = 1024
    pool = Batch(*(np.zeros((rows, 3), np.float32) for _ in range(2)), np.zeros(rows, np.float32),
                 np.zeros((rows, 3), np.float32), np.zeros(rows, np.float32))
    algo = StubAlgo({False: 0.004, True: bf16_cost})
    settings = ProbeSettings(batch_seconds=0.06, warmup_updates=1, max_batch=512)
    result = probe._sweep_learner(algo, pool, np.random.default_rng(0), None, settings, [], [256, 512], ["cpu"], 1,
                                  lambda kind, payload: None, rebuild=None)  # no narrower width offered
    precision = result["precision"]
    assert precision["batch"] == 256 and precision["fp32_updates_per_s"] > 0
    first_bf16 = algo.seen.index(True)
    assert set(algo.seen[:first_bf16]) == {False}  # float32 timed first, then bf16
    if isinstance(bf16_cost, Exception):  # a device without bf16 costs the timing, not the profile
        assert precision["bf16_updates_per_s"] is None and "no bf16 here" in precision["bf16_error"]
    else:
        assert (precision["bf16_updates_per_s"] > precision["fp32_updates_per_s"]) is chosen
    assert decide.choose_precision(precision, None)[0] is chosen and algo.config.bf16 is chosen
    # every update of the sweep ran in the chosen precision: the tail after the timing is all ``chosen``
    tail = algo.seen[-10:]
    assert tail == [chosen] * 10 and [p["batch"] for p in result["sweep"]] == [256, 512]


def test_the_narrower_width_only_for_a_float32_cpu_learner():
    assert decide.choose_hidden_size(256, 192, bf16=False, on_gpu=False)[0] == 192
    assert decide.choose_hidden_size(256, 192, bf16=True, on_gpu=False)[0] == 256
    assert decide.choose_hidden_size(256, 192, bf16=False, on_gpu=True)[0] == 256
    assert decide.choose_hidden_size(256, 0, bf16=False, on_gpu=False)[0] == 256  # none offered
    assert decide.choose_hidden_size(128, 192, bf16=False, on_gpu=False)[0] == 128  # not narrower
    assert "0.56 of the wide ones' multiply-adds" in decide.choose_hidden_size(256, 192, bf16=False, on_gpu=False)[1]


def test_the_probe_sweeps_the_width_the_run_will_take():
    """bf16 slower here: the float32 learner takes the offered 192 units, and the sweep times that learner."""
    from spreeze.replay import Batch

    rows = 1024
    pool = Batch(*(np.zeros((rows, 3), np.float32) for _ in range(2)), np.zeros(rows, np.float32),
                 np.zeros((rows, 3), np.float32), np.zeros(rows, np.float32))
    wide = StubAlgo({False: 0.004, True: 0.006})
    wide.config = Config(narrow_hidden_size=192)
    built = []

    def rebuild(config):
        built.append(config)
        narrow = StubAlgo({False: 0.002, True: 0.002})
        narrow.config = config
        return narrow

    settings = ProbeSettings(batch_seconds=0.06, warmup_updates=1, max_batch=512)
    result = probe._sweep_learner(wide, pool, np.random.default_rng(0), None, settings, [], [256, 512], ["cpu"], 1,
                                  lambda kind, payload: None, rebuild=rebuild)
    assert [(c.hidden_size, c.narrow_hidden_size, c.bf16) for c in built] == [(192, 0, False)]
    assert result["hidden_size"] == 192 and set(wide.seen) == {False, True}  # the wide one timed the precisions
    assert wide.closed  # and was let go (its thread pool, with --learner-overlap)
    assert result["sweep"][0]["updates_per_s"] > 1.5 * result["precision"]["fp32_updates_per_s"]  # the narrow one


def test_the_width_is_chosen_with_the_precision_and_said(tmp_path):
    offer = Config(buffer_size=100_000, narrow_hidden_size=192)
    slower_bf16, faster_bf16 = FakeProbe(precision=(150.0, 130.0)), FakeProbe(precision=(80.0, 130.0))
    tuned, profile, lines = run_tune(tmp_path / "a", slower_bf16, config=offer)
    assert (tuned.hidden_size, tuned.narrow_hidden_size, tuned.bf16) == (192, 0, False)  # the offer is spent
    assert profile["chosen"]["hidden_size"]["by"] == "profile"
    assert any("width      hidden layers of 192 (chosen by the profile: 192 units instead of 256" in line
               for line in lines)
    tuned, profile, lines = run_tune(tmp_path / "a", slower_bf16, config=offer)  # from the cache: the same
    assert tuned.hidden_size == 192 and slower_bf16.calls == 1 and "hidden layers of 192 (profile)" in lines[0]
    tuned, profile, _ = run_tune(tmp_path / "b", faster_bf16, config=offer)
    assert (tuned.hidden_size, tuned.bf16) == (256, True) and "bf16 autocast pays" in profile["chosen"]["hidden_size"]["reason"]
    tuned, _, _ = run_tune(tmp_path / "c", faster_bf16, config=dataclasses.replace(offer, bf16=False))
    assert tuned.hidden_size == 192  # float32 set in a config: the float32 learner's width
    # --hidden-size by hand, --deterministic and a resume keep the width; so does a config without the offer
    for explicit, config, by in (({"hidden_size"}, offer, "user"),
                                 ((), dataclasses.replace(offer, critic_hidden_size=256), "config"),
                                 ((), dataclasses.replace(offer, deterministic=True), "deterministic"),
                                 ((), dataclasses.replace(offer, resume="some/run"), "resume")):
        tuned, profile, _ = run_tune(tmp_path / "d", slower_bf16, explicit=explicit, config=config)
        assert (tuned.hidden_size, tuned.narrow_hidden_size) == (256, 0)
        assert profile["chosen"]["hidden_size"]["by"] == by
    tuned, profile, _ = run_tune(tmp_path / "e", slower_bf16)
    assert tuned.hidden_size == 256 and "hidden_size" not in profile["chosen"]
    # nothing profiled, or a failed probe: float32, so the offered width
    both = dataclasses.replace(offer, samplers=1, batch_size=256)
    tuned, profile, _ = run_tune(tmp_path / "f", faster_bf16, explicit={"samplers", "batch_size"}, config=both)
    assert tuned.hidden_size == 192 and profile["chosen"]["hidden_size"]["by"] == "default"
    tuned, profile, _ = run_tune(tmp_path / "g", FakeProbe(fail=True), config=offer)
    assert tuned.hidden_size == 192 and profile["chosen"]["hidden_size"]["by"] == "default"


def test_precision_is_chosen_from_the_profile_and_explained(tmp_path):
    faster = FakeProbe(precision=(80.0, 130.0))
    tuned, profile, lines = run_tune(tmp_path / "a", faster)
    assert tuned.bf16 is True and profile["chosen"]["bf16"]["by"] == "profile" and faster.bf16_seen == [None]
    assert any("precision  bf16 autocast (chosen by the profile: at batch 256: bf16 130" in line for line in lines)
    tuned, profile, lines = run_tune(tmp_path / "a", faster)  # from the cache: the same choice, said in one line
    assert tuned.bf16 is True and faster.calls == 1 and "bf16 (profile)" in lines[0]
    slower = FakeProbe(precision=(150.0, 130.0))
    tuned, profile, _ = run_tune(tmp_path / "b", slower)
    assert tuned.bf16 is False and "float32 150 (0.87x, under 1.25x)" in profile["chosen"]["bf16"]["reason"]
    # by hand (or a preset/config) wins, and the probe is not asked to time both
    tuned, profile, _ = run_tune(tmp_path / "c", faster, explicit={"bf16"}, config=Config(buffer_size=100_000, bf16=False))
    assert tuned.bf16 is False and profile["chosen"]["bf16"]["by"] == "user" and faster.bf16_seen[-1] is False
    tuned, profile, _ = run_tune(tmp_path / "d", slower, config=Config(buffer_size=100_000, bf16=True))
    assert tuned.bf16 is True and profile["chosen"]["bf16"]["by"] == "config"
    # --deterministic: float32 whatever the machine, decided before probing
    tuned, profile, _ = run_tune(tmp_path / "e", faster, config=Config(buffer_size=100_000, deterministic=True))
    assert tuned.bf16 is False and profile["chosen"]["bf16"]["by"] == "deterministic" and faster.bf16_seen[-1] is False
    # nothing profiled (samplers and batch given) or a failed probe: float32, said why
    both = Config(buffer_size=100_000, samplers=1, batch_size=256)
    tuned, profile, _ = run_tune(tmp_path / "f", faster, explicit={"samplers", "batch_size"}, config=both)
    assert tuned.bf16 is False and "nothing was profiled" in profile["chosen"]["bf16"]["reason"]
    # a resumed run (samplers and batch forced, bf16 from its saved config) keeps what it had
    tuned, profile, _ = run_tune(tmp_path / "f", faster, explicit={"samplers", "batch_size"},
                                 config=dataclasses.replace(both, bf16=True))
    assert tuned.bf16 is True and profile["chosen"]["bf16"]["by"] == "config"
    tuned, profile, _ = run_tune(tmp_path / "g", FakeProbe(fail=True))
    assert tuned.bf16 is False and "measurement failed" in profile["chosen"]["bf16"]["reason"]


def test_failed_probe_falls_back_to_defaults_without_caching(tmp_path):
    tuned, profile, lines = run_tune(tmp_path, FakeProbe(fail=True))
    assert profile["source"] == "failed" and tuned.samplers >= 1 and tuned.batch_size >= 1 and not profile["cache_path"]
    assert any(line.startswith("[spreeze] warning") and "simulated crash" in line for line in lines)
    assert list(tmp_path.glob("*.json")) == []


def test_a_failed_probe_s_fallback_count_leaves_a_replay_split_the_config_accepts(tmp_path, monkeypatch):
    """The fallback took logical - 1 samplers as they came: on a 64-thread host with --buffer-size 10,000 the
    warm-up no longer fit the split, the launch was refused, and (a failed profile is not cached) at every relaunch."""
    real = probe.machine_inventory()
    monkeypatch.setattr(probe, "machine_inventory", lambda: {**real, "logical": 64, "physical": 32})
    config = Config(buffer_size=10_000, learning_starts=10_000, envs_per_sampler=4)
    tuned, profile, _ = run_tune(tmp_path, FakeProbe(fail=True), config=config)
    assert profile["source"] == "failed" and tuned.samplers >= 1
    tuned.validate()
    tuned, profile, _ = run_tune(tmp_path, FakeProbe(fail=True), config=Config(deterministic=True, num_envs=4))
    assert profile["source"] == "failed" and tuned.samplers == 4  # lock-step rounds run min(samplers, envs)


def test_a_failed_probe_with_remote_only_keeps_no_local_sampler(tmp_path):
    """--remote-only's 0 local samplers is a value, not "choose": the fallback must not put the default count
    there (validate would then stop the launch over a --samplers nobody typed)."""
    config = Config(buffer_size=100_000, ray="auto", remote_only=True, remote_samplers=4)
    tuned, profile, lines = run_tune(tmp_path, FakeProbe(fail=True), explicit={"remote_only"}, config=config)
    assert profile["source"] == "failed" and tuned.samplers == 0 and profile["chosen"]["samplers"]["value"] == 0
    tuned.validate()
    assert any("0 sampler(s)" in line for line in lines)


def test_the_console_says_who_fixed_what_when_nothing_is_profiled(tmp_path):
    tuned, _, lines = run_tune(tmp_path, FakeProbe(), explicit={"samplers"},
                               config=Config(buffer_size=100_000, samplers=2, deterministic=True))
    assert tuned.batch_size == 256
    line = next(line for line in lines if "no profiling needed" in line)
    assert "samplers 2 (given by hand)" in line and "batch size 256 (--deterministic)" in line


def test_a_launch_that_profiles_nothing_still_plans_the_learner_s_threads(tmp_path, monkeypatch):
    """Samplers and batch kept (a resume that does not re-decide its batch resets the tuner's thread count to 0)
    or given by hand: the early return chose no thread count, and the learner took every core the samplers left,
    hyper-threads included."""
    real = probe.machine_inventory()
    monkeypatch.setattr(probe, "machine_inventory", lambda: {**real, "logical": 32, "physical": 16})
    physical = 16
    assert decide.cpu_learner_cores(physical) > 1  # so that --serial's one thread is told apart
    for kwargs, kept, expected, by in ((dict(samplers=3, batch_size=256), {"samplers", "batch_size"},
                                        decide.cpu_learner_cores(physical), "default"),
                                       (dict(samplers=3, batch_size=256, learner_threads=2), {"samplers", "batch_size"},
                                        2, "user"),
                                       (dict(samplers=2, deterministic=True), set(), 1, "deterministic"),
                                       # --serial: this process is every role, one thread (spreeze.defaults)
                                       (dict(samplers=2, batch_size=256, serial=True), {"samplers", "batch_size"},
                                        1, "default")):
        tuned, profile, _ = run_tune(tmp_path, FakeProbe(), config=Config(buffer_size=100_000, **kwargs), kept=kept,
                                     explicit={"samplers"})
        assert profile["source"] == "none", kwargs
        assert profile["chosen"]["learner_threads"] == {"value": expected, "by": by,
                                                        "reason": profile["chosen"]["learner_threads"]["reason"]}


def test_a_given_sampler_count_prices_the_spare_as_the_run_splits_the_replay(tmp_path, monkeypatch):
    """With --samplers 4 and one spare the spare's regions hold a quarter of --buffer-size on top of it; the tuner
    priced them as a whole second replay (one active sampler) and refused one that fits, suggesting half."""
    import spreeze.replay as replay_mod
    from spreeze.replay import ReplayTooLarge, transition_specs
    from spreeze.shm import segment_nbytes

    config = Config(buffer_size=1_000_000, samplers=4, spare_samplers=1, envs_per_sampler=1)
    exact = segment_nbytes(transition_specs(22, 6, config.buffer_size, config.total_envs, config.active_envs))
    doubled = segment_nbytes(transition_specs(22, 6, config.buffer_size, 2, 1))
    assert exact < doubled
    monkeypatch.setattr(replay_mod, "available_memory", lambda: (1 << 30) + (exact + doubled) // 2)
    monkeypatch.setattr(replay_mod, "shm_free_bytes", lambda: None)
    tuned, profile, _ = run_tune(tmp_path, FakeProbe(), config=config, explicit={"samplers"})
    assert tuned.samplers == 4 and profile["replay_bytes"] == exact
    with pytest.raises(ReplayTooLarge):  # the sampler count open: still the most it can be
        run_tune(tmp_path, FakeProbe(), config=dataclasses.replace(config, samplers=0))


def test_lock_step_runs_get_no_more_samplers_than_envs(tmp_path, monkeypatch):
    """--deterministic runs min(samplers, envs) sampler processes a round: a slow env on a large machine got 15
    samplers in autotune.json, config.json and the console for 8 envs."""
    real = probe.machine_inventory()
    monkeypatch.setattr(probe, "machine_inventory", lambda: {**real, "logical": 32, "physical": 16})
    monkeypatch.setattr(probe, "cpu_load", lambda seconds: {"per_core_percent": [0.0] * 32, "background_cores": 0.0})
    config = Config(buffer_size=100_000, deterministic=True, num_envs=4)
    tuned, profile, _ = run_tune(tmp_path, FakeProbe(cores=(32, 16), env_step_s=5e-3), config=config)
    assert tuned.samplers == 4 and "capped at the 4 envs" in profile["chosen"]["samplers"]["reason"]
    tuned.validate()
    tuned, profile, _ = run_tune(tmp_path / "more", FakeProbe(cores=(32, 16), env_step_s=5e-3),
                                 config=dataclasses.replace(config, num_envs=16))
    assert 4 < tuned.samplers < 16 and "capped" not in profile["chosen"]["samplers"]["reason"]


def test_the_knee_rule_says_why_its_sweep_ended(tmp_path):
    m = measurements(2, 2)
    m["learner"]["sweep"] = m["learner"]["sweep"][:1]  # one batch: the walk reaches the end of the sweep
    m["learner"]["stopped"] = "sweep time budget of 35 s used"
    reason = plan_for(m)["batch_size"]["reason"]
    assert reason.startswith("largest batch measured") and "sweep time budget of 35 s used" in reason


def test_values_a_resumed_run_keeps_are_recorded_as_kept_not_as_given_by_hand(tmp_path):
    tuned, profile, lines = run_tune(tmp_path, FakeProbe(), config=Config(buffer_size=100_000, samplers=3),
                                     kept={"samplers"})
    assert tuned.samplers == 3 and profile["chosen"]["samplers"]["by"] == "resume"
    assert profile["chosen"]["samplers"]["reason"] == "kept from the run it resumes"
    text = "\n".join(summary_lines(profile))
    assert "3 (kept from the resumed run)" in text and "given by hand" not in text.split("samplers")[-1].split("\n")[0]


def test_a_profile_cut_short_is_used_but_not_saved(tmp_path):
    """A sweep its time limit cut short serves this launch but is not cached: every later launch would reuse it."""
    fake = FakeProbe(stopped="probe stopped by its 90 s time limit")
    tuned, profile, lines = run_tune(tmp_path, fake)
    assert profile["source"] == "measured" and tuned.batch_size in (256, 512)
    assert list(tmp_path.glob("*.json")) == [] and "not saved" in profile["cache_problem"]
    assert any(line.startswith("[spreeze] warning") and "cut short" in line for line in lines)
    # no saved profile to point at: the summary says so, and the run's end has none to update (it warned, after a
    # whole run, that it could not update a file that was never written)
    assert profile["cache_path"] is None and "not saved)" in summary_lines(profile)[0]
    assert remember_noise_scale(profile, 300.0, CONFIG) is None and list(tmp_path.glob("*.json")) == []
    run_tune(tmp_path, fake)
    assert fake.calls == 2  # measured again


def test_a_probe_that_timed_no_batch_falls_back_to_defaults(tmp_path):
    tuned, profile, lines = run_tune(tmp_path, FakeProbe(empty=True))
    assert profile["source"] == "failed" and "timed no batch" in profile["probe_error"]
    assert "GPU memory ran out" in profile["probe_error"] and tuned.batch_size >= 1
    assert list(tmp_path.glob("*.json")) == []


def test_probe_reports_the_precision_before_the_sweep():
    """The precision the sweep runs in reaches the parent as soon as it is chosen, so a sweep cut short by the
    time limit still says which precision its rates were timed in."""
    events = []
    config = Config(buffer_size=100_000, hidden_size=32, bf16=None)
    settings = ProbeSettings(batch_seconds=0.06, warmup_updates=1, max_batch=256)
    learner = probe.measure_learner(config, WALKER, settings, 1, lambda kind, payload: events.append((kind, payload)))
    assert [kind for kind, _ in events] == ["precision", "batch"]
    assert events[0][1] == learner["precision"] and events[0][1]["fp32_updates_per_s"] > 0
    assert events[1][1] == learner["sweep"][0]


def test_cpu_target_percent_sizes_the_samplers_at_launch(tmp_path, monkeypatch):
    """--cpu-target-percent is the share of the CPUs the tuner sizes the samplers for, not only the governor's."""
    m = measurements(32, 32)
    chosen = {p: decide.plan(m, samplers_given=None, batch_given=None, buffer_size=10**6, collect_per_update=0.0,
                             mem_available=m["memory"]["available"], replay_bytes=GiB // 5,
                             target_cpu_percent=p)["samplers"] for p in (50, 75, 95)}
    assert chosen[50]["value"] < chosen[75]["value"] < chosen[95]["value"]
    assert "95% of 32 logical CPUs" in chosen[95]["reason"] and "75% of 32" in chosen[75]["reason"]
    seen = []
    real_plan = decide.plan
    monkeypatch.setattr(decide, "plan", lambda *a, **kw: seen.append(kw["target_cpu_percent"]) or real_plan(*a, **kw))
    run_tune(tmp_path, FakeProbe(), config=Config(buffer_size=100_000, cpu_target_percent=95.0))
    assert seen == [95.0]


def test_deterministic_profile_times_and_reports_the_one_learner_thread(tmp_path):
    """--deterministic runs one learner thread (spreeze.defaults.learner_threads): the probe times that, the
    samplers are planned around it and autotune.json says so, not the cores a free-running learner would get."""
    fake = FakeProbe()
    threads_seen = []
    real = fake.__call__

    def probe_fn(config, env_info, settings, learner_threads, on_event):
        threads_seen.append(learner_threads)
        return real(config, env_info, settings, learner_threads, on_event)

    _, profile, _ = run_tune(tmp_path, probe_fn, config=Config(buffer_size=100_000, deterministic=True,
                                                                learner_threads=4))
    assert threads_seen == [1]
    assert profile["chosen"]["learner_threads"]["value"] == 1
    assert profile["chosen"]["learner_threads"]["by"] == "deterministic"
    # with a GPU learner, threads given by hand are reported as given (the learner runs them)
    m = measurements(8, 4, [GTX_1060])
    chosen = decide.plan(m, samplers_given=None, batch_given=None, buffer_size=10**6, collect_per_update=0.0,
                         mem_available=m["memory"]["available"], replay_bytes=GiB // 5, learner_threads_given=3)
    assert chosen["learner_threads"]["value"] == 3 and chosen["learner_threads"]["by"] == "user"


def test_gpu_summary_and_no_driver_inventory(monkeypatch):
    m = measurements(24, 12, [GTX_1060])
    m["gpus"] = [{"index": 0, "name": "NVIDIA GeForce GTX 1060 6GB", "memory_total": 6 * GiB,
                  "memory_free": 5 * GiB, "utilization": 3.0}]
    m["seconds"] = 12.0
    profile = {"measurements": m, "chosen": plan_for(m), "cache_path": "x.json", "memory_available": 28 * GiB,
               "replay_bytes": GiB}
    text = "\n".join(summary_lines(profile))
    assert "GTX 1060" in text and "GPU" in text and "6.0 GiB" in text

    import pynvml

    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    gpus, note = probe.gpu_inventory()
    assert gpus == [] and "no NVIDIA driver" in note
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert probe.gpu_inventory() == ([], "pynvml is not installed")


def test_gpu_inventory_reads_nvml(monkeypatch):
    class Mem:
        total, free = 4 * GiB, 3 * GiB

    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"GeForce GTX 950M" if h == 0 else "RTX",
        nvmlDeviceGetMemoryInfo=lambda h: Mem, nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=7))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus, note = probe.gpu_inventory()
    assert note == "ok" and [g["name"] for g in gpus] == ["GeForce GTX 950M", "RTX"]
    assert gpus[0]["memory_total"] == 4 * GiB and gpus[0]["utilization"] == 7.0
    # CUDA_VISIBLE_DEVICES: the profile (and its cache key) lists the GPUs this process may use, in CUDA's order
    fake.nvmlDeviceGetUUID = lambda h: f"GPU-{h}aaa-uuid"
    for visible, names in (("1", ["RTX"]), ("1,0", ["RTX", "GeForce GTX 950M"]), ("", []), ("0,7,1", ["GeForce GTX 950M"]),
                           ("GPU-1aa", ["RTX"]), ("MIG-4f3e", ["GeForce GTX 950M", "RTX"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert [g["name"] for g in probe.gpu_inventory()[0]] == names, visible


def test_visible_gpus_follow_cuda_s_rules():
    from spreeze.gpu import visible_indices

    uuids = ["GPU-aaaa", "GPU-aabb", "GPU-cccc"]
    assert visible_indices(3, uuids.__getitem__, None) == [0, 1, 2]         # unset: all
    assert visible_indices(3, uuids.__getitem__, "2,0") == [2, 0]          # CUDA's order
    assert visible_indices(3, uuids.__getitem__, "1,-1,2") == [1]          # the list ends at an invalid entry
    assert visible_indices(3, uuids.__getitem__, "GPU-cc,GPU-aa") == [2]   # an ambiguous prefix ends it too
    assert visible_indices(3, uuids.__getitem__, "1,1") == [1]
    assert visible_indices(3, lambda i: 1 / 0, "0,2") == [0, 2]            # UUIDs read only for UUID entries


def test_run_metrics_gpu_utilisation_averages_the_visible_gpus_only(monkeypatch):
    import spreeze.gpu as gpu

    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 3, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=[10, 90, 50][h]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gpu, "_state", {"init": None, "visible": None})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu.gpu_utilization() == 90.0  # not the host's mean of 50
    monkeypatch.setattr(gpu, "_state", {"init": None, "visible": None})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu.gpu_utilization() == 50.0


def _live_children() -> set[int]:
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_probe_process_is_time_limited_and_reaped():
    before = _live_children()
    began = time.monotonic()
    with pytest.raises(ProbeFailed, match="time limit"):
        probe.run_probe(CONFIG, WALKER, ProbeSettings(timeout_s=0.3), 1)
    # cut short: these settings would measure for 35 s and more without the limit (a bound, not a speed test)
    assert time.monotonic() - began < 30
    assert _live_children() <= before


_KILLED_PROBE_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import numpy as np
from autotune.probe import _reap, sweep_replay
from spreeze.proc import start_process
from spreeze.replay import Batch
from spreeze.shm import live_segments


def hold_a_segment(conn):  # a GPU critic's sweep holds its replay when the time limit kills it
    rows = 4096
    replay = sweep_replay(Batch(np.zeros((rows, 3), np.float32), np.zeros((rows, 1), np.float32),
                                np.zeros(rows, np.float32), np.zeros((rows, 3), np.float32), np.zeros(rows, np.float32)))
    conn.send(replay.handle.segment.segment_name)
    time.sleep(120)


if __name__ == "__main__":
    import multiprocessing as mp
    receiver, sender = mp.get_context("spawn").Pipe(duplex=False)
    child = start_process(hold_a_segment, sender, name="spreeze-test-killed-probe")
    assert receiver.poll(60), "the child made no segment"
    name, pid = receiver.recv(), child.pid
    _reap(child, finished=False)
    print("made", name)
    print("left", live_segments(pid))
"""


def test_a_probe_killed_at_its_time_limit_leaves_no_segment_and_no_tracker_warning(tmp_path):
    import subprocess

    script = tmp_path / "killed_probe.py"
    script.write_text(_KILLED_PROBE_SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "made spreeze_" in done.stdout and "left []" in done.stdout, done.stdout
    # the resource tracker names a segment (or semaphore) its registrant did not unlink when the launch exits, and
    # prints a traceback for a name it is told to forget but does not know
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# ----- the real thing, short --------------------------------------------------------------------------
def test_real_probe_on_this_machine(tmp_path):
    from spreeze.envs import check_env
    from spreeze.proc import usable_cores

    info = check_env("Walker2DBulletEnv-v0")
    lines = []
    began = time.monotonic()
    tuned, profile = tune(Config(buffer_size=200_000), info, set(), reprofile=True, cache_dir=str(tmp_path),
                          log=lines.append, settings=SHORT_SETTINGS, progress=False)
    took = time.monotonic() - began
    m = profile["measurements"]
    assert profile["source"] == "measured", lines
    assert m["cpu"]["logical"] >= 1 and m["cpu"]["physical"] >= 1
    assert 0 < m["sampler"]["env_step_s"] < 0.05 and m["sampler"]["steps"] > 0
    assert m["sampler"]["rss_bytes"] > 50 * MiB  # a real python + torch + pybullet process
    sweep = m["learner"]["sweep"]
    assert sweep and all(p["updates_per_s"] > 0 for p in sweep)
    assert [p["batch"] for p in sweep] == decide.batch_candidates()[:len(sweep)]
    if not m["learner"]["on_gpu"]:
        assert all(p["gpu_util"] is None for p in sweep)
    cores = usable_cores()
    learner_threads = profile["chosen"]["learner_threads"]["value"]
    assert 1 <= tuned.samplers and tuned.samplers + (0 if m["learner"]["on_gpu"] else learner_threads) <= max(cores, 2)
    assert tuned.batch_size in [p["batch"] for p in sweep]
    precision = m["learner"]["precision"]  # both timed at the smallest batch, as --bf16 was left unset
    assert precision["batch"] == sweep[0]["batch"] and precision["fp32_updates_per_s"] > 0 < precision["bf16_updates_per_s"]
    assert tuned.bf16 is decide.choose_precision(precision, None)[0]
    assert any("machine profile" in line for line in lines)
    print("\n".join(lines), f"\n[test] tune took {took:.1f} s")
    # the saved profile is reused at once (by a launch whose sweep would stop at the same largest batch)
    again, profile2 = tune(Config(buffer_size=200_000), info, set(), cache_dir=str(tmp_path), log=lines.append,
                           settings=SHORT_SETTINGS)
    assert profile2["source"] == "cache" and (again.samplers, again.batch_size) == (tuned.samplers, tuned.batch_size)


# ----- the governor acting on real sampler processes ------------------------------------------------------
@pytest.mark.slow
def test_governor_pauses_and_resumes_real_spare_samplers(tmp_path, monkeypatch):
    """A real run (processes) with one active sampler and one spare. The governor's decisions are scripted
    (the real rule needs 15 s of sustained load per change; its logic is tested above); the supervisor acts
    on them: the spare starts paused, runs once resumed, stops stepping when paused, and runs again."""
    from autotune import governor as governor_mod
    from launch.compose import train
    from spreeze import runners as runners_mod
    from spreeze import supervisor as sup_mod
    from spreeze.envs import check_env
    from spreeze.stats import sampler_role

    class ScriptedGovernor:
        def __init__(self, **kwargs):
            self.want, self.reason = None, None

        def decide(self, now_s, cpu_percent, active):
            if self.want is None or self.want == active:
                return active, None
            return self.want, self.reason

        def reset(self):
            pass

    script = {"phase": "spare idle", "since": time.monotonic(), "mark": None, "done": False}
    seen: dict[str, tuple] = {}
    real_govern, real_budget = sup_mod.Supervisor.govern, runners_mod.Run.budget_reached

    def govern(self, governor, cpu_percent):
        """Called by the supervisor every --log-interval-s: record what the samplers did, script the next step."""
        now, steps = time.monotonic(), self.stats.env_steps.copy()
        phase, held = script["phase"], now - script["since"]

        def to(next_phase, want=None, reason=None):
            script.update(phase=next_phase, since=now, mark=steps.copy())
            if want is not None:
                governor.want, governor.reason = want, reason

        script.setdefault("first_call", time.monotonic())  # the clock of the heartbeats
        # a heartbeat newer than the supervisor's start-up stamp: the spare's process runs (paused)
        spare_runs = self.stats.heartbeats[sampler_role(1)] > script["first_call"]
        if phase == "spare idle" and steps[0] > 0 and spare_runs:
            to("spare idle, watched")
        elif phase == "spare idle, watched" and held >= 1.5:
            seen["before resume"] = (script["mark"], steps.copy())
            to("resumed", 2, "test: resuming the spare")
        elif phase == "resumed" and steps[1] > 200:
            to("pausing", 1, "test: pausing the spare")
        elif phase == "pausing" and held >= 1.0:  # the sampler finishes the step it was in
            to("paused, watched")
        elif phase == "paused, watched" and held >= 1.5:
            seen["while paused"] = (script["mark"], steps.copy())
            to("resumed again", 2, "test: resuming the spare again")
        elif phase == "resumed again" and steps[1] > script["mark"][1] + 200:
            seen["after resume"] = (script["mark"], steps.copy())
            script["done"] = True
        real_govern(self, governor, cpu_percent)

    monkeypatch.setattr(governor_mod, "CpuGovernor", ScriptedGovernor)
    monkeypatch.setattr(sup_mod.Supervisor, "govern", govern)
    monkeypatch.setattr(runners_mod.Run, "budget_reached",
                        lambda self: "the test's script is done" if script["done"] else real_budget(self))
    run_dir = tmp_path / "run"
    config = Config(env_id="Pendulum-v1", samplers=1, spare_samplers=1, envs_per_sampler=1, collect_per_update=0,
                    learning_starts=50_000, buffer_size=50_000, batch_size=64, hidden_size=32, total_steps=0,
                    minutes=2.0, log_interval_s=0.5, eval_interval_s=60.0, learner_threads=1, actor_device="cpu",
                    critic_device="cpu", window=False, run_dir=str(run_dir))
    config.validate()
    lines = []
    result = train(config, check_env("Pendulum-v1"), log=lines.append)
    assert result.exit_code == 0, lines
    assert script["done"], f"stuck in phase {script['phase']!r} (the --minutes cap ended the run): {seen}"

    (first, last) = seen["before resume"]
    assert last[0] > first[0] and last[1] == 0  # sampler 0 ran; the spare, started paused, did not step
    (first, last) = seen["while paused"]
    assert last[0] > first[0] and last[1] == first[1] > 0  # paused: no step while the other one ran
    (first, last) = seen["after resume"]
    assert last[1] > first[1]  # resumed: it steps again
    events = (run_dir / "events.log").read_text()
    assert "samplers active 1 -> 2: test: resuming the spare" in events
    assert "samplers active 2 -> 1: test: pausing the spare" in events
    assert "samplers active 1 -> 2: test: resuming the spare again" in events
    with open(run_dir / "metrics.csv") as f:
        active = {row["active_samplers"] for row in csv.DictReader(f)}
    assert {"1", "2"} <= active


def test_profile_key_tells_critics_of_another_cost_apart():
    """A profile measured with plain critics is not reused for C51 or LayerNorm critics (their updates cost
    more), nor for an actor updated every second step or updates replayed as CUDA graphs (they cost less), while
    a plain config keeps the key, and so the file, it had."""
    from autotune.cache import workload_key

    devices = ("cpu", "cpu")
    plain = workload_key(Config(), WALKER, devices, 1)
    assert not {"critic_atoms", "critic_hidden_size", "critic_layer_norm", "learner_overlap", "policy_delay",
                "cuda_graphs"} & set(plain)
    keys = [workload_key(Config(**kw), WALKER, devices, 1) for kw in
            ({"critic_atoms": 101}, {"critic_layer_norm": True}, {"critic_hidden_size": 512},
             {"learner_overlap": True}, {"policy_delay": 2}, {"cuda_graphs": True})]
    assert all(k != plain for k in keys) and len({json.dumps(k, sort_keys=True) for k in keys}) == 6


def test_profile_key_is_the_same_for_settings_that_time_the_same_update():
    """TD3 given its own default delay, critics as wide as the actor and env kwargs in another order time the same
    update as without them: each had a profile of its own (the machine profiled again for nothing). A queue
    transport's learner draws no batch from a GPU mirror, so its profile is not timed through one."""
    from autotune.cache import workload_key

    devices = ("cpu", "cpu")
    assert workload_key(Config(algo="td3", policy_delay=2), WALKER, devices, 1) == \
        workload_key(Config(algo="td3"), WALKER, devices, 1)
    assert workload_key(Config(algo="sac", policy_delay=2), WALKER, devices, 1) != \
        workload_key(Config(algo="sac"), WALKER, devices, 1)  # SAC's own is 1: 2 is another update
    assert workload_key(Config(critic_hidden_size=256), WALKER, devices, 1) == workload_key(Config(), WALKER, devices, 1)
    assert workload_key(Config(env_kwargs=("a=1", "b=2")), WALKER, devices, 1) == \
        workload_key(Config(env_kwargs=("b=2", "a=1")), WALKER, devices, 1)
    assert workload_key(Config(env_kwargs=("a=1", "a=2")), WALKER, devices, 1) != \
        workload_key(Config(env_kwargs=("a=2", "a=1")), WALKER, devices, 1)  # the last one is in force
    gpu = ("cuda:0", "cuda:0")
    assert "replay_mirror" in workload_key(Config(), WALKER, gpu, 1)
    assert "replay_mirror" not in workload_key(Config(experience_transport="queue", collect_per_update=0), WALKER,
                                               gpu, 1)


def test_profile_key_tells_apart_what_changes_the_env_or_the_sweep(tmp_path):
    """The env's keyword arguments and wrappers change its step time, observation normalisation the update's
    cost, and a small --buffer-size caps the sweep: each gets a profile of its own, while a plain config keeps its
    key. A capped sweep is not reused by a launch that may take larger batches."""
    from autotune.cache import workload_key

    devices = ("cpu", "cpu")
    plain = workload_key(Config(), WALKER, devices, 1)
    assert not {"env_kwargs", "wrapper", "normalize_obs", "sweep_cap"} & set(plain)
    keys = [workload_key(Config(env_kwargs=("frame_skip=4",)), WALKER, devices, 1),
            workload_key(Config(wrapper=("gymnasium.wrappers:ClipAction",)), WALKER, devices, 1),
            workload_key(Config(normalize_obs=True), WALKER, devices, 1),
            workload_key(Config(), WALKER, devices, 1, sweep_cap=32_768)]
    assert all(k != plain for k in keys) and len({json.dumps(k, sort_keys=True) for k in keys}) == 4
    fake = FakeProbe()
    run_tune(tmp_path, fake, config=Config(buffer_size=50_000))       # the sweep stops at 32,768
    run_tune(tmp_path, fake, config=Config(buffer_size=1_000_000))    # may take up to 65,536: profiles again
    run_tune(tmp_path, fake, config=Config(buffer_size=2_000_000))    # the same cap as the last one: reused
    assert fake.calls == 2 and len(list(tmp_path.glob("*.json"))) == 2
