"""What children tell the supervisor, one small dataclass per kind, routed by the supervisor's handler table.
Experience and weights never travel this way (shared memory does); these are rare and small."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Evaluation:
    """A test result (the tested weights ride along as ``actor_flat``, for the best policy)."""
    result: dict


@dataclass(frozen=True)
class _Said:
    source: str   # "learner" or the child's process title
    text: str


class Error(_Said):
    """The child is failing; the run ends with this text."""


class Warn(_Said):
    """Something went wrong that training survives (a checkpoint not written): events.log."""


class Event(_Said):
    """A decision worth a line in events.log (the learner's new batch)."""


class Info(_Said):
    """A line for the console only."""


class GaveUp(_Said):
    """A sampler stopped for good (its env keeps failing): it is not restarted."""


class Checkpointed(_Said):
    """The learner wrote a checkpoint (``text`` is its path), for the observers."""
