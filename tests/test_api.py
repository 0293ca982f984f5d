"""The Python API: ``spreeze.train(env_id, **overrides) -> Run`` and ``spreeze.load_policy`` with each checkpoint."""
import csv
import json

import numpy as np
import pytest
import torch

import spreeze
from launch.api import Run
from spreeze.algos import make_actor
from spreeze.checkpoint import Policy, save_actor, save_checkpoint
from spreeze.config import Config, ConfigError
from spreeze.envs import ActionScaler, check_env

CONFIG = Config(env_id="Pendulum-v1", hidden_size=16)
OBS = np.array([0.3, -0.9, 1.7], np.float32)


def _actor(seed: int):
    torch.manual_seed(seed)
    return make_actor(CONFIG, 3, 1)


@pytest.fixture
def run_with_every_policy(tmp_path):
    """A run directory holding a final, a best and a checkpointed actor, each with different weights."""
    info = check_env("Pendulum-v1")
    run = tmp_path / "run"
    actors = {"final": _actor(1), "best": _actor(2), "latest": _actor(3)}
    save_actor(run, actors["final"], CONFIG.to_dict(), info, "final")
    save_actor(run, actors["best"], CONFIG.to_dict(), info, "best")
    save_checkpoint(run, {"actor": actors["latest"].state_dict()}, {"updates": 7}, CONFIG.to_dict())
    scale = ActionScaler(info.action_low, info.action_high)
    expected = {name: Policy(actor, scale)(OBS) for name, actor in actors.items()}
    assert len({float(a[0]) for a in expected.values()}) == 3  # the test can tell the three apart
    return run, expected


def test_load_policy_final_best_latest(run_with_every_policy):
    run, expected = run_with_every_policy
    assert np.allclose(spreeze.load_policy(run)(OBS), expected["final"])
    for name in ("final", "best", "latest"):
        assert np.allclose(spreeze.load_policy(run, checkpoint=name)(OBS), expected[name]), name


def test_load_policy_from_paths(run_with_every_policy):
    run, expected = run_with_every_policy
    cases = [
        (run / "best" / "actor.pt", None, "best"),               # a policy file as the first argument
        (run, run / "best" / "actor.pt", "best"),                # an absolute path
        (run, "checkpoints/latest.pt", "latest"),                # relative to the run
        (run, "latest.pt", "latest"),                            # a name in the run's checkpoints/
        (run / "checkpoints" / "latest.pt", None, "latest"),     # a training checkpoint as the first argument
    ]
    for first, checkpoint, which in cases:
        assert np.allclose(spreeze.load_policy(first, checkpoint)(OBS), expected[which]), (first, checkpoint)
    # a file names its policy already: a checkpoint beside it was ignored (the file loaded, whatever was asked)
    with pytest.raises(ValueError, match="is a file, loaded as it is: checkpoint='latest'"):
        spreeze.load_policy(run / "best" / "actor.pt", checkpoint="latest")


def test_a_relative_checkpoint_is_the_run_s_even_where_another_run_s_file_has_that_name(run_with_every_policy,
                                                                                       tmp_path, monkeypatch):
    """Standing in another run's directory, ``load_policy(run, "checkpoints/latest.pt")`` loaded that run's file."""
    run, expected = run_with_every_policy
    other = tmp_path / "other"
    save_checkpoint(other, {"actor": _actor(4).state_dict()}, {"updates": 1}, CONFIG.to_dict())
    monkeypatch.chdir(other)
    assert np.allclose(spreeze.load_policy(run, "checkpoints/latest.pt")(OBS), expected["latest"])
    assert not np.allclose(spreeze.load_policy(".", "checkpoints/latest.pt")(OBS), expected["latest"])


def test_load_policy_says_what_is_missing(run_with_every_policy, tmp_path):
    run, _ = run_with_every_policy
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        spreeze.load_policy(run, "nope.pt")
    with pytest.raises(FileNotFoundError, match="neither a run directory nor a policy file"):
        spreeze.load_policy(tmp_path / "no-such-run")
    (run / "best" / "actor.pt").unlink()
    (run / "checkpoints" / "latest.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no test evaluation"):
        spreeze.load_policy(run, "best")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        spreeze.load_policy(run, "latest")


