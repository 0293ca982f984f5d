"""SAC/TD3/CrossQ on tiny cases whose losses and targets can be worked out by hand."""
import contextlib
import math

import numpy as np
import pytest
import torch

from spreeze.algos import SAC, TD3, CrossQ, make_algo, to_torch_batch
from spreeze.algos.base import soft_update
from spreeze.algos.distributional import (AUTO_MARGIN, EDGE_WARN_SHARE, DistributionalTwinQ,
                                          categorical_projection, distributional_target, support_edge_warning)
from spreeze.algos.networks import BatchRenormTwinQ, EnsembleBatchRenorm, TwinQ
from spreeze.config import Config, ConfigError
from spreeze.replay import Batch

OBS, ACT = 3, 2


def constant_q(q: TwinQ, value: float) -> None:
    """Make both Q networks output ``value`` for every input (all weights 0, last bias = value)."""
    with torch.no_grad():
        for layer in q.layers:
            layer.weight.zero_()
            layer.bias.zero_()
        q.layers[-1].bias.fill_(value)


def batch(rewards, terminated, n=None):
    n = len(rewards)
    rng = np.random.default_rng(0)
    return Batch(rng.standard_normal((n, OBS), dtype=np.float32), rng.uniform(-1, 1, (n, ACT)).astype(np.float32),
                 np.asarray(rewards, np.float32), rng.standard_normal((n, OBS), dtype=np.float32),
                 np.asarray(terminated, np.float32))


def test_td3_critic_loss_by_hand():
    config = Config(algo="td3", gamma=0.9, target_noise=0.0)
    algo = TD3(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 1.0)         # Q(s, a) = 1
    constant_q(algo.critic_target, 5.0)  # Q_target(s', a') = 5
    b = algo.batch(batch(rewards=[1.0, 2.0], terminated=[0.0, 1.0]))
    # targets: 1 + 0.9 * 5 = 5.5 (not terminal) and 2 (terminal); twin losses summed
    expected = 2 * ((1 - 5.5) ** 2 + (1 - 2.0) ** 2) / 2
    loss = algo.update_critic(b)["critic_loss"]
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_sac_critic_loss_by_hand_with_vanishing_temperature():
    config = Config(algo="sac", gamma=0.5, initial_alpha=1e-12)
    algo = SAC(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 0.0)
    constant_q(algo.critic_target, 2.0)
    b = algo.batch(batch(rewards=[1.0, 1.0, 3.0], terminated=[0.0, 0.0, 1.0]))
    # targets: 1 + 0.5 * 2 = 2, 2, and 3 (terminal); alpha * log_prob ~ 0
    expected = 2 * (2.0 ** 2 + 2.0 ** 2 + 3.0 ** 2) / 3
    assert float(algo.update_critic(b)["critic_loss"]) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("algo_name", ["sac", "td3"])
def test_n_step_rows_bootstrap_with_gamma_to_the_n(algo_name):
    """A row of --n-step 3 already holds three discounted rewards: its bootstrap is gamma**3 * Q(s_t+3)."""
    config = Config(algo=algo_name, gamma=0.5, n_step=3, initial_alpha=1e-12, target_noise=0.0)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 0.0)
    constant_q(algo.critic_target, 8.0)
    b = algo.batch(batch(rewards=[1.75, 1.5], terminated=[0.0, 1.0]))
    # targets: 1.75 + 0.125 * 8 = 2.75, and 1.5 (terminal)
    expected = 2 * (2.75 ** 2 + 1.5 ** 2) / 2
    assert float(algo.update_critic(b)["critic_loss"]) == pytest.approx(expected, rel=1e-4)


def test_sac_entropy_bonus_enters_the_target():
    config = Config(algo="sac", gamma=1.0, initial_alpha=1.0)
    algo = SAC(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 0.0)
    constant_q(algo.critic_target, 0.0)
    b = algo.batch(batch(rewards=[0.0] * 512, terminated=[0.0] * 512))
    torch.manual_seed(3)
    with torch.no_grad():
        _, log_prob = algo.actor.sample(b.next_obs_actor)
    torch.manual_seed(3)
    loss = float(algo.update_critic(b)["critic_loss"])
    # target = -alpha * log_prob, Q = 0: loss = 2 * mean(log_prob^2)
    assert loss == pytest.approx(2 * float((log_prob ** 2).mean()), rel=1e-5)


@pytest.mark.parametrize("algo_name", ["sac", "td3"])
def test_truncation_bootstraps_termination_does_not(algo_name):
    """The buffer stores `terminated` only: a time-limit truncation keeps gamma * Q(s', a')."""
    config = Config(algo=algo_name, gamma=0.9, initial_alpha=1e-12, target_noise=0.0)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 0.0)
    constant_q(algo.critic_target, 10.0)
    truncated_only = float(algo.update_critic(algo.batch(batch([0.0], [0.0])))["critic_loss"])
    constant_q(algo.critic, 0.0)
    terminated = float(algo.update_critic(algo.batch(batch([0.0], [1.0])))["critic_loss"])
    assert truncated_only == pytest.approx(2 * 9.0 ** 2, rel=1e-4)
    assert terminated == pytest.approx(0.0, abs=1e-8)


