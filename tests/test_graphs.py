"""--cuda-graphs (spreeze/algos/graphs.py): what a capture needs, checked on the CPU (no host read inside an
update's tensor work, batches copied into a graph's inputs as aliased as they came, the settings it refuses);
the captures themselves on a GPU."""
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spreeze.algos import make_algo
from spreeze.algos.base import TorchBatch
from spreeze.algos.graphs import WARMUP_UPDATES, CudaGraphSteps, aliasing, clone_batch, copy_batch
from spreeze.config import Config, ConfigError
from spreeze.defaults import cuda_graphs_default, resolve, resolve_devices
from spreeze.replay import Batch

from conftest import fake_checkpoint

OBS, ACT = 3, 2
# float(t), bool(t) and t.item() dispatch to _local_scalar_dense; the others wait for the GPU to size their output.
# Not seen here: .cpu(), .numpy(), .tolist() dispatch nothing on the CPU (a GPU capture would fail on them)
HOST_READS = ("_local_scalar_dense", "aten.equal", "aten.nonzero", "aten.masked_select", "aten.unique")
NUMBER_TENSORS = ("lift_fresh",)  # torch.tensor / as_tensor of Python numbers: a host-to-device copy on a GPU


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))

    def matching(self, fragments) -> list[str]:
        return [n for n in self.names if any(f in n for f in fragments)]


