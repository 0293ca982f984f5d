"""The live window, its headless fallback, the render process and the viz.plot / viz.play tools.

Window tests run under a real X server: a session fixture starts Xvfb (``apt-get install -y xvfb``) and
the tests talk to it through libX11 to see and close the window like a user would. They are skipped
only when the Xvfb binary is missing. Every process a test starts is stopped by the test or its fixture.
"""
from __future__ import annotations

import csv
import ctypes
import ctypes.util
import json
import multiprocessing as mp
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spreeze.proc import StopFlag
from viz.live import CURVE_NAME, LiveView

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RENDER_ENV = "InvertedPendulumBulletEnv-v0"  # PyBullet renders headless; Pendulum-v1 would need pygame
TITLE = "Pendulum-v1 · sac · test-run"


# ----- helpers ----------------------------------------------------------------------------------------
def wait_for(condition, timeout: float, every: float = 0.05, poll=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poll is not None:
            poll()
        if condition():
            return True
        time.sleep(every)
    return False


def eval_row(i: int, value: float | None = None) -> dict:
    return {"time_s": 2.0 * i, "env_steps": 500 * i, "updates": 60 * i, "policy_version": i,
            "test_return": value if value is not None else -1500 + 37.0 * i + (i * 7919 % 101),
            "test_return_std": 0.0, "episode_length": 200.0}


def metrics_row(i: int) -> dict:
    return {"time_s": 2.0 * i, "env_steps": 500 * i, "updates": 60 * i, "policy_version": i,
            "test_return": -1500.0, "train_return": -1400 + 30.0 * i + (i * 104729 % 89),
            "sampling_hz": 2500 + (i * 31 % 17) * 10, "update_hz": 90 + i % 7, "update_frame_rate": 23000 + 40 * i,
            "batch_size": 256, "collect_per_update": 8.0, "fetch_share": 0.1, "cpu_percent": 50 + i * 13 % 40,
            "gpu_percent": "", "critic_loss": 1.0, "actor_loss": 2.0, "alpha": 0.2}


def feed_rows(view: LiveView, start: int, stop: int) -> None:
    for i in range(start, stop):
        view.feed("eval", eval_row(i))
        view.feed("metrics", metrics_row(i))


def read_png(path: Path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    return data


def png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def gif_frames(path: Path) -> tuple[int, tuple[int, int]]:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "GIF"
        return image.n_frames, image.size


def gif_distinct_frames(path: Path) -> int:
    """Frames of the GIF that differ in pixels: a rendered episode moves, a blank or frozen render does not."""
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return len({frame.convert("RGB").tobytes() for frame in ImageSequence.Iterator(image)})


class X11:
    """Just enough Xlib (through ctypes) to find top-level windows by title and ask one to close."""

    class ClientMessage(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("serial", ctypes.c_ulong), ("send_event", ctypes.c_int),
                    ("display", ctypes.c_void_p), ("window", ctypes.c_ulong), ("message_type", ctypes.c_ulong),
                    ("format", ctypes.c_int), ("data", ctypes.c_long * 5), ("pad", ctypes.c_long * 24)]

    def __init__(self, display: str):
        lib = ctypes.cdll.LoadLibrary(ctypes.util.find_library("X11"))
        lib.XOpenDisplay.restype = ctypes.c_void_p
        lib.XOpenDisplay.argtypes = [ctypes.c_char_p]
        lib.XDefaultRootWindow.restype = ctypes.c_ulong
        lib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        lib.XQueryTree.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(ctypes.c_ulong),
                                   ctypes.POINTER(ctypes.c_ulong), ctypes.POINTER(ctypes.POINTER(ctypes.c_ulong)),
                                   ctypes.POINTER(ctypes.c_uint)]
        lib.XFetchName.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(ctypes.c_char_p)]
        lib.XFree.argtypes = [ctypes.c_void_p]
        lib.XInternAtom.restype = ctypes.c_ulong
        lib.XInternAtom.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.XSendEvent.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
        lib.XFlush.argtypes = [ctypes.c_void_p]
        lib.XCloseDisplay.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.display = lib.XOpenDisplay(display.encode())
        assert self.display, f"cannot open X display {display}"

    def windows(self) -> dict[str, int]:
        """Title -> window id of the root's children (the top-level windows without a window manager)."""
        root, parent = ctypes.c_ulong(), ctypes.c_ulong()
        children, count = ctypes.POINTER(ctypes.c_ulong)(), ctypes.c_uint()
        self.lib.XQueryTree(self.display, self.lib.XDefaultRootWindow(self.display), ctypes.byref(root),
                            ctypes.byref(parent), ctypes.byref(children), ctypes.byref(count))
        found = {}
        for i in range(count.value):
            name = ctypes.c_char_p()
            if self.lib.XFetchName(self.display, children[i], ctypes.byref(name)) and name.value:
                found[name.value.decode("utf-8", "replace")] = children[i]
                self.lib.XFree(name)
        if children:
            self.lib.XFree(children)
        return found

    def request_close(self, window: int) -> None:
        """What a window manager's close button does: a WM_DELETE_WINDOW client message."""
        event = self.ClientMessage()
        event.type = 33  # ClientMessage
        event.window = window
        event.message_type = self.lib.XInternAtom(self.display, b"WM_PROTOCOLS", 0)
        event.format = 32
        event.data[0] = self.lib.XInternAtom(self.display, b"WM_DELETE_WINDOW", 0)
        self.lib.XSendEvent(self.display, window, 0, 0, ctypes.byref(event))
        self.lib.XFlush(self.display)

    class Image(ctypes.Structure):  # the leading fields of Xlib's XImage
        _fields_ = [("width", ctypes.c_int), ("height", ctypes.c_int), ("xoffset", ctypes.c_int),
                    ("format", ctypes.c_int), ("data", ctypes.c_void_p), ("byte_order", ctypes.c_int),
                    ("bitmap_unit", ctypes.c_int), ("bitmap_bit_order", ctypes.c_int), ("bitmap_pad", ctypes.c_int),
                    ("depth", ctypes.c_int), ("bytes_per_line", ctypes.c_int), ("bits_per_pixel", ctypes.c_int)]

    def pixels(self, window: int) -> bytes | None:
        """A digest of what ``window`` shows now (XGetImage of the whole window); None if it cannot be read."""
        import hashlib

        lib = self.lib
        uint, int_ = ctypes.c_uint, ctypes.c_int
        lib.XGetGeometry.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(ctypes.c_ulong),
                                     *[ctypes.POINTER(int_)] * 2, *[ctypes.POINTER(uint)] * 4]
        lib.XGetImage.restype = ctypes.POINTER(self.Image)
        lib.XGetImage.argtypes = [ctypes.c_void_p, ctypes.c_ulong, int_, int_, uint, uint, ctypes.c_ulong, int_]
        lib.XDestroyImage.argtypes = [ctypes.POINTER(self.Image)]
        root, x, y, width, height, border, depth = ctypes.c_ulong(), int_(), int_(), uint(), uint(), uint(), uint()
        if not lib.XGetGeometry(self.display, window, *map(ctypes.byref, (root, x, y, width, height, border, depth))):
            return None
        image = lib.XGetImage(self.display, window, 0, 0, width.value, height.value, 0xFFFFFFFF, 2)  # ZPixmap
        if not image:
            return None
        try:
            data = ctypes.string_at(image.contents.data, image.contents.bytes_per_line * image.contents.height)
        finally:
            lib.XDestroyImage(image)
        return hashlib.sha1(data).digest()

    def close(self) -> None:
        self.lib.XCloseDisplay(self.display)


