"""spreeze: high-throughput off-policy RL (SAC, TD3, CrossQ) on one machine, after the Spreeze paper.

``spreeze.train("Pendulum-v1", minutes=1)`` trains as ``spreeze train`` does; ``spreeze.load_policy(run_dir)``
gives the trained policy as a function."""
__version__ = "0.1.0"


def train(env_id: str, **overrides):
    """Train on ``env_id`` with any Config field as a keyword (``minutes=5, algo="td3"``); returns a ``Run``
    with ``run_dir``, ``evaluations``, ``summary`` and ``exit_code``; ``callbacks=[...]`` watch it from this
    process. See :func:`launch.api.train`.

    Imported on call: the core package never imports the composition root (``launch``) at import time."""
    from launch.api import train as _train

    return _train(env_id, **overrides)


def load_policy(run_or_file, checkpoint: str | None = None):
    """Load a trained policy: ``spreeze.load_policy("runs/<run>")(obs)`` gives the env action.

    ``checkpoint``: ``"final"``, ``"best"`` (the best mean of 5 tests; before the fifth, the latest tested), ``"latest"`` (the newest training
    checkpoint's actor) or a path to a policy or checkpoint file; None is ``"final"``, and the only choice when
    ``run_or_file`` is itself a file."""
    from spreeze.checkpoint import load_policy as _load

    return _load(run_or_file, checkpoint)
