"""The observers a run gets from its flags: the reward curve (live window, else curve.png), the ``--render``
process and the CPU governor. Built here, so that ``spreeze/`` imports neither ``viz`` nor ``autotune``."""
from __future__ import annotations

import math
import os
import secrets
import threading
import traceback
from pathlib import Path

from spreeze.files import atomic_write
from spreeze.observers import Observer, RunContext
from spreeze.proc import stop_process

JOIN_TIMEOUT_S = 5.0


def build_observers(config, callbacks=()) -> list[Observer]:
    """The window process, the render process and the governor run beside processes only; ``--serial`` writes
    the final curve.png alone, and lock-step rounds are not governed (every sampler takes part in each).
    ``callbacks``: the API user's objects (:class:`CallbackObserver`)."""
    observers: list[Observer] = [CurveObserver(live=not config.serial)]
    if config.tensorboard:
        observers.append(TensorBoardObserver())
    if config.wandb:
        observers.append(WandbObserver())
    if callbacks:
        observers.append(CallbackObserver(callbacks))
    if config.render and not config.serial:
        observers.append(RenderObserver())
    if not config.serial and not config.deterministic and config.sampler_processes:  # --remote-only: none here
        observers.append(GovernorObserver())
    return observers


class CurveObserver(Observer):
    """The reward-curve window process (``viz.live``), never fatal to training; ``curve.png`` at the end."""

    def __init__(self, live: bool = True):
        self.live = live
        self.view = None
        self.title = self.run_dir = None
        self.evaluations: list[dict] = []
        self.metrics: list[dict] = []

    def on_start(self, run: RunContext) -> None:
        c = run.config
        self.title, self.run_dir = f"{c.env_id} · {c.algo.upper()} · {run.run_dir.name}", run.run_dir
        self.evaluations, self.metrics = list(run.evaluations), list(run.metrics)  # a resumed run's past
        if self.live:
            from viz.live import LiveView

            self.view = LiveView(run.supervisor.ctx, run.run_dir, self.title, window=c.window, log=run.log)
            self.view.start(self.evaluations, self.metrics)

    def on_metrics(self, row: dict) -> None:
        self.metrics.append(row)
        if self.view is not None:
            self.view.feed("metrics", row)

    def on_evaluation(self, row: dict) -> None:
        self.evaluations.append(row)
        if self.view is not None:
            self.view.feed("eval", row)

    def poll(self) -> None:
        if self.view is not None:
            self.view.poll()

    def close(self) -> None:
        if self.view is not None:
            self.view.close(final=True)
        elif self.run_dir is not None:
            from viz.figure import write_curve_png

            write_curve_png(self.run_dir / "curve.png", self.title, self.evaluations, self.metrics)


class RenderObserver(Observer):
    """``--render``: plays the newest policy now and then; not restarted, never fatal to training."""

    def __init__(self):
        self.process = self.supervisor = None

    def on_start(self, run: RunContext) -> None:
        from viz.render import start_render

        sup = self.supervisor = run.supervisor
        self.process = start_render(run.config, run.env_info, sup.weights.handle, sup.stats.handle, run.run_dir,
                                    sup.stop_event, os.getpid())

    def poll(self) -> None:
        """One that died inside a weights copy left their lock held: free it."""
        process = self.process
        if process is not None and process.exitcode is not None:
            self.process = None
            self.supervisor.recover_weights_lock("spreeze-render", process.pid)

    def close(self) -> None:
        if self.process is not None:
            stop_process(self.process, JOIN_TIMEOUT_S)


class GovernorObserver(Observer):
    """Pauses or resumes samplers at each metrics row so that CPU use stays near ``--cpu-target-percent``."""

    def __init__(self):
        self.governor = self.supervisor = None

    def on_start(self, run: RunContext) -> None:
        from autotune import governor

        c = run.config
        self.supervisor = run.supervisor
        self.governor = governor.CpuGovernor(target_percent=c.cpu_target_percent, min_active=1,
                                             max_active=c.sampler_processes)

    def on_metrics(self, row: dict) -> None:
        self.supervisor.govern(self.governor, row["cpu_percent"])