def test_sac_actor_loss_by_hand_and_alpha_tuning_direction():
    config = Config(algo="sac", initial_alpha=0.5, alpha_lr=0.1)
    algo = SAC(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 3.0)
    b = algo.batch(batch(rewards=[0.0] * 256, terminated=[0.0] * 256))
    torch.manual_seed(5)
    with torch.no_grad():
        _, log_prob = algo.actor.sample(b.obs_actor)
    torch.manual_seed(5)
    out = algo.update_actor(b)
    assert float(out["actor_loss"]) == pytest.approx(float((0.5 * log_prob - 3.0).mean()), rel=1e-5)
    entropy = -float(log_prob.mean())
    # entropy above the target (-act_dim) lowers alpha, below it raises alpha
    assert (float(out["alpha"]) < 0.5) == (entropy > -ACT)


def test_td3_delays_actor_and_target_updates():
    config = Config(algo="td3", policy_delay=3)
    algo = TD3(config, OBS, ACT, "cpu", "cpu")
    b = algo.batch(batch([0.0] * 32, [0.0] * 32))
    actor_before = [p.clone() for p in algo.actor.parameters()]
    algo.update(b)  # update 0: actor updated
    changed = [not torch.equal(a, p) for a, p in zip(actor_before, algo.actor.parameters())]
    assert any(changed)
    snapshot = [p.clone() for p in algo.actor.parameters()]
    algo.update(b)
    algo.update(b)  # updates 1, 2: actor untouched
    assert all(torch.equal(a, p) for a, p in zip(snapshot, algo.actor.parameters()))


