"""The live reward-curve window, in its own process, fed by the supervisor without ever blocking it.

The supervisor hands every evaluator result and metrics row to :meth:`LiveView.feed`, which keeps a copy
(for the final ``curve.png``) and offers it to a small bounded queue with ``put_nowait``: when the window
process falls behind, new points are dropped for the window instead of waiting. The window process
drains the queue every tick and redraws at most once a second, so a backlog never builds up while it is
alive. It runs at a lower priority and without torch.

Failure handling, all in :meth:`LiveView.poll` (called by the supervisor's loop):

- the user closed the window: the process exits with code 0 on its own; it is not restarted;
- the process died (crash, signal): logged once with its exit code and restarted with the history so
  far, a bounded number of times, each time with fresh queues and a fresh stop flag, because a process
  killed inside ``Queue.get`` or ``Event.wait`` leaves that object's lock held forever
  (docs/pitfalls.md, "Shared memory and locks"). The stop flag is lock-free for the same reason
  (:class:`spreeze.proc.StopFlag`, the supervisor's too).

Without a display (on Linux no ``DISPLAY`` or an X server that does not answer; anywhere a backend that cannot
open a window) the process says so once and writes ``curve.png`` every few seconds instead; ``window=False``
(``--no-window``) does the same on purpose. :meth:`LiveView.close` always writes the final ``curve.png``
in the calling process with the Agg canvas, never pyplot (docs/pitfalls.md, "Rendering and plotting").
"""
from __future__ import annotations

import multiprocessing.queues
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from spreeze.proc import StopFlag, start_process, stop_process

PROCESS_NAME = "spreeze-window"
CURVE_NAME = "curve.png"
QUEUE_SIZE = 256
PNG_INTERVAL_S = 5.0
REDRAW_INTERVAL_S = 1.0
TICK_S = 0.05
MAX_RESTARTS = 3
JOIN_TIMEOUT_S = 3.0
NICENESS = 10
ERROR_GRACE_S = 0.5  # for the feeder thread to deliver a dying window's error message
MAX_HISTORY_ON_RESTART = 20_000
KINDS = ("eval", "metrics")


# ----- what travels between the owner and the window process, one small dataclass per kind -------------------
@dataclass(frozen=True)
class Row:
    """Owner to window: one evaluator result (``kind`` "eval") or metrics row ("metrics") to draw."""
    kind: str
    row: dict


@dataclass(frozen=True)
class Opened:
    """Window to owner, once: ``mode`` "window" or "png", and the console line that says which and why."""
    mode: str
    message: str


@dataclass(frozen=True)
class Drawn:
    """Window to owner, after each redraw or PNG: how many rows of each kind it showed."""
    evals: int
    metrics: int


@dataclass(frozen=True)
class Failed:
    """Window to owner, as it dies of an exception: the error, for the console."""
    text: str


@dataclass(frozen=True)
class History:
    """The rows a (re)started window begins with."""
    evals: list
    metrics: list


class _QuietQueue(multiprocessing.queues.Queue):
    """An mp Queue whose feeder thread drops, instead of printing a traceback for, data it cannot send.

    That happens only when the window process is dead and its queue is being thrown away; the data is
    kept in :attr:`LiveView.evals` / :attr:`LiveView.metrics` anyway.
    """

    @staticmethod
    def _on_queue_feeder_error(e, obj):
        pass


