"""MQTT topic names and JSON payloads of the edge-agent contract (see DESIGN.md, "MQTT interface").

Everything that ends up on the wire as a topic or a JSON body is built here, so the contract lives in
one module: ``Topics`` for names, ``payload()`` for bodies.

Serialisation: callers may pass numpy scalars and arrays (detections come straight out of
post-processing); they are converted through their ``tolist()`` method, which numpy scalars and
arrays both have, so this module does not need to import numpy. NaN and infinity are rejected
(``ValueError``): JSON has no such values and strict consumers would choke on them; use ``None``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
# Short name -> full schema name; a typo in a caller must fail loudly rather than publish a bad schema.
SCHEMAS: dict[str, str] = {
    name: f"edge-agent/{name}/{SCHEMA_VERSION}"
    for name in (
        "status",
        "camera-state",
        "detections",
        "telemetry",
        "engine",
        "cmd-result",
        "event",
        "zone",
        "line",
        "deployment",
    )
}

_FORBIDDEN = ("+", "#", "/", "\x00")
# Fleet topic levels next to the device ids (which therefore may not start with '_', agent.config).
FLEET_ALL = "_all"
FLEET_GROUP = "_group"
FLEET_ANY = "_any"


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it can be one topic level; ValueError naming ``what`` otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}: must be a non-empty string, got {value!r}")
    bad = [c for c in _FORBIDDEN if c in value]
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise ValueError(f"{what}: {value!r} contains {shown}; a topic level cannot contain '+', '#' or '/'")
    return value


@dataclass(frozen=True)
class Topics:
    """Topic names for one device: ``{prefix}/{device}/...``.

    ``prefix`` may have several levels (``site/edge-agent``) but no wildcards; ``device`` is one level.
    Per-camera / per-model names are validated on every call (cheap) and cached, because the
    detections topic is asked for once per frame.
    """

    prefix: str
    device: str
    _cache: dict[tuple[str, str], str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prefix or self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(f"prefix: {self.prefix!r} must be non-empty without leading/trailing '/'")
        for level in self.prefix.split("/"):
            check_name(level, "prefix")
        check_name(self.device, "device")

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.device}"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def telemetry(self) -> str:
        return f"{self.base}/telemetry"

    @property
    def cmd_filter(self) -> str:
        return f"{self.base}/cmd/+"

    def _named(self, kind: str, name: str, what: str) -> str:
        key = (kind, name)
        topic = self._cache.get(key)
        if topic is None:
            check_name(name, what)
            topic = kind.format(base=self.base, name=name)
            if len(self._cache) < 4096:  # bound the cache: names come from config, but be safe
                self._cache[key] = topic
        return topic

    def camera_state(self, camera: str) -> str:
        return self._named("{base}/cameras/{name}/state", camera, "camera")

    def detections(self, camera: str) -> str:
        return self._named("{base}/cameras/{name}/detections", camera, "camera")

    def snapshot(self, camera: str) -> str:
        return self._named("{base}/cameras/{name}/snapshot", camera, "camera")

    def events(self, camera: str) -> str:
        return self._named("{base}/cameras/{name}/events", camera, "camera")

    def zone(self, camera: str, zone: str) -> str:
        """Retained occupancy of a camera's zone: ``{base}/cameras/{camera}/zones/{zone}``."""
        return self._named2("zones", camera, zone, "zone")

    def line(self, camera: str, line: str) -> str:
        """Retained counts of a camera's line: ``{base}/cameras/{camera}/lines/{line}``."""
        return self._named2("lines", camera, line, "line")

    def track_snapshot(self, camera: str, track_id: int) -> str:
        """JPEG of a track's best detection, after its ``end`` event (not cached: one per track)."""
        check_name(camera, "camera")
        return f"{self.base}/cameras/{camera}/tracks/{int(track_id)}/snapshot"

    def regions_filter(self) -> tuple[str, str, str]:
        """Subscription filters matching every zone, line and camera state of this device (stale ones, such
        as those of a camera removed while the agent was stopped, are cleared)."""
        cams = f"{self.base}/cameras/+"
        return f"{cams}/zones/+", f"{cams}/lines/+", f"{cams}/state"

    def _named2(self, kind: str, camera: str, name: str, what: str) -> str:
        key = (f"{kind}/{camera}", name)
        topic = self._cache.get(key)
        if topic is None:
            check_name(camera, "camera")
            check_name(name, what)
            topic = f"{self.base}/cameras/{camera}/{kind}/{name}"
            if len(self._cache) < 4096:
                self._cache[key] = topic
        return topic

    def engine(self, model: str) -> str:
        return self._named("{base}/engines/{name}", model, "model")

    def cmd(self, action: str) -> str:
        return self._named("{base}/cmd/{name}", action, "action")

    def cmd_result(self, action: str) -> str:
        return self._named("{base}/cmd/{name}/result", action, "action")

    def action_of(self, topic: str) -> str | None:
        """The action of an inbound ``{base}/cmd/{action}`` topic, None for any other topic."""
        head = f"{self.base}/cmd/"
        if not topic.startswith(head):
            return None
        action = topic[len(head) :]
        return action if action and "/" not in action else None

    # ---- fleet: commands shared by many devices, answered on each device's own cmd/<action>/result ----
    def fleet_filters(self, groups: Iterable[str] = (), shared: bool = False) -> tuple[str, ...]:
        """``{prefix}/_all/cmd/+`` and ``{prefix}/_group/<g>/cmd/+`` for each group; with ``shared`` also the
        MQTT shared subscriptions that hand each ``{prefix}/_any/cmd/<action>`` (and each
        ``{prefix}/_group/<g>/any/cmd/<action>``) to one subscribed agent only."""
        groups = [check_name(g, "group") for g in groups]
        filters = [
            f"{self.prefix}/{FLEET_ALL}/cmd/+",
            *(f"{self.prefix}/{FLEET_GROUP}/{g}/cmd/+" for g in groups),
        ]
        if shared:
            share = self.prefix.replace("/", "-")  # a share name is one level; the same for every agent
            filters.append(f"$share/{share}/{self.prefix}/{FLEET_ANY}/cmd/+")
            filters += [f"$share/{share}.{g}/{self.prefix}/{FLEET_GROUP}/{g}/any/cmd/+" for g in groups]
        return tuple(filters)

    def fleet_action_of(self, topic: str, groups: Collection[str] = (), shared: bool = False) -> str | None:
        """The action of an inbound fleet command (``_all``, one of ``groups``, and with ``shared`` their "any
        one agent" forms), None for other topics."""
        head = f"{self.prefix}/"
        if not topic.startswith(head):
            return None
        levels = topic[len(head) :].split("/")
        if len(levels) == 3 and levels[0] == FLEET_ALL and levels[1] == "cmd":
            action = levels[2]
        elif len(levels) == 4 and levels[0] == FLEET_GROUP and levels[1] in groups and levels[2] == "cmd":
            action = levels[3]
        elif shared and len(levels) == 3 and levels[0] == FLEET_ANY and levels[1] == "cmd":
            action = levels[2]
        elif (
            shared
            and len(levels) == 5
            and levels[0] == FLEET_GROUP
            and levels[1] in groups
            and levels[2:4]
            == [
                "any",
                "cmd",
            ]
        ):
            action = levels[4]
        else:
            return None
        return action or None


def _to_json(obj: Any) -> Any:
    # numpy scalars and arrays (and anything else array-like) expose tolist(); sets/tuples -> lists.
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON; numpy values allowed, NaN/inf rejected."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_to_json)
    return text.encode()


def payload(schema_short: str, ts: float | None = None, **fields: Any) -> bytes:
    """JSON body ``{"schema": "edge-agent/<schema_short>/1", "ts": <unix s>, **fields}`` as bytes.

    ``ts`` defaults to now (``time.time()``); pass it to stamp an event with its own time.
    """
    schema = SCHEMAS.get(schema_short)
    if schema is None:
        raise ValueError(f"schema: unknown {schema_short!r} (known: {', '.join(sorted(SCHEMAS))})")
    if "schema" in fields:
        raise ValueError("fields: 'schema' is set by payload() and cannot be passed")
    body: dict[str, Any] = {"schema": schema, "ts": time.time() if ts is None else float(ts)}
    body.update(fields)
    return dumps(body)