# metrics.csv column -> scalar tag, grouped as SB3 names its own (train/, rollout/, time/)
SCALARS = {"update_hz": "throughput/update_hz", "sampling_hz": "throughput/sampling_hz",
           "update_frame_rate": "throughput/update_frame_rate", "updates": "train/updates",
           "batch_size": "train/batch_size", "critic_loss": "train/critic_loss", "actor_loss": "train/actor_loss",
           "alpha": "train/entropy_temperature", "noise_scale": "train/critic_noise_scale",
           "train_return": "rollout/train_return", "cpu_percent": "utilisation/cpu_percent",
           "gpu_percent": "utilisation/gpu_percent", "fetch_share": "utilisation/learner_fetch_share",
           "active_samplers": "utilisation/active_samplers", "time_s": "time/elapsed_s"}
# --ray: local and remote samplers apart and what the ingest moved (all zero without it: not logged then)
REMOTE_SCALARS = {"local_sampling_hz": "throughput/local_sampling_hz",
                  "remote_sampling_hz": "throughput/remote_sampling_hz", "ingest_rows_hz": "throughput/ingest_rows_hz",
                  "ingest_mb_s": "throughput/ingest_mb_s", "remote_alive": "remote/alive_samplers",
                  "remote_lost_blocks": "remote/lost_blocks"}
EVAL_SCALARS = {"test_return": "eval/test_return", "test_return_mean5": "eval/test_return_mean5",
                "episode_length": "eval/episode_length"}


def metric_tags(config) -> dict:
    """The metrics.csv columns a run logs as scalars: the remote ones only with --ray."""
    return {**SCALARS, **REMOTE_SCALARS} if config.ray else SCALARS


def scalars(row: dict, tags: dict) -> dict:
    """The finite numbers of a CSV row under their tags (a NaN or an empty cell is left out, not logged as 0)."""
    out = {}
    for key, tag in tags.items():
        try:
            value = float(row.get(key))
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[tag] = value
    return out


class TensorBoardObserver(Observer):
    """Event files in ``<run>/tensorboard`` (``--no-tensorboard`` turns them off), so that a run sits beside SB3
    or CleanRL runs in TensorBoard; the x axis is env steps, as SB3's. The CSVs stay the record."""

    def __init__(self):
        self.writer = None
        self.tags = SCALARS

    def on_start(self, run: RunContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tags = metric_tags(run.config)
        # a resumed run appends a new event file; purge_step hides what the earlier session logged past the
        # checkpoint it resumes from, so TensorBoard shows one curve. The checkpoint's own count, not the last
        # kept metrics row: a test taken between that row and the checkpoint is kept, and stays visible
        resumed = getattr(run.supervisor, "resumed", None)
        resumed_at = int(resumed["counters"]["env_steps"]) + 1 if resumed else None
        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"), purge_step=resumed_at)

    def _write(self, values: dict, step) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, int(step))

    def on_metrics(self, row: dict) -> None:
        self._write(scalars(row, self.tags), row["env_steps"])

    def on_evaluation(self, row: dict) -> None:
        self._write(scalars(row, EVAL_SCALARS), row["env_steps"])
        self.writer.flush()  # tests are rare and what a user watches

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


WANDB_ID_FILE = "wandb-run-id"
WANDB_FINISH_TIMEOUT_S = 60.0