def test_soft_update_is_polyak():
    config = Config(algo="sac", tau=0.25)
    algo = SAC(config, OBS, ACT, "cpu", "cpu")
    constant_q(algo.critic, 4.0)
    constant_q(algo.critic_target, 0.0)
    algo.soft_update()
    assert float(algo.critic_target.layers[-1].bias[0, 0, 0]) == pytest.approx(1.0)


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_two_device_path_places_each_tensor_where_it_is_used(algo_name, monkeypatch):
    """Spreeze 3.1's split with the critics on a device that really differs from the actor's, without a GPU:
    torch's "meta" device (shapes only; any op mixing a meta and a CPU tensor raises). r, d, a only on the
    critic device; observations on both."""
    real_autocast = torch.autocast

    def autocast(device_type, *args, **kwargs):  # autocast has no meta backend: a no-op there
        return contextlib.nullcontext() if device_type == "meta" else real_autocast(device_type, *args, **kwargs)

    monkeypatch.setattr(torch, "autocast", autocast)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    algo = make_algo(Config(algo=algo_name), OBS, ACT, "cpu", "meta")
    assert (algo.actor_device, algo.critic_device) == (cpu, meta)
    assert all(p.device == cpu for p in algo.actor.parameters())
    targets = [] if algo_name == "crossq" else [*algo.critic_target.parameters()]
    assert all(p.device == meta for p in [*algo.critic.parameters(), *algo.critic.buffers(), *targets])
    if algo_name != "td3":
        assert algo.log_alpha.device == cpu  # the temperature is updated with the actor
    b = algo.batch(batch([1.0] * 16, [0.0] * 16))
    assert b.obs_actor.device == b.next_obs_actor.device == cpu
    assert b.obs_critic.device == b.next_obs_critic.device == meta
    assert b.rewards.device == b.terminated.device == b.actions.device == meta
    # the critic update takes the actor's next actions across and computes on the critic device only: an
    # actor-device tensor used there without a copy would raise
    assert algo.update_critic(b)["critic_loss"].device == meta
    assert to_torch_batch(batch([1.0] * 4, [0.0] * 4), cpu, meta).obs_actor.device == cpu

    # and the same code, both on the CPU, trains
    same = make_algo(Config(algo=algo_name), OBS, ACT, "cpu", "cpu")
    stats = same.update(same.batch(batch([1.0] * 16, [0.0] * 16)))
    assert all(math.isfinite(float(v)) for v in stats.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algo_name", ["sac", "td3"])
def test_cuda_split_update(algo_name):
    critic_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    config = Config(algo=algo_name)
    algo = make_algo(config, OBS, ACT, "cuda:0", critic_device)
    b = algo.batch(batch([1.0] * 64, [0.0] * 64))
    assert b.rewards.device == torch.device(critic_device) and b.obs_actor.device == torch.device("cuda:0")
    stats = algo.update(b)
    assert all(math.isfinite(float(v)) for v in stats.values())


@pytest.mark.parametrize("algo_name, critic_atoms, layer_norm, overlap", [
    ("sac", 0, False, False), ("crossq", 0, False, False), ("sac", 51, False, False), ("td3", 51, False, False),
    ("sac", 0, True, False), ("sac", 0, False, True), ("sac", 51, False, True)])
def test_learning_a_bandit_moves_the_policy_toward_the_best_action(algo_name, critic_atoms, layer_norm, overlap):
    """One-step episodes with reward -(a - 0.5)^2: after training the deterministic action nears 0.5 (with
    --critic-atoms, led by the distributional critic's expected value; with --learner-overlap, by critics one
    update old)."""
    torch.manual_seed(0)
    config = Config(algo=algo_name, gamma=0.0, actor_lr=3e-3, critic_lr=3e-3, hidden_size=32, initial_alpha=0.05,
                    policy_delay=1, critic_atoms=critic_atoms, critic_layer_norm=layer_norm, learner_overlap=overlap)
    algo = make_algo(config, 1, 1, "cpu", "cpu")
    rng = np.random.default_rng(0)
    for _ in range(600):
        actions = rng.uniform(-1, 1, (128, 1)).astype(np.float32)
        rewards = -((actions[:, 0] - 0.5) ** 2)
        obs = np.zeros((128, 1), np.float32)
        algo.update(algo.batch(Batch(obs, actions, rewards.astype(np.float32), obs, np.ones(128, np.float32))))
    action = float(algo.actor.act(torch.zeros(1, 1), deterministic=True))
    algo.close()
    assert action == pytest.approx(0.5, abs=0.15)


@pytest.mark.parametrize("critic_atoms, bf16, policy_delay, normalize", [(0, False, 1, False), (51, True, 2, True)])
def test_overlapped_sac_update_is_the_sequential_one_on_frozen_copies(monkeypatch, critic_atoms, bf16, policy_delay,
                                                                      normalize):
    """--learner-overlap: the critics' step reads the actor and temperature from before the actor's step, and the
    actor's step reads the critics from before theirs; the same steps run one after the other on copies give the
    same weights, bit for bit (the sampling noise fixed, as the two threads draw it in no fixed order)."""
    import copy

    import spreeze.algos.networks as networks

    monkeypatch.setattr(networks.torch, "randn_like", lambda t: torch.full_like(t, 0.3))
    made = []
    for overlap in (True, False):
        torch.manual_seed(0)
        made.append(make_algo(Config(learner_overlap=overlap, critic_atoms=critic_atoms, bf16=bf16,
                                     policy_delay=policy_delay, normalize_obs=normalize), OBS, ACT, "cpu", "cpu"))
    overlapped, sequential = made
    for step in range(4):
        raw = batch([float(step), -1.0, 0.5, 2.0] * 16, [0.0, 1.0] * 32)
        raw = raw._replace(obs=raw.obs * (step + 1.0))  # observation statistics that move between steps
        stats = overlapped.update(overlapped.batch(raw))
        b = sequential.batch(raw)
        with sequential.autocast():
            if step % policy_delay == 0:
                actor_before = copy.deepcopy(sequential.actor)
                critic_before = copy.deepcopy(sequential.critic).requires_grad_(False)
                alpha_before = sequential.log_alpha.detach().exp()
                sequential.update_critic(b, actor_before, alpha_before)
                sequential.update_actor(b, critic_before)
            else:
                sequential.update_critic(b)
        sequential.soft_update()
        sequential.updates += 1
        assert math.isfinite(float(stats["critic_loss"])) and math.isfinite(float(stats["actor_loss"]))
    for name in ("actor", "critic", "critic_target"):
        for a, s in zip(getattr(overlapped, name).state_dict().values(), getattr(sequential, name).state_dict().values()):
            assert torch.equal(a, s), name
    assert torch.equal(overlapped.log_alpha, sequential.log_alpha)
    assert overlapped.actor_updates == 4 // policy_delay
    assert any(t.name.startswith("spreeze-actor-update") for t in __import__("threading").enumerate())
    overlapped.close()
    assert not any(t.name.startswith("spreeze-actor-update") for t in __import__("threading").enumerate())


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_optimizers_run_fused_and_stay_so_when_loading_a_for_loop_adams_state(algo_name):
    """Fused Adam on the CPU, also after resuming a checkpoint written by the for-loop Adam (torch would otherwise
    bring back the saved group's flags)."""
    names = ["actor_optimizer", "critic_optimizer", "alpha_optimizer"]
    algo = make_algo(Config(algo=algo_name), OBS, ACT, "cpu", "cpu")
    names = [n for n in names if hasattr(algo, n)]
    assert all(getattr(algo, n).param_groups[0]["fused"] is True for n in names)
    old = make_algo(Config(algo=algo_name), OBS, ACT, "cpu", "cpu")
    for n in names:
        group = getattr(old, n).param_groups[0]
        setattr(old, n, torch.optim.Adam(group["params"], lr=group["lr"], betas=group["betas"]))
    b = old.batch(batch([1.0] * 64, [0.0] * 64))
    for _ in range(2):
        old.update(b)
    algo.load_state_dict(old.state_dict())
    assert all(getattr(algo, n).param_groups[0]["fused"] is True for n in names)
    for n in names:  # the moments and step counts came over
        loaded, saved = getattr(algo, n).state_dict()["state"], getattr(old, n).state_dict()["state"]
        assert loaded.keys() == saved.keys() and loaded
        assert all(torch.equal(loaded[i][k].float(), saved[i][k].float()) for i in saved for k in saved[i])
    stats = algo.update(b)
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_learner_overlap_is_for_free_running_sac():
    with pytest.raises(ConfigError, match="applies to sac"):
        Config(algo="td3", learner_overlap=True).validate()
    with pytest.raises(ConfigError, match="deterministic"):
        Config(learner_overlap=True, deterministic=True).validate()


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_bf16_autocast_keeps_outputs_in_float32_and_trains(algo_name):
    config = Config(algo=algo_name, bf16=True)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    b = algo.batch(batch([1.0] * 64, [0.0] * 64))
    with algo.autocast():
        q = algo.critic(b.obs_critic, b.actions)
        hidden = algo.critic.layers[0](torch.cat([b.obs_critic, b.actions], -1).unsqueeze(0).expand(2, -1, -1)
                                       .contiguous())
    assert q.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    before = [p.clone() for p in algo.critic.parameters()]
    stats = algo.update(b)
    assert all(math.isfinite(float(v)) for v in stats.values())
    assert all(p.dtype == torch.float32 for p in algo.critic.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, algo.critic.parameters()))