# ----- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def xvfb():
    """A private Xvfb server; yields its DISPLAY string (Xvfb picks a free number through -displayfd)."""
    exe = shutil.which("Xvfb")
    if exe is None:
        pytest.skip("Xvfb is not installed (apt-get install -y xvfb)")
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen([exe, "-displayfd", str(write_fd), "-screen", "0", "1280x1024x24", "-nolisten", "tcp"],
                              pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], 15)
        number = os.read(read_fd, 32).decode().strip() if ready else ""
        assert number.isdigit(), "Xvfb did not report a display number"
        yield f":{number}"
    finally:
        os.close(read_fd)
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


@pytest.fixture
def views():
    """LiveViews made by a test; any still open at the end are closed (their processes stopped)."""
    made = []
    yield made
    for view in made:
        if view.process is not None and view.process.exitcode is None:
            os.kill(view.process.pid, signal.SIGCONT)
        view.close(final=False)
        assert view.process is None or view.process.exitcode is not None


def make_view(views, ctx, run_dir, *, window=True, **kwargs) -> tuple[LiveView, list[str]]:
    logs: list[str] = []
    view = LiveView(ctx, run_dir, TITLE, window=window, log=logs.append, **kwargs)
    views.append(view)
    return view, logs


@pytest.fixture
def recorded_runs(tmp_path):
    """Two finished runs written by hand: one with evaluations.csv, one with only metrics.csv."""
    from spreeze.runlog import EVAL_FIELDS, METRICS_FIELDS

    runs = []
    for name, algo, with_evals in (("run-a", "sac", True), ("run-b", "td3", False)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "config.json").write_text(json.dumps({"env_id": "Pendulum-v1", "algo": algo}))
        with open(run_dir / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=METRICS_FIELDS)
            writer.writeheader()
            for i in range(1, 30):
                row = metrics_row(i)
                row["test_return"] = "" if i < 3 else -1500 + 40 * i
                writer.writerow(row)
        if with_evals:
            with open(run_dir / "evaluations.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=EVAL_FIELDS)
                writer.writeheader()
                for i in range(25):
                    writer.writerow(eval_row(i))
        runs.append(run_dir)
    return runs


@pytest.fixture
def saved_run(tmp_path):
    """A run directory with a final policy and a checkpoint of an (untrained) actor."""
    from spreeze.algos import make_actor
    from spreeze.checkpoint import save_checkpoint, save_final_actor
    from spreeze.config import Config
    from spreeze.envs import check_env

    run_dir = tmp_path / "run"
    config = Config(env_id=RENDER_ENV)
    info = check_env(RENDER_ENV)
    actor = make_actor(config, info.obs_dim, info.act_dim)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    save_final_actor(run_dir, actor, config.to_dict(), info)
    save_checkpoint(run_dir, {"actor": actor.state_dict()}, {"env_steps": 0}, config.to_dict())
    return run_dir


def headless_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ----- the live window --------------------------------------------------------------------------------
def test_window_opens_redraws_from_fed_data_and_shuts_down_cleanly(xvfb, ctx, views, tmp_path, monkeypatch):
    monkeypatch.setenv("DISPLAY", xvfb)
    view, logs = make_view(views, ctx, tmp_path)
    view.start()
    feed_rows(view, 0, 5)
    assert wait_for(lambda: view.drawn == (5, 5), 30, poll=view.poll), (view.mode, view.drawn, logs)
    assert view.mode == "window"
    x = X11(xvfb)
    try:
        assert TITLE in x.windows()
        redraws = view.redraws
        feed_rows(view, 5, 12)
        assert wait_for(lambda: view.drawn == (12, 12), 10, poll=view.poll)
        assert view.redraws > redraws
        view.close()
        assert view.process.exitcode == 0  # left on its own when asked, not terminated
        assert wait_for(lambda: TITLE not in x.windows(), 5)
    finally:
        x.close()
    assert png_size(tmp_path / CURVE_NAME) == (1200, 750)
    assert logs == ["[spreeze] live window open (closing it leaves training running)"]


def test_closing_the_window_leaves_training_running(xvfb, ctx, views, tmp_path, monkeypatch):
    monkeypatch.setenv("DISPLAY", xvfb)
    view, logs = make_view(views, ctx, tmp_path)
    view.start()
    feed_rows(view, 0, 3)
    assert wait_for(lambda: view.drawn == (3, 3), 30, poll=view.poll)
    first = view.process
    x = X11(xvfb)
    try:
        x.request_close(x.windows()[TITLE])
    finally:
        x.close()
    assert wait_for(lambda: view.closed_by_user, 10, poll=view.poll), logs
    assert first.exitcode == 0 and view.process is first and view.restarts == 0
    assert any("live window closed; training goes on" in line for line in logs)
    for i in range(3, 500):  # the trainer keeps feeding and polling: nothing blocks, nothing raises
        view.feed("eval", eval_row(i))
        view.poll()
    view.close()
    read_png(tmp_path / CURVE_NAME)
    assert len(view.evals) == 500


@pytest.mark.parametrize("display", [None, ":4917"], ids=["no-DISPLAY", "unreachable-DISPLAY"])
def test_headless_fallback_writes_a_growing_png(display, ctx, views, tmp_path, monkeypatch):
    if display is None:
        monkeypatch.delenv("DISPLAY", raising=False)
    else:
        monkeypatch.setenv("DISPLAY", display)
    view, logs = make_view(views, ctx, tmp_path, png_interval_s=0.3, queue_size=1024)  # room for the burst below
    view.start()
    feed_rows(view, 0, 2)
    curve = tmp_path / CURVE_NAME
    assert wait_for(lambda: view.drawn == (2, 2) and curve.exists(), 30, poll=view.poll), (view.drawn, logs)
    first = len(read_png(curve))
    feed_rows(view, 2, 150)
    assert wait_for(lambda: view.drawn == (150, 150), 15, poll=view.poll)
    second = len(read_png(curve))
    assert second > first, (first, second)
    assert view.mode == "png"
    off = [line for line in logs if "live window off" in line]
    assert len(off) == 1 and "no display" in off[0] and "every 0.3 s" in off[0], logs
    view.close()
    assert view.process.exitcode == 0
    assert png_size(curve) == (1200, 750)
    assert not list(tmp_path.glob(".*.tmp"))


def test_no_window_flag_writes_png_even_with_a_display(xvfb, ctx, views, tmp_path, monkeypatch):
    monkeypatch.setenv("DISPLAY", xvfb)
    view, logs = make_view(views, ctx, tmp_path, window=False, png_interval_s=0.3)
    view.start()
    feed_rows(view, 0, 4)
    assert wait_for(lambda: view.drawn == (4, 4), 30, poll=view.poll)
    assert view.mode == "png"
    assert logs == [f"[spreeze] live window off (--no-window); writing {tmp_path / CURVE_NAME} every 0.3 s"]
    x = X11(xvfb)
    try:
        assert TITLE not in x.windows()
    finally:
        x.close()
    read_png(tmp_path / CURVE_NAME)


def test_killed_window_process_is_restarted_with_its_history_and_training_goes_on(ctx, views, tmp_path, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    view, logs = make_view(views, ctx, tmp_path, png_interval_s=0.2, max_restarts=1)
    view.start()
    feed_rows(view, 0, 6)
    assert wait_for(lambda: view.drawn == (6, 6), 30, poll=view.poll)
    first = view.process
    os.kill(first.pid, signal.SIGKILL)
    for i in range(6, 60):  # a trainer's loop: feed and poll go on while the window is dead and restarting
        view.feed("eval", eval_row(i))
        view.poll()
        time.sleep(0.02)
    assert wait_for(lambda: view.process is not first, 5, poll=view.poll)
    died = [line for line in logs if "died" in line]
    assert died == ["[spreeze] live window process died (exit code -9); restarting it (1 of 1)"], logs
    assert view.restarts == 1 and first.exitcode == -signal.SIGKILL
    # the new process starts from everything fed so far, including what arrived while none was running
    assert wait_for(lambda: view.drawn == (60, 6), 30, poll=view.poll), view.drawn
    second = view.process
    os.kill(second.pid, signal.SIGKILL)
    assert wait_for(lambda: any("giving up" in line for line in logs), 10, poll=view.poll), logs
    assert view.process is second  # bounded: no third process
    feed_rows(view, 60, 70)
    view.poll()
    view.close()
    assert png_size(tmp_path / CURVE_NAME) == (1200, 750)
    assert len(view.evals) == 70 and len(view.metrics) == 16


def test_feed_never_blocks_when_the_window_stops_reading(ctx, views, tmp_path, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    view, logs = make_view(views, ctx, tmp_path, png_interval_s=0.2, queue_size=8)
    view.start()
    assert wait_for(lambda: view.mode == "png", 30, poll=view.poll)
    os.kill(view.process.pid, signal.SIGSTOP)  # a window that hangs and reads nothing
    try:
        # in a thread with a (generous) deadline: a feed that waited for the stopped reader would hang here
        import threading

        feeder = threading.Thread(target=lambda: [view.feed("metrics", metrics_row(i)) for i in range(3000)],
                                  daemon=True)
        feeder.start()
        feeder.join(timeout=60)
        assert not feeder.is_alive(), "feed blocked on a window that reads nothing"
        assert view.dropped >= 3000 - 8 - 100  # the queue holds 8; the rest is dropped for the window
    finally:
        os.kill(view.process.pid, signal.SIGCONT)
    assert len(view.metrics) == 3000  # ... but kept for the final curve.png
    view.close()
    assert view.process.exitcode == 0
    read_png(tmp_path / CURVE_NAME)


def test_a_resumed_run_s_history_starts_the_window_whole(ctx, tmp_path, monkeypatch):
    """The earlier session's rows go to the window process as its starting history, as after a restart, not
    through the bounded queue, which dropped all but its first few hundred rows."""
    import viz.live

    started = []
    monkeypatch.setattr(viz.live, "start_process", lambda *args, **kwargs: started.append(args) or _NoProcess())
    view = LiveView(ctx, tmp_path, TITLE, window=False, log=lambda _: None)
    view.start([eval_row(i) for i in range(700)], [{"time_s": float(i), "env_steps": i} for i in range(900)])
    history = started[0][-1]
    assert isinstance(history, viz.live.History)
    assert len(history.evals) == 700 and len(history.metrics) == 900 and view.dropped == 0
    assert len(view.evals) == 700 and len(view.metrics) == 900  # and the final curve.png has them


class _NoProcess:
    exitcode, pid = 0, None


def test_feed_rejects_unknown_kinds(ctx, tmp_path):
    view = LiveView(ctx, tmp_path, TITLE, window=False, log=lambda _: None)
    with pytest.raises(ValueError):
        view.feed("evaluation", eval_row(0))
    view.feed("eval", eval_row(0))  # before start(): recorded, not sent
    view.close()
    read_png(tmp_path / CURVE_NAME)


# ----- the render process -----------------------------------------------------------------------------
def test_render_process_writes_a_gif_per_new_policy(ctx, tmp_path, monkeypatch):
    import torch

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights
    from viz.render import start_render

    monkeypatch.delenv("DISPLAY", raising=False)
    config = Config(env_id=RENDER_ENV)
    info = check_env(RENDER_ENV)
    actor = make_actor(config, info.obs_dim, info.act_dim)
    weights = SharedWeights.create(actor, ctx)
    stats = SharedStats.create(1)
    stop = StopFlag(ctx)  # the supervisor's kind of stop signal
    process = None
    try:
        stats.env_steps[0] = 1234
        process = start_render(config, info, weights.handle, stats.handle, tmp_path, stop, os.getpid(),
                               interval_s=0.2)
        first = tmp_path / "videos" / "step_1234.gif"
        assert wait_for(first.exists, 60), "no GIF from the render process"
        time.sleep(0.5)
        assert len(list((tmp_path / "videos").glob("*.gif"))) == 1  # same policy version: not played again
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.1)
        stats.env_steps[0] = 5678
        weights.publish(actor, version=1)
        assert wait_for((tmp_path / "videos" / "step_5678.gif").exists, 30)
        stop.set()
        process.join(15)
        assert process.exitcode == 0
        frames, size = gif_frames(first)
        assert frames > 1 and size == (320, 240)
        assert gif_distinct_frames(first) > 1  # the rendered scene moves
        assert (tmp_path / "videos" / "step_5678.gif").read_bytes() != first.read_bytes()  # another policy, played
        assert not list((tmp_path / "videos").glob(".*"))  # no temp files left
    finally:
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(5)
        weights.close()
        stats.close()


def test_render_gifs_are_thinned_to_a_bounded_count_spanning_the_run(tmp_path):
    """--render writes a GIF every 30 s of a run without a budget: the folder keeps at most MAX_GIFS, the first and
    the newest among them, spread about evenly over the run; other files are left alone."""
    from viz.video import MAX_GIFS, thin_gifs

    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "notes.txt").write_text("mine")
    (videos / "step_x.gif").write_bytes(b"GIF89a")
    written = []
    for k in range(1, 301):
        steps = 1000 * k
        (videos / f"step_{steps}.gif").write_bytes(b"GIF89a")
        written.append(steps)
        thin_gifs(videos)
        kept = sorted(int(p.name[5:-4]) for p in videos.glob("step_*.gif") if p.name[5:-4].isdigit())
        assert len(kept) <= MAX_GIFS and kept[0] == 1000 and kept[-1] == steps
    gaps = [b - a for a, b in zip(kept, kept[1:])]
    assert len(kept) == MAX_GIFS and max(gaps) <= 3 * 300_000 / MAX_GIFS  # no stretch of the run left out
    assert (videos / "notes.txt").exists() and (videos / "step_x.gif").exists()


def test_render_process_plays_in_the_pybullet_gui_when_a_display_opens(xvfb, ctx, tmp_path, monkeypatch):
    import torch

    from spreeze.algos import make_actor
    from spreeze.config import Config
    from spreeze.envs import check_env
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights
    from viz.render import start_render

    monkeypatch.setenv("DISPLAY", xvfb)
    config = Config(env_id=RENDER_ENV)
    info = check_env(RENDER_ENV)
    actor = make_actor(config, info.obs_dim, info.act_dim)
    weights = SharedWeights.create(actor, ctx)
    stats = SharedStats.create(1)
    stop = StopFlag(ctx)  # the supervisor's kind of stop signal
    process = None
    x = X11(xvfb)
    try:
        process = start_render(config, info, weights.handle, stats.handle, tmp_path, stop, os.getpid(),
                               interval_s=0.2)
        assert wait_for(lambda: any("Bullet Physics" in title for title in x.windows()), 30)
        window = next(w for title, w in x.windows().items() if "Bullet Physics" in title)

        def watch_the_window(timeout: float, *, changes: int | None = None, quiet_s: float | None = None) -> int:
            """Watch the window's pixels until they changed ``changes`` times or stayed the same for ``quiet_s``;
            return the number of changes seen (a timeout fails the test)."""
            seen, last, last_change, begun = 0, x.pixels(window), time.monotonic(), time.monotonic()
            while time.monotonic() - begun < timeout:
                now = x.pixels(window)
                if now != last:
                    seen, last, last_change = seen + 1, now, time.monotonic()
                if changes is not None and seen >= changes:
                    return seen
                if quiet_s is not None and time.monotonic() - last_change >= quiet_s:
                    return seen
                time.sleep(0.03)
            raise AssertionError(f"after {timeout} s: {seen} changes of the window (wanted changes={changes}, "
                                 f"quiet_s={quiet_s})")

        assert x.pixels(window) is not None
        watch_the_window(60, quiet_s=2.5)  # the first episode ends, and the same policy is not played again
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.3)
        weights.publish(actor, version=1)
        # the new policy is played on screen: the scene moves (a frozen or black window would not change)
        watch_the_window(30, changes=3)
        stop.set()
        process.join(15)
        assert process.exitcode == 0
        assert not (tmp_path / "videos").exists()  # finished episodes played on screen were not recorded
    finally:
        x.close()
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(5)
        weights.close()
        stats.close()


