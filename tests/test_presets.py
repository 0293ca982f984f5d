"""Per-env presets, --config files, where every value came from, --env-kwargs and --wrapper."""
import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys

import pytest

from spreeze.config import FIELD_CHOICES, Config, ConfigError, parse_env_kwargs
from spreeze.settings import config_record, parse, preset_names, preset_patterns, read_preset, resolve_preset_name

from conftest import ROOT, exit_and_stderr, fake_checkpoint

WRAPPERS = "tests.env_wrappers"


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ----- presets ---------------------------------------------------------------------------------------------

def test_shipped_presets_load_validate_and_cite_measured_sections():
    """Each preset converts like flags and validates; its comment names docs/benchmarks.md sections that exist."""
    headings = {line.lstrip("#").strip() for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
                if line.startswith("#")}
    assert set(preset_names()) == {"classic_control", "mujoco", "pybullet", "pybullet_humanoid", "pybullet_legged"}
    for name in preset_names():
        settings = read_preset(name)
        assert settings and preset_patterns(name)
        assert not {"samplers", "batch_size"} & set(settings), "the machine's settings are the autotuner's"
        Config(**settings).validate()
        for algo in FIELD_CHOICES["algo"]:  # each algorithm's share of the preset converts and validates too
            Config(algo=algo, **read_preset(name, algo)).validate()
        text = (ROOT / "spreeze" / "presets" / f"{name}.yaml").read_text()
        assert "docs/benchmarks.md" in text
        cited = set(re.findall(r'"([^"]+)"', text))  # a heading, or its start up to a word's end
        missing = {c for c in cited if not any(h == c or (h.startswith(c) and not h[len(c)].isalnum())
                                               for h in headings)}
        assert cited and not missing, missing


@pytest.mark.parametrize("env_id, preset", [
    ("Pendulum-v1", "classic_control"), ("Walker2DBulletEnv-v0", "pybullet_legged"), ("HalfCheetahBulletEnv-v0", "pybullet"),
    ("HopperBulletEnv-v0", "pybullet_legged"),
    ("HumanoidBulletEnv-v0", "pybullet_humanoid"), ("Walker2d-v5", "mujoco"), ("HalfCheetah-v4", "mujoco"),
    ("MountainCarContinuous-v0", "none"), ("tests.faulty_envs:NanEveryPendulum-v0", "none"),
])
def test_auto_picks_by_env_id(env_id, preset):
    assert resolve_preset_name("auto", env_id) == preset
    bare = env_id.rpartition(":")[2]  # no two presets may claim one env
    assert len([n for n in preset_names() if any(fnmatch.fnmatchcase(bare, p) for p in preset_patterns(n))]) <= 1


def test_an_env_without_a_preset_and_the_default_env_keep_the_plain_defaults():
    """auto is the default: it must change nothing where no preset matches, and the PyBullet preset pins values
    that are the defaults today (it records what was measured, should a default change), except SAC's policy
    delay."""
    plain = parse(["--env", "MountainCarContinuous-v0"])
    assert plain.config == Config(env_id="MountainCarContinuous-v0", preset="none")
    assert set(plain.sources.values()) == {"default", "flag"}
    walker = parse([])  # the default env: its preset pins today's defaults, adds the distributional critic,
    # delays the actor's updates and offers narrower hidden layers (the profile takes them for a float32 learner)
    assert dataclasses.replace(walker.config, preset="auto", critic_atoms=0, policy_delay=0,
                               narrow_hidden_size=0) == Config()
    assert walker.config.preset == "pybullet_legged" and walker.sources["n_step"] == "preset:pybullet_legged"
    assert walker.config.critic_atoms == 101 and walker.sources["critic_atoms"] == "preset:pybullet_legged"
    assert walker.config.policy_delay == 2 and walker.sources["policy_delay"] == "preset:pybullet_legged"
    assert (walker.config.hidden_size, walker.config.narrow_hidden_size) == (256, 192)
    assert walker.sources["narrow_hidden_size"] == "preset:pybullet_legged"
    cheetah = parse(["--env", "HalfCheetahBulletEnv-v0"])  # the family's preset: the actor's delay and the layers
    assert (dataclasses.replace(cheetah.config, preset="auto", env_id=Config().env_id, policy_delay=0,
                                narrow_hidden_size=0) == Config())
    assert cheetah.config.policy_delay == 2 and cheetah.sources["policy_delay"] == "preset:pybullet"
    assert cheetah.config.narrow_hidden_size == 192 and cheetah.sources["narrow_hidden_size"] == "preset:pybullet"
    humanoid = parse(["--env", "HumanoidBulletEnv-v0"])  # the narrower layers were not measured on it
    assert humanoid.config.narrow_hidden_size == 0
    assert humanoid.sources["narrow_hidden_size"] == "preset:pybullet_humanoid"
    assert parse(["--env", "HalfCheetahBulletEnv-v0", "--algo", "td3"]).config.narrow_hidden_size == 0  # SAC's only
    assert parse(["--env", "HalfCheetahBulletEnv-v0", "--algo", "td3"]).sources["policy_delay"] == "default"