def assert_learns_pendulum_serially(tmp_path, lock_step=True, **overrides):
    """A tiny learning test in the real pipeline (serial): the recorded test returns rise from a random
    policy's (about -1200 to -1500) to a swung-up pendulum's. Lock-step rounds (``--deterministic``) test at fixed
    env steps, so the outcome does not depend on how fast the machine is: timed tests on a slower CI machine once
    caught a C51 run between swings. Sized with 6,000 steps: C51 and CrossQ each had a best mean of 5 of -52 to
    -122 over seeds 0-3, n-step (free-running, timed tests: it needs rows of n steps) -51 to -347. The run stops
    once its mean of 5 reaches the line (--target-return), which is what the test asserts on: the steps after it
    only cost time."""
    from launch.compose import train
    from spreeze.envs import check_env

    timing = (dict(deterministic=True, num_envs=1, eval_every_steps=250) if lock_step
              else dict(envs_per_sampler=1, eval_interval_s=1.0))
    config = Config(env_id="Pendulum-v1", serial=True, samplers=1, spare_samplers=0,
                    total_steps=6000, minutes=3.0, learning_starts=500, batch_size=128, hidden_size=64,
                    collect_per_update=1.0, seed=0, log_interval_s=60.0, target_return=-400.0,
                    window=False, actor_device="cpu", critic_device="cpu", learner_threads=1,
                    run_dir=str(tmp_path / "run"), **timing, **overrides)
    config.validate()
    result = train(config, check_env("Pendulum-v1"), log=lambda line: None)
    returns = [e["test_return"] for e in result.evaluations]
    assert result.exit_code == 0 and result.summary["stopped_by"] == "target_return", returns
    assert min(returns[:2]) < -700  # it did start from a bad policy
    assert result.summary["best_mean5_test_return"] >= -400, returns  # (a lock-step stop tests once more after)
    return result


@pytest.mark.slow
def test_n_step_sac_learns_pendulum(tmp_path):
    assert_learns_pendulum_serially(tmp_path, lock_step=False, n_step=3)


# --- CrossQ --------------------------------------------------------------------------------------------

def test_crossq_bootstraps_from_the_live_critic_without_a_target():
    """No target network: the bootstrap Q(s', a') comes from the critic being fitted, in the same pass."""
    config = Config(algo="crossq", gamma=0.9, initial_alpha=1e-12)
    algo = CrossQ(config, OBS, ACT, "cpu", "cpu")
    assert not hasattr(algo, "critic_target") and "critic_target" not in algo.state_dict()
    constant_q(algo.critic, 1.0)  # zero weights after every normalisation: Q = 1 whatever the statistics
    b = algo.batch(batch(rewards=[1.0, 2.0], terminated=[0.0, 1.0]))
    # targets: 1 + 0.9 * 1 = 1.9 (not terminal) and 2 (terminal); Q = 1; twin losses summed
    expected = 2 * ((1 - 1.9) ** 2 + (1 - 2.0) ** 2) / 2
    assert float(algo.update_critic(b)["critic_loss"]) == pytest.approx(expected, rel=1e-4)


def test_crossq_normalises_over_the_joint_batch_of_both_states():
    """The fitted pass sees (s, a) and (s', pi(s')) together: the input statistics move toward their mixture."""
    config = Config(algo="crossq")
    algo = CrossQ(config, OBS, ACT, "cpu", "cpu")
    raw = batch(rewards=[0.0] * 64, terminated=[0.0] * 64)
    raw = raw._replace(obs=raw.obs + 10.0, next_obs=raw.next_obs - 4.0)  # means 10 and -4: mixture 3
    algo.critic_loss(algo.batch(raw))
    first = algo.critic.norms[0]
    obs_running_mean = first.running_mean[0, 0, :OBS]
    # one step of momentum 0.01 from 0 toward the mixture's mean of about 3 (neither 10 nor -4)
    assert obs_running_mean.mean().item() == pytest.approx(0.01 * 3.0, abs=0.006)
    assert int(first.steps) == 1


def test_crossq_actor_update_reads_the_running_statistics_and_leaves_them():
    config = Config(algo="crossq", initial_alpha=0.5)
    algo = CrossQ(config, OBS, ACT, "cpu", "cpu")
    b = algo.batch(batch(rewards=[0.0] * 32, terminated=[0.0] * 32))
    before = [t.clone() for t in algo.critic.buffers()]
    seen = []
    hook = algo.critic.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    algo.update_actor(b)
    hook.remove()
    assert seen == [False] and algo.critic.training  # eval mode inside, train mode restored
    assert all(torch.equal(a, t) for a, t in zip(before, algo.critic.buffers()))


def test_crossq_noise_scale_measurement_does_not_train_the_statistics():
    algo = CrossQ(Config(algo="crossq"), OBS, ACT, "cpu", "cpu")
    b = algo.batch(batch(rewards=[1.0] * 64, terminated=[0.0] * 64))
    before = [t.clone() for t in algo.critic.buffers()]
    big, small = algo.critic_gradient_sq_norms(b, 8)
    assert big > 0 and small > 0
    assert all(torch.equal(a, t) for a, t in zip(before, algo.critic.buffers()))


