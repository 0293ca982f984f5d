"""Speed ratios: collect:update held by both sides waiting (PQL beta_a:v), actor:critic by the update schedule."""
import csv
import os
import time

import numpy as np
import pytest
import torch

from spreeze import learner as learner_mod
from spreeze import sampler as sampler_mod
from spreeze.algos import SAC, TD3
from spreeze.config import Config, ConfigError
from spreeze.replay import Batch

_REAL_LEARNER_RUN = learner_mod.loop
_REAL_SAMPLER_RUN = sampler_mod.loop


def slowed_learner_run(*args, **kwargs):
    """The real learner loop with every update delayed (spawned by reference: ``test_ratio`` is importable)."""
    delay_s = float(os.environ["SPREEZE_TEST_DELAY_S"])
    update = learner_mod.Learner.step

    def slowed(self):
        time.sleep(delay_s)
        update(self)

    learner_mod.Learner.step = slowed
    _REAL_LEARNER_RUN(*args, **kwargs)


def slowed_sampler_run(*args, **kwargs):
    """The real sampler loop with every step of its envs delayed."""
    delay_s = float(os.environ["SPREEZE_TEST_DELAY_S"])
    step = sampler_mod.Sampler.step

    def slowed(self):
        time.sleep(delay_s)
        step(self)

    sampler_mod.Sampler.step = slowed
    _REAL_SAMPLER_RUN(*args, **kwargs)


def run_slowed(tmp_path, monkeypatch, side: str, **overrides) -> list[dict]:
    from spreeze.envs import check_env
    from launch.compose import train

    monkeypatch.setenv("SPREEZE_TEST_DELAY_S", "0.008")
    if side == "learner":
        monkeypatch.setattr(learner_mod, "loop", slowed_learner_run)
    else:
        monkeypatch.setattr(sampler_mod, "loop", slowed_sampler_run)
    settings = dict(env_id="Pendulum-v1", samplers=1, envs_per_sampler=4, spare_samplers=0, batch_size=64,
                    hidden_size=32, learning_starts=500, collect_per_update=4.0, total_steps=3500,
                    minutes=3.0,  # a wall-clock cap: a ratio deadlock fails the test instead of hanging it
                    log_interval_s=1.0, eval_interval_s=60.0, learner_threads=1, actor_device="cpu",
                    critic_device="cpu", window=False, run_dir=str(tmp_path / "run"))
    config = Config(**{**settings, **overrides})
    config.validate()
    lines = []
    result = train(config, check_env("Pendulum-v1"), log=lines.append)
    assert result.exit_code == 0, lines
    assert f"[spreeze] reached --total-steps {config.total_steps}" in lines, lines  # not the --minutes cap
    with open(tmp_path / "run" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def achieved_collect_per_update(rows: list[dict]) -> float:
    """Env steps per update between the first and the last row once learning runs (the steady state)."""
    learning = [r for r in rows if int(r["updates"]) > 0]
    assert len(learning) >= 3, rows
    first, last = learning[0], learning[-1]
    return (int(last["env_steps"]) - int(first["env_steps"])) / (int(last["updates"]) - int(first["updates"]))


@pytest.mark.slow
def test_slowed_learner_holds_the_samplers_to_the_collect_ratio(tmp_path, monkeypatch):
    rows = run_slowed(tmp_path, monkeypatch, "learner", algo="td3")
    assert achieved_collect_per_update(rows) == pytest.approx(4.0, rel=0.10)
    assert float(rows[-1]["actor_per_critic_update"]) == pytest.approx(0.5, abs=0.01)  # TD3's default delay


@pytest.mark.slow
def test_slowed_sampler_holds_the_learner_to_the_collect_ratio(tmp_path, monkeypatch):
    rows = run_slowed(tmp_path, monkeypatch, "sampler", policy_delay=2)
    assert achieved_collect_per_update(rows) == pytest.approx(4.0, rel=0.10)
    assert float(rows[-1]["actor_per_critic_update"]) == pytest.approx(0.5, abs=0.01)  # SAC with --policy-delay 2


def tiny_batch(n=32, obs=3, act=2):
    rng = np.random.default_rng(0)
    return Batch(rng.standard_normal((n, obs), dtype=np.float32), rng.uniform(-1, 1, (n, act)).astype(np.float32),
                 np.zeros(n, np.float32), rng.standard_normal((n, obs), dtype=np.float32), np.zeros(n, np.float32))


def test_policy_delay_defaults_per_algorithm():
    assert Config(algo="sac").effective_policy_delay == 1
    assert Config(algo="td3").effective_policy_delay == 2
    assert Config(algo="sac", policy_delay=3).effective_policy_delay == 3
    with pytest.raises(ConfigError, match="--policy-delay"):
        Config(policy_delay=-1).validate()


def test_sac_updates_its_actor_once_per_policy_delay_critic_updates():
    algo = SAC(Config(algo="sac", policy_delay=3), 3, 2, "cpu", "cpu")
    b = algo.batch(tiny_batch())
    actor_before = [p.clone() for p in algo.actor.parameters()]
    critic_before = [p.clone() for p in algo.critic.parameters()]
    algo.update(b)  # update 0: actor and critic
    assert any(not torch.equal(a, p) for a, p in zip(actor_before, algo.actor.parameters()))
    snapshot, alpha = [p.clone() for p in algo.actor.parameters()], float(algo.log_alpha.detach())
    stats = [algo.update(b), algo.update(b)]  # updates 1, 2: critic only
    assert all(torch.equal(a, p) for a, p in zip(snapshot, algo.actor.parameters()))
    assert float(algo.log_alpha.detach()) == alpha
    assert any(not torch.equal(a, p) for a, p in zip(critic_before, algo.critic.parameters()))
    assert all({"critic_loss", "actor_loss", "alpha"} <= set(s) for s in stats)  # the last actor values carry on
    algo.update(b)
    assert (algo.updates, algo.actor_updates) == (4, 2)


def test_td3_counts_its_actor_updates():
    algo = TD3(Config(algo="td3"), 3, 2, "cpu", "cpu")
    b = algo.batch(tiny_batch())
    for _ in range(5):
        algo.update(b)
    assert (algo.updates, algo.actor_updates) == (5, 3)
    state = algo.state_dict()
    fresh = TD3(Config(algo="td3"), 3, 2, "cpu", "cpu")
    fresh.load_state_dict(state)
    assert fresh.actor_updates == 3
