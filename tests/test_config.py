import dataclasses

import pytest

from spreeze.config import FIELD_CHOICES, Config, ConfigError
from spreeze.flags import FIELD_GROUPS, HELP_GROUPS, build_parser, explicit_flags, field_docs
from spreeze.settings import parse_config

from conftest import exit_and_stderr


def test_every_field_has_a_flag_with_its_docstring_and_default():
    docs = field_docs()
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(Config):
        assert docs.get(f.name), f"{f.name} has no docstring"
        assert actions[f.name].help.replace("%%", "%") == docs[f.name]
        assert actions[f.name].default == f.default


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(Config):
        assert f"--{f.name.replace('_', '-')}" in text
    assert "75 %" in text  # a docstring with a percent sign survives argparse's formatting


def test_parse_values_and_bool_flags():
    config = parse_config(["--env-id", "Pendulum-v1", "--batch-size", "512", "--serial", "--minutes", "1.5"])
    assert (config.env_id, config.batch_size, config.serial, config.minutes) == ("Pendulum-v1", 512, True, 1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 3


@pytest.mark.parametrize("kwargs, fragment", [
    ({"algo": "ppo"}, "--algo"),
    ({"buffer_size": 0}, "--buffer-size"),
    ({"batch_size": 2000, "buffer_size": 1000}, "larger than --buffer-size"),
    ({"gamma": 1.5}, "--gamma"),
    ({"target_return": float("nan")}, "--target-return"),
    ({"actor_device": "tpu"}, "--actor-device"),
    # a device torch cannot name was a traceback (exit 1) from deep in the launch, not one line
    ({"actor_device": "cuda:-1"}, "--actor-device"), ({"critic_device": "cuda0"}, "--critic-device"),
    # nan passes every range check; inf turns the ratio to 0 (a division by zero mid-run) or the learner off
    ({"replay_ratio": float("inf")}, "--replay-ratio must be a finite"),
    ({"collect_per_update": float("nan")}, "--collect-per-update must be a finite"),
    ({"publish_interval_s": float("inf")}, "--publish-interval-s must be a finite"),
    ({"minutes": float("nan")}, "--minutes must be a finite"),
    ({"noise_min": 0.9, "noise_max": 0.1}, "--noise-min"),
    # the noise rule's batch follows the learner's measurements: without them it would never move
    ({"batch_size": 0, "noise_scale_interval": 0}, "--noise-scale-interval 0"),
    # gymnasium refuses a negative reset seed: every sampler failed and was restarted until the budget ran out
    ({"seed": -1}, "--seed must be >= 0"),
])
def test_validate_rejects(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Config(**kwargs).validate()


def test_every_float_setting_is_checked_for_nan_and_inf_but_minutes_may_be_inf():
    import typing

    floats = [name for name, kind in typing.get_type_hints(Config).items() if kind is float]
    assert {"gamma", "tau", "actor_lr", "replay_ratio", "minutes", "cpu_target_percent"} <= set(floats)
    for name in floats:
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a finite"):
            Config(**{name: float("nan")}).validate()
        if name != "minutes":
            with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a finite"):
                Config(**{name: float("inf")}).validate()
    Config(minutes=float("inf")).validate()
    Config(actor_device="cuda", critic_device="cuda:1").validate()


def test_no_noise_measurements_are_refused_only_where_the_noise_rule_would_choose_the_batch():
    for fine in (dict(batch_rule="knee"), dict(batch_size=256), dict(deterministic=True),  # a fixed batch each
                 dict(resume="runs/earlier")):  # its batch comes from its config.json (checked once merged)
        Config(noise_scale_interval=0, **fine).validate()


def test_explicit_flags():
    assert explicit_flags(["--samplers", "3", "--batch-size=128", "--no-serial"]) == {"samplers", "batch_size", "serial"}
    assert explicit_flags(["--env", "Pendulum-v1"]) == explicit_flags(["--env-id=Pendulum-v1"]) == {"env_id"}
    assert parse_config(["--env", "Pendulum-v1"]).env_id == parse_config(["--env-id=Pendulum-v1"]).env_id


@pytest.mark.parametrize("args, fragment, in_process", [
    # a real `python run.py` for a parser error and for one found after the env's import (pybullet prints
    # on the way); the rest call the same entry point in this process, which saves a torch import each
    (["--batch-size", "abc"], "--batch-size", False),
    (["--env", "Walker2DBulletEnv-v9"], "Walker2DBulletEnv-v0", False),
    (["--samplers", "-1"], "--samplers", True),
    (["--env", "CartPole-v1"], "Discrete", True),
    (["--env", "Pendulum-v1", "--buffer-size", "100000000000"], "--buffer-size", True),
])
def test_run_py_bad_input_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capfd, keep_signal_handlers, args,
                                                         fragment, in_process):
    code, stderr = exit_and_stderr(args, tmp_path, in_process, monkeypatch, capfd)
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("argv[0]")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("run.py: error:") and fragment in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_audit_7_abbreviated_flags_are_refused_not_misread(capsys):
    """Audit point 7: argparse took `--min 30` for `--minutes 30` while the explicit-flag detection saw `min`,
    so `--resume R --min 30` kept the old budget. Abbreviations are refused; explicit flags come from the parser."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--min", "30"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--min" in err[0]
    assert explicit_flags(["--minutes", "30"]) == {"minutes"}
    assert explicit_flags(["--minutes=30", "--no-window", "--env", "Pendulum-v1"]) == {"minutes", "window", "env_id"}


def test_audit_1_warm_up_is_checked_against_the_capacity_that_can_fill():
    """Audit point 1 (config side): spares get regions of their own, so only the active envs' share counts."""
    spared = Config(buffer_size=15_000, samplers=1, spare_samplers=1, envs_per_sampler=4)
    spared.validate()
    assert spared.region_capacity * spared.active_envs == 15_000  # not 7,500 as when spares took half
    with pytest.raises(ConfigError, match="warm-up"):
        Config(buffer_size=10_001, learning_starts=10_000, samplers=1, envs_per_sampler=3).validate()
    with pytest.raises(ConfigError, match="--write-block"):
        Config(buffer_size=12_000, learning_starts=1_000, samplers=100, envs_per_sampler=4, write_block=64).validate()


# ----- --help by section, and choices shared with validate ------------------------------------------------
def _sections(parser):
    """{section title: [dest, ...]} as --help prints them."""
    return {group.title: [a.dest for a in group._group_actions] for group in parser._action_groups}


def test_every_field_has_a_help_section():
    """A new Config field must be filed in FIELD_GROUPS; until it is, --help lists it under "other"."""
    fields = [f.name for f in dataclasses.fields(Config)]
    keys = [key for key, _, _ in HELP_GROUPS]
    missing = [name for name in fields if name not in FIELD_GROUPS]
    assert not missing, f"Config fields without a --help section in FIELD_GROUPS: {missing}"
    assert set(FIELD_GROUPS) <= set(fields), "FIELD_GROUPS names a field Config no longer has"
    assert set(FIELD_GROUPS.values()) == set(keys)  # no unknown section, and no section left empty
    sections = _sections(build_parser())
    assert "other" not in sections
    titles = {key: title for key, title, _ in HELP_GROUPS}
    for name in fields:
        assert name in sections[titles[FIELD_GROUPS[name]]]


def test_help_prints_the_sections_in_order_and_choices_instead_of_types(capsys):
    with pytest.raises(SystemExit):
        build_parser("spreeze train").parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: spreeze train [--env ENV_ID] [options]")
    positions = [text.index(f"\n{title}:\n") for _, title, _ in HELP_GROUPS]
    assert positions == sorted(positions)
    for wanted in ("budget", "algorithm", "parallelism", "devices", "reproducibility"):
        assert f"\n{wanted}:" in text
    assert "--algo {sac,td3,crossq}" in text
    assert "--batch-rule {noise,knee}" in text and "--experience-transport {shm,queue}" in text
    assert "--actor-device {auto,cpu,cuda:N}" in text
    assert "--algo STR" not in text
    # the algorithm flags sit in their own section, between its heading and the next one
    algorithm = text[text.index("\nalgorithm:\n"):text.index("\nreplay, batch and ratios:\n")]
    assert "--gamma" in algorithm and "--samplers" not in algorithm


def test_choices_are_one_table_for_the_parser_and_validate(monkeypatch, capsys):
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for name, choices in FIELD_CHOICES.items():
        assert tuple(actions[name].choices) == tuple(choices)
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be"):
            Config(**{name: "bogus"}).validate()
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--algo", "ppo"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    # one table: a choice added to it is accepted by both the parser and validate, with nothing else changed
    monkeypatch.setitem(FIELD_CHOICES, "batch_rule", ("noise", "knee", "halving"))
    assert parse_config(["--batch-rule", "halving"]).batch_rule == "halving"
    monkeypatch.setitem(FIELD_CHOICES, "batch_rule", ("noise",))
    with pytest.raises(ConfigError, match="--batch-rule must be noise, not 'knee'"):
        Config(batch_rule="knee").validate()


def test_explicit_flags_see_flags_in_every_section():
    assert explicit_flags(["--algo", "td3", "--deterministic", "--cache-dir", "x", "--bf16"]) == {
        "algo", "deterministic", "cache_dir", "bf16"}


def test_remote_only_may_resume():
    """A resumed run's step count has a counter of its own (it went to a local sampler's, which --remote-only
    has none of, and was refused)."""
    pytest.importorskip("ray")  # --ray is checked for Ray first
    Config(ray="auto", remote_only=True, samplers=0, resume="runs/x").validate()


def test_target_return_none_unsets_a_resumed_run_s_target(tmp_path):
    """A resumed run keeps its saved --target-return; one that had met it stopped again at once, and the flag took
    numbers only (inf is refused), so nothing on the command line could train it on."""
    import json

    from spreeze.checkpoint import CHECKPOINT_NAME, resume_config
    from spreeze.flags import explicit_flags

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / CHECKPOINT_NAME).write_bytes(b"")
    (run / "config.json").write_text(json.dumps(Config(env_id="Pendulum-v1", target_return=-200.0).to_dict()))
    for args, expected in ((["--target-return", "none"], None), (["--target-return", "-150"], -150.0), ([], -200.0)):
        argv = ["--resume", str(run), *args]
        config = resume_config(parse_config(argv), explicit_flags(argv))
        assert config.target_return == expected, args
    assert parse_config(["--target-return", "None"]).target_return is None
    with pytest.raises(SystemExit):
        parse_config(["--target-return", "high"])