def test_precedence_flag_over_config_over_preset_over_default(tmp_path):
    cfg = write(tmp_path / "my.yaml", "learning-starts: 2000\nhidden_size: 128\nactor-lr: 1e-4\n")
    parsed = parse(["--env", "Pendulum-v1", "--config", str(cfg), "--hidden-size", "32"])
    c, s = parsed.config, parsed.sources
    assert (c.hidden_size, s["hidden_size"]) == (32, "flag")                        # flag > config > preset
    assert (c.learning_starts, s["learning_starts"]) == (2000, f"config:{cfg}")     # config > preset
    assert (c.actor_lr, s["actor_lr"]) == (1e-4, f"config:{cfg}")                  # YAML's text '1e-4' -> float
    assert (c.critic_lr, s["critic_lr"]) == (1e-3, "preset:classic_control")        # preset > default
    assert (c.gamma, s["gamma"]) == (0.98, "default")
    assert c.preset == "classic_control"
    # what the user gave (flags and the file) is explicit; a preset's values are not (see spreeze.settings.Parsed)
    assert parsed.explicit == {"env_id", "config_file", "hidden_size", "learning_starts", "actor_lr"}
    off = parse(["--env", "Pendulum-v1", "--preset", "none"])
    assert (off.config.critic_lr, off.sources["critic_lr"]) == (Config.critic_lr, "default")
    # the file may choose the preset too; the env id of the file picks the auto preset
    chosen = parse(["--config", str(write(tmp_path / "p.yaml", "env: Pendulum-v1\npreset: none\n"))])
    assert chosen.config.env_id == "Pendulum-v1" and chosen.config.preset == "none"
    assert chosen.config.learning_starts == Config.learning_starts


def test_config_file_values_convert_like_flags(tmp_path):
    cfg = write(tmp_path / "c.yaml", "serial: yes\ntarget-return: null\nwrapper: gymnasium.wrappers:ClipAction\n"
                                     "env-kwargs: {g: 3.5, name: 'true', big: 1.0e+30, tol: 1e-5, tag: '1e-5'}\n"
                                     "seed: 7\nactor-lr: 3e-4\n")
    c = parse(["--config", str(cfg), "--env", "Pendulum-v1"]).config
    assert (c.serial, c.target_return, c.seed, c.actor_lr) == (True, None, 7, 3e-4)
    assert c.wrapper == ("gymnasium.wrappers:ClipAction",)
    # 1e-5 unquoted is a number, as --env-kwargs tol=1e-5 makes it (YAML 1.1 alone reads it as text)
    assert parse_env_kwargs(c.env_kwargs) == {"g": 3.5, "name": "true", "big": 1e30, "tol": 1e-5, "tag": "1e-5"}
    assert parse_env_kwargs(parse(["--env", "Pendulum-v1", "--env-kwargs", "tol=1e-5"]).config.env_kwargs) == {
        "tol": 1e-5}
    # an optional switch (--bf16/--no-bf16, unset: the profile decides) takes true, false or null
    for text, value in (("true", True), ("false", False), ("null", None)):
        cfg = write(tmp_path / f"b-{text}.yaml", f"bf16: {text}\n")
        assert parse(["--config", str(cfg), "--env", "Pendulum-v1"]).config.bf16 is value


