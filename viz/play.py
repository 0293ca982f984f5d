"""Replay a saved policy: ``python -m viz.play runs/<run> [--checkpoint PATH] [--out video.gif] [--episodes N]``.

Plays the run's final policy (``final/actor.pt``), or the actor of a checkpoint, deterministically. With
a display that really opens and no ``--out``, the episodes play in a window in real time; otherwise (or
with ``--out``) their frames are written as a GIF, by default ``runs/<run>/videos/<final|checkpoint>.gif``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from viz.video import MAX_FRAMES


def build_parser(prog: str = "python -m viz.play") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run", type=Path, help="run directory, e.g. runs/Walker2DBulletEnv-v0-sac-20260101-120000")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="play this instead of final/actor.pt: 'best' (best/actor.pt, the best mean of 5 "
                             "tests), 'latest' (the newest checkpoint's actor), 'final', a policy or checkpoint "
                             "file, or a file name in <run>/checkpoints/")
    parser.add_argument("--out", type=Path, default=None, help="write a GIF here instead of opening a window")
    parser.add_argument("--episodes", type=int, default=1, help="episodes to play (all go into one GIF)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first episode's reset")
    parser.add_argument("--frame-every", type=int, default=0,
                        help="keep every k-th frame in the GIF; 0 chooses about 20 frames per second of play")
    parser.add_argument("--max-frames", type=int, default=MAX_FRAMES, help="GIF frames per episode at most")
    return parser


def load(run_dir: Path, checkpoint: Path | None):
    """(policy, env_id, name): what ``spreeze.load_policy`` reads for ``checkpoint`` (None: "final"; "best",
    "latest", or a policy or checkpoint file, as given or in the run or its checkpoints/), so that play accepts
    every name the API does. The file is found once and read once."""
    from spreeze import load_policy
    from spreeze.checkpoint import policy_file

    name = "final" if checkpoint is None else str(checkpoint)
    path = policy_file(run_dir, checkpoint)
    label = name if name in ("final", "best", "latest") else path.stem
    policy = load_policy(path)
    return policy, policy.env_id, label


def run_env(run_dir: Path, env_id: str):
    """The run's Config when its config.json is for ``env_id`` (so that its --env-kwargs and --wrapper apply to
    the played env too), else the bare id."""
    from spreeze.config import Config

    path = run_dir / "config.json"
    if path.is_file():
        config = Config.from_dict(json.loads(path.read_text()))
        if config.env_id == env_id:
            return config
    return env_id


def main(argv: list[str] | None = None, prog: str = "python -m viz.play") -> int:
    """``prog``: how errors name the command (``spreeze play`` when the installed command runs it)."""
    args = build_parser(prog).parse_args(argv)
    from gymnasium.error import DependencyNotInstalled

    from spreeze.config import ConfigError
    from spreeze.envs import quiet_c_output
    from viz.display import display_available
    from viz.video import default_frame_every, env_fps, make_render_env, play_episode, write_gif

    if not args.run.is_dir():
        print(f"{prog}: error: {args.run} is not a run directory", file=sys.stderr)
        return 2
    if args.out is not None and args.out.suffix.lower() != ".gif":
        print(f"{prog}: error: --out must be a .gif file, not {args.out}", file=sys.stderr)
        return 2
    if args.episodes < 1 or args.max_frames < 1 or args.frame_every < 0:
        print(f"{prog}: error: need --episodes >= 1, --max-frames >= 1 and --frame-every >= 0", file=sys.stderr)
        return 2
    try:
        policy, env_id, name = load(args.run, args.checkpoint)
    except (FileNotFoundError, KeyError, ValueError, ConfigError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    human = args.out is None and display_available()
    try:
        env = make_render_env(run_env(args.run, env_id), human=human)
    except (DependencyNotInstalled, ConfigError) as err:
        print(f"{prog}: error: {env_id} cannot render here: {err}", file=sys.stderr)
        return 2
    with quiet_c_output():  # pybullet prints a banner on import
        import pybullet

    frame_every = args.frame_every or default_frame_every(env)
    frames = []
    try:
        for i in range(args.episodes):
            episode = play_episode(env, policy, args.seed + i, record=not human, frame_every=frame_every,
                                   max_frames=args.max_frames, realtime=human)
            frames.extend(episode.frames)
            print(f"episode {i + 1}: return {episode.total_reward:.1f} over {episode.length} steps"
                  + (" (recording stopped at --max-frames)" if len(episode.frames) >= args.max_frames else ""))
    except DependencyNotInstalled as err:  # raised at the first render(), not at make()
        print(f"{prog}: error: {env_id} cannot render here: {err}", file=sys.stderr)
        return 2
    except pybullet.error:
        if not human:
            raise
        print("window closed")
        return 0
    finally:
        try:
            env.close()
        except pybullet.error:  # the user closed the PyBullet GUI: the connection is already gone
            pass
    if not human:
        out = args.out or args.run / "videos" / f"{name}.gif"
        write_gif(frames, out, env_fps(env) / frame_every)
        print(f"wrote {out} ({len(frames)} frames)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