def test_a_resume_s_flags_are_checked_against_the_run_s_settings_not_the_defaults(tmp_path):
    """--resume R --buffer-size 5000 on a Pendulum run (warm-up 1,000) was refused at parsing, against the default
    env's warm-up of 10,000 steps, before the run's config.json was read; the merged settings are what is checked."""
    import json

    from spreeze.checkpoint import CHECKPOINT_NAME, resume_config
    from spreeze.flags import explicit_flags

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / CHECKPOINT_NAME).write_bytes(b"")
    (run / "config.json").write_text(json.dumps(Config(env_id="Pendulum-v1", learning_starts=1000).to_dict()))
    argv = ["--resume", str(run), "--buffer-size", "5000"]
    config = resume_config(parse_config(argv), explicit_flags(argv))
    config.validate()
    assert (config.buffer_size, config.learning_starts) == (5000, 1000)
    argv = ["--resume", str(run), "--buffer-size", "500"]  # under the run's own warm-up: refused once merged
    with pytest.raises(ConfigError, match="--learning-starts 1000 is larger than --buffer-size 500"):
        resume_config(parse_config(argv), explicit_flags(argv)).validate()


def test_a_replay_too_small_for_any_sampler_count_is_refused_before_the_profile(monkeypatch, tmp_path):
    """With the sampler count left to the tuner, the replay's fit was checked only after profiling (minutes on a
    first launch) and then refused: a misfit that even one sampler's envs show is refused before it."""
    import autotune
    from launch.compose import SetupError, resolve
    from spreeze.settings import parse

    tuned = []

    def fake_tune(config, env_info, explicit, **kwargs):
        tuned.append(config)
        batch = min(64, config.buffer_size)
        chosen = {"samplers": {"value": 1, "by": "profile"}, "batch_size": {"value": batch, "by": "profile"}}
        return dataclasses.replace(config, samplers=1, batch_size=batch), {"chosen": chosen}

    monkeypatch.setattr(autotune, "tune", fake_tune)

    def launch(*args):
        parsed = parse(["--env", "Pendulum-v1", "--no-window", "--run-dir", str(tmp_path / str(len(tuned))), *args])
        return resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lambda line: None)

    # 20 slots for one sampler's one env (Pendulum's preset): fewer than a --write-block of 32
    with pytest.raises(SetupError, match=r"--write-block 32 .*\(even with one sampler process, the fewest the "
                                         r"autotuner chooses: 1 env\)"):
        launch("--buffer-size", "20", "--learning-starts", "16")
    assert tuned == [] and not (tmp_path / "0").exists()
    # one that fits one sampler is the tuner's to size, as before
    assert launch("--buffer-size", "1000", "--learning-starts", "64").config.samplers == 1 and len(tuned) == 1
    with pytest.raises(SystemExit):  # a count given by hand: refused as it is parsed, as before
        launch("--buffer-size", "1000", "--learning-starts", "64", "--samplers", "40")
    assert len(tuned) == 1