# ----- viz.plot and viz.play --------------------------------------------------------------------------
def test_plot_draws_two_recorded_runs_on_one_figure(recorded_runs, tmp_path):
    from viz.plot import build_figure, read_run

    curves = [read_run(run) for run in recorded_runs]
    assert [c.source for c in curves] == ["evaluations.csv", "metrics.csv"]
    assert len(curves[0].test_return) == 25 and len(curves[1].test_return) == 27  # rows without a test return skipped
    figure = build_figure(curves)
    for ax in figure.axes:
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["run-a (sac)", "run-b (td3)"]
    out = tmp_path / "compare.png"
    result = subprocess.run([sys.executable, "-m", "viz.plot", *map(str, recorded_runs), "--out", str(out)],
                            cwd=ROOT, env=headless_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "2 run(s)" in result.stdout
    assert png_size(out) == (1300, 500)


def test_plot_without_any_data_fails_with_one_line(tmp_path, capsys):
    from viz.plot import main

    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "none of the runs" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_play_writes_a_gif_from_the_saved_final_policy(saved_run):
    result = subprocess.run([sys.executable, "-m", "viz.play", str(saved_run), "--frame-every", "1",
                             "--max-frames", "40", "--episodes", "2"],
                            cwd=ROOT, env=headless_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = saved_run / "videos" / "final.gif"  # no display and no --out: the default file
    frames, size = gif_frames(out)
    assert frames > 2 and size == (320, 240)
    assert "episode 2: return" in result.stdout


def test_play_accepts_every_name_load_policy_does(saved_run):
    """'final', 'latest', a checkpoint's file name, and a policy file's path, as spreeze.load_policy reads them."""
    from viz.play import load

    final_file = saved_run / "final" / "actor.pt"
    for checkpoint, name in ((None, "final"), ("final", "final"), ("latest", "latest"), ("latest.pt", "latest"),
                             (str(final_file), "actor")):
        policy, env_id, label = load(saved_run, None if checkpoint is None else Path(checkpoint))
        assert (env_id, label) == (RENDER_ENV, name) and callable(policy)


def test_play_a_named_checkpoint_to_a_chosen_file(saved_run, tmp_path, monkeypatch, capsys):
    from viz.play import main

    monkeypatch.delenv("DISPLAY", raising=False)
    out = tmp_path / "ckpt.gif"
    assert main([str(saved_run), "--checkpoint", "latest.pt", "--out", str(out), "--frame-every", "2"]) == 0
    frames, _ = gif_frames(out)
    assert frames > 1
    assert main([str(saved_run), "--checkpoint", "nope.pt", "--out", str(out)]) == 2
    assert main([str(saved_run), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "error" in capsys.readouterr().err


def test_the_live_window_needs_an_x_display_on_linux_only(monkeypatch):
    """macOS and Windows draw windows without X: there matplotlib's own backend decides (and the window process
    falls back to curve.png if it cannot open one); pybullet's GUI keeps the X check everywhere."""
    from viz.display import display_available, window_problem

    monkeypatch.delenv("DISPLAY", raising=False)
    assert window_problem("darwin") is None and window_problem("win32") is None
    assert "DISPLAY is not set" in window_problem("linux")
    assert not display_available()


def test_a_window_process_that_fails_delivers_its_error_before_it_exits(tmp_path):
    """The window's status queue has its join thread cancelled (a parent that stops reading must not hold the
    window's exit), so join_thread() delivered nothing: the error line was left to chance. It arrives now."""
    import multiprocessing as mp

    from viz.live import Failed, _window_main

    ctx = mp.get_context("spawn")
    data, status, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    # history None: the window fails as it starts, in its own process
    process = ctx.Process(target=_window_main, args=(data, status, stop, str(tmp_path), "t", False, 1.0, os.getpid(),
                                                     None))
    process.start()
    process.join(60)
    assert process.exitcode == 1
    failed = status.get(timeout=5)
    assert isinstance(failed, Failed) and failed.text.startswith("AttributeError"), failed
    for q in (data, status):
        q.close()
        q.join_thread()