@pytest.mark.parametrize("text, fragment", [
    ("batch-size: abc\n", "invalid int value"),
    ("serial: 3\n", "true or false"),
    ("bf16: 3\n", "true or false"),
    ("bach-size: 256\n", "unknown key 'bach-size' (did you mean batch-size?)"),
    ("config: other.yaml\n", "cannot be set here"),
    ("gamma: [0.9]\n", "single value"),
    ("gamma: 1.5\n", "--gamma must be in (0, 1]"),   # validate() runs on a file's values too
    ("- a\n- b\n", "must be a mapping"),
    ("a: [1,\n", "malformed YAML"),
])
def test_a_bad_config_file_is_one_line_exit_2(tmp_path, capsys, text, fragment):
    cfg = write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["--env", "Pendulum-v1", "--config", str(cfg)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_a_preset_with_resume_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--resume", "runs/x", "--preset", "none"])
    assert "--resume" in capsys.readouterr().err


# ----- --env-kwargs and --wrapper ---------------------------------------------------------------------------

def test_env_kwargs_are_yaml_scalars():
    assert parse_env_kwargs(["g=9.81", "n=3", "flag=true", "name=abc", "tiny=1e-5", "quoted='3'", "none=null"]) == \
        {"g": 9.81, "n": 3, "flag": True, "name": "abc", "tiny": 1e-5, "quoted": "3", "none": None}
    for bad in ["g", "=3", "g=", "g=[1,", "g={a: 1}", "two words=1"]:
        with pytest.raises(ConfigError):
            parse_env_kwargs([bad])
    with pytest.raises(ConfigError, match="twice"):
        parse_env_kwargs(["g=1", "g=2"])


def test_env_kwargs_and_wrappers_reach_the_env():
    import numpy as np

    from spreeze.envs import check_env, make_env
    from viz.video import make_render_env

    config = Config(env_id="Pendulum-v1", env_kwargs=("g=3.5",), wrapper=(f"{WRAPPERS}:double_reward",))
    env, _ = make_env(config, seed=3)
    plain, _ = make_env("Pendulum-v1", seed=3)
    assert env.unwrapped.g == 3.5 and plain.unwrapped.g != 3.5
    action = np.array([0.5], np.float32)
    _, reward, *_ = env.step(action)
    _, plain_reward, *_ = plain.step(action)
    assert reward == pytest.approx(2 * plain_reward)  # same first step: g only acts on the next state
    assert check_env(config).obs_dim == 3
    render_env = make_render_env(config, human=False)
    assert render_env.unwrapped.g == 3.5 and render_env.unwrapped.render_mode == "rgb_array"
    for e in (env, plain, render_env):
        e.close()
    for wrapper, fragment in ((f"{WRAPPERS}:not_an_env", "not a gymnasium env"),
                              (f"{WRAPPERS}:NOT_CALLABLE", "not a callable"),
                              (f"{WRAPPERS}:missing", "has no"),
                              ("spreeze_no_such_module:W", "cannot import")):
        with pytest.raises(ConfigError, match=fragment):
            check_env(Config(env_id="Pendulum-v1", wrapper=(wrapper,)))
    with pytest.raises(ConfigError, match="cannot be built"):
        check_env(Config(env_id="Pendulum-v1", env_kwargs=("gravity=3",)))


def test_the_probe_builds_the_env_with_kwargs_and_wrappers(tmp_path, monkeypatch):
    from autotune.probe import SHORT_SETTINGS, measure_sampler
    from spreeze.envs import check_env

    log = tmp_path / "builds.log"
    monkeypatch.setenv("SPREEZE_TEST_WRAPPER_LOG", str(log))
    config = Config(env_id="Pendulum-v1", envs_per_sampler=2, env_kwargs=("g=4.5",),
                    wrapper=(f"{WRAPPERS}:RecordBuilds",))
    info = check_env(config)
    log.unlink()
    measure_sampler(config, info, SHORT_SETTINGS)
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["4.5", "4.5"]


# ----- provenance -------------------------------------------------------------------------------------------

def test_config_record_keeps_the_fields_resume_reads():
    config = Config(env_id="Pendulum-v1", env_kwargs=("g=3",), wrapper=("a:b",))
    record = json.loads(json.dumps(config_record(config, {"env_id": "flag"})))
    assert "sources" not in {f.name for f in dataclasses.fields(Config)}
    assert record["sources"]["env_id"] == "flag" and record["sources"]["gamma"] == "default"
    assert set(record["sources"]) == {f.name for f in dataclasses.fields(Config)}
    assert Config.from_dict(record) == config  # JSON lists come back as the tuples Config holds


def test_resolve_marks_tuned_and_resumed_values(tmp_path, monkeypatch):
    """The tuner's choices become "autotune" and leave values the user gave alone; resume marks the rest."""
    import autotune
    from launch.compose import resolve

    def fake_tune(config, env_info, explicit, **kwargs):
        by = "deterministic" if config.deterministic else "profile"
        chosen = {"samplers": {"value": 2, "by": "profile"}, "learner_threads": {"value": 1, "by": "profile"},
                  "batch_size": {"value": config.batch_size, "by": "user"}, "bf16": {"value": by == "profile", "by": by}}
        return dataclasses.replace(config, samplers=2, bf16=by == "profile"), {"chosen": chosen}

    monkeypatch.setattr(autotune, "tune", fake_tune)
    parsed = parse(["--env", "Pendulum-v1", "--batch-size", "128", "--no-window", "--run-dir", str(tmp_path / "r")])
    resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
    s = resolved.sources
    assert (resolved.config.samplers, s["samplers"]) == (2, "autotune")
    assert (resolved.config.learner_threads, s["learner_threads"]) == (1, "autotune")
    assert (resolved.config.batch_size, s["batch_size"]) == (128, "flag")
    assert (resolved.config.bf16, s["bf16"]) == (True, "autotune")
    assert s["hidden_size"] == "preset:classic_control" and s["gamma"] == "default"
    # --deterministic's float32 is a fixed default, not the machine's choice
    parsed = parse(["--env", "Pendulum-v1", "--deterministic", "--no-window", "--run-dir", str(tmp_path / "d")])
    resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
    assert (resolved.config.bf16, resolved.sources["bf16"]) == (False, "default")


def test_a_resume_that_re_decides_its_batch_finds_the_launch_s_profile(tmp_path, monkeypatch):
    """A default run's config.json holds the precision the profile chose (True/False), but its profile is cached
    under the setting as given (unset): a resume that re-decides its batch asks the tuner with the precision unset
    again, so it finds that profile instead of measuring the machine again; one given now, or set in the run's
    config by hand, stays."""
    import autotune
    from launch.compose import resolve

    seen = []

    def fake_tune(config, env_info, explicit, **kwargs):
        seen.append((config.bf16, config.batch_size))
        chosen = {"samplers": {"value": config.samplers, "by": "config"}, "learner_threads": {"value": 1, "by": "profile"},
                  "batch_size": {"value": 256, "by": "profile"}, "bf16": {"value": True, "by": "profile"}}
        return dataclasses.replace(config, batch_size=256, bf16=True), {"chosen": chosen}

    monkeypatch.setattr(autotune, "tune", fake_tune)
    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=512, bf16=True, batch_rule="noise", window=False,
                   run_dir=str(run))
    fake_checkpoint(run, saved)
    (run / "config.json").write_text(json.dumps(saved.to_dict()))
    for by, flags, expected in (("profile", [], None), ("default", [], None), ("config", [], True),
                                ("profile", ["--no-bf16"], False)):
        (run / "autotune.json").write_text(json.dumps({"chosen": {"batch_size": {"value": 512, "by": "profile"},
                                                                  "bf16": {"value": True, "by": by}}}))
        parsed = parse(["--resume", str(run), *flags])
        resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
        assert seen[-1] == (expected, 0), (by, flags)
    # a width the profile chose from the precision: the precision stays with the width the checkpoint keeps
    (run / "autotune.json").write_text(json.dumps({"chosen": {"batch_size": {"value": 512, "by": "profile"},
                                                              "bf16": {"value": True, "by": "profile"},
                                                              "hidden_size": {"value": 256, "by": "profile"}}}))
    parsed = parse(["--resume", str(run)])
    resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
    assert seen[-1] == (True, 0)


