"""spreeze: high-throughput off-policy RL (SAC, TD3) on one machine, after the Spreeze paper."""
__version__ = "0.1.0"


def load_policy(run_or_file, checkpoint: str = "final"):
    """Load a trained policy: ``spreeze.load_policy("runs/<run>")(obs)`` gives the env action;
    ``checkpoint="best"`` loads the policy of the run's best mean of 5 tests instead of the final one."""
    from spreeze.checkpoint import load_policy as _load

    return _load(run_or_file, checkpoint)