@pytest.mark.parametrize("algo_name", ["sac", "crossq"])
def test_the_first_rows_gradient_is_a_sample_of_the_whole_batchs(algo_name, monkeypatch):
    """McCandlish et al.'s noise-scale estimate needs the gradient on the first rows to be a sample of the whole
    batch's: averaged over the batch's slices (each rotated to the front) it is the whole batch's gradient. CrossQ's
    batch-normalised critics must not normalise the slice by its own statistics for this to hold."""
    monkeypatch.setattr(torch, "randn_like", torch.zeros_like)  # the same next actions in every pass
    algo = (CrossQ if algo_name == "crossq" else SAC)(Config(algo=algo_name), OBS, ACT, "cpu", "cpu")
    rng = np.random.default_rng(0)
    b = algo.batch(batch(rewards=list(rng.normal(size=32)), terminated=[0.0] * 32))
    whole, _ = algo.critic_gradients(b, 8)
    slices = [algo.critic_gradients(type(b)(*(t.roll(-8 * k, 0) for t in b)), 8)[1] for k in range(4)]
    assert torch.allclose(torch.stack(slices).mean(0), whole, rtol=1e-4, atol=1e-6)


def test_crossq_delays_its_actor_by_three_and_uses_beta1_one_half():
    config = Config(algo="crossq")
    assert config.effective_policy_delay == 3
    algo = CrossQ(config, OBS, ACT, "cpu", "cpu")
    assert algo.critic_optimizer.param_groups[0]["betas"] == (0.5, 0.999)
    b = algo.batch(batch([0.0] * 32, [0.0] * 32))
    for _ in range(7):
        algo.update(b)
    assert (algo.updates, algo.actor_updates) == (7, 3)  # actor at updates 0, 3, 6


def test_crossq_checkpoint_state_carries_the_normalisation_statistics():
    config = Config(algo="crossq", critic_hidden_size=48, hidden_size=16)
    algo = CrossQ(config, OBS, ACT, "cpu", "cpu")
    assert algo.critic.layers[0].weight.shape == (2, OBS + ACT, 48) and algo.actor.net[0].out_features == 16
    b = algo.batch(batch([1.0] * 32, [0.0] * 32))
    for _ in range(3):
        algo.update(b)
    copy = CrossQ(config, OBS, ACT, "cpu", "cpu")
    copy.load_state_dict(algo.state_dict())
    assert torch.equal(copy.critic.norms[1].running_var, algo.critic.norms[1].running_var)
    assert int(copy.critic.norms[1].steps) == 3 and copy.updates == 3
    copy.critic.eval(), algo.critic.eval()
    assert torch.equal(copy.critic(b.obs_critic, b.actions), algo.critic(b.obs_critic, b.actions))


def test_batch_renorm_is_batch_norm_in_warm_up_and_running_norm_after():
    torch.manual_seed(0)
    norm = EnsembleBatchRenorm(2, 5, momentum=0.5, warmup_steps=3)
    x = torch.randn(2, 400, 5) * 3.0 + 2.0
    out = norm(x)  # warm-up: the batch's own statistics
    assert out.mean(1).abs().max().item() < 1e-4
    assert out.std(1).sub(1).abs().max().item() < 1e-2
    assert norm.running_mean.mean().item() == pytest.approx(0.5 * 2.0, abs=0.3)
    for _ in range(2):
        norm(x)
    # past the warm-up, a batch from elsewhere is corrected toward the running statistics (r, d unclipped):
    # the output equals normalising with the running statistics, while gradients still flow through the batch's
    norm.running_mean.fill_(1.0), norm.running_var.fill_(4.0)
    shifted = torch.randn(2, 400, 5) * 2.5 + 1.5
    expected = (shifted - 1.0) / math.sqrt(4.0 + norm.eps)
    assert torch.allclose(norm(shifted), expected, atol=2e-3)
    norm.eval()
    assert torch.allclose(norm(shifted), (shifted - norm.running_mean) / (norm.running_var + norm.eps).sqrt())


def test_batch_renorm_twin_q_shapes():
    critic = BatchRenormTwinQ(OBS, ACT, 16, 2)
    q = critic(torch.randn(9, OBS), torch.randn(9, ACT))
    assert q.shape == (2, 9) and len(critic.norms) == len(critic.layers) == 3


@pytest.mark.slow
def test_crossq_learns_pendulum(tmp_path):
    assert_learns_pendulum_serially(tmp_path, algo="crossq")


# --- --normalize-obs -----------------------------------------------------------------------------------

