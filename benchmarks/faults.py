"""Fault drill: real runs, real signals, and how long each fault took to recover from.

    python -m benchmarks.faults

Each scenario starts ``run.py`` on Pendulum-v1 in a subprocess, injects one fault and measures: the
restart of a SIGKILLed sampler, evaluator and window (time until the supervisor logged the restart and
until the new process runs under its name), the exit of every child after the main process is
SIGKILLed, Ctrl-C and SIGTERM (time to a clean exit with a final checkpoint), a NaN loss, an env that
keeps crashing, and a resume. Prints a markdown table and writes it as CSV under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import markdown_table, results_dir, write_csv
from spreeze.proc import role_processes

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--env", "Pendulum-v1", "--batch-size", "256", "--spare-samplers", "0", "--hidden-size", "64",
        "--learning-starts", "1000", "--collect-per-update", "1", "--eval-interval-s", "2", "--log-interval-s", "1",
        "--checkpoint-interval-s", "2"]




def wait_for(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return None


class Run:
    def __init__(self, tmp: Path, name: str, args: list[str]):
        self.run_dir = tmp / name
        env = {**os.environ, "SPREEZE_CACHE_DIR": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *BASE, *args, "--run-dir", str(self.run_dir)],
                                     cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

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
        return self.proc.returncode, out


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
    resumed = subprocess.run([sys.executable, str(ROOT / "run.py"), "--resume", str(run.run_dir), "--minutes", "0",
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for role in ("spreeze-sampler-1", "spreeze-evaluator", "spreeze-window"):
            rows.append(restart_drill(tmp, role))
        rows.append(main_kill_drill(tmp))
        rows.append(signal_drill(tmp, signal.SIGINT))
        rows.append(signal_drill(tmp, signal.SIGTERM))
        rows.append(nan_drill(tmp))
        rows.append(env_crash_drill(tmp))
    out = results_dir(args.tag)
    write_csv(out / "faults.csv", rows)
    print(markdown_table(rows))
    print(f"results: {out / 'faults.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
