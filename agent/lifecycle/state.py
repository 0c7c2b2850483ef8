"""One model's engine lifecycle as the daemon holds it: the state it publishes, and what it has in hand.

    me = ModelEngine(ctx, target)
    me.state.update(state="checking", backend="onnxruntime")
    publish(me.name, me.state.to_payload())     # the retained `engines/{model}` body (DESIGN.md)

EngineState is typed here and a dict only at the MQTT edge (to_payload). A field is in the payload from
the first time it is set, in that order, so the retained body keeps the shape it always had: `error`
appears with the first job, `load_error` with the first load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from agent.lifecycle.cancel import Killable
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget
from engines.buildproc import Progress
from engines.precision import Precision

# The daemon's log names the engine manager for every line of its lifecycle.
log = logging.getLogger("agent.lifecycle.manager")

StatePublisher = Callable[[str, dict[str, Any]], None]  # (model, payload): the MQTT edge

# Allowed moves of the engine state; anything else is a bug (logged, still published).
TRANSITIONS: dict[str | None, frozenset[str]] = {
    None: frozenset({"checking"}),
    "checking": frozenset({"ready", "fallback", "failed"}),  # failed: its plan was refused in a row
    "fallback": frozenset({"building", "ready"}),  # ready: an engine another process built, adopted
    # fallback: an engine built but that this device cannot run; ONNX Runtime serves (issue 36.2).
    "building": frozenset({"building", "ready", "failed", "fallback"}),
    "ready": frozenset({"building", "ready", "fallback"}),
    "failed": frozenset({"building", "ready", "fallback"}),
}


@dataclass
class EngineState:
    """The retained MQTT engine state of one model (DESIGN.md `engines/{model}`)."""

    state: str | None = None  # checking | ready | fallback | building | failed
    backend: str | None = None  # the runtime serving detections now
    precision: str | None = None
    reasons: list[str] = field(default_factory=list)  # why an engine is (re)built
    key: str | None = None
    loaded: bool | None = None  # False: built, but this device cannot run it (load_error says why)
    validation: dict[str, Any] | None = None  # the gate's {metric, value, threshold, passed, ...}
    fingerprint: dict[str, Any] | None = None
    progress: Progress | None = None  # of the job under way
    error: str | None = None
    load_error: str | None = None
    plan_sha256: str | None = None
    nvtx_verbosity: str | None = None
    build_s: float | None = None
    tried: list[dict[str, Any]] | None = None  # the gate's steps of the last job
    # Where the engine `key` names came from: built (here), cache (pulled from engines.cache), store (found
    # in the local store: at start, or written by another process).
    origin: str | None = None
    _order: list[str] = field(default_factory=list, repr=False)  # fields set so far, first set first

    def update(self, **values: Any) -> None:
        for name, value in values.items():
            if name not in _PUBLISHED:
                raise TypeError(f"the engine state has no field {name!r}")
            setattr(self, name, value)
            if name not in self._order:
                self._order.append(name)

    def to_payload(self) -> dict[str, Any]:
        """The fields set so far as the MQTT body's fields (agent.mqtt.topics.payload adds schema, ts)."""
        out: dict[str, Any] = {}
        for name in self._order:
            value = getattr(self, name)
            if isinstance(value, Progress):
                value = {"phase": value.phase, "step": value.step, "total": value.total}
            out[name] = value
        return out


_PUBLISHED = frozenset(f.name for f in fields(EngineState) if not f.name.startswith("_"))


def payload_of(**values: Any) -> dict[str, Any]:
    """The payload of a state set in one go (a model no engine lifecycle runs for)."""
    state = EngineState()
    state.update(**values)
    return state.to_payload()


@dataclass
class ModelEngine:
    """One model's engine lifecycle; every field is read and written under `lock`."""

    ctx: ModelContext
    target: EngineTarget
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: EngineState = field(default_factory=EngineState)
    job: Killable | None = None  # the job's JobCancel, then its child: retire() and close() kill it
    busy: bool = False  # a job (capture, child, adoption) is under way
    seen: tuple = ()  # engine dir listing at the last check, to notice builds made by other processes
    last_progress_pub: float = 0.0
    phases_logged: set = field(default_factory=set)  # progress phases of the job under way, said once
    retired: bool = False  # replaced or removed by a reload: its job's late news is dropped
    refusals: int = 0  # plans TensorRT refused at load in a row (one that loads: 0); 2+: no auto rebuild
    requested: Precision | None = None  # of the last job: a refused plan is rebuilt as it was asked

    @property
    def name(self) -> str:
        return self.ctx.name


class StateBoard:
    """Where a model's engine state is changed and published: under the model's lock, so retained states
    reach MQTT in order, and not once the model is retired (reloaded away)."""

    def __init__(self, publish: StatePublisher) -> None:
        self.publish = publish

    def set(self, me: ModelEngine, **fields: Any) -> None:
        with me.lock:
            new = fields.get("state")
            old = me.state.state
            if new is not None and new != old and new not in TRANSITIONS[old]:
                log.error("model %s: engine state %s -> %s is not a planned transition", me.name, old, new)
            me.state.update(**fields)
            if me.state.fingerprint is None:
                me.state.update(fingerprint=me.target.fingerprint.manifest_dict())
            if not me.retired:
                self.publish(me.name, me.state.to_payload())