def test_obs_normalizer_matches_the_statistics_of_everything_it_saw():
    from spreeze.algos.networks import ObsNormalizer

    rng = np.random.default_rng(0)
    chunks = [rng.normal(5.0, 3.0, (n, 4)) * [1, 10, 0.1, 1] for n in (7, 100, 1, 33)]
    norm = ObsNormalizer(4, clip=10.0)
    for chunk in chunks:
        norm.update(torch.as_tensor(chunk, dtype=torch.float32))
    seen = np.concatenate(chunks)
    assert int(norm.count) == len(seen)
    assert norm.mean.numpy() == pytest.approx(seen.mean(0), rel=1e-5)
    assert norm.var.numpy() == pytest.approx(seen.var(0), rel=1e-4)
    out = norm(torch.as_tensor(seen, dtype=torch.float32)).numpy()
    assert out.mean(0) == pytest.approx(np.zeros(4), abs=1e-4) and out.std(0) == pytest.approx(np.ones(4), rel=1e-3)
    far = torch.full((1, 4), 1e6)
    assert torch.all(norm(far) == 10.0)  # clipped


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_normalize_obs_feeds_critics_normalised_rows_and_the_actor_raw_ones(algo_name):
    config = Config(algo=algo_name, normalize_obs=True)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    raw = batch([0.0] * 64, [0.0] * 64)
    raw = raw._replace(obs=raw.obs * 4.0 + 7.0, next_obs=raw.next_obs * 4.0 + 7.0)
    b = algo.batch(raw)
    norm = algo.actor.obs_norm
    assert int(norm.count) == 64 and norm.mean.numpy() == pytest.approx(raw.obs.mean(0), rel=1e-5)
    assert torch.equal(b.obs_actor, torch.from_numpy(raw.obs))  # the actor normalises by itself
    assert torch.allclose(b.obs_critic, norm(torch.from_numpy(raw.obs)))
    assert torch.allclose(b.next_obs_critic, norm(torch.from_numpy(raw.next_obs)))
    assert abs(float(b.obs_critic.mean())) < 0.1
    stats = algo.update(b)
    assert all(math.isfinite(float(v)) for v in stats.values())
    if algo_name == "td3":  # the target actor normalises with the actor's statistics, also between target updates
        algo.update(algo.batch(raw._replace(obs=raw.obs + 3.0)))  # TD3's delay 2: the targets are not due here
        assert torch.equal(algo.actor_target.obs_norm.mean, norm.mean) and int(norm.count) == 128
        saved = algo.state_dict()  # as a checkpoint from before the sharing held them: the target's copy lagging
        saved["actor_target"] = dict(saved["actor_target"], **{"obs_norm.mean": norm.mean * 0.0})
        fresh = make_algo(config, OBS, ACT, "cpu", "cpu")
        fresh.load_state_dict(saved)
        assert torch.equal(fresh.actor.obs_norm.mean, norm.mean) and fresh.actor_target.obs_norm is fresh.actor.obs_norm


def test_normalize_obs_statistics_travel_with_the_weights_and_into_saved_policies(tmp_path):
    import multiprocessing as mp

    from spreeze.algos import make_actor
    from spreeze.checkpoint import load_policy, save_actor
    from spreeze.envs import check_env
    from spreeze.weights import SharedWeights

    config = Config(env_id="Pendulum-v1", normalize_obs=True, hidden_size=16)
    algo = make_algo(config, 3, 1, "cpu", "cpu")
    raw = Batch(np.random.default_rng(1).normal(3.0, 2.0, (50, 3)).astype(np.float32), np.zeros((50, 1), np.float32),
                np.zeros(50, np.float32), np.zeros((50, 3), np.float32), np.zeros(50, np.float32))
    algo.batch(raw)
    weights = SharedWeights.create(algo.actor, mp.get_context("spawn"))
    try:
        weights.publish(algo.actor, 1)
        sampler_actor = make_actor(config, 3, 1)  # as a sampler holds it
        weights.pull(sampler_actor, 0)
    finally:
        weights.close()  # the owner's close unlinks the segment
    assert sampler_actor.obs_norm.mean.numpy() == pytest.approx(algo.actor.obs_norm.mean.numpy(), rel=1e-6)
    obs = torch.as_tensor(raw.obs[:5])
    assert torch.allclose(sampler_actor.act(obs, deterministic=True), algo.actor.act(obs, deterministic=True), atol=1e-6)
    save_actor(tmp_path, algo.actor, config.to_dict(), check_env("Pendulum-v1"))
    policy = load_policy(tmp_path)
    expected = 2.0 * algo.actor.act(obs[:1], deterministic=True).numpy()[0]  # Pendulum's actions span [-2, 2]
    assert policy(raw.obs[0]) == pytest.approx(expected, abs=1e-5)


# --- distributional critics (--critic-atoms) -----------------------------------------------------------

def delta_twins(q, twin_atoms: tuple[int, int]) -> None:
    """Each target twin puts (almost) all its mass on one atom, whatever the input."""
    with torch.no_grad():
        for layer in q.layers:
            layer.weight.zero_()
            layer.bias.zero_()
        for twin, atom in enumerate(twin_atoms):
            q.layers[-1].bias[twin, 0, atom] = 60.0


