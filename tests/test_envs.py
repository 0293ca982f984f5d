"""Env checks and construction: one clear line for a bad id or space, seeded resets, private PyBullet physics."""
import numpy as np
import pytest

from spreeze.config import ConfigError
from spreeze.envs import ActionScaler, check_env, make_env


def test_check_env_reads_the_spaces_of_a_box_env():
    info = check_env("Pendulum-v1")
    assert (info.obs_dim, info.act_dim, info.action_low, info.action_high) == (3, 1, (-2.0,), (2.0,))
    assert info.max_episode_steps == 200


@pytest.mark.parametrize("env_id, fragment", [
    ("Pendulum-v9", "closest registered ids"),
    ("CartPole-v1", "Discrete action space"),
    ("no_such_module:Thing-v0", "cannot import"),
])
def test_check_env_refuses_with_one_line(env_id, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        check_env(env_id)
    assert "\n" not in str(err.value)


def test_make_env_resets_with_its_seed():
    (a, obs_a), (b, obs_b), (c, obs_c) = make_env("Pendulum-v1", 3), make_env("Pendulum-v1", 3), make_env("Pendulum-v1", 4)
    try:
        assert np.array_equal(obs_a, obs_b) and not np.array_equal(obs_a, obs_c)
    finally:
        for env in (a, b, c):
            env.close()


def test_pybullet_env_runs_on_its_own_direct_connection():
    import pybullet

    env, obs = make_env("HopperBulletEnv-v0", 0)
    try:
        assert env.unwrapped._p.getConnectionInfo()["connectionMethod"] == pybullet.DIRECT
        assert np.all(np.isfinite(obs))
    finally:
        env.close()


def test_action_scaler_maps_the_unit_box_onto_the_bounds_and_clips():
    scale = ActionScaler((-2.0, 0.0), (2.0, 1.0))
    assert np.allclose(scale(np.array([-1.0, 1.0])), [-2.0, 1.0])
    assert np.allclose(scale(np.array([0.0, 0.0])), [0.0, 0.5])
    assert np.allclose(scale(np.array([5.0, -5.0])), [2.0, 0.0])


def test_the_wrapper_examples_of_the_readme_and_the_error_message_pass_the_env_check():
    """The README's and the --wrapper error's example was ClipAction, which gymnasium makes unbounded
    (Box(-inf, inf)): the env check refused the example it gave."""
    import re

    from conftest import ROOT
    from spreeze.config import Config

    readme = (ROOT / "README.md").read_text()
    examples = set(re.findall(r"--wrapper (\w[\w.]*:\w[\w.]*)", readme)) - {"module:callable"}  # the form
    with pytest.raises(ConfigError) as refused:
        Config(wrapper=("not a spec",)).validate()
    examples |= set(re.findall(r"say (\w[\w.]*:\w[\w.]*)", str(refused.value)))
    assert len(examples) >= 1, examples
    for spec in examples:
        info = check_env(Config(env_id="Pendulum-v1", wrapper=(spec,)))
        assert info.act_dim == 1, spec