def random_batch(n: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch(rng.standard_normal((n, OBS), dtype=np.float32), rng.uniform(-1, 1, (n, ACT)).astype(np.float32),
                 rng.standard_normal(n, dtype=np.float32), rng.standard_normal((n, OBS), dtype=np.float32),
                 (rng.uniform(size=n) < 0.1).astype(np.float32))


@pytest.mark.parametrize("algo_name, extra", [
    ("sac", {}), ("sac", {"critic_atoms": 51}), ("sac", {"critic_atoms": 51, "policy_delay": 2}),
    ("sac", {"normalize_obs": True, "critic_layer_norm": True}), ("td3", {}), ("td3", {"critic_atoms": 51}),
    ("crossq", {})])
def test_an_updates_tensor_work_reads_nothing_back_to_the_host(algo_name, extra):
    """A CUDA capture fails on a host read, and outside one every read stalls the GPU learner: after the first
    update (which sets the C51 range from its batch), neither kind of step reads a value back or makes a tensor
    of a Python number."""
    config = Config(algo=algo_name, hidden_size=16, **extra)
    torch.manual_seed(0)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    b = algo.batch(random_batch(32))
    algo.update(b)
    for actor_due in (True, False):
        with RecordOps() as ops:
            stats = algo.step(b, actor_due)
        assert ops.matching(HOST_READS) == [] and ops.matching(NUMBER_TENSORS) == [], (actor_due, ops.matching(
            HOST_READS + NUMBER_TENSORS))
        assert "critic_loss" in stats and ("actor_loss" in stats) == actor_due
        assert all(torch.is_tensor(v) for v in stats.values())


def test_the_records_would_catch_a_host_read_and_a_number_made_a_tensor():
    """The check above can fail: what it looks for is what these calls dispatch to."""
    t = torch.ones(3)
    with RecordOps() as ops:
        float(t.sum())
        bool(t.any())
        torch.as_tensor(0.5)
    assert len(ops.matching(("_local_scalar_dense",))) == 2 and ops.matching(NUMBER_TENSORS)


def test_the_c51_support_flag_is_read_from_the_device_until_set_and_again_after_a_load():
    config = Config(algo="sac", hidden_size=16, critic_atoms=11)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    critic = algo.critic
    assert not critic.support_ready()  # read: not set yet
    algo.update(algo.batch(random_batch(16)))
    assert critic.support_ready() and algo.critic_target.support_ready()
    with RecordOps() as ops:
        assert critic.support_ready()
    assert ops.names == []  # known: nothing read
    fresh = make_algo(config, OBS, ACT, "cpu", "cpu").critic
    critic.load_state_dict(fresh.state_dict())  # a state whose range is unset
    assert not critic.support_ready()
    fresh.load_state_dict(algo.critic_target.state_dict())
    assert fresh.support_ready()


def test_the_update_merges_the_last_actor_stats_into_critic_only_steps_and_counts():
    config = Config(algo="sac", hidden_size=16, policy_delay=2)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    b = algo.batch(random_batch(16))
    first = algo.update(b)  # actor due
    second = algo.update(b)  # critic only
    assert (algo.updates, algo.actor_updates) == (2, 1)
    assert set(first) == set(second) == {"critic_loss", "actor_loss", "alpha", "q_value"}
    assert second["actor_loss"] is first["actor_loss"] and second["critic_loss"] is not first["critic_loss"]


def test_a_graphs_inputs_keep_the_batchs_aliasing_and_take_new_batches():
    obs, nxt = torch.zeros(4, OBS), torch.ones(4, OBS)
    acts, rew, term = torch.zeros(4, ACT), torch.zeros(4), torch.zeros(4)
    shared = TorchBatch(obs, nxt, obs, nxt, acts, rew, term)  # one device: the actor's and critics' obs are one
    split = TorchBatch(obs, nxt, obs.clone(), nxt.clone(), acts, rew, term)  # --normalize-obs: the critics' own
    assert aliasing(shared) == (0, 1, 0, 1, 4, 5, 6) and aliasing(split) == (0, 1, 2, 3, 4, 5, 6)
    static = clone_batch(shared)
    assert aliasing(static) == aliasing(shared) and static.obs_actor is not obs
    new = TorchBatch(*(torch.full_like(t, float(i + 2)) for i, t in enumerate(shared)))
    new = new._replace(obs_critic=new.obs_actor, next_obs_critic=new.next_obs_actor)
    copy_batch(static, new)
    for got, want in zip(static, new):
        assert torch.equal(got, want)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: counts replays (a real capture records without running; this
    one's capture runs the step once, which these bookkeeping checks do not look at)."""
    made = 0

    def __init__(self):
        FakeGraph.made += 1
        self.replays = 0

    def replay(self):
        self.replays += 1


class FakeStream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other):
        pass


def test_graph_steps_warm_up_capture_once_replay_and_forget_other_batches(monkeypatch):
    """CudaGraphSteps' bookkeeping with torch's CUDA graph and stream calls faked: each kind of step runs eagerly
    WARMUP_UPDATES times, is captured once, then only replayed on copies of the new batches; the stats are the
    graph's own outputs; a new batch size drops the other size's graphs."""
    import contextlib

    import spreeze.algos.graphs as graphs

    monkeypatch.setattr(graphs, "one_cuda_device", lambda a, c: True)
    marked = []  # capturable Adam runs on CUDA only: recorded here instead
    monkeypatch.setattr(graphs, "mark_capturable", lambda optimizers: marked.extend(optimizers))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    capture_streams, current_devices = [], []
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: capture_streams.append(kw.get("stream"))
                        or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: current_devices.append(d) or contextlib.nullcontext())
    FakeGraph.made = 0
    algo = make_algo(Config(algo="sac", hidden_size=16, policy_delay=2, cuda_graphs=True), OBS, ACT, "cpu", "cpu")
    eager_steps = []
    real_step = algo.step
    monkeypatch.setattr(algo, "step", lambda b, due: eager_steps.append(due) or real_step(b, due))
    for i in range(2 * WARMUP_UPDATES):
        algo.update(algo.batch(random_batch(32, seed=i)))
    assert eager_steps == [True, False] * WARMUP_UPDATES and FakeGraph.made == 0
    assert marked == algo.optimizers() and len(marked) == 3  # actor, critics, temperature
    steps = algo._graphs
    stats = [algo.update(algo.batch(random_batch(32, seed=10 + i))) for i in range(6)]
    assert FakeGraph.made == 2 and len(eager_steps) == 2 * WARMUP_UPDATES + 2  # the two captures ran step once each
    actor_key, critic_key = (32, True, False, (0, 1, 0, 1, 4, 5, 6)), (32, False, False, (0, 1, 0, 1, 4, 5, 6))
    assert set(steps.graphs) == {actor_key, critic_key}
    assert [steps.graphs[k][0].replays for k in (actor_key, critic_key)] == [3, 3]
    assert stats[0]["critic_loss"] is steps.graphs[actor_key][2]["critic_loss"]  # the graph's output tensor
    assert stats[1]["actor_loss"] is steps.graphs[actor_key][2]["actor_loss"]  # critic-only steps repeat it
    last = algo.batch(random_batch(32, seed=15))
    torch.testing.assert_close(steps.graphs[critic_key][1].obs_critic, last.obs_critic)  # the inputs took the batch
    assert (algo.updates, algo.actor_updates) == (2 * WARMUP_UPDATES + 6, WARMUP_UPDATES + 3)
    for i in range(2 * WARMUP_UPDATES + 2):  # the learner re-decided its batch
        algo.update(algo.batch(random_batch(64, seed=20 + i)))
    assert {k[0] for k in steps.graphs} == {64} and FakeGraph.made == 4
    # every step ran with the learner's device current, and each capture on a stream made on it (cuda:1 otherwise
    # recorded the current device's, cuda:0)
    assert len(current_devices) == algo.updates and set(current_devices) == {algo.critic_device}
    assert len(capture_streams) == 4 and all(st.device == algo.critic_device for st in capture_streams)
    algo.load_state_dict(algo.state_dict())  # a load replaces the optimizers' state the graphs were captured on
    assert algo._graphs is None


