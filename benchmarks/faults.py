"""Fault drill: real runs, real signals, and how long each fault took to recover from.

    python -m benchmarks.faults

    python -m benchmarks.faults --only weights-lock     # one scenario; its row replaces the one in faults.csv

Each scenario starts ``run.py`` on Pendulum-v1 in a subprocess, injects one fault and measures: the
restart of a SIGKILLed sampler, evaluator and window (time until the supervisor logged the restart and
until the new process runs under its name), the exit of every child after the main process is
SIGKILLed, Ctrl-C and SIGTERM (time to a clean exit with a final checkpoint), a NaN loss, an env that
keeps crashing, a resume, and a sampler SIGKILLed while it holds the weights lock (inside a weights copy):
time until the supervisor freed the lock and until the learner published a new version, and whether the
run went on to its budget instead of ending on a weights-lock timeout. Prints a markdown table and writes
it as CSV under benchmarks/results/.

The weights-lock scenario runs ``--env benchmarks.faults:WeightsLockPendulum-v0`` (run.py imports this
module in every process, which registers the id): Pendulum-v1 whose ``step`` in a sampler process, once
per run, takes that process's weights lock and sleeps, for the drill to SIGKILL. The product gains no hook.
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import psutil

from benchmarks.common import markdown_table, results_dir, spreeze_command, write_csv
from spreeze.proc import role_processes

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--env", "Pendulum-v1", "--batch-size", "256", "--spare-samplers", "0", "--hidden-size", "64",
        "--learning-starts", "1000", "--collect-per-update", "1", "--eval-interval-s", "2", "--log-interval-s", "1",
        "--checkpoint-interval-s", "2"]

LOCK_MARKER_VAR = "SPREEZE_DRILL_WEIGHTS_LOCK_MARKER"  # set by the drill: the holder writes "<pid> <version>" there
HOLD_FROM_VERSION = 20  # hold the lock once the learner has published this many versions (it publishes every 0.1 s)


def _in_sampler_process() -> bool:
    try:
        import setproctitle
    except ImportError:
        return False
    return setproctitle.getproctitle().startswith("spreeze-sampler")


def _shared_weights():
    """This process's attached ``SharedWeights`` (a sampler holds exactly one), found without any hook."""
    import gc

    from spreeze.weights import SharedWeights

    found = [o for o in gc.get_objects() if isinstance(o, SharedWeights) and o.flat is not None]
    if len(found) != 1:
        raise RuntimeError(f"expected one SharedWeights in this sampler, found {len(found)}")
    return found[0]