def test_categorical_projection_by_hand():
    support = torch.tensor([0.0, 1.0, 2.0, 3.0])
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [1.0, 0.0]])
    atoms = torch.tensor([[1.25, 0.0], [-5.0, 9.0], [3.0, 0.0]])  # inside; clipped both ends; the top end
    expected = torch.tensor([[0.0, 0.75, 0.25, 0.0], [0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(categorical_projection(probs, atoms, support), expected)


def test_a_non_finite_return_projects_to_a_nan_row_not_a_crash():
    """A NaN actor's log-probability (SAC's bonus) made a NaN return: its position became an out-of-range index and
    scatter_add_ raised (a device-side assert on a GPU), where scalar critics end with a non-finite loss and the
    learner's one-line stop. The row comes out NaN; the others are as before."""
    support = torch.tensor([0.0, 1.0, 2.0, 3.0])
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    atoms = torch.tensor([[1.25, 0.0], [float("nan"), 1.0], [2.0, float("inf")]])
    projected = categorical_projection(probs, atoms, support)
    assert torch.allclose(projected[0], torch.tensor([0.0, 0.75, 0.25, 0.0]))
    assert torch.isnan(projected[1]).all() and torch.isnan(projected[2]).all()


def test_categorical_projection_keeps_mass_and_the_mean_inside_the_support():
    generator = torch.Generator().manual_seed(0)
    support = torch.linspace(-10, 10, 51)
    probs = torch.softmax(torch.randn(64, 51, generator=generator), -1)
    atoms = 0.5 + 0.9 * support.expand(64, -1) + torch.randn(64, 1, generator=generator)  # shifted, shrunk
    projected = categorical_projection(probs, atoms, support)
    assert torch.allclose(projected.sum(-1), torch.ones(64))
    assert torch.allclose((projected * support).sum(-1), (probs * atoms.clamp(-10, 10)).sum(-1), atol=1e-4)


def test_categorical_projection_puts_no_negative_mass_at_the_top_of_a_float32_support():
    """A return at or above q_max sits at position (q_max - q_min) / step, which float32 can round a hair above
    n - 1: with the lower index held at n - 2, the weight of n - 1 came out above 1 and n - 2 got a negative mass
    (36 of these 1,200 supports)."""
    for n in (11, 51, 101, 201):
        for bound in torch.linspace(1.0, 5000.0, 300).tolist():
            support = torch.linspace(-bound, bound, n)
            atoms = torch.tensor([[bound, 2 * bound, -2 * bound, -bound]])
            projected = categorical_projection(torch.full((1, 4), 0.25), atoms, support)
            assert (projected >= 0).all(), (n, bound, projected.min())
            assert torch.allclose(projected.sum(-1), torch.ones(1))


@pytest.mark.parametrize("algo_name", ["sac", "td3"])
def test_distributional_target_by_hand(algo_name):
    """Support -2..2 (5 atoms); target twins sit on 1 and 0: the lower (0) is taken. A live row's atoms go to
    r + gamma * 0 = 0.5, split between 0 and 1; a terminal row keeps its reward -1."""
    config = Config(algo=algo_name, gamma=0.5, critic_atoms=5, q_range="-2,2", initial_alpha=1e-12,
                    target_noise=0.0)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    delta_twins(algo.critic_target, (3, 2))
    b = algo.batch(batch(rewards=[0.5, -1.0], terminated=[0.0, 1.0]))
    target = distributional_target(algo.critic_target, b, b.actions, torch.zeros(2), algo.gamma_n)
    assert torch.allclose(target, torch.tensor([[0, 0, 0.5, 0.5, 0], [0, 1.0, 0, 0, 0]]), atol=1e-6)
    # the SAC entropy bonus shifts the next atoms before discounting: 0.5 + 0.5 * (0 + 1) = 1
    shifted = distributional_target(algo.critic_target, b, b.actions, torch.ones(2), algo.gamma_n)
    assert torch.allclose(shifted[0], torch.tensor([0, 0, 0, 1.0, 0]), atol=1e-6)
    # the loss is both twins' cross-entropy against it
    logits = algo.critic.logits(b.obs_critic, b.actions)
    expected = -(target * torch.log_softmax(logits, -1)).sum(-1).mean(1).sum()
    assert float(algo.critic_loss(b).detach()) == pytest.approx(float(expected.detach()), rel=1e-5)


def test_distributional_critic_shapes_and_expected_values():
    q = DistributionalTwinQ(OBS, ACT, 16, 2, atoms=11, q_range=(-5.0, 5.0))
    obs, actions = torch.randn(7, OBS), torch.rand(7, ACT)
    logits = q.logits(obs, actions)
    assert logits.shape == (2, 7, 11)
    assert q(obs, actions).shape == (2, 7)
    assert torch.allclose(q(obs, actions), (torch.softmax(logits, -1) * torch.linspace(-5, 5, 11)).sum(-1))


def test_auto_q_range_is_set_once_from_the_first_batch_and_saved():
    config = Config(algo="td3", gamma=0.9, critic_atoms=11, target_noise=0.0)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    assert not bool(algo.critic.support_set)
    algo.update(algo.batch(batch(rewards=[2.0, -1.5], terminated=[0.0, 0.0])))
    bound = AUTO_MARGIN * 2.0 / (1 - 0.9)  # the largest |reward| over (1 - gamma)
    for q in (algo.critic, algo.critic_target):
        assert float(q.support[0]) == pytest.approx(-bound) and float(q.support[-1]) == pytest.approx(bound)
    algo.update(algo.batch(batch(rewards=[50.0, 0.0], terminated=[0.0, 0.0])))
    assert float(algo.critic.support[-1]) == pytest.approx(bound)  # not moved by later batches
    fresh = make_algo(config, OBS, ACT, "cpu", "cpu")
    fresh.load_state_dict(algo.state_dict())
    assert bool(fresh.critic.support_set) and torch.equal(fresh.critic.support, algo.critic.support)


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_the_actor_update_reports_the_critics_mean_q_of_its_actions(algo_name):
    """``q_value``: the Q the actor's loss reads (SAC: the lower twin; TD3: the first critic), on the batch."""
    config = Config(algo=algo_name, hidden_size=16)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    if algo_name != "crossq":
        constant_q(algo.critic, 3.0)
    b = algo.batch(batch(rewards=[0.0] * 64, terminated=[0.0] * 64))
    out = algo.update_actor(b)
    if algo_name == "crossq":
        assert math.isfinite(float(out["q_value"]))
    else:
        assert float(out["q_value"]) == pytest.approx(3.0, rel=1e-5)


def test_support_edge_warning_fires_past_its_share_of_the_half_width_on_either_side():
    assert support_edge_warning(0.0, -100.0, 100.0) is None
    assert support_edge_warning(EDGE_WARN_SHARE * 100.0 - 1.0, -100.0, 100.0) is None
    assert "--q-range" in support_edge_warning(EDGE_WARN_SHARE * 100.0 + 1.0, -100.0, 100.0)
    assert support_edge_warning(-90.0, -100.0, 100.0) is not None
    assert support_edge_warning(45.0, 0.0, 50.0) is not None and support_edge_warning(25.0, 0.0, 50.0) is None
    assert support_edge_warning(float("nan"), -1.0, 1.0) is None


def test_critic_atoms_is_refused_for_crossq_and_a_bad_q_range():
    for bad in (dict(algo="crossq", critic_atoms=11), dict(critic_atoms=1), dict(critic_atoms=11, q_range="3,1"),
                dict(critic_atoms=11, q_range="-1")):
        with pytest.raises(ConfigError):
            Config(**bad).validate()


@pytest.mark.slow
def test_distributional_sac_learns_pendulum(tmp_path):
    assert_learns_pendulum_serially(tmp_path, critic_atoms=51)


def test_critic_layer_norm_normalises_each_twin_with_its_own_gain():
    """--critic-layer-norm: each hidden layer's pre-activations of each twin are layer-normalised, then scaled by
    that twin's gain (a gain changed in twin 0 leaves twin 1's Q unchanged)."""
    torch.manual_seed(0)
    plain, normed = TwinQ(OBS, ACT, 16, 2), TwinQ(OBS, ACT, 16, 2, layer_norm=True)
    assert len(plain.norms) == 0 and len(normed.norms) == 2
    assert set(plain.state_dict()) < set(normed.state_dict())  # the same layer names: old checkpoints still load
    obs, act = torch.randn(5, OBS), torch.randn(5, ACT)
    x = torch.cat([obs, act], -1)
    h = normed.layers[0](x.unsqueeze(0).expand(2, -1, -1))
    mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
    with torch.no_grad():
        normed.norms[0].weight[0].fill_(2.0)
        normed.norms[0].bias[0].fill_(0.5)
    by_hand = torch.relu((h - mean) / torch.sqrt(var + 1e-5) * normed.norms[0].weight + normed.norms[0].bias)
    for layer, norm in zip(normed.layers[1:-1], normed.norms[1:]):
        by_hand = torch.relu(norm(layer(by_hand)))
    expected = normed.layers[-1](by_hand).squeeze(-1)
    q = normed(obs, act)
    assert q.shape == (2, 5) and torch.allclose(q, expected, atol=1e-6)
    with torch.no_grad():
        normed.norms[0].weight[0].fill_(3.0)
    assert torch.equal(normed(obs, act)[1], q[1]) and not torch.allclose(normed(obs, act)[0], q[0])


@pytest.mark.parametrize("algo_name, critic_atoms", [("sac", 0), ("td3", 51)])
def test_critic_layer_norm_reaches_the_algorithms_critics_and_is_refused_for_crossq(algo_name, critic_atoms):
    algo = make_algo(Config(algo=algo_name, critic_layer_norm=True, critic_atoms=critic_atoms), OBS, ACT, "cpu", "cpu")
    assert len(algo.critic.norms) == len(algo.critic_target.norms) == 2
    with torch.no_grad():
        algo.critic.norms[0].weight.fill_(3.0)
    soft_update(algo.critic_target, algo.critic, 0.5)  # the target's gains follow the critic's
    assert torch.allclose(algo.critic_target.norms[0].weight, torch.full_like(algo.critic.norms[0].weight, 2.0))
    with pytest.raises(ConfigError, match="critic-layer-norm"):
        Config(algo="crossq", critic_layer_norm=True).validate()
    with pytest.raises(ConfigError, match="needs --total-steps"):
        Config(deterministic=True, lr_schedule="linear", minutes=5.0).validate()


def test_lr_scale_follows_the_nearer_end_of_the_budget():
    from spreeze.pace import lr_scale
    assert lr_scale(Config(total_steps=1000), 500) == 1.0  # constant
    steps = Config(lr_schedule="linear", total_steps=1000)
    assert [lr_scale(steps, s) for s in (0, 250, 1000, 2000)] == [1.0, 0.75, 0.0, 0.0]
    both = Config(lr_schedule="linear", total_steps=1000, minutes=1.0)
    assert lr_scale(both, 100, elapsed_s=30.0) == pytest.approx(0.5)   # time is further on
    assert lr_scale(both, 900, elapsed_s=30.0) == pytest.approx(0.1)   # steps are
    assert lr_scale(both, 100, elapsed_s=None) == pytest.approx(0.9)   # lock-step: steps only
    assert lr_scale(Config(lr_schedule="linear"), 10**9, elapsed_s=10**6) == 1.0  # no budget


@pytest.mark.parametrize("algo_name", ["sac", "td3", "crossq"])
def test_scale_learning_rates_sets_every_optimizer_from_the_configured_rates(algo_name):
    config = Config(algo=algo_name, actor_lr=1e-3, critic_lr=2e-3, alpha_lr=4e-3)
    algo = make_algo(config, OBS, ACT, "cpu", "cpu")
    optimizers = {n: o for n, o in algo.modules().items() if isinstance(o, torch.optim.Optimizer)}
    for scale in (0.5, 0.5, 0.25):  # repeated calls do not compound
        algo.scale_learning_rates(scale)
    rates = {"actor_optimizer": 1e-3, "critic_optimizer": 2e-3, "alpha_optimizer": 4e-3}
    assert {n: o.param_groups[0]["lr"] for n, o in optimizers.items()} == pytest.approx(
        {n: rates[n] * 0.25 for n in optimizers})
    state = algo.state_dict()  # a resumed run brings back the scaled rate; the next scaling starts from config
    fresh = make_algo(config, OBS, ACT, "cpu", "cpu")
    fresh.load_state_dict(state)
    fresh.scale_learning_rates(1.0)
    assert fresh.critic_optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