def test_a_resume_chooses_the_machine_s_learner_threads_again_and_does_not_repeat_reprofile(tmp_path, monkeypatch):
    """The learner's thread count the tuner chose is for the cores of the machine it was chosen on: a resume
    (perhaps on a smaller machine) leaves it to this machine's tuner, as it does CUDA graphs; a count its user
    gave stays. ``--reprofile`` asks for one measurement, not one at every later resume."""
    import autotune
    from launch.compose import resolve

    seen = []

    def fake_tune(config, env_info, explicit, **kwargs):
        seen.append((config.learner_threads, kwargs.get("reprofile")))
        chosen = {"samplers": {"value": 1, "by": "config"}, "batch_size": {"value": 256, "by": "config"},
                  "learner_threads": {"value": 2, "by": "profile"}}
        return dataclasses.replace(config, learner_threads=config.learner_threads or 2), {"chosen": chosen}

    monkeypatch.setattr(autotune, "tune", fake_tune)
    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, learner_threads=16, reprofile=True,
                   window=False, run_dir=str(run))
    fake_checkpoint(run, saved)
    for source, flags, expected in (("autotune", [], (0, False)), ("default", [], (0, False)),
                                    ("flag", [], (16, False)), ("autotune", ["--learner-threads", "3"], (3, False)),
                                    ("autotune", ["--reprofile"], (0, True))):
        (run / "config.json").write_text(json.dumps(config_record(saved, {"learner_threads": source,
                                                                          "reprofile": "flag"})))
        parsed = parse(["--resume", str(run), *flags])
        resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
        assert seen[-1] == expected, (source, flags)
        assert resolved.config.learner_threads == (expected[0] or 2) and resolved.config.reprofile is expected[1]
        if expected[0] == 0:
            assert resolved.sources["learner_threads"] == "autotune"


