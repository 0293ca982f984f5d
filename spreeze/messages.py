"""What children tell the supervisor, one small dataclass per kind, routed by the supervisor's handler table.
Experience and weights never travel this way (shared memory does); these are rare and small."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Evaluation:
    """A test result (the tested weights ride along as ``actor_flat``, for the best policy)."""
    result: dict


@dataclass(frozen=True)
class Error:
    """The child is failing; the run ends with this text."""
    source: str
    text: str


@dataclass(frozen=True)
class Warn:
    """Something went wrong that training survives (a checkpoint not written): events.log."""
    source: str
    text: str


@dataclass(frozen=True)
class Event:
    """A decision worth a line in events.log (the learner's new batch)."""
    source: str
    text: str


@dataclass(frozen=True)
class Info:
    """A line for the console only."""
    source: str
    text: str


@dataclass(frozen=True)
class GaveUp:
    """A sampler stopped for good (its env keeps failing): it is not restarted."""
    source: str
    text: str


@dataclass(frozen=True)
class Checkpointed:
    """The learner wrote a checkpoint, for the observers."""
    source: str
    path: str