def test_cuda_graphs_settings_that_cannot_work_are_refused(monkeypatch):
    for bad, words in [({"learner_overlap": True}, "--learner-overlap"), ({"lr_schedule": "linear"}, "--lr-schedule"),
                       ({"deterministic": True}, "--deterministic"),
                       ({"actor_device": "cpu"}, "CUDA device"), ({"critic_device": "cpu"}, "CUDA device")]:
        with pytest.raises(ConfigError, match=words):
            Config(cuda_graphs=True, **bad).validate()
    Config(cuda_graphs=True).validate()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="share a CUDA device"):
        resolve_devices(Config(cuda_graphs=True))  # no GPU here: the learner would be on the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="cuda:0 and cuda:1"):
        resolve_devices(Config(cuda_graphs=True))  # two GPUs place the critics on the second
    assert resolve_devices(Config(cuda_graphs=True, critic_device="cuda:0")) == ("cuda:0", "cuda:0")
    assert resolve_devices(Config(cuda_graphs=True, actor_device="cuda", critic_device="cuda:0")) == ("cuda", "cuda:0")
    with pytest.raises(ValueError, match="one CUDA device"):
        CudaGraphSteps(make_algo(Config(hidden_size=16), OBS, ACT, "cpu", "cpu"))


@pytest.mark.parametrize("devices, extra, on, words", [
    (("cuda:0", "cuda:0"), {}, True, "one GPU (cuda:0)"),
    (("cuda", "cuda:0"), {}, True, "one GPU"),
    (("cpu", "cpu"), {}, False, "on the CPU"),
    (("cuda:0", "cpu"), {}, False, "on the CPU"),
    (("cuda:0", "cuda:1"), {}, False, "cuda:0 and cuda:1, not on one GPU"),
    (("cuda:1", "cuda:1"), {}, False, "measured on cuda:0 only"),
    (("cuda:0", "cuda:0"), {"deterministic": True}, False, "--deterministic"),
    (("cuda:0", "cuda:0"), {"lr_schedule": "linear"}, False, "--lr-schedule linear"),
    (("cuda:0", "cuda:0"), {"learner_overlap": True}, False, "--learner-overlap")])
def test_cuda_graphs_unset_is_on_for_a_learner_on_one_gpu_and_off_where_a_capture_cannot_work(devices, extra, on, words):
    value, why = cuda_graphs_default(Config(**extra), *devices)
    assert value is on and words in why