class LiveView:
    """Owner side of the window process; see the module docstring for the behaviour."""

    def __init__(self, ctx, run_dir: Path, title: str, window: bool, log=print, *,
                 png_interval_s: float = PNG_INTERVAL_S, queue_size: int = QUEUE_SIZE,
                 max_restarts: int = MAX_RESTARTS):
        self.ctx = ctx
        self.run_dir = Path(run_dir)
        self.title = title
        self.window = window
        self.log = log
        self.png_interval_s = png_interval_s
        self.queue_size = queue_size
        self.max_restarts = max_restarts
        self.evals: list[dict] = []
        self.metrics: list[dict] = []
        self.process = None
        self.mode: str | None = None       # "window" or "png", as reported by the process
        self.drawn: tuple[int, int] = (0, 0)  # (evals, metrics rows) shown by the last redraw or PNG
        self.redraws = 0
        self.dropped = 0
        self.restarts = 0
        self.closed_by_user = False
        self._gave_up = False
        self._closed = False
        self._said_mode = False
        self._data = self._status = self._stop = None

    # ----- owner API --------------------------------------------------------------------------------
    def start(self, evaluations=(), metrics=()) -> None:
        """Start the window; a resumed run's earlier rows go in as its starting history (as after a restart),
        not through the bounded queue, which would drop all but the first few hundred."""
        self.evals.extend(dict(row) for row in evaluations)
        self.metrics.extend(dict(row) for row in metrics)
        self._spawn()

    def feed(self, kind: str, payload: dict) -> None:
        """Record one row and offer it to the window; never blocks (a full queue drops the row there)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
        row = dict(payload)
        (self.evals if kind == "eval" else self.metrics).append(row)
        if self._data is None or self._closed or self._gave_up or self.closed_by_user:
            return
        try:
            self._data.put_nowait(Row(kind, row))
        except (queue.Full, ValueError, OSError):
            self.dropped += 1

    def poll(self) -> None:
        """Log what the process reported; restart it if it died (not if the user closed the window)."""
        if self.process is None or self._closed:
            return
        self._read_status()
        if self._gave_up or self.closed_by_user:
            return
        code = self.process.exitcode
        if code is None:
            return
        if code == 0:
            self.closed_by_user = True
            self.log("[spreeze] live window closed; training goes on (curve.png is written at the end)")
            self._discard_channels()
            return
        if self.restarts >= self.max_restarts:
            self._gave_up = True
            self.log(f"[spreeze] live window process died (exit code {code}) after {self.restarts} restart(s); "
                     "giving up on it, training goes on (curve.png is written at the end)")
            self._discard_channels()
            return
        self.restarts += 1
        self.log(f"[spreeze] live window process died (exit code {code}); "
                 f"restarting it ({self.restarts} of {self.max_restarts})")
        self._discard_channels()
        self._spawn()

    def close(self, final: bool = True) -> None:
        """Stop the process and, with ``final``, write ``curve.png`` from everything fed so far."""
        if not self._closed:
            self._closed = True
            if self.process is not None:
                self._stop.set()
                stop_process(self.process, JOIN_TIMEOUT_S)
                self._read_status()
                self._discard_channels()
                for leftover in self.run_dir.glob(f".{CURVE_NAME}.*.tmp"):
                    leftover.unlink(missing_ok=True)
        if final:
            from viz.figure import write_curve_png

            write_curve_png(self.run_dir / CURVE_NAME, self.title, self.evals, self.metrics)

    # ----- internals --------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._data = _QuietQueue(self.queue_size, ctx=self.ctx)
        self._data.cancel_join_thread()  # exiting must never wait on a window that stopped reading
        self._status = _QuietQueue(ctx=self.ctx)
        self._stop = StopFlag(self.ctx)
        history = History(self.evals[-MAX_HISTORY_ON_RESTART:], self.metrics[-MAX_HISTORY_ON_RESTART:])
        self.process = start_process(_window_main, self._data, self._status, self._stop, str(self.run_dir),
                                     self.title, self.window, self.png_interval_s, os.getpid(), history,
                                     name=PROCESS_NAME)

    def _discard_channels(self) -> None:
        for channel in (self._data, self._status):
            if channel is not None:
                channel.cancel_join_thread()
                channel.close()
        self._data = self._status = None

    def _read_status(self) -> None:
        while self._status is not None:
            try:
                message = self._status.get_nowait()
            except (queue.Empty, ValueError, OSError, EOFError):
                return
            if isinstance(message, Opened):
                self.mode = message.mode
                if not self._said_mode:
                    self._said_mode = True
                    self.log(f"[spreeze] {message.message}")
            elif isinstance(message, Drawn):
                self.drawn = (message.evals, message.metrics)
                self.redraws += 1
            elif isinstance(message, Failed):
                self.log(f"[spreeze] live window error: {message.text}")


# ----- the window process -------------------------------------------------------------------------------
def _window_main(data, status, stop, run_dir: str, title: str, window: bool, png_interval_s: float,
                 parent_pid: int, history: History) -> None:
    """Entry point of ``spreeze-window``. Exit code 0: stopped, or the user closed the window."""
    status.cancel_join_thread()
    try:
        os.nice(NICENESS)  # no torch here, so no thread cap is needed
    except OSError:
        pass
    try:
        _WindowProcess(data, status, stop, Path(run_dir), title, window, png_interval_s, parent_pid,
                       history).run()
    except Exception as err:
        traceback.print_exc()
        status.put(Failed(f"{type(err).__name__}: {err}"[:500]))
        status.close()
        # the feeder thread delivers it: join_thread() waits for nothing after cancel_join_thread() above, so a
        # moment's grace (a short message fits the pipe) before the exit code tells the owner we died
        time.sleep(ERROR_GRACE_S)
        sys.exit(1)


class _WindowProcess:
    def __init__(self, data, status, stop, run_dir: Path, title: str, window: bool, png_interval_s: float,
                 parent_pid: int, history: History):
        from spreeze.proc import ParentWatch

        self.data, self.status, self.stop = data, status, stop
        self.run_dir, self.title, self.window = run_dir, title, window
        self.png_interval_s = png_interval_s
        self.parent = ParentWatch(parent_pid)
        self.evals, self.metrics = list(history.evals), list(history.metrics)
        self.fresh = True
        self.user_closed = False
        self.figure = self.curves = None

    def run(self) -> None:
        mode, message = self._open()
        self.status.put(Opened(mode, message))
        if mode == "window":
            self._window_loop()
        else:
            self._png_loop()

    def _open(self) -> tuple[str, str]:
        """Open the window if we may and can; else prepare a headless Agg figure. Returns (mode, message)."""
        from viz.display import window_problem
        from viz.figure import CurveFigure, new_agg_figure

        every = f"writing {self.run_dir / CURVE_NAME} every {self.png_interval_s:g} s"
        if not self.window:
            reason = "live window off (--no-window)"
        else:
            reason = window_problem()
            if reason is None:
                try:
                    self._open_window()
                    return "window", "live window open (closing it leaves training running)"
                except Exception as err:  # a backend without GUI support, or an X error
                    reason = f"the window cannot open ({type(err).__name__}: {err})"
            reason = f"live window off: {reason}"
        self.figure = new_agg_figure()
        self.curves = CurveFigure(self.figure, self.title)
        return "png", f"{reason}; {every}"

    def _open_window(self) -> None:
        import matplotlib

        if matplotlib.get_backend().lower() == "agg":  # matplotlib found no usable GUI toolkit
            raise RuntimeError("matplotlib has no interactive backend here (backend is agg)")
        import matplotlib.pyplot as plt

        from viz.figure import FIGSIZE, CurveFigure

        self.figure = plt.figure(figsize=FIGSIZE, layout="constrained")
        self.curves = CurveFigure(self.figure, self.title)
        self.figure.canvas.manager.set_window_title(self.title)
        self.figure.canvas.mpl_connect("close_event", self._on_close)
        plt.show(block=False)
        self._redraw()

    def _on_close(self, _event) -> None:
        self.user_closed = True

    def _should_stop(self) -> bool:
        return self.stop.is_set() or self.parent.gone()

    def _drain(self) -> None:
        for _ in range(10 * QUEUE_SIZE):
            try:
                point = self.data.get_nowait()
            except queue.Empty:
                return
            (self.evals if point.kind == "eval" else self.metrics).append(point.row)
            self.fresh = True

    def _report_drawn(self) -> None:
        self.status.put(Drawn(len(self.evals), len(self.metrics)))

    def _redraw(self) -> None:
        self.curves.update(self.evals, self.metrics)
        self.figure.canvas.draw_idle()
        self.figure.canvas.flush_events()
        self.fresh = False
        self._report_drawn()

    def _window_loop(self) -> None:
        import matplotlib.pyplot as plt

        last_draw = time.monotonic()
        while not self._should_stop():
            self._drain()
            if self.user_closed or not plt.fignum_exists(self.figure.number):
                return
            if self.fresh and time.monotonic() - last_draw >= REDRAW_INTERVAL_S:
                self._redraw()
                last_draw = time.monotonic()
            self.figure.canvas.flush_events()  # keeps the window responsive (resize, close) between redraws
            time.sleep(TICK_S)
        plt.close(self.figure)

    def _png_loop(self) -> None:
        from viz.figure import save_png

        last_write = -float("inf")
        while not self._should_stop():
            self._drain()
            if self.fresh and time.monotonic() - last_write >= self.png_interval_s:
                self.curves.update(self.evals, self.metrics)
                save_png(self.figure, self.run_dir / CURVE_NAME)
                self.fresh = False
                last_write = time.monotonic()
                self._report_drawn()
            time.sleep(2 * TICK_S)