def test_an_env_without_a_time_limit_is_warned_about_at_launch(monkeypatch, tmp_path):
    """An env registered without a time limit ran a test episode until it terminated: one that never does held back
    every later test (no curve, no best policy, no --target-return) with nothing said."""
    import autotune
    from launch.compose import resolve
    from spreeze.settings import parse

    monkeypatch.setattr(autotune, "tune", lambda config, env_info, explicit, **kwargs: (
        dataclasses.replace(config, samplers=1, batch_size=256), {"chosen": {}}))
    for kwargs, warned in (([], True), (["--env-kwargs", "max_episode_steps=50"], False)):
        lines = []
        parsed = parse(["--env", "SpreezeTestNoTimeLimit-v0", "--no-window", "--run-dir", str(tmp_path / str(warned)),
                        *kwargs])
        resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
        assert any("has no time limit" in line and "max_episode_steps=N" in line for line in lines) == warned, lines


def test_a_step_budget_that_ends_in_the_warm_up_and_serial_s_missing_window_are_said(tmp_path, monkeypatch):
    """--total-steps under the warm-up, or a resume given a few thousand steps more than its checkpoint's (its
    replay refilled), stopped before the learner's first update with nothing said but 0 updates; --serial dropped
    the window and --render without a word."""
    import json

    import autotune
    from conftest import fake_checkpoint
    from launch.compose import resolve
    from spreeze.replay import REPLAY_FILE
    from spreeze.settings import config_record, parse

    monkeypatch.setattr(autotune, "tune", lambda config, env_info, explicit, **kwargs: (
        dataclasses.replace(config, samplers=1, batch_size=256), {"chosen": {}}))

    def warned(*flags) -> bool:
        lines = []
        parsed = parse(["--no-window", *flags])
        resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
        return any("before its first update" in line for line in lines)

    fresh = ["--env", "Pendulum-v1", "--learning-starts", "5000", "--run-dir"]
    assert warned(*fresh, str(tmp_path / "a"), "--total-steps", "4000")
    assert not warned(*fresh, str(tmp_path / "b"), "--total-steps", "6000")
    assert not warned(*fresh, str(tmp_path / "c"))  # no step limit
    lines = []  # --serial's window and --render, which only run beside processes, are said to be off
    parsed = parse(["--env", "Pendulum-v1", "--serial", "--render", "--run-dir", str(tmp_path / "s")])
    resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert any("no live window" in line and "no --render process" in line for line in lines), lines
    lines = []  # a --serial run that asked for neither (the window is on by default): nothing to say
    parsed = parse(["--env", "Pendulum-v1", "--serial", "--run-dir", str(tmp_path / "t")])
    resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert not any("no live window" in line for line in lines), lines
    lines = []
    parsed = parse(["--env", "Pendulum-v1", "--serial", "--window", "--run-dir", str(tmp_path / "u")])
    resolve(parsed.config, set(parsed.explicit), parsed.sources, log=lines.append)
    assert any("no live window" in line for line in lines) and not any("--render" in line for line in lines), lines
    run = tmp_path / "run"
    saved = Config(env_id="Pendulum-v1", samplers=1, batch_size=256, learning_starts=5000, run_dir=str(run))
    fake_checkpoint(run, saved, env_steps=100_000)
    (run / "config.json").write_text(json.dumps(config_record(saved, {})))
    assert warned("--resume", str(run), "--total-steps", "103000")
    assert not warned("--resume", str(run), "--total-steps", "106000")
    (run / "checkpoints" / REPLAY_FILE).write_bytes(b"")  # a saved replay comes back: no warm-up to wait for
    assert not warned("--resume", str(run), "--total-steps", "103000")


