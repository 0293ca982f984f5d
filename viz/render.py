"""The policy-visualization process (``--render``): every few seconds it plays the newest policy once.

It reads the actor weights the learner broadcasts (the same shared segment the samplers read) and steps
its own env, so it never writes experience. To never slow the learner measurably it runs at the lowest
CPU priority with one torch thread, plays only when the policy changed since its last episode, renders
only every k-th frame and stops a recording after a few seconds of video.

With a display that really opens (docs/pitfalls.md: ``human`` without one kills the process with
no exception) the episode plays in the PyBullet GUI; otherwise the ``rgb_array`` frames become
``runs/<run>/videos/step_<env steps>.gif``. Closing the GUI window ends this process with code 0;
training is not affected either way.
"""
from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

PROCESS_NAME = "spreeze-render"
RENDER_INTERVAL_S = 30.0
RENDER_SEED_OFFSET = 55_555_555
NICENESS = 19


def start_render(config, env_info, weights_handle, stats_handle, run_dir, stop_event, parent_pid,
                 interval_s: float = RENDER_INTERVAL_S):
    """Start and return the ``spreeze-render`` process; it exits when ``stop_event`` is set or the parent dies.
    Exit code 0 when stopped or when the user closed the GUI, 1 on an error."""
    from spreeze.proc import ChildLink, Role, child_main, start_process

    build = partial(_build, config, env_info, weights_handle, stats_handle, str(run_dir), interval_s)
    return start_process(child_main, Role("render"), build, _loop, ChildLink(None, stop_event, parent_pid),
                         name=PROCESS_NAME)


def _build(config, env_info, weights_handle, stats_handle, run_dir: str, interval_s: float, child) -> "_Renderer":
    from spreeze.stats import SharedStats
    from spreeze.weights import SharedWeights

    try:
        os.nice(NICENESS)
    except OSError:
        pass
    weights = child.keep(SharedWeights.attach(weights_handle))  # drops its numpy views before closing the segment
    stats = child.keep(SharedStats.attach(stats_handle))
    return _Renderer(config, env_info, weights, stats, Path(run_dir), interval_s, should_stop=child.should_stop,
                     wait=child.stop_event.wait)


def _loop(renderer: "_Renderer", child) -> None:
    from gymnasium.error import DependencyNotInstalled

    try:
        renderer.loop()
    except DependencyNotInstalled as err:  # e.g. classic-control envs without pygame
        print(f"[spreeze] policy visualization off: {renderer.config.env_id} cannot render here: {err}", flush=True)
        sys.exit(1)


class _Renderer:
    def __init__(self, config, env_info, weights, stats, run_dir: Path, interval_s: float, should_stop, wait):
        from spreeze.algos import make_actor
        from spreeze.checkpoint import Policy
        from spreeze.envs import ActionScaler
        from viz.display import display_available

        self.config, self.weights, self.stats = config, weights, stats
        self.videos = run_dir / "videos"
        self.interval_s = interval_s
        self.should_stop, self.wait = should_stop, wait
        self.human = display_available()
        self.actor = make_actor(config, env_info.obs_dim, env_info.act_dim)
        self.policy = Policy(self.actor, ActionScaler(env_info.action_low, env_info.action_high))

    def close(self) -> None:
        pass

    def loop(self) -> None:
        from spreeze.envs import quiet_c_output
        from viz.video import default_frame_every, env_fps, make_render_env, play_episode, thin_gifs, write_gif

        with quiet_c_output():  # pybullet prints a banner on import
            import pybullet
        env = make_render_env(self.config, human=self.human)  # one GUI connection per process, kept
        frame_every = default_frame_every(env)
        version, played, episodes = -1, None, 0
        try:
            while not self.should_stop():
                begun = time.monotonic()
                if self.weights.current_version() != played:
                    version = self.weights.pull(self.actor, version)
                    env_steps = self.stats.total_env_steps()
                    try:
                        episode = play_episode(env, self.policy, self.config.seed + RENDER_SEED_OFFSET + episodes,
                                               record=not self.human, frame_every=frame_every,
                                               realtime=self.human, should_stop=self.should_stop)
                    except pybullet.error:
                        if not self.human:
                            raise
                        print("[spreeze] render window closed; policy visualization stopped", flush=True)
                        return
                    if episode is None:
                        return
                    played, episodes = version, episodes + 1
                    if episode.frames:
                        write_gif(episode.frames, self.videos / f"step_{env_steps}.gif", env_fps(env) / frame_every)
                        thin_gifs(self.videos)
                while not self.should_stop() and time.monotonic() - begun < self.interval_s:
                    self.wait(min(0.5, self.interval_s))
        finally:
            try:
                env.close()
            except pybullet.error:  # the user closed the GUI: the connection is already gone
                pass
