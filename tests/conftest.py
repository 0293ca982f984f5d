"""Shared fixtures and helpers: a tiny registered env with known episode ends, leak checks for every test, and
run.py in a subprocess with the checks of a clean exit."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spreeze.config import Config  # noqa: E402
from spreeze.proc import role_processes  # noqa: E402
from spreeze.shm import live_segments  # noqa: E402


class CountdownEnv(gym.Env):
    """Obs = [step index, 1]; reward = 1 per step; terminates after ``terminate_at`` steps."""

    def __init__(self, terminate_at: int = 5):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self.terminate_at = terminate_at
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.array([float(self.t), 1.0], np.float32)
        return obs, 1.0, self.t >= self.terminate_at, False, {}


# Terminates at step 5: every 5th transition is terminal.
gym.register("SpreezeTestTerminating-v0", entry_point=CountdownEnv, kwargs={"terminate_at": 5}, max_episode_steps=100)
# Truncated by the time limit at step 3, never terminates.
gym.register("SpreezeTestTruncating-v0", entry_point=CountdownEnv, kwargs={"terminate_at": 10_000}, max_episode_steps=3)
# No time limit: an episode ends when the env terminates, at step 10,000.
gym.register("SpreezeTestNoTimeLimit-v0", entry_point=CountdownEnv, kwargs={"terminate_at": 10_000})


# A small Pendulum run in one process: seconds, not minutes.
SMALL_SERIAL = Config(env_id="Pendulum-v1", serial=True, samplers=1, spare_samplers=0, envs_per_sampler=1,
                      learning_starts=300, batch_size=32, buffer_size=10_000, hidden_size=16, collect_per_update=8.0,
                      eval_interval_s=0.05, log_interval_s=60.0, checkpoint_interval_s=600.0, actor_device="cpu",
                      critic_device="cpu", window=False)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no shared-memory segment of this process, no child process and no deferral of
    Ctrl-C (an unpaired lock acquire) behind."""
    before_children = _children()
    yield
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before_children
                and p.name() != "resource_tracker" and "resource_tracker" not in " ".join(p.cmdline())]
    for p in leftover:
        p.kill()
    from spreeze import proc

    deferred, proc._INTERRUPTS.depth, proc._pending = (proc._INTERRUPTS.depth, proc._pending), 0, False
    segments = live_segments(os.getpid())
    assert not segments, f"test left shared-memory segments: {segments}"
    assert not leftover, f"test left child processes: {[p.cmdline() for p in leftover]}"
    assert deferred == (0, False), f"test left Ctrl-C deferred (depth, pending): {deferred}"


@pytest.fixture
def keep_signal_handlers():
    """Puts the Ctrl-C and SIGTERM handlers back after a test that calls ``run.py``'s entry point in this process
    (it leaves its own SIGINT handler installed, as a process that exits next may)."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def exit_and_stderr(argv: list[str], cwd: Path, in_process: bool, monkeypatch, capfd,
                    entry: str = "run.py") -> tuple[int, str]:
    """``python run.py ARGV`` (``entry="launch"``: ``python -m launch ARGV``) in ``cwd``: the exit code and stderr,
    from a real process, or from its entry point called in this process (the same code after the interpreter's
    start, without a torch import: for the cases where the process boundary is not what is tested)."""
    if in_process:
        from launch.cli import main as cli_main
        from launch.compose import main as run_main

        monkeypatch.chdir(cwd)
        try:
            code = (run_main if entry == "run.py" else cli_main)(argv)
        except SystemExit as stop:  # the parser's errors
            code = stop.code
        return code, capfd.readouterr().err
    command = [str(ROOT / "run.py")] if entry == "run.py" else ["-m", "launch"]
    proc = subprocess.run([sys.executable, *command, *argv], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc.returncode, proc.stderr


# ----- run.py in a subprocess ----------------------------------------------------------------------------
PENDULUM_FAST = ["--env", "Pendulum-v1", "--batch-size", "256", "--spare-samplers", "0", "--hidden-size", "64", "--actor-lr", "1e-3", "--critic-lr", "1e-3",
                 "--alpha-lr", "1e-3", "--learning-starts", "1000", "--collect-per-update", "1",
                 "--eval-interval-s", "2", "--log-interval-s", "2"]


def fake_checkpoint(run: Path, config: Config, obs_dim: int = 3, act_dim: int = 1, **counters) -> Path:
    """A checkpoint the launch can read for a resume (Pendulum's sizes by default): ``config``'s actor, untrained,
    and ``counters`` (the learner's, such as the batch it had got to)."""
    from spreeze.algos import make_actor
    from spreeze.checkpoint import save_checkpoint

    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    return save_checkpoint(run, {"actor": make_actor(config, obs_dim, act_dim).state_dict()}, dict(counters),
                           config.to_dict())


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def start(args, cwd, hangup: str = "default") -> subprocess.Popen:
    """run.py in its own session (process group = its pid), so a test can signal the whole group like a
    terminal's Ctrl-C does, and nothing it sends reaches pytest. ``hangup``: SIGHUP's disposition it starts with,
    "default" as from a terminal whatever pytest inherited (a nohup'd CI), or "ignore" as under nohup."""
    env = {**os.environ, "SPREEZE_CACHE_DIR": str(Path(cwd) / "cache")}
    disposition = signal.SIG_IGN if hangup == "ignore" else signal.SIG_DFL
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, disposition))


def session_members(sid: int) -> list[psutil.Process]:
    """Processes still alive (not zombies) in session ``sid``."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def signal_group_and_check_clean_exit(proc: subprocess.Popen, sig: int, expected_codes=(130,)) -> str:
    """Send ``sig`` to run.py's whole process group (what a terminal does), then check: one of the expected
    exit codes, no traceback, every process of the group gone and no shared-memory segment of the run left."""
    everyone = proc_tree(proc.pid)
    os.killpg(proc.pid, sig)
    out, _ = proc.communicate(timeout=90)  # a hang guard only: the speed is measured by benchmarks.faults
    assert proc.returncode in expected_codes, out
    assert "Traceback" not in out, out
    _, alive = psutil.wait_procs(everyone, timeout=15)
    assert not alive, f"processes left behind: {alive}"
    deadline = time.monotonic() + 15
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_members(proc.pid), session_members(proc.pid)
    assert live_segments(proc.pid) == []
    return out


def proc_tree(pid: int) -> list[psutil.Process]:
    """Every descendant of ``pid`` (children of children included, the resource tracker too)."""
    return psutil.Process(pid).children(recursive=True)


def spreeze_children(pid: int) -> dict[str, psutil.Process]:
    return role_processes(pid)


def assert_clean(pid: int, children: list[psutil.Process]) -> None:
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"children left behind: {alive}"
    assert live_segments(pid) == []