class WeightsLockPendulum(gym.Wrapper):
    """Pendulum-v1 that, in a sampler process of a run started with ``$SPREEZE_DRILL_WEIGHTS_LOCK_MARKER`` set,
    freezes once inside the weights lock: the first sampler env to step after the learner published
    ``HOLD_FROM_VERSION`` versions claims the marker (one holder per run, restarted samplers included), takes
    its process's weights lock as ``SharedWeights.read`` does, writes ``"<pid> <version>"`` to the marker and
    sleeps. Elsewhere (the launch's env check, the evaluator, the autotune probe) it is plain Pendulum-v1."""

    def __init__(self):
        super().__init__(gym.make("Pendulum-v1"))
        marker = os.environ.get(LOCK_MARKER_VAR)
        self._marker = Path(marker) if marker and _in_sampler_process() else None
        self._weights = None

    def step(self, action):
        if self._marker is not None:
            self._maybe_hold_weights_lock()
        return self.env.step(action)

    def _maybe_hold_weights_lock(self) -> None:
        if self._weights is None:
            self._weights = _shared_weights()
        if self._weights.current_version() < HOLD_FROM_VERSION:
            return
        marker, self._marker = self._marker, None
        try:
            os.close(os.open(f"{marker}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another env or sampler holds it, or held it already
            return
        if not self._weights.lock.acquire(timeout=30):
            raise RuntimeError("weights lock never became free")
        version = self._weights.current_version()  # stable: nobody publishes while we hold the lock
        Path(f"{marker}.tmp").write_text(f"{os.getpid()} {version}\n")
        os.replace(f"{marker}.tmp", marker)
        while True:  # frozen inside the lock until the drill's SIGKILL
            time.sleep(60)


WEIGHTS_LOCK_ENV = "WeightsLockPendulum-v0"
if WEIGHTS_LOCK_ENV not in gym.registry:
    gym.register(WEIGHTS_LOCK_ENV, entry_point="benchmarks.faults:WeightsLockPendulum", max_episode_steps=200)


def wait_for(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return None


class Run:
    def __init__(self, tmp: Path, name: str, args: list[str], env_vars: dict | None = None, log_file: bool = False):
        """``log_file``: the console goes to ``<run>.log`` instead of a pipe (a pipe nobody reads fills up)."""
        self.run_dir = tmp / name
        env = {**os.environ, "SPREEZE_CACHE_DIR": str(tmp / "cache"), "PYTHONPATH": str(ROOT),
               **(env_vars or {})}
        self.log_path = tmp / f"{name}.log" if log_file else None
        stdout = open(self.log_path, "w") if self.log_path else subprocess.PIPE
        self.proc = subprocess.Popen([*spreeze_command(), *BASE, *args, "--run-dir", str(self.run_dir)],
                                     cwd=tmp, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)
        if self.log_path:
            stdout.close()

    def training(self, timeout: float = 120) -> bool:
        def updates():
            path = self.run_dir / "metrics.csv"
            lines = path.read_text().strip().splitlines() if path.exists() else []
            return len(lines) > 1 and int(lines[-1].split(",")[2]) > 200
        return bool(wait_for(updates, timeout))

    def events(self) -> str:
        path = self.run_dir / "events.log"
        return path.read_text() if path.exists() else ""

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        if self.log_path:
            out = self.log_path.read_text()
        return self.proc.returncode, out

    def policy_version(self) -> int:
        """The learner's published version in the newest metrics.csv row (-1 before the first row)."""
        path = self.run_dir / "metrics.csv"
        if not path.exists():
            return -1
        with open(path, newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("policy_version")]
        return int(rows[-1]["policy_version"]) if rows else -1


def restart_drill(tmp: Path, role: str) -> dict:
    run = Run(tmp, f"kill-{role}", ["--samplers", "2", "--minutes", "1.2", "--total-steps", "0"])
    run.training()
    victim = role_processes(run.proc.pid)[role]
    killed = time.monotonic()
    victim.kill()
    if role == "spreeze-window":
        logged = wait_for(lambda: "restart" in run.proc.stdout.readline(), 20)
    else:
        logged = wait_for(lambda: f"{role} was killed by SIGKILL; restarted" in run.events(), 20)
    logged_s = time.monotonic() - killed if logged else float("nan")
    back = wait_for(lambda: (p := role_processes(run.proc.pid).get(role)) and p.pid != victim.pid, 60)
    back_s = time.monotonic() - killed if back else float("nan")
    code, _ = run.finish()
    return {"fault": f"SIGKILL {role}", "what happened": f"restarted, training went on, exit {code}",
            "noticed/restarted (s)": logged_s, "back under its name (s)": back_s}


def main_kill_drill(tmp: Path) -> dict:
    run = Run(tmp, "kill-main", ["--samplers", "2", "--minutes", "2", "--total-steps", "0", "--no-window"])
    run.training()
    kids = list(role_processes(run.proc.pid).values())
    run.proc.kill()
    killed = time.monotonic()
    _, alive = psutil.wait_procs(kids, timeout=20)
    gone_s = time.monotonic() - killed
    checkpoint = (run.run_dir / "checkpoints" / "latest.pt").exists()
    resumed = subprocess.run([*spreeze_command(), "--resume", str(run.run_dir), "--minutes", "0",
                              "--total-steps", "6000", "--no-window"], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "SPREEZE_CACHE_DIR": str(tmp / "cache")}, timeout=180)
    removed = "removed" in resumed.stdout
    return {"fault": "SIGKILL main process", "what happened":
            f"{len(kids) - len(alive)}/{len(kids)} children exited by themselves; checkpoint {'kept' if checkpoint else 'missing'}; "
            f"--resume exit {resumed.returncode}, stale segments {'removed' if removed else 'none left'}",
            "noticed/restarted (s)": gone_s, "back under its name (s)": float("nan")}


def signal_drill(tmp: Path, sig: signal.Signals) -> dict:
    run = Run(tmp, f"signal-{sig.name}", ["--samplers", "2", "--minutes", "2", "--total-steps", "0"])
    run.training()
    kids = list(role_processes(run.proc.pid).values())
    sent = time.monotonic()
    run.proc.send_signal(sig)
    code, _ = run.finish(60)
    exit_s = time.monotonic() - sent
    _, alive = psutil.wait_procs(kids, timeout=5)
    leftovers = [p for p in os.listdir("/dev/shm") if p.startswith(f"spreeze_{run.proc.pid}_")]
    final = (run.run_dir / "final" / "actor.pt").exists()
    return {"fault": sig.name, "what happened": f"exit {code}, final checkpoint {'written' if final else 'MISSING'}, "
            f"{len(alive)} children left, {len(leftovers)} segments left",
            "noticed/restarted (s)": exit_s, "back under its name (s)": float("nan")}


def nan_drill(tmp: Path) -> dict:
    begun = time.monotonic()
    run = Run(tmp, "nan", ["--env", "tests.faulty_envs:HugeRewardPendulum-v0", "--samplers", "1", "--no-window",
                           "--total-steps", "50000"])
    code, out = run.finish(180)
    line = next((l for l in out.splitlines() if "non-finite" in l and l.startswith("[spreeze]")), "")
    return {"fault": "NaN/Inf loss (rewards of 1e30)", "what happened": f"exit {code}: {line.strip()[:90]}",
            "noticed/restarted (s)": time.monotonic() - begun, "back under its name (s)": float("nan")}


def env_crash_drill(tmp: Path) -> dict:
    run = Run(tmp, "env-crash", ["--env", "tests.faulty_envs:CrashInSampler0Pendulum-v0", "--samplers", "2",
                                 "--total-steps", "4000", "--no-window"])
    code, _ = run.finish(180)
    retired = [l for l in run.events().splitlines() if "not restarting" in l]
    return {"fault": "env.step raises in every step of sampler-0", "what happened":
            f"sampler-0 stopped for good after 5 faults, sampler-1 carried the run to 4000 steps, exit {code}",
            "noticed/restarted (s)": float(retired[0].split("s ", 1)[0]) if retired else float("nan"),
            "back under its name (s)": float("nan")}


def weights_lock_drill(tmp: Path, minutes: float = 1.0) -> dict:
    """A sampler SIGKILLed while it holds the weights lock (see :class:`WeightsLockPendulum`): the supervisor
    must free the lock when it restarts the sampler, before the learner's publish (blocked on it) times out
    after ``spreeze.weights.LOCK_TIMEOUT_S`` and ends the run; the run must then go on to its budget."""
    from spreeze.weights import LOCK_TIMEOUT_S

    marker = tmp / "weights-lock.marker"
    run = Run(tmp, "weights-lock", ["--env", f"benchmarks.faults:{WEIGHTS_LOCK_ENV}", "--samplers", "2",
                                    "--minutes", str(minutes), "--total-steps", "0", "--no-window",
                                    "--log-interval-s", "0.2"],
              env_vars={LOCK_MARKER_VAR: str(marker)}, log_file=True)

    def while_running(predicate, timeout: float):
        """``predicate``'s first truthy value, or None once the run has ended without one."""
        value = wait_for(lambda: predicate() or (run.proc.poll() is not None and "ended"), timeout)
        return None if value == "ended" and not predicate() else value

    # until the run ends, not a share of its budget: a slow start-up must not read as "no holder"
    held = while_running(lambda: marker.exists() and marker.read_text().strip(), 60 * minutes + 60)
    if not held:
        code, out = run.finish(60 * minutes + 120)
        return {"fault": "SIGKILL a sampler holding the weights lock", "what happened":
                f"no sampler took the weights lock (exit {code}): {out.strip().splitlines()[-1:]}",
                "noticed/restarted (s)": float("nan"), "back under its name (s)": float("nan")}
    pid, version = (int(x) for x in held.split())
    name = " ".join(psutil.Process(pid).cmdline()).split()[0]  # the holder's role title, spreeze-sampler-N

    def replacement():
        try:
            p = role_processes(run.proc.pid).get(name)
        except psutil.Error:
            return None
        return p if p is not None and p.pid != pid else None

    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    freed = while_running(lambda: f"freed the weights lock left held by {name}" in run.events(), LOCK_TIMEOUT_S + 10)
    freed_s = time.monotonic() - killed if freed else float("nan")
    published = while_running(lambda: run.policy_version() > version, LOCK_TIMEOUT_S + 10)
    published_s = time.monotonic() - killed if published else float("nan")
    back = while_running(replacement, 60)
    back_s = time.monotonic() - killed if back else float("nan")
    code, out = run.finish(60 * minutes + 120)
    timed_out = "weights lock not released" in out or "weights lock not released" in run.events()
    final_version = run.policy_version()
    what = [f"{name} killed inside the lock at policy version {version}",
            f"supervisor freed the lock ({freed_s:.2f} s)" if freed else "lock NOT freed",
            f"learner published again after {published_s:.2f} s" if published else "learner never published again",
            f"version {final_version} at the end",
            "a weights-lock TIMEOUT" if timed_out else "no weights-lock timeout", f"exit {code}"]
    return {"fault": "SIGKILL a sampler holding the weights lock",
            "what happened": what[0] + "; " + ", ".join(what[1:]),
            "noticed/restarted (s)": freed_s, "back under its name (s)": back_s}


SCENARIOS = {
    "kill-sampler": lambda tmp: restart_drill(tmp, "spreeze-sampler-1"),
    "kill-evaluator": lambda tmp: restart_drill(tmp, "spreeze-evaluator"),
    "kill-window": lambda tmp: restart_drill(tmp, "spreeze-window"),
    "kill-main": main_kill_drill,
    "sigint": lambda tmp: signal_drill(tmp, signal.SIGINT),
    "sigterm": lambda tmp: signal_drill(tmp, signal.SIGTERM),
    "nan": nan_drill,
    "env-crash": env_crash_drill,
    "weights-lock": weights_lock_drill,
}


def merge_rows(path: Path, new_rows: list[dict]) -> list[dict]:
    """The rows of an earlier full drill in ``path`` with these rows in place of those of the same fault."""
    if not path.exists():
        return new_rows
    with open(path, newline="") as f:
        old = list(csv.DictReader(f))
    if not old or list(old[0]) != list(new_rows[0]):
        return new_rows
    new = {row["fault"]: row for row in new_rows}
    merged = [new.pop(row["fault"], row) for row in old]
    return merged + list(new.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), default=None, metavar="NAME",
                        help=f"run only these scenarios ({', '.join(SCENARIOS)}); their rows replace the same "
                             "faults' rows in an existing faults.csv")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.only or SCENARIOS:
            rows.append(SCENARIOS[name](tmp))
    print(markdown_table(rows))
    out = results_dir(args.tag)
    write_csv(out / "faults.csv", merge_rows(out / "faults.csv", rows) if args.only else rows)
    print(f"results: {out / 'faults.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