def test_a_resume_chooses_the_remote_sampler_count_again_on_the_cluster_it_runs_on(tmp_path, monkeypatch):
    """``--remote-samplers 0`` is one sampler per CPU of the cluster the run was launched on: a resume on another
    cluster reused that count as if given by hand (actors beyond its CPUs wait unplaced); a count its user gave
    stays."""
    pytest.importorskip("ray")
    import autotune
    import spreeze.remote as remote
    from launch.compose import resolve

    monkeypatch.setattr(autotune, "tune", lambda config, env_info, explicit, **kwargs: (config, {"chosen": {}}))
    monkeypatch.setattr(remote, "check_cluster", lambda config, env_info: {
        "address": "10.0.0.1:6379", "ray_version": "x", "cluster_cpus": 8.0, "nodes": 1, "block_rows": 64,
        "block_round_trip_ms": 1.0})
    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, ray="10.0.0.1:6379", remote_samplers=30,
                   window=False, run_dir=str(run))
    fake_checkpoint(run, saved)
    for source, flags, expected, by in (("autotune", [], 8, "profile"), ("flag", [], 30, "user"),
                                        ("autotune", ["--remote-samplers", "4"], 4, "user")):
        (run / "config.json").write_text(json.dumps(config_record(saved, {"remote_samplers": source})))
        parsed = parse(["--resume", str(run), *flags])
        resolved = resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)
        assert resolved.config.remote_samplers == expected, (source, flags)
        assert resolved.profile["ray"]["remote_samplers"]["by"] == by, (source, flags)