def test_serial_runs_start_no_spares_and_q_range_bounds_are_finite():
    """--serial steps its samplers in one process and never steps a spare in: a spare's replay region was
    allocated (and priced against memory) for nothing, and announced. An infinite --q-range made NaN atoms."""
    serial = Config(serial=True, samplers=1, spare_samplers=1, envs_per_sampler=4)
    assert (serial.sampler_processes, serial.spares, serial.total_envs) == (1, 0, 4)
    free = dataclasses.replace(serial, serial=False)
    assert (free.sampler_processes, free.spares, free.total_envs) == (2, 1, 8)
    for bad in ("-inf,inf", "-1e39,1e39", "0,inf"):
        with pytest.raises(ConfigError, match="--q-range needs finite bounds"):
            Config(critic_atoms=11, q_range=bad).validate()
    Config(critic_atoms=11, q_range="-1e6,1e6").validate()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_sigterm_or_ctrl_c_before_training_ends_the_launch_with_130_and_one_line(monkeypatch, capsys, signame):
    """run.py installs a SIGTERM handler that stops the launch as Ctrl-C does (it killed the process with 143
    during env checks or profiling, leaving an empty run directory), says so in one line, and puts the caller's
    SIGTERM handler back. Both take the path of a Ctrl-C during training (spreeze.proc.interrupt)."""
    import os
    import signal

    import launch.compose as compose

    from spreeze.proc import interrupts_deferred

    finished = []

    def resolve(*args, **kwargs):
        with interrupts_deferred():  # as a shared lock's hold: the signal must wait for its end
            os.kill(os.getpid(), getattr(signal, signame))  # delivered here, in the main thread
            finished.append(True)
        raise AssertionError(f"the {signame} should have stopped the launch")

    before, pytest_sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(compose, "resolve", resolve)
    try:
        assert compose.main(["--env", "Pendulum-v1"]) == 130
    finally:
        signal.signal(signal.SIGINT, pytest_sigint)  # run.py leaves its own SIGINT handler installed
    assert "interrupted before training" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert finished == [True]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_in_the_run_s_set_up_ends_the_launch_with_130_and_one_line(monkeypatch, capsys, signame):
    """Between the resolved settings and the run's own handlers (observers built, the run directory and its
    set-up files written) nothing is started yet: one line and exit 130, as before training, not a traceback."""
    import os
    import signal

    import launch.compose as compose

    def run(resolved, *args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signame))  # delivered here, in the main thread
        raise AssertionError(f"the {signame} should have stopped the launch")

    pytest_sigint = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(compose, "resolve", lambda *args, **kwargs: object())
    monkeypatch.setattr(compose, "run", run)
    try:
        code = compose.main(["--env", "Pendulum-v1"])
    except KeyboardInterrupt:  # caught here: escaping, it would stop pytest itself
        pytest.fail("the KeyboardInterrupt rose out of main: run.py would end in a traceback")
    finally:
        signal.signal(signal.SIGINT, pytest_sigint)  # run.py leaves its own SIGINT handler installed
    err = capsys.readouterr().err
    assert code == 130 and "interrupted before training" in err and "Traceback" not in err


def test_a_ctrl_c_after_the_run_while_its_noise_scale_is_kept_loses_only_that(monkeypatch, capsys):
    """The run has given Ctrl-C back when its noise scale is written into the machine's profile: an interrupt there
    must not turn a finished run into 'interrupted before training'."""
    import types

    import autotune
    import launch.compose as compose

    finished = types.SimpleNamespace(exit_code=0, summary={})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compose, "train", lambda *args, **kwargs: finished)
    monkeypatch.setattr(autotune, "remember_noise_scale", interrupted)
    resolved = types.SimpleNamespace(config=Config(env_id="Pendulum-v1"), env_info=None, profile={}, sources={})
    try:
        assert compose.run(resolved) is finished
    except KeyboardInterrupt:  # caught here: escaping, it would stop pytest itself
        pytest.fail("the KeyboardInterrupt rose out of run(): a finished run read as 'interrupted before training'")
    assert "noise scale was not kept" in capsys.readouterr().err
