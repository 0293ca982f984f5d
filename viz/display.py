"""Whether an X display can really be opened.

``DISPLAY`` being set is not enough: a stale or unreachable display makes pybullet's ``human`` mode kill
the whole process with exit code 1 and no Python exception (docs/pitfalls.md). So we open (and close)
a real X connection through libX11 before anything is allowed to use a GUI.

macOS and Windows draw windows without an X server: there the live window asks the GUI toolkit itself
(:func:`window_problem`), and falls back to ``curve.png`` when matplotlib cannot open one. pybullet's GUI stays
behind the X check (:func:`display_available`): on those systems ``--render`` and ``viz.play`` record GIFs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


def window_problem(platform: str = sys.platform) -> str | None:
    """For the live (matplotlib) window: None where one may open; otherwise a short reason for the user."""
    if platform == "darwin" or platform.startswith("win"):
        return None  # native windowing: the backend decides when the window opens
    return display_problem()


def display_problem() -> str | None:
    """None when an X connection opens; otherwise a short reason for the user."""
    name = os.environ.get("DISPLAY", "")
    if not name:
        return "no display (DISPLAY is not set)"
    path = ctypes.util.find_library("X11")
    if path is None:
        return "no display (libX11 is not installed)"
    try:
        x11 = ctypes.cdll.LoadLibrary(path)
    except OSError as err:
        return f"no display (libX11 cannot be loaded: {err})"
    x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
    x11.XOpenDisplay.restype = ctypes.c_void_p
    x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
    connection = x11.XOpenDisplay(name.encode())
    if not connection:
        return f"no display (cannot connect to X display {name!r})"
    x11.XCloseDisplay(connection)
    return None


def display_available() -> bool:
    return display_problem() is None
