"""Home Assistant MQTT discovery: retained entity configs that point HA at the agent's own topics.

Pure functions, no MQTT client: the daemon publishes ``discovery_messages()`` retained (kind "state")
at start and after every reload, and clears with an empty retained payload ``removed_topics()`` after
a reload and ``stale_topics()`` (what the broker still holds under ``node_filter()``) at start.
Nothing new goes on the wire for the data itself: every entity reads a topic the agent publishes
anyway (camera state, detections through a ``value_template``; snapshots as they are), so HA sees exactly
what Node-RED sees.

Per enabled camera (one HA device per agent, named ``edge-agent <device_id>``):

- ``binary_sensor`` streaming (connectivity): camera ``state`` == streaming; attributes from the same
  payload (camera_state, fps_in, reconnects, last_error);
- ``sensor`` fps: ``fps_out`` of the camera state (results per second), republished every telemetry
  interval;
- ``sensor`` latency (ms, duration): ``latency_ms.total`` of the detections, per camera. Telemetry only
  has stage latencies over all cameras, so the detections are the only per-camera source; they arrive
  once per frame, so this entity is disabled by default (enable it in HA if the recorder load is fine);
- ``sensor`` <label> count: detections with that label in the latest frame, for the camera's
  ``classes`` or, without them, ``homeassistant.count_labels``;
- ``binary_sensor`` <label> detected (device class occupancy): ON while the latest detections include
  the label, for the same labels as the counts.
  Latency, label counts and "detected" read the detections: a camera with ``publish.detections: off``
  has none of them;
- ``image`` snapshot: the camera's snapshot topic (annotated JPEGs, on request or on detection), as HA's
  MQTT image platform takes them (``image_topic``, ``content_type`` image/jpeg);
- per zone (agent.events): ``binary_sensor`` occupancy (device class occupancy) and a ``sensor`` count
  per label (the zone's ``labels``, else the camera's ``classes``, else ``count_labels``), from the
  zone's retained state, and the sensors of the zone rules on for the zone (pipelines.rules: each
  declares its ``StateEntity``s, e.g. loitering); per line: ``sensor`` in and out (crossings,
  total_increasing) from the line's retained state. These topics change only when something happens, so
  they have no ``expire_after``.

Every entity is unavailable while the status topic says ``offline`` (graceful stop or the broker's last
will after a crash), available for any other state (online, degraded, rebuilding: the agent runs).
Validation rules are HA's, see tests/test_discovery.py; the value templates are in
agent.homeassistant.templates.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.config import AgentConfig
from agent.homeassistant.templates import (
    AVAILABILITY_TEMPLATE,
    FPS_TEMPLATE,
    LATENCY_TEMPLATE,
    OCCUPANCY_TEMPLATE,
    STREAMING_ATTRIBUTES_TEMPLATE,
    STREAMING_TEMPLATE,
    count_template,
    detected_template,
    line_template,
    state_field_template,
    zone_count_template,
)
from agent.mqtt.topics import Topics
from pipelines.rules import StateEntity, zone_params, zone_rules

# HA's discovery topic matcher allows only these in node_id and object_id (mqtt/discovery.py).
_TOPIC_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
# HA entity ids are lower-case letters, digits and single underscores (core.py VALID_ENTITY_ID).
_ENTITY_UNSAFE = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class _Entity:
    component: str
    camera: str
    # streaming | fps | snapshot | latency | count | detected | zone_occupancy | zone_count | line_in/_out
    kind: str
    label: str | None
    object_id: str
    region: str | None = None  # zone or line name


def node_id(cfg: AgentConfig) -> str:
    """The discovery node id: MQTT prefix + device id, reduced to the characters HA accepts.

    Two agents whose prefix/device id differ only in characters replaced here ('.', '/') would share it;
    device ids are host names, where that does not happen in practice.
    """
    return _TOPIC_UNSAFE.sub("_", f"{cfg.mqtt.prefix}_{cfg.device_id}")


def _entity_slug(text: str) -> str:
    return _ENTITY_UNSAFE.sub("_", text.lower()).strip("_")


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:6]


def _labels(cfg: AgentConfig, classes: list[str] | None) -> list[str]:
    # No `classes` means the camera reports every class; count the configured defaults then.
    return list(dict.fromkeys(classes or cfg.homeassistant.count_labels))


def _plan(cfg: AgentConfig) -> list[_Entity]:
    """The entities of ``cfg`` with unique object ids (empty when discovery is disabled)."""
    if not cfg.homeassistant.enabled:
        return []
    wanted: list[tuple[str, str, str, str | None, str, str | None]] = []
    for camera, cam in cfg.cameras.items():
        if not cam.enabled:
            continue
        cam_part = _TOPIC_UNSAFE.sub("_", camera)
        wanted += [
            ("binary_sensor", camera, "streaming", None, f"{cam_part}_streaming", None),
            ("sensor", camera, "fps", None, f"{cam_part}_fps", None),
            ("image", camera, "snapshot", None, f"{cam_part}_snapshot", None),
        ]
        if cam.publish.detections != "off":
            wanted.append(("sensor", camera, "latency", None, f"{cam_part}_latency", None))
            for label in _labels(cfg, cam.classes):
                label_part = _TOPIC_UNSAFE.sub("_", label)
                wanted.append(("sensor", camera, "count", label, f"{cam_part}_{label_part}_count", None))
                wanted.append(
                    ("binary_sensor", camera, "detected", label, f"{cam_part}_{label_part}_detected", None)
                )
        if not cam.tracking.enabled:
            continue
        for zone, zc in cam.zones.items():
            zone_part = f"{cam_part}_zone_{_TOPIC_UNSAFE.sub('_', zone)}"
            wanted.append(("binary_sensor", camera, "zone_occupancy", None, f"{zone_part}_occupancy", zone))
            for label in _labels(cfg, zc.labels or cam.classes):
                label_part = _TOPIC_UNSAFE.sub("_", label)
                wanted.append(
                    ("sensor", camera, "zone_count", label, f"{zone_part}_{label_part}_count", zone)
                )
            on = dict(zone_params(zc))
            for rule in zone_rules():
                if rule.key in on:
                    wanted += [
                        ("sensor", camera, f"zone_{e.suffix}", None, f"{zone_part}_{e.suffix}", zone)
                        for e in rule.entities
                    ]
        for line in cam.lines:
            line_part = f"{cam_part}_line_{_TOPIC_UNSAFE.sub('_', line)}"
            wanted.append(("sensor", camera, "line_in", None, f"{line_part}_in", line))
            wanted.append(("sensor", camera, "line_out", None, f"{line_part}_out", line))
    # Replacing characters can make two names meet ("a.b" and "a_b" cameras, "a"+"b_c" vs "a_b"+"c");
    # those get a hash of what they stand for. Compared as HA entity ids (lower case), which are the
    # stricter of the two: the default entity ids stay distinct as well as the topics.
    seen: dict[str, int] = {}
    for *_, object_id, _region in wanted:
        key = _entity_slug(object_id)
        seen[key] = seen.get(key, 0) + 1
    out = []
    for component, camera, kind, label, object_id, region in wanted:
        if seen[_entity_slug(object_id)] > 1:
            object_id = f"{object_id}_{_short_hash(camera, kind, label or '', region or '')}"
        out.append(_Entity(component, camera, kind, label, object_id, region))
    return out


def _config_topic(cfg: AgentConfig, entity: _Entity) -> str:
    return f"{cfg.homeassistant.discovery_prefix}/{entity.component}/{node_id(cfg)}/{entity.object_id}/config"


def config_topics(cfg: AgentConfig) -> list[str]:
    """Every discovery config topic ``cfg`` publishes (none when discovery is disabled)."""
    return [_config_topic(cfg, e) for e in _plan(cfg)]


def _expire_after(cfg: AgentConfig, entity: _Entity) -> int | None:
    """Seconds without a message after which HA shows the entity unavailable.

    Availability already covers a dead agent; this covers a live one whose data stopped (a hung
    pipeline, a camera that delivers nothing). The camera state is republished every telemetry
    interval, so three intervals; detections come once per frame, so ten frame periods where `fps`
    limits the camera. Never under 30 s, to ride out a broker reconnect without flapping.
    """
    if entity.kind in ("streaming", "fps"):
        return max(30, math.ceil(3 * cfg.telemetry.interval_s))
    if entity.region is not None or entity.kind == "snapshot":
        return None  # retained, published on change: quiet for hours is normal; an image has no expiry
    fps = cfg.cameras[entity.camera].fps
    return max(30, math.ceil(10 / fps)) if fps else 30


def _payload(cfg: AgentConfig, topics: Topics, version: str, node: str, entity: _Entity) -> dict[str, Any]:
    """The discovery config of `entity`: what every entity has, then what its kind adds."""
    body: dict[str, Any] = {
        "unique_id": f"{node}_{entity.object_id}",
        # HA >= 2025.10 takes the suggested entity id from default_entity_id (object_id is deprecated
        # there and ignored from 2026.4); older versions drop the unknown key and derive the same id
        # from device name + entity name.
        "default_entity_id": f"{entity.component}.{_entity_slug(f'{node}_{entity.object_id}')}",
        "qos": 1,
        "availability": [
            {
                "topic": topics.status,
                "value_template": AVAILABILITY_TEMPLATE,
                "payload_available": "online",
                "payload_not_available": "offline",
            }
        ],
        # One availability topic: availability_mode (latest/all/any) makes no difference, left default.
        "device": {
            "identifiers": [node],
            "name": f"edge-agent {cfg.device_id}",
            "manufacturer": "edge-agent",
            "model": "edge-agent",
            "sw_version": version,
        },
        "origin": {"name": "edge-agent", "sw_version": version},
    }
    expire = _expire_after(cfg, entity)
    if expire is not None:
        body["expire_after"] = expire
    if entity.kind in ("streaming", "fps", "latency", "snapshot"):
        fields = _camera_fields(topics, entity)
    elif entity.kind in ("count", "detected"):
        fields = _detection_fields(topics, entity)
    else:
        fields = _region_fields(topics, entity)
    return body | fields | {"name": _shown(cfg, entity, fields["name"])}


def _shown(cfg: AgentConfig, entity: _Entity, name: str) -> str:
    """`name` (it starts with the camera's id, and the zone's or line's) with their display `name`s where
    they have one: HA shows these; the ids stay in the topics and the unique ids."""
    cam = cfg.cameras[entity.camera]
    ids, shown = entity.camera, cam.name or entity.camera
    if entity.region is not None:
        regions = cam.lines if entity.kind.startswith("line_") else cam.zones
        region = regions.get(entity.region)
        ids += f" {entity.region}"
        shown += f" {(region.name if region is not None else None) or entity.region}"
    return shown + name.removeprefix(ids)


def _camera_fields(topics: Topics, entity: _Entity) -> dict[str, Any]:
    """The camera's own entities: streaming, fps, latency, snapshot."""
    cam = entity.camera
    if entity.kind == "streaming":
        return {
            "name": f"{cam} streaming",
            "state_topic": topics.camera_state(cam),
            "value_template": STREAMING_TEMPLATE,
            "payload_on": "ON",
            "payload_off": "OFF",
            "device_class": "connectivity",
            "entity_category": "diagnostic",
            "json_attributes_topic": topics.camera_state(cam),
            "json_attributes_template": STREAMING_ATTRIBUTES_TEMPLATE,
        }
    if entity.kind == "fps":
        return {
            "name": f"{cam} fps",
            "state_topic": topics.camera_state(cam),
            "value_template": FPS_TEMPLATE,
            "unit_of_measurement": "fps",
            "state_class": "measurement",
            "suggested_display_precision": 1,
            "entity_category": "diagnostic",
        }
    if entity.kind == "latency":
        return {
            "name": f"{cam} latency",
            "state_topic": topics.detections(cam),
            "value_template": LATENCY_TEMPLATE,
            "device_class": "duration",
            "unit_of_measurement": "ms",
            "state_class": "measurement",
            "suggested_display_precision": 0,
            "entity_category": "diagnostic",
            # One state per frame per camera would flood HA's recorder: opt-in.
            "enabled_by_default": False,
        }
    # snapshot: HA's MQTT image platform; the payload is the JPEG itself (no state_topic, no template).
    return {"name": f"{cam} snapshot", "image_topic": topics.snapshot(cam), "content_type": "image/jpeg"}


def _detection_fields(topics: Topics, entity: _Entity) -> dict[str, Any]:
    """Per label: how many are seen (count), whether any is (detected)."""
    cam, label = entity.camera, entity.label or ""  # always set for these kinds
    if entity.kind == "count":
        return {
            "name": f"{cam} {label} count",
            "state_topic": topics.detections(cam),
            "value_template": count_template(label),
            "unit_of_measurement": "objects",
            "state_class": "measurement",
        }
    return {
        "name": f"{cam} {label} detected",
        "state_topic": topics.detections(cam),
        "value_template": detected_template(label),
        "payload_on": "ON",
        "payload_off": "OFF",
        "device_class": "occupancy",
    }


def _region_fields(topics: Topics, entity: _Entity) -> dict[str, Any]:
    """Zones (occupancy, count per label, the zone rules' sensors) and lines (crossings each way)."""
    cam = entity.camera
    ruled = _rule_entities().get(entity.kind)
    if ruled is not None:
        zone = entity.region or ""
        return {
            "name": f"{cam} {zone} {ruled.name}",
            "state_topic": topics.zone(cam, zone),
            "value_template": state_field_template(ruled.path),
            **({"unit_of_measurement": ruled.unit} if ruled.unit else {}),
            **({"state_class": ruled.state_class} if ruled.state_class else {}),
        }
    if entity.kind == "zone_occupancy":
        zone = entity.region or ""
        return {
            "name": f"{cam} {zone} occupancy",
            "state_topic": topics.zone(cam, zone),
            "value_template": OCCUPANCY_TEMPLATE,
            "payload_on": "ON",
            "payload_off": "OFF",
            "device_class": "occupancy",
        }
    if entity.kind == "zone_count":
        zone, label = entity.region or "", entity.label or ""
        return {
            "name": f"{cam} {zone} {label} count",
            "state_topic": topics.zone(cam, zone),
            "value_template": zone_count_template(label),
            "unit_of_measurement": "objects",
            "state_class": "measurement",
        }
    line, direction = entity.region or "", entity.kind.removeprefix("line_")  # line_in / line_out
    return {
        "name": f"{cam} {line} {direction}",
        "state_topic": topics.line(cam, line),
        "value_template": line_template(direction),
        "unit_of_measurement": "crossings",
        "state_class": "total_increasing",
    }


def _rule_entities() -> dict[str, StateEntity]:
    """The zone rules' sensors by entity kind (``zone_{suffix}``)."""
    return {f"zone_{e.suffix}": e for rule in zone_rules() for e in rule.entities}


def discovery_messages(cfg: AgentConfig, topics: Topics, version: str) -> dict[str, bytes]:
    """Retained discovery configs ``{config topic: JSON}`` for ``cfg`` ({} when disabled).

    ``topics`` must be the daemon's (``Topics(cfg.mqtt.prefix, cfg.device_id)``): the state, detections
    and status topics the entities read. Publish each retained, QoS 1 (``kind="state"``).
    """
    node = node_id(cfg)
    return {
        _config_topic(cfg, e): json.dumps(
            _payload(cfg, topics, version, node, e), separators=(",", ":"), ensure_ascii=False
        ).encode()
        for e in _plan(cfg)
    }


def node_filter(cfg: AgentConfig) -> str:
    """Subscription filter matching every discovery config of this agent's node, for ``stale_topics``."""
    return f"{cfg.homeassistant.discovery_prefix}/+/{node_id(cfg)}/+/config"


def stale_topics(cfg: AgentConfig, retained: Iterable[str]) -> list[str]:
    """Of the config topics found retained under ``node_filter(cfg)``, those ``cfg`` does not publish.

    For start-up: a camera removed while the agent was stopped has no old config to diff against, but
    its configs are still retained on the broker. Subscribe to ``node_filter(cfg)`` (retained messages
    arrive right after the SUBACK), collect the topics with a non-empty payload, clear these.
    """
    keep = set(config_topics(cfg))
    return sorted(t for t in retained if t not in keep)


def removed_topics(old: AgentConfig, new: AgentConfig) -> list[str]:
    """Config topics of ``old`` that ``new`` no longer publishes: clear each with an empty retained payload.

    Covers removed or disabled cameras, changed classes/count labels, discovery disabled, and a changed
    discovery prefix, MQTT prefix or device id (the node id changes, so every old config goes).
    """
    keep = set(config_topics(new))
    return [t for t in config_topics(old) if t not in keep]
