"""Playing one deterministic episode of a policy, on screen or into frames, and writing frames as a GIF.

Shared by the render process (:mod:`viz.render`) and ``python -m viz.play``. Quirks handled
(docs/pitfalls.md, "Rendering and plotting"): ``human`` mode is only ever requested after
:func:`viz.display.display_available` said yes, because without a display pybullet kills the process
with no exception; ``render()`` is only called after ``reset()``; an ``rgb_array`` PyBullet env must be a
private DIRECT connection, since the locomotion envs attach to any shared-memory physics server they find.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np

GIF_FPS = 20.0
MAX_FRAMES = 200  # 10 s of GIF: enough to see the gait, small enough to write every few minutes
MAX_GIFS = 24  # --render records one every 30 s, and a run has no budget by default: the folder is thinned


@dataclass
class Episode:
    total_reward: float
    length: int
    frames: list[np.ndarray] = field(default_factory=list)


def make_render_env(env, human: bool) -> gym.Env:
    """``env``: an env id, or a run's Config (its --env-kwargs and --wrapper apply here too)."""
    from spreeze.envs import build_env, quiet_c_output, register_envs

    register_envs()
    with quiet_c_output():  # pybullet's connection banner
        return build_env(env, render_mode="human" if human else "rgb_array")


def env_fps(env: gym.Env) -> float:
    return float(env.metadata.get("render_fps") or 30)


def default_frame_every(env: gym.Env) -> int:
    """Keep every k-th step so the GIF plays at about GIF_FPS in real time."""
    return max(1, round(env_fps(env) / GIF_FPS))


def play_episode(env: gym.Env, policy, seed: int, *, record: bool, frame_every: int = 1,
                 max_frames: int = MAX_FRAMES, realtime: bool = False, should_stop=lambda: False) -> Episode | None:
    """One episode of ``policy`` (env observation -> env action); None if ``should_stop`` said so midway.

    ``record`` keeps every ``frame_every``-th ``rgb_array`` frame and ends the episode after ``max_frames``
    frames; ``realtime`` paces the steps to the env's frame rate for a human watching the GUI.
    """
    from spreeze.envs import _assert_private_physics, quiet_c_output

    with quiet_c_output():  # pybullet connects (and prints a banner) at the first reset
        obs, _ = env.reset(seed=seed)
    if env.render_mode == "rgb_array":
        _assert_private_physics(env)
    episode = Episode(0.0, 0, [env.render()] if record else [])
    step_s = 1.0 / env_fps(env)
    while True:
        if should_stop():
            return None
        begun = time.monotonic()
        obs, reward, terminated, truncated, _ = env.step(policy(obs))
        episode.total_reward += float(reward)
        episode.length += 1
        if record and episode.length % frame_every == 0:
            episode.frames.append(env.render())
        if terminated or truncated or (record and len(episode.frames) >= max_frames):
            return episode
        if realtime:
            time.sleep(max(0.0, step_s - (time.monotonic() - begun)))


def write_gif(frames: list[np.ndarray], path: Path, fps: float) -> Path:
    """Frames (H x W x 3 uint8) as a looping GIF, written atomically (temp file, rename)."""
    from PIL import Image

    if not frames:
        raise ValueError("no frames to write")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(np.asarray(frame, dtype=np.uint8)) for frame in frames]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                       duration=max(20, round(1000.0 / fps)), loop=0)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def thin_gifs(folder: Path, keep: int = MAX_GIFS) -> list[Path]:
    """At most ``keep`` ``step_<env steps>.gif`` files in ``folder``: past that, the one whose neighbours are
    closest together in env steps goes (the first and the newest stay), so the GIFs span the whole run about
    evenly at a bounded size. Returns the removed paths."""
    def steps(path: Path) -> int | None:
        digits = path.name[len("step_"):-len(".gif")]
        return int(digits) if digits.isdigit() else None

    gifs = sorted((n, p) for p in Path(folder).glob("step_*.gif") if (n := steps(p)) is not None)
    removed = []
    while len(gifs) > max(keep, 2):
        i = min(range(1, len(gifs) - 1), key=lambda j: (gifs[j + 1][0] - gifs[j - 1][0], gifs[j][0]))
        gifs[i][1].unlink(missing_ok=True)
        removed.append(gifs.pop(i)[1])
    return removed
