"""The messages over a shard's pipe, both ways: one frozen dataclass each (pickled by the pipe).

The supervisor (agent.shards.host, agent.shards.sharded) reads the shard's messages (`Up`), the shard
(agent.shards.child) reads the supervisor's (`Down`); each side dispatches them by type through one
table. The first message on a new pipe is the supervisor's `Assign`; the shard answers `Started` or
`Failed` once, then reports until it is told to `Stop` or its pipe closes.

Request ids (`rid`) pair a `Snapshot`, `Reload` or `Tap` with its `Answer` (a tap's `Frame`s come first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.config import AgentConfig
from agent.runtime.reports import CameraState
from agent.service.supervisor import Progress
from engines.precision import Precision

# ---- supervisor -> shard ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    """The first message: who the shard is, its part of the config, and where its track ids start."""

    index: int
    part: AgentConfig
    level: str
    first_id: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Snapshot:
    rid: int
    camera: str


@dataclass(frozen=True)
class Reload:
    """The shard's new part; `first_ids`: where the track ids of the cameras handed to it start (added,
    moved here, back after a removal: agent.shards.tracks.TrackEpochs)."""

    rid: int
    part: AgentConfig
    first_ids: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Tap:
    """Frames of the model's pipeline for the accuracy gate or INT8 calibration: `Frame`s, then `Answer`."""

    rid: int
    model: str
    total: int
    interval_s: float
    timeout_s: float


Down = Assign | Stop | Snapshot | Reload | Tap

# ---- shard -> supervisor ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    pid: int


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class CameraChanged:
    """A camera's state changed (the full retained payload's fields: the supervisor republishes them)."""

    camera: str
    state: CameraState


@dataclass(frozen=True)
class ProgressReport:
    progress: Progress


@dataclass(frozen=True)
class TelemetryReport:
    fields: dict[str, Any]
    stages: dict[str, Any]


@dataclass(frozen=True)
class EngineState:
    model: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class RebuildAsked:
    model: str
    force: bool
    precision: Precision | None
    reasons: list[str] | None


@dataclass(frozen=True)
class TrackEvent:
    """A copy of an object or zone event the shard published (`new`, `update`, `end`, `zone_enter`,
    `zone_leave`: its payload's fields): the supervisor keeps the open tracks, to close them if the shard
    dies (agent.shards.tracks)."""

    camera: str
    body: dict[str, Any]


@dataclass(frozen=True)
class RegionState:
    """A retained zone or line state the shard published (`body` empty: deleted); reset on its death."""

    topic: str
    body: bytes


@dataclass(frozen=True)
class Frame:
    rid: int
    item: Any  # (image, origin)


@dataclass(frozen=True)
class Answer:
    rid: int
    ok: bool
    body: Any  # the answer's fields, or the error


Up = (
    Started
    | Failed
    | CameraChanged
    | ProgressReport
    | TelemetryReport
    | EngineState
    | RebuildAsked
    | TrackEvent
    | RegionState
    | Frame
    | Answer
)