def test_plain_defaults_fill_cuda_graphs_for_this_machine_and_keep_a_given_value(monkeypatch):
    """runners.train resolves what no profile set: with the learner on one GPU the graphs go on."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve(Config()).cuda_graphs is True
    assert resolve(Config(cuda_graphs=False)).cuda_graphs is False
    assert resolve(Config(lr_schedule="linear")).cuda_graphs is False
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve(Config()).cuda_graphs is False


def test_launch_chooses_cuda_graphs_before_the_profile_says_so_and_a_resume_chooses_again(tmp_path, monkeypatch):
    """Through launch.compose.resolve with the profile faked: unset, the graphs go on for a learner on one GPU
    before the tuner runs (it times the updates the run will make), with a console line, "default" as the
    source and the reason in autotune.json; given by flag they stay as given. A resumed run whose graphs its
    machine chose chooses again on this machine (a GPU run resumed on a CPU-only one); one its user asked for keeps
    them (and is refused where no GPU is)."""
    import json

    import autotune
    from launch.compose import SetupError
    from launch.compose import resolve as launch_resolve
    from spreeze.settings import config_record, parse

    seen = []

    def fake_tune(config, env_info, explicit, **kwargs):
        seen.append(config.cuda_graphs)
        chosen = {"samplers": {"value": 1, "by": "profile"}, "batch_size": {"value": 256, "by": "profile"}}
        return dataclasses.replace(config, samplers=1, batch_size=256), {"chosen": chosen}

    def launch(args):
        parsed = parse(["--env", "Pendulum-v1", "--no-window", *args])
        lines = []
        resolved = launch_resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
        return resolved, [x for x in lines if "CUDA graphs" in x]

    monkeypatch.setattr(autotune, "tune", fake_tune)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    resolved, lines = launch(["--run-dir", str(tmp_path / "a")])
    assert seen[-1] is True and resolved.config.cuda_graphs is True and resolved.sources["cuda_graphs"] == "default"
    assert resolved.profile["cuda_graphs"]["value"] is True and len(lines) == 1 and "on (" in lines[0]
    resolved, lines = launch(["--run-dir", str(tmp_path / "b"), "--lr-schedule", "linear"])
    assert seen[-1] is False and resolved.profile["cuda_graphs"]["reason"] == "not with --lr-schedule linear"
    assert len(lines) == 1 and "off (not with --lr-schedule linear)" in lines[0]
    resolved, lines = launch(["--run-dir", str(tmp_path / "c"), "--no-cuda-graphs"])
    assert seen[-1] is False and resolved.sources["cuda_graphs"] == "flag" and lines == []
    assert "cuda_graphs" not in resolved.profile

    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, cuda_graphs=True, window=False, run_dir=str(run))
    fake_checkpoint(run, saved)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for source in ("default", "flag"):
        (run / "config.json").write_text(json.dumps(config_record(saved, {"cuda_graphs": source})))
        parsed = parse(["--resume", str(run)])
        if source == "default":
            resolved = launch_resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
            assert seen[-1] is False and resolved.sources["cuda_graphs"] == "default"
        else:
            with pytest.raises(SetupError, match="--cuda-graphs"):
                launch_resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)


def _graphed_and_eager(algo_name: str, **extra):
    pair = []
    for graphs in (True, False):
        torch.manual_seed(0)
        config = Config(algo=algo_name, hidden_size=32, cuda_graphs=graphs, **extra)
        pair.append(make_algo(config, OBS, ACT, "cuda:0", "cuda:0"))
    return pair


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [{}, {"critic_atoms": 51}])
def test_graphed_td3_updates_are_the_eager_ones(extra):
    """TD3 without target noise draws nothing that matters, so graphed and eager updates must agree: through the
    warm-ups, both captures (actor due and not) and their replays on changing batches."""
    graphed, eager = _graphed_and_eager("td3", target_noise=0.0, **extra)
    for i in range(4 * WARMUP_UPDATES + 6):
        batch = random_batch(64, seed=i)
        got, want = graphed.update(graphed.batch(batch)), eager.update(eager.batch(batch))
        assert float(got["critic_loss"]) == pytest.approx(float(want["critic_loss"]), rel=1e-4, abs=1e-5)
    assert len(graphed._graphs.graphs) == 2 and eager._graphs is None
    for a, b in zip(graphed.actor.parameters(), eager.actor.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (graphed.updates, graphed.actor_updates) == (eager.updates, eager.actor_updates)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algo_name, extra", [("sac", {"critic_atoms": 51, "policy_delay": 2}), ("sac", {}),
                                              ("crossq", {})])
def test_graphed_updates_train_change_batch_and_checkpoint(algo_name, extra):
    graphed, _ = _graphed_and_eager(algo_name, **extra)
    before = [p.detach().clone() for p in graphed.critic.parameters()]
    losses = []
    for i in range(3 * WARMUP_UPDATES + 8):
        stats = graphed.update(graphed.batch(random_batch(128, seed=i)))
        losses.append(float(stats["critic_loss"]))
    assert all(math.isfinite(v) for v in losses) and len(set(losses[-5:])) == 5  # each replay wrote new values
    assert any(not torch.equal(a, b) for a, b in zip(before, graphed.critic.parameters()))
    assert {k[0] for k in graphed._graphs.graphs} == {128}
    for i in range(2 * WARMUP_UPDATES + 2):  # the learner re-decided its batch: new graphs, the old ones dropped
        graphed.update(graphed.batch(random_batch(256, seed=100 + i)))
    assert {k[0] for k in graphed._graphs.graphs} == {256}
    assert graphed.state_finite()
    state = graphed.state_dict()
    restored = make_algo(dataclasses.replace(graphed.config, cuda_graphs=False), OBS, ACT, "cuda:0", "cuda:0")
    restored.load_state_dict(state)  # a graphed run's checkpoint resumes eagerly (and the other way round)
    assert math.isfinite(float(restored.update(restored.batch(random_batch(128)))["critic_loss"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_default_launch_on_a_gpu_trains_with_graphs(tmp_path):
    """run.py with nothing about graphs on the command line: the learner on cuda:0 replays CUDA graphs (chosen
    before training, said on the console, recorded in config.json and autotune.json) and trains to the end."""
    import json

    from conftest import start

    run_dir = tmp_path / "run"
    proc = start(["--env", "Pendulum-v1", "--samplers", "1", "--batch-size", "256", "--learning-starts", "500",
                  "--total-steps", "3000", "--minutes", "3", "--no-window", "--eval-interval-s", "1",
                  "--run-dir", str(run_dir)], tmp_path)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "CUDA graphs on (the learner is on one GPU (cuda:0)" in out, out
    config = json.loads((run_dir / "config.json").read_text())
    assert config["cuda_graphs"] is True and config["sources"]["cuda_graphs"] == "default"
    assert json.loads((run_dir / "autotune.json").read_text())["cuda_graphs"]["value"] is True
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] > 100 and math.isfinite(summary["final_test_return"])