class WandbObserver(Observer):
    """``--wandb``: the same scalars to Weights & Biases (``pip install .[wandb]``; ``WANDB_MODE=offline`` works
    without an account). Env steps are the x axis of every chart (a metric, not W&B's own step counter, which
    must only grow while tests and metrics rows arrive interleaved). The W&B run id is kept in the run directory,
    so that ``--resume`` continues the same W&B run instead of starting a new one (W&B ignores resuming in
    offline mode: there the sessions' files share the id)."""

    def __init__(self, finish_timeout_s: float = WANDB_FINISH_TIMEOUT_S):
        self.run = None
        self.tags = SCALARS
        self.log = print
        self.finish_timeout_s = finish_timeout_s

    def on_start(self, run: RunContext) -> None:
        import wandb

        c = run.config
        self.log = run.log
        self.tags = metric_tags(c)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "spreeze"), name=run.run_dir.name,
                              dir=str(run.run_dir), config=c.to_dict(), group=f"{c.env_id}-{c.algo}",
                              id=wandb_run_id(run.run_dir), resume="allow" if c.resume else None,
                              reinit="finish_previous")
        self.run.define_metric("env_steps")
        self.run.define_metric("*", step_metric="env_steps")

    def _log(self, values: dict, row: dict) -> None:
        self.run.log({**values, "env_steps": int(row["env_steps"])})

    def on_metrics(self, row: dict) -> None:
        self._log(scalars(row, self.tags), row)

    def on_evaluation(self, row: dict) -> None:
        self._log(scalars(row, EVAL_SCALARS), row)

    def close(self) -> None:
        """Finish the upload, for ``finish_timeout_s`` at most: the run's clean-up (summary.json, the shared memory)
        waits behind it, with Ctrl-C ignored, and an online finish waits as long as the network does."""
        if self.run is None:
            return
        run, self.run, failed = self.run, None, []

        def finish():
            import wandb

            try:
                run.finish()
                wandb.teardown()  # its service process would outlive the run (a leaked child) until we exit
            except BaseException as err:  # raised here, in the caller's thread, as a close that failed
                failed.append(err)

        worker = threading.Thread(target=finish, name="spreeze-wandb-finish", daemon=True)
        worker.start()
        worker.join(self.finish_timeout_s)
        if worker.is_alive():
            self.log(f"[spreeze] warning: W&B did not finish its upload within {self.finish_timeout_s:.0f} s; left "
                     "behind (`wandb sync` on the run's wandb/ folder uploads what it kept)")
        elif failed:
            raise failed[0]


def wandb_run_id(run_dir) -> str:
    """The run directory's W&B run id, made and written (atomically) by its first session (8 lowercase hex
    characters, in the form of W&B's own ids; made here, as W&B's maker is not public API). The file names the
    directory too: a copy of a run directory (how a run is branched) gets an id of its own while the original
    still holds the id, so the branch does not log into the original's W&B run; a moved one keeps it."""
    path = Path(run_dir) / WANDB_ID_FILE
    here = str(Path(run_dir).resolve())
    kept = path.read_text().splitlines() if path.exists() else []
    if kept and kept[0].strip():
        run_id = kept[0].strip()
        if len(kept) < 2 or kept[1] == here:  # a file of one line: an older version's, kept as it is
            return run_id
        try:
            copied = (Path(kept[1]) / WANDB_ID_FILE).read_text().split()[:1] == [run_id]
        except OSError:
            copied = False
        if copied:  # a copy: the original keeps its id
            run_id = secrets.token_hex(4)
    else:
        run_id = secrets.token_hex(4)
    atomic_write(path, lambda f: f.write(f"{run_id}\n{here}\n".encode()))  # a new id, or a moved run's, here
    return run_id


class CallbackObserver(Observer):
    """The API's callbacks (``spreeze.train(..., callbacks=[...])``), run in this process as SB3's are: objects
    with any of ``on_evaluation(row)``, ``on_metrics(row)``, ``on_checkpoint(path)``. One that raises is logged
    with its traceback and training goes on: a user's bug must not end the run it watches."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)
        self.log = print

    def on_start(self, run: RunContext) -> None:
        self.log = run.log

    def _call(self, hook: str, argument) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(argument)
            except Exception:
                self.log(f"[spreeze] callback {type(callback).__name__}.{hook} raised, training goes on:\n"
                         + traceback.format_exc().rstrip())

    def on_evaluation(self, row: dict) -> None:
        self._call("on_evaluation", dict(row))

    def on_metrics(self, row: dict) -> None:
        self._call("on_metrics", dict(row))

    def on_checkpoint(self, path) -> None:
        self._call("on_checkpoint", path)