# ----- through run.py ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, fragment, in_process", [
    # a real `python run.py` for a parser error and for an env that cannot be built (its import prints on the way);
    # the rest call the same entry point in this process, which saves a torch import each
    (["--preset", "pybulet"], "did you mean pybullet", False),
    (["--config", "{in}/malformed.yaml"], "malformed YAML", True),
    (["--config", "{in}/unknown.yaml"], "unknown key 'bach-size'", True),
    (["--config", "{in}/missing.yaml"], "cannot read it", True),
    (["--env-kwargs", "g"], "key=value", True),
    (["--env-kwargs", "gravity=3"], "cannot be built", False),
    (["--wrapper", "spreeze_no_such_module:Wrap"], "cannot import", True),
    (["--wrapper", f"{WRAPPERS}:NOT_CALLABLE"], "not a callable", True),
    (["--wrapper", "no-colon"], "module:callable", True),
])
def test_run_py_bad_preset_config_kwargs_wrapper_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capfd,
                                                                                 keep_signal_handlers, args, fragment,
                                                                                 in_process):
    given = tmp_path / "in"
    write(given / "malformed.yaml", "batch-size: [256\n")
    write(given / "unknown.yaml", "bach-size: 256\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    argv = ["--env", "Pendulum-v1", "--samplers", "1", "--batch-size", "64", *[a.format(**{"in": given}) for a in args]]
    monkeypatch.setenv("SPREEZE_CACHE_DIR", str(tmp_path / "cache"))
    code, stderr = exit_and_stderr(argv, cwd, in_process, monkeypatch, capfd)
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("argv[0]")]
    assert len(lines) == 1 and fragment in lines[0], stderr
    assert list(cwd.iterdir()) == [] and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_run_and_resume_keep_kwargs_wrapper_and_record_every_source(tmp_path):
    """A real run: the wrapper sees g=3.5 in the check, the sampler and the evaluator processes; config.json says
    where each value came from; a resume without the flags builds the same env and marks the rest "resume"."""
    run_dir, log = tmp_path / "run", tmp_path / "builds.log"
    cfg = write(tmp_path / "my.yaml", "learning-starts: 300\neval-interval-s: 1\n")
    env = {**os.environ, "SPREEZE_CACHE_DIR": str(tmp_path / "cache"), "SPREEZE_TEST_WRAPPER_LOG": str(log)}
    common = ["--no-window", "--log-interval-s", "1"]
    first = subprocess.run([sys.executable, str(ROOT / "run.py"), "--env", "Pendulum-v1", "--config", str(cfg),
                            "--env-kwargs", "g=3.5", "--wrapper", f"{WRAPPERS}:RecordBuilds", "--samplers", "1",
                            "--spare-samplers", "0", "--batch-size", "64", "--total-steps", "800", "--minutes", "2",
                            "--replay-ratio", "32",  # 2 env steps per update: the run is about its env, not updates
                            "--run-dir", str(run_dir), *common], cwd=tmp_path, capture_output=True, text=True,
                           timeout=240, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "[spreeze] preset classic_control for Pendulum-v1" in first.stdout
    builds = [line.split() for line in log.read_text().splitlines()]
    roles = {title for title, _ in builds}
    assert {"spreeze-sampler-0", "spreeze-evaluator"} <= roles and len(roles) >= 3  # and the main process's check
    assert {g for _, g in builds} == {"3.5"}

    record = json.loads((run_dir / "config.json").read_text())
    assert record["env_kwargs"] == ["g=3.5"] and record["wrapper"] == [f"{WRAPPERS}:RecordBuilds"]
    sources = record["sources"]
    assert sources["env_kwargs"] == sources["wrapper"] == sources["batch_size"] == "flag"
    assert sources["learning_starts"] == f"config:{cfg}" and record["learning_starts"] == 300
    assert sources["hidden_size"] == "preset:classic_control" and record["hidden_size"] == 64
    assert sources["gamma"] == "default" and record["preset"] == "classic_control"

    log.unlink()
    resumed = subprocess.run([sys.executable, str(ROOT / "run.py"), "--resume", str(run_dir), "--total-steps", "1200",
                              *common], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[spreeze] preset" not in resumed.stdout  # the saved values, not the preset's again
    builds = [line.split() for line in log.read_text().splitlines()]
    assert "spreeze-sampler-0" in {title for title, _ in builds} and {g for _, g in builds} == {"3.5"}
    record = json.loads((run_dir / "config.json").read_text())
    assert record["env_kwargs"] == ["g=3.5"] and record["total_steps"] == 1200
    sources = record["sources"]
    assert sources["total_steps"] == "flag" and sources["env_kwargs"] == sources["hidden_size"] == "resume"


def test_humanoid_preset_normalises_observations_and_the_others_do_not():
    assert read_preset("pybullet_humanoid")["normalize_obs"] is True
    assert ({k: v for k, v in read_preset("pybullet_humanoid").items() if k not in ("normalize_obs",
                                                                                   "narrow_hidden_size")}
            == {k: v for k, v in read_preset("pybullet").items() if k != "narrow_hidden_size"})
    assert not any(read_preset(name).get("normalize_obs") for name in ("pybullet", "pybullet_legged", "classic_control",
                                                                        "mujoco"))
    assert ({k: v for k, v in read_preset("pybullet_legged").items() if k != "critic_atoms"}
            == read_preset("pybullet"))
    assert read_preset("pybullet")["policy_delay"] == read_preset("pybullet_humanoid")["policy_delay"] == 2
    assert "policy_delay" not in read_preset("pybullet", "td3")  # measured with SAC only


def test_a_preset_extends_another_and_a_bad_extends_is_one_line(tmp_path, monkeypatch):
    """``extends``: the base's settings, then the preset's own over them; an unknown base or a circle is refused."""
    import spreeze.settings as settings

    for name, text in {"base": "envs: [A-v0]\nsettings:\n  n-step: 3\n  batch-rule: noise\n",
                       "child": "envs: [B-v0]\nextends: base\nsettings:\n  n-step: 1\n  critic-atoms: 51\n",
                       "lost": "envs: [C-v0]\nextends: nowhere\n",
                       "loop_a": "envs: [D-v0]\nextends: loop_b\n", "loop_b": "envs: [E-v0]\nextends: loop_a\n"}.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(settings, "_preset_dir", lambda: tmp_path)
    assert settings.read_preset("child") == {"n_step": 1, "batch_rule": "noise", "critic_atoms": 51}
    with pytest.raises(ConfigError, match="names no preset"):
        settings.read_preset("lost")
    with pytest.raises(ConfigError, match="circle"):
        settings.read_preset("loop_a")


def test_a_preset_key_no_preset_has_is_refused(tmp_path, monkeypatch):
    """A typo such as ``extend:`` or ``algo_settings:`` would silently drop what it was meant to bring."""
    import spreeze.settings as settings

    for name, text in {"base": "envs: [A-v0]\nsettings:\n  n-step: 3\n",
                       "typo": "envs: [B-v0]\nextend: base\n",
                       "snake": "envs: [C-v0]\nalgo_settings:\n  sac:\n    policy-delay: 2\n"}.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(settings, "_preset_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match="unknown key.s. extend "):
        settings.read_preset("typo")
    with pytest.raises(ConfigError, match="unknown key.s. algo_settings "):
        settings.read_preset("snake")
    assert settings.read_preset("base") == {"n_step": 3}


def test_algo_settings_apply_to_their_algorithm_only(tmp_path, monkeypatch):
    """``algo-settings``: values measured with one algorithm (an update rule's, such as the policy delay, mean
    something else for another) apply when --algo is that one; another algorithm keeps its own defaults, and
    the preset's plain settings hold for every algorithm. A bad section is one line."""
    import spreeze.settings as settings

    for name, text in {"base": "envs: [A-v0]\nsettings:\n  n-step: 3\nalgo-settings:\n  td3:\n    critic-atoms: 11\n",
                       "child": "envs: [B-v0]\nextends: base\nalgo-settings:\n  sac:\n    policy-delay: 2\n",
                       "typo": "envs: [C-v0]\nalgo-settings:\n  sax:\n    policy-delay: 2\n",
                       "flat": "envs: [D-v0]\nalgo-settings:\n  policy-delay: 2\n",
                       "chooser": "envs: [E-v0]\nsettings:\n  algo: td3\n"}.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(settings, "_preset_dir", lambda: tmp_path)
    assert settings.read_preset("child") == {"n_step": 3, "policy_delay": 2}  # sac, the default algorithm
    assert settings.read_preset("child", "td3") == {"n_step": 3, "critic_atoms": 11}
    assert settings.read_preset("child", "crossq") == {"n_step": 3}
    for bad, fragment in (("typo", "names no algorithm: sax"), ("flat", "must map algorithm names"),
                          ("chooser", "'algo' cannot be set here")):
        with pytest.raises(ConfigError, match=fragment):
            settings.read_preset(bad)


def test_the_default_env_with_another_algorithm_keeps_that_algorithm_s_defaults():
    """The legged preset's C51 critics and (from pybullet) policy delay were measured with SAC: --algo crossq on the
    default env runs (it refused C51 before) with CrossQ's own actor delay, and td3 with its own, through flags and
    the API."""
    from launch.api import make_config

    crossq = parse(["--algo", "crossq"])
    assert crossq.config.preset == "pybullet_legged" and crossq.config.critic_atoms == 0
    assert crossq.config.policy_delay == 0 and crossq.config.effective_policy_delay == 3
    assert crossq.sources["n_step"] == "preset:pybullet_legged" and crossq.sources["policy_delay"] == "default"
    td3 = parse(["--algo", "td3", "--env", "HopperBulletEnv-v0"])
    assert td3.config.critic_atoms == 0 and td3.config.effective_policy_delay == 2
    config, _, sources = make_config("Walker2DBulletEnv-v0", {"algo": "crossq"})
    assert config.critic_atoms == 0 and config.effective_policy_delay == 3 and sources["critic_atoms"] == "default"
    config, _, sources = make_config("Walker2DBulletEnv-v0", {})
    assert config.critic_atoms == 101 and config.policy_delay == 2 and sources["policy_delay"] == "preset:pybullet_legged"


def test_file_and_api_values_read_as_the_flags_would():
    """YAML 1.1 reads an unquoted on/off as true/false: for a flag whose choices are on/off that is what was
    meant. The API writes an env_kwargs dict as a --config file's mapping does (None stays None, "" stays a
    string), and refuses resume with a preset as run.py does."""
    from launch.api import make_config
    from spreeze.settings import settings_from_mapping

    assert settings_from_mapping({"replay-mirror": True}, "f.yaml")["replay_mirror"] == "on"
    assert settings_from_mapping({"replay-mirror": False}, "f.yaml")["replay_mirror"] == "off"
    config, _, _ = make_config("Pendulum-v1", {"env_kwargs": {"render_mode": None, "name": "", "flag": "on", "g": 9.5}})
    assert parse_env_kwargs(config.env_kwargs) == {"render_mode": None, "name": "", "flag": "on", "g": 9.5}
    with pytest.raises(ConfigError, match="resume continues with the run's own settings"):
        make_config("Pendulum-v1", {"resume": "runs/x", "preset": "none"})


def test_wandb_without_the_package_is_refused_before_anything_starts(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--wandb needs Weights & Biases"):
        Config(wandb=True).validate()