@pytest.mark.parametrize("overrides, message", [
    ({"minuts": 1}, "unknown setting 'minuts'; did you mean 'minutes'?"),
    ({"algo": "ppo"}, "--algo must be sac, td3 or crossq, not 'ppo'"),
    ({"batch_size": "256"}, "argument --batch-size: invalid int value: '256'"),
    ({"window": 1}, "argument --window: invalid bool value: 1"),
    ({"buffer_size": 0}, "--buffer-size must be positive, got 0"),
    ({"gamma": 2.0}, "--gamma must be in (0, 1], got 2.0"),
])
def test_train_refuses_bad_settings_before_anything_starts(tmp_path, monkeypatch, overrides, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        spreeze.train("Pendulum-v1", run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), **overrides)
    assert isinstance(raised.value, ConfigError) and str(raised.value) == message
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_a_bad_env_with_the_command_line_s_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="unknown environment id 'Pendulum-v9'.*Pendulum-v1"):
        spreeze.train("Pendulum-v9", window=False)
    assert list(tmp_path.iterdir()) == []


def test_train_runs_the_command_line_s_path_and_returns_the_run(tmp_path):
    run = spreeze.train("Pendulum-v1", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=1,
                        learning_starts=300, batch_size=32, buffer_size=10_000, hidden_size=16,
                        collect_per_update=8.0, eval_interval_s=0.05, log_interval_s=60.0, total_steps=1_500,
                        actor_device="cpu", critic_device="cpu", window=False, run_dir=tmp_path / "run",
                        cache_dir=str(tmp_path / "cache"))
    assert isinstance(run, Run) and run.exit_code == 0
    assert run.run_dir == tmp_path / "run"
    saved_summary = json.loads((run.run_dir / "summary.json").read_text())
    assert json.dumps(run.summary, sort_keys=True) == json.dumps(saved_summary, sort_keys=True)  # NaN-safe
    assert run.summary["stopped_by"] == "total_steps"
    with open(run.run_dir / "evaluations.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(run.evaluations) == len(rows) >= 1
    assert all(isinstance(row, dict) and "test_return" in row for row in run.evaluations)
    saved = json.loads((run.run_dir / "config.json").read_text())
    assert (saved["env_id"], saved["batch_size"], saved["hidden_size"]) == ("Pendulum-v1", 32, 16)
    autotune = json.loads((run.run_dir / "autotune.json").read_text())
    assert autotune["chosen"]["batch_size"]["by"] == "user"  # the keywords count as given by hand
    for name in ("final", "latest"):
        assert spreeze.load_policy(run.run_dir, name)(OBS).shape == (1,)


def test_train_layers_keywords_over_the_config_file_over_the_preset(tmp_path):
    """The API resolves settings as the command line does: keywords > config_file= > preset > defaults."""
    from launch.api import make_config

    settings = tmp_path / "settings.yaml"
    settings.write_text("hidden-size: 48\ngamma: 0.9\n")
    config, explicit, sources = make_config("Pendulum-v1", {"gamma": 0.95, "config_file": str(settings),
                                                            "env_kwargs": {"g": 9.81}})
    assert config.preset == "classic_control" and sources["learning_starts"] == "preset:classic_control"
    assert config.learning_starts == 1000
    assert (config.hidden_size, sources["hidden_size"]) == (48, f"config:{settings}")
    assert (config.gamma, sources["gamma"]) == (0.95, "api")
    assert config.env_kwargs == ("g=9.81",) and {"gamma", "hidden_size", "env_kwargs"} <= explicit
    plain, _, plain_sources = make_config("Pendulum-v1", {"preset": "none"})
    assert plain.learning_starts == 10_000 and "preset:classic_control" not in plain_sources.values()
