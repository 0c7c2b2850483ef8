"""Home Assistant MQTT discovery (agent.homeassistant), checked against Home Assistant's own rules.

Home Assistant is not installed here; what it requires is encoded below, from its source
(home-assistant/core, paths under homeassistant/components/ unless noted):

- mqtt/discovery.py: HA subscribes to ``{prefix}/+/+/config`` and ``{prefix}/+/+/+/config`` and accepts a
  topic only if, after the prefix, it matches ``TOPIC_MATCHER``
  (``<component>/[<node_id>/]<object_id>/config``, node_id and object_id in ``[a-zA-Z0-9_-]``); the
  component must be in mqtt/const.py ``SUPPORTED_COMPONENTS``; the payload must be a JSON object; an
  empty payload removes the entity.
- mqtt/config.py ``MQTT_RO_SCHEMA``: ``state_topic`` required (a valid subscribe topic),
  ``value_template``, ``qos`` 0..2, ``encoding``.
- mqtt/schemas.py ``MQTT_ENTITY_COMMON_SCHEMA``: ``availability`` list of {topic (required),
  payload_available, payload_not_available, value_template}, ``availability_mode`` all/any/latest,
  ``device`` (``MQTT_ENTITY_DEVICE_INFO_SCHEMA``: at least one of identifiers/connections, string
  fields), ``origin`` (name required), enabled_by_default, entity_category, icon, json_attributes_topic,
  json_attributes_template, object_id, unique_id; mqtt/const.py ``CONF_DEFAULT_ENTITY_ID``
  (``default_entity_id``, HA >= 2025.10, which deprecates object_id for entity ids).
- mqtt/sensor.py and mqtt/binary_sensor.py: their ``DISCOVERY_SCHEMA`` keys (device_class,
  expire_after >= 0, force_update, name, state_class, unit_of_measurement, suggested_display_precision
  >= 0, options only for enum; payload_on/payload_off default ON/OFF, off_delay). These schemas are built
  with ``extra=vol.REMOVE_EXTRA``: HA silently drops unknown keys, so a misspelt key would never fail in
  HA. The tests therefore allow only known full key names (abbreviations fail too).
- mqtt/image.py (HA >= 2023.7): ``MQTT_BASE_SCHEMA`` (qos, encoding, group) plus content_type, name,
  exactly one of ``image_topic`` / ``url_topic`` (valid subscribe topics, ``validate_topic_required``),
  image_encoding (only b64), url_template; content_type not with url_topic; no state_topic, no
  value_template (the payload is the image itself), no expire_after.
- sensor/const.py ``DEVICE_CLASS_UNITS`` / ``DEVICE_CLASS_STATE_CLASSES``, binary_sensor/__init__.py
  ``BinarySensorDeviceClass``: the device classes, units and state classes used here.
- Value templates (helpers/template.py ``async_render_with_possible_json_value``, mqtt/models.py
  ``MqttValueTemplate``): rendered in a sandboxed Jinja2 environment with ``value`` (the payload text)
  and ``value_json`` (only when the payload parses as JSON), output stripped. A sensor with a unit or
  state class needs a number; ``None`` (mqtt/const.py ``PAYLOAD_NONE``) makes it unknown and an empty
  output is ignored; a binary sensor compares the output with payload_on/payload_off.
- mqtt/entity.py ``MqttAvailabilityMixin``: the availability template's output is compared with
  payload_available / payload_not_available, anything else leaves availability as it was, and an
  entity is unavailable until its first availability message. ``MQTT_ATTRIBUTES_BLOCKED`` names JSON
  attributes HA refuses ("state" among them).
- core.py ``VALID_ENTITY_ID`` (util/ in newer releases): the entity id format.
- helpers/entity.py ``EntityCategory``: config or diagnostic; sensor/binary_sensor entities refuse
  config (they cannot be configured).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import paho.mqtt.client as paho
import pytest
from fixtures_mqtt import Broker, Message, Subscriber
from jinja2.sandbox import ImmutableSandboxedEnvironment
from paho.mqtt.enums import CallbackAPIVersion

from agent.config import AgentConfig, ConfigError, parse_config
from agent.homeassistant.discovery import (
    config_topics,
    discovery_messages,
    node_filter,
    node_id,
    removed_topics,
    stale_topics,
)
from agent.homeassistant.templates import AVAILABILITY_TEMPLATE, count_template, detected_template
from agent.mqtt.topics import Topics, payload
from agent.results import detection_fields
from pipelines.frames import Detections, Frame
from pipelines.scheduler import Result

REPO = Path(__file__).resolve().parents[1]

# ---- Home Assistant's rules (see the module docstring for where each comes from) ----------------------
TOPIC_MATCHER = re.compile(
    r"(?P<component>\w+)/(?:(?P<node_id>[a-zA-Z0-9_-]+)/)?(?P<object_id>[a-zA-Z0-9_-]+)/config"
)
SUPPORTED = {"binary_sensor", "sensor", "image"}  # the three of SUPPORTED_COMPONENTS used here
VALID_ENTITY_ID = re.compile(r"^(?!.+__)(?!_)[\da-z_]+(?<!_)\.(?!_)[\da-z_]+(?<!_)$")
COMMON_KEYS = {
    "availability", "availability_mode", "availability_template", "availability_topic",
    "payload_available", "payload_not_available", "device", "origin", "enabled_by_default",
    "entity_category", "entity_picture", "icon", "json_attributes_topic", "json_attributes_template",
    "object_id", "default_entity_id", "unique_id", "name", "qos", "encoding", "state_topic",
    "value_template",
}  # fmt: skip
KEYS = {
    "sensor": COMMON_KEYS
    | {
        "device_class", "expire_after", "force_update", "last_reset_value_template", "options",
        "suggested_display_precision", "state_class", "unit_of_measurement",
    },
    "binary_sensor": COMMON_KEYS
    | {"device_class", "expire_after", "force_update", "off_delay", "payload_off", "payload_on"},
    "image": COMMON_KEYS - {"state_topic", "value_template"}
    | {"content_type", "group", "image_encoding", "image_topic", "url_template", "url_topic"},
}  # fmt: skip
DEVICE_KEYS = {
    "identifiers", "connections", "manufacturer", "model", "model_id", "name", "hw_version",
    "serial_number", "sw_version", "via_device", "suggested_area", "configuration_url",
}  # fmt: skip
ORIGIN_KEYS = {"name", "sw_version", "support_url"}
AVAILABILITY_KEYS = {"topic", "payload_available", "payload_not_available", "value_template"}
BINARY_SENSOR_DEVICE_CLASSES = {
    "battery", "battery_charging", "carbon_monoxide", "cold", "connectivity", "door", "garage_door",
    "gas", "heat", "light", "lock", "moisture", "motion", "moving", "occupancy", "opening", "plug",
    "power", "presence", "problem", "running", "safety", "smoke", "sound", "tamper", "update",
    "vibration", "window",
}  # fmt: skip
STATE_CLASSES = {"measurement", "measurement_angle", "total", "total_increasing"}
# Only the sensor device classes used here; a new one must bring HA's units/state classes for it.
SENSOR_DEVICE_CLASS_UNITS = {"duration": {"d", "h", "min", "s", "ms", "µs"}}
SENSOR_DEVICE_CLASS_STATE_CLASSES = {"duration": STATE_CLASSES - {"measurement_angle"}}
PAYLOAD_NONE = "None"


def valid_subscribe_topic(topic: Any) -> bool:
    if not isinstance(topic, str) or not topic or "\0" in topic or len(topic.encode()) > 65535:
        return False
    levels = topic.split("/")
    return all(("+" not in lv or lv == "+") and ("#" not in lv or lv == "#") for lv in levels) and (
        "#" not in levels[:-1]
    )


def check_home_assistant_config(component: str, body: Any) -> list[str]:
    """What Home Assistant would reject or silently drop in one discovery payload ([] when fine)."""
    if not isinstance(body, dict):
        return ["payload is not a JSON object"]
    errors = [f"unknown key {k!r}" for k in sorted(set(body) - KEYS[component])]
    if component == "image":
        sources = [k for k in ("image_topic", "url_topic") if k in body]
        if len(sources) != 1 or not valid_subscribe_topic(body[sources[0]]):
            errors.append("image: exactly one of image_topic / url_topic, a valid subscribe topic")
        if "content_type" in body and "url_topic" in body:
            errors.append("image: content_type can not be used together with url_topic")
        if body.get("image_encoding", "b64") != "b64":
            errors.append("image_encoding: only b64")
    elif not valid_subscribe_topic(body.get("state_topic")):
        errors.append("state_topic: required, a valid subscribe topic")
    for key in ("value_template", "json_attributes_template"):
        if key in body:
            try:
                ENV.parse(body[key])
            except jinja2.TemplateSyntaxError as exc:
                errors.append(f"{key}: {exc}")
    if "json_attributes_topic" in body and not valid_subscribe_topic(body["json_attributes_topic"]):
        errors.append("json_attributes_topic: invalid")
    if body.get("qos", 0) not in (0, 1, 2):
        errors.append("qos: 0, 1 or 2")
    if not isinstance(body.get("name"), str) or not body["name"]:
        errors.append("name: a non-empty string")
    if not isinstance(body.get("unique_id"), str) or not body["unique_id"]:
        errors.append("unique_id: a non-empty string")
    entity_id = body.get("default_entity_id")
    if not (isinstance(entity_id, str) and VALID_ENTITY_ID.match(entity_id)):
        errors.append(f"default_entity_id: not a valid entity id: {entity_id!r}")
    elif not entity_id.startswith(f"{component}."):
        errors.append(f"default_entity_id: {entity_id!r} is not in domain {component}")
    avail = body.get("availability")
    if not isinstance(avail, list) or not avail:
        errors.append("availability: a non-empty list (every retained entity must have one)")
    else:
        for a in avail:
            errors += [f"availability: unknown key {k!r}" for k in set(a) - AVAILABILITY_KEYS]
            if not valid_subscribe_topic(a.get("topic")):
                errors.append("availability.topic: required, a valid subscribe topic")
            if "value_template" in a:
                ENV.parse(a["value_template"])
    if body.get("availability_mode", "latest") not in ("all", "any", "latest"):
        errors.append("availability_mode: all, any or latest")
    device = body.get("device")
    if not isinstance(device, dict):
        errors.append("device: required here (entities are grouped under the agent's device)")
    else:
        errors += [f"device: unknown key {k!r}" for k in set(device) - DEVICE_KEYS]
        if not (device.get("identifiers") or device.get("connections")):
            errors.append("device: needs identifiers or connections")
        if not all(isinstance(i, str) for i in device.get("identifiers", [])):
            errors.append("device.identifiers: strings")
        if not all(isinstance(v, str) for k, v in device.items() if k not in ("identifiers", "connections")):
            errors.append("device: fields must be strings")
        if not device.get("name"):
            errors.append("device.name: HA wants it in every entity's device info")
    origin = body.get("origin", {"name": "-"})
    if not isinstance(origin.get("name"), str) or set(origin) - ORIGIN_KEYS:
        errors.append("origin: name required, known keys only")
    for key in ("expire_after", "suggested_display_precision", "off_delay"):
        if key in body and not (isinstance(body[key], int) and body[key] >= 0):
            errors.append(f"{key}: an integer >= 0")
    for key in ("enabled_by_default", "force_update"):
        if key in body and not isinstance(body[key], bool):
            errors.append(f"{key}: true or false")
    if body.get("entity_category", "diagnostic") != "diagnostic":
        errors.append("entity_category: read-only entities may only be diagnostic")
    dc = body.get("device_class")
    if component == "binary_sensor":
        if dc is not None and dc not in BINARY_SENSOR_DEVICE_CLASSES:
            errors.append(f"device_class: {dc!r} is not a binary sensor device class")
    else:
        sc, unit = body.get("state_class"), body.get("unit_of_measurement")
        if sc is not None and sc not in STATE_CLASSES:
            errors.append(f"state_class: {sc!r}")
        if dc is not None:
            if dc not in SENSOR_DEVICE_CLASS_UNITS:
                errors.append(f"device_class: {dc!r} has no rules in this test (add HA's)")
            elif unit not in SENSOR_DEVICE_CLASS_UNITS[dc]:
                errors.append(f"unit_of_measurement: {unit!r} is not a unit of {dc}")
            elif sc is not None and sc not in SENSOR_DEVICE_CLASS_STATE_CLASSES[dc]:
                errors.append(f"state_class: {sc!r} not allowed for {dc}")
        if "options" in body and dc != "enum":
            errors.append("options: only for device_class enum")
    return errors


# ---- rendering like Home Assistant ---------------------------------------------------------------
# HA renders in a sandboxed environment whose undefined values log and render empty; StrictUndefined
# for real payloads proves the templates read only fields the agent actually sends.
ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
LENIENT = ImmutableSandboxedEnvironment(undefined=jinja2.Undefined)


def render(template: str, body: bytes, env: jinja2.Environment = ENV) -> str:
    value = body.decode()
    variables: dict[str, Any] = {"value": value}
    with contextlib.suppress(ValueError):  # value_json only for JSON, as in HA
        variables["value_json"] = json.loads(value)
    return env.from_string(template).render(**variables).strip()


def numeric_state(out: str) -> float | None:
    """A sensor with a unit/state class: "None" is unknown, anything else must be a finite number."""
    if out == PAYLOAD_NONE:
        return None
    value = float(out)  # HA refuses a non-numeric state for such a sensor
    assert math.isfinite(value)
    return value


def available(config: dict[str, Any], retained: dict[str, bytes]) -> bool:
    """An entity's availability as HA derives it from the retained messages of its availability topics."""
    result = False  # HA: unavailable until the first availability message
    for a in config["availability"]:
        body = retained.get(a["topic"])
        if body is None:
            continue
        out = render(a["value_template"], body, LENIENT) if "value_template" in a else body.decode()
        if out == a.get("payload_available", "online"):
            result = True
        elif out == a.get("payload_not_available", "offline"):
            result = False
    return result


# ---- configs and payloads like the daemon's -------------------------------------------------------
def make_cfg(cameras: dict[str, dict[str, Any]] | None = None, **top: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "device_id": "yard-01",
        "models": {"detector": {"onnx": "/models/detector.onnx"}},
        "cameras": {
            "gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector", "fps": 5},
            "street": {"url": "rtsp://10.0.0.22/s", "model": "detector", "classes": ["person", "bus"]},
        }
        if cameras is None
        else cameras,
        "homeassistant": {"enabled": True},
    }
    data.update(top)
    return parse_config(data)


def messages(cfg: AgentConfig, version: str = "0.1.0") -> dict[str, dict[str, Any]]:
    raw = discovery_messages(cfg, Topics(cfg.mqtt.prefix, cfg.device_id), version)
    return {topic: json.loads(body) for topic, body in raw.items()}


def entity(msgs: dict[str, dict[str, Any]], object_id: str) -> dict[str, Any]:
    (config,) = [b for t, b in msgs.items() if t.split("/")[-2] == object_id]
    return config


def camera_state(state: str = "streaming", last_error: str | None = None) -> bytes:
    # Fields as the daemon publishes them (agent.runtime.reports.camera_state_payload).
    return payload(
        "camera-state", state=state, fps_in=25.02, fps_out=24.87, reconnects=2, last_error=last_error
    )


def status(state: str) -> bytes:
    fields = {"version": "0.1.0", "started_at": 1.0, "cameras_up": 1, "cameras_total": 2}
    return payload("status", state=state, **fields)


LABELS = ["person", "bicycle", "car", "bus", "traffic light"]


def detections(class_ids: list[int], camera: str = "gate") -> bytes:
    """A detections payload built by the daemon's own code path (results.detection_fields)."""
    t0 = time.monotonic()
    stamps = {"captured": t0, "dequeued": t0 + 0.004, "preprocessed": t0 + 0.006, "inferred": t0 + 0.031}
    stamps |= {"postprocessed": t0 + 0.0334, "published": t0 + 0.0347}
    frame = Frame(camera, 7, np.zeros((72, 128, 3), np.uint8), time.time(), stamps)
    n = len(class_ids)
    boxes = np.tile(np.array([[1.0, 2.0, 30.0, 40.0]], np.float32), (n, 1))
    dets = Detections(boxes, np.full(n, 0.8, np.float32), np.array(class_ids, np.int32))
    result = Result(frame, dets, "detector", "onnxruntime", "fp32", 1)
    return payload("detections", **detection_fields(result, LABELS))


# ---- unit tests -------------------------------------------------------------------------------------
def test_disabled_by_default() -> None:
    cfg = make_cfg(homeassistant={})
    assert cfg.homeassistant.enabled is False
    assert cfg.homeassistant.discovery_prefix == "homeassistant"
    assert cfg.homeassistant.count_labels == ["person", "car"]
    assert discovery_messages(cfg, Topics(cfg.mqtt.prefix, cfg.device_id), "0.1.0") == {}


def test_entities_per_camera() -> None:
    msgs = messages(make_cfg())
    object_ids = sorted(t.split("/")[-2] for t in msgs)
    # gate has no classes: the default count labels; street counts its own classes; each counted label
    # also has its "detected" binary sensor.
    kinds = ("streaming", "fps", "snapshot", "latency")
    labels = {"gate": ["person", "car"], "street": ["person", "bus"]}
    assert object_ids == sorted(
        [f"{cam}_{kind}" for cam in ("gate", "street") for kind in kinds]
        + [
            f"{cam}_{label}_{what}"
            for cam, ls in labels.items()
            for label in ls
            for what in ("count", "detected")
        ]
    )
    assert {t.split("/")[1] for t in msgs} == {"sensor", "binary_sensor", "image"}
    cfg = make_cfg(
        {
            "gate": {"url": "rtsp://a", "model": "detector"},
            "attic": {"url": "rtsp://b", "model": "detector", "enabled": False},
        },
        homeassistant={"enabled": True, "count_labels": ["dog", "dog", "cat"]},
    )
    object_ids = sorted(t.split("/")[-2] for t in messages(cfg))
    assert object_ids == sorted(
        [f"gate_{kind}" for kind in kinds]
        + ["gate_dog_count", "gate_cat_count", "gate_dog_detected", "gate_cat_detected"]
    )


def test_every_config_is_what_home_assistant_accepts() -> None:
    for cfg in (
        make_cfg(),
        # multi-level MQTT prefix, a device id and camera name with dots, a label with a space
        make_cfg(
            {"cam.front": {"url": "rtsp://a", "model": "detector", "classes": ["traffic light"]}},
            device_id="nvr.local",
            mqtt={"prefix": "site/edge-agent"},
            homeassistant={"enabled": True, "discovery_prefix": "ha/discovery"},
        ),
    ):
        msgs = messages(cfg)
        assert msgs
        prefix = cfg.homeassistant.discovery_prefix
        for topic, body in msgs.items():
            assert topic.startswith(f"{prefix}/")
            match = TOPIC_MATCHER.fullmatch(topic[len(prefix) + 1 :])
            assert match is not None, topic
            assert match["component"] in SUPPORTED
            assert match["node_id"] == node_id(cfg)
            # Exactly 3 levels after the prefix: caught by HA's "{prefix}/+/+/+/config" subscription.
            assert len(topic[len(prefix) + 1 :].split("/")) == 4
            assert check_home_assistant_config(match["component"], body) == [], (topic, body)


def test_node_id_and_names() -> None:
    assert node_id(make_cfg()) == "edge-agent_yard-01"
    cfg = make_cfg(device_id="nvr.local", mqtt={"prefix": "site/edge-agent"})
    assert node_id(cfg) == "site_edge-agent_nvr_local"
    gate = entity(messages(make_cfg()), "gate_person_count")
    assert gate["unique_id"] == "edge-agent_yard-01_gate_person_count"
    assert gate["default_entity_id"] == "sensor.edge_agent_yard_01_gate_person_count"
    assert gate["name"] == "gate person count"
    assert gate["device"] == {
        "identifiers": ["edge-agent_yard-01"],
        "name": "edge-agent yard-01",
        "manufacturer": "edge-agent",
        "model": "edge-agent",
        "sw_version": "0.1.0",
    }


def test_ids_stay_unique_when_names_collide() -> None:
    cams = {
        name: {"url": f"rtsp://{i}", "model": "detector", "classes": classes}
        for i, (name, classes) in enumerate(
            [
                ("a.b", ["person"]),
                ("a_b", ["person"]),  # same as a.b once '.' is replaced
                ("Gate", ["person"]),
                ("gate", ["person"]),  # same entity id as Gate (HA ids are lower case)
                ("x", ["y z", "y_z", "b_c", "☕", "🚗"]),  # labels colliding after replacement
                ("x_b", ["c"]),  # x + b_c vs x_b + c
            ]
        )
    }
    cfg = make_cfg(cams)
    msgs = messages(cfg)
    assert len(msgs) == sum(4 + 2 * len(c["classes"]) for c in cams.values())
    for key in ("unique_id", "default_entity_id"):
        values = [b[key] for b in msgs.values()]
        assert len(set(values)) == len(values), key
    object_ids = [t.split("/")[-2] for t in msgs]
    assert len({o.lower() for o in object_ids}) == len(object_ids)
    for topic, body in msgs.items():
        assert check_home_assistant_config(topic.split("/")[1], body) == []
    # Stable: the same config gives the same ids, in any camera order.
    reordered = make_cfg(dict(reversed(list(cams.items()))))
    assert set(discovery_messages(reordered, Topics("edge-agent", "yard-01"), "0.1.0")) == set(msgs)
    # Two agents never share a unique id.
    other = messages(make_cfg(cams, device_id="yard-02"))
    assert not {b["unique_id"] for b in msgs.values()} & {b["unique_id"] for b in other.values()}


def test_entity_details() -> None:
    msgs = messages(make_cfg())
    topics = Topics("edge-agent", "yard-01")
    streaming = entity(msgs, "gate_streaming")
    assert streaming["device_class"] == "connectivity"
    assert streaming["state_topic"] == streaming["json_attributes_topic"] == topics.camera_state("gate")
    fps = entity(msgs, "gate_fps")
    assert (fps["state_topic"], fps["unit_of_measurement"], fps["state_class"]) == (
        topics.camera_state("gate"),
        "fps",
        "measurement",
    )
    latency = entity(msgs, "gate_latency")
    assert (latency["state_topic"], latency["device_class"], latency["unit_of_measurement"]) == (
        topics.detections("gate"),
        "duration",
        "ms",
    )
    assert latency["enabled_by_default"] is False  # once per frame: opt-in for the recorder's sake
    count = entity(msgs, "street_bus_count")
    assert (count["state_topic"], count["state_class"]) == (topics.detections("street"), "measurement")
    for body in msgs.values():
        assert body["availability"] == [
            {
                "topic": topics.status,
                "value_template": AVAILABILITY_TEMPLATE,
                "payload_available": "online",
                "payload_not_available": "offline",
            }
        ]
        assert body["origin"] == {"name": "edge-agent", "sw_version": "0.1.0"}


def test_expire_after() -> None:
    msgs = messages(make_cfg(telemetry={"interval_s": 20}))
    # camera state: republished every telemetry interval -> three intervals
    assert entity(msgs, "gate_streaming")["expire_after"] == 60
    assert entity(msgs, "street_fps")["expire_after"] == 60
    # detections: per frame; gate is limited to 5 fps -> 30 s floor; street has no limit -> 30 s
    assert entity(msgs, "gate_person_count")["expire_after"] == 30
    assert entity(msgs, "street_latency")["expire_after"] == 30
    slow = messages(make_cfg({"slow": {"url": "rtsp://s", "model": "detector", "fps": 0.1}}))
    assert entity(slow, "slow_car_count")["expire_after"] == 100  # ten frame periods


@pytest.mark.parametrize(
    ("state", "expected"),
    [("online", True), ("degraded", True), ("rebuilding", True), ("offline", False)],
)
def test_availability_follows_status(state: str, expected: bool) -> None:
    msgs = messages(make_cfg())
    retained = {Topics("edge-agent", "yard-01").status: status(state)}
    assert render(AVAILABILITY_TEMPLATE, status(state)) == ("online" if expected else "offline")
    assert all(available(b, retained) is expected for b in msgs.values())


def test_availability_after_a_crash() -> None:
    # The broker publishes the client's will: agent.mqtt sets state offline (plus a reason).
    lwt = payload("status", state="offline", reason="connection lost")
    msgs = messages(make_cfg())
    assert not any(available(b, {Topics("edge-agent", "yard-01").status: lwt}) for b in msgs.values())
    # No status seen yet: unavailable, as HA starts every MQTT entity.
    assert not any(available(b, {}) for b in msgs.values())


@pytest.mark.parametrize(
    ("state", "expected"),
    [("streaming", "ON"), ("starting", "OFF"), ("reconnecting", "OFF"), ("failed", "OFF")],
)
def test_streaming_template(state: str, expected: str) -> None:
    config = entity(messages(make_cfg()), "gate_streaming")
    err = None if state == "streaming" else "rtsp://viewer:***@10.0.0.21/stream1: timeout"
    body = camera_state(state, err)
    assert render(config["value_template"], body) == expected
    assert expected in (config["payload_on"], config["payload_off"])
    attributes = json.loads(render(config["json_attributes_template"], body))
    assert attributes == {"camera_state": state, "fps_in": 25.02, "reconnects": 2, "last_error": err}
    assert "state" not in attributes  # blocked by HA (MQTT_ATTRIBUTES_BLOCKED)


def test_fps_template() -> None:
    config = entity(messages(make_cfg()), "gate_fps")
    assert numeric_state(render(config["value_template"], camera_state())) == 24.87


def test_latency_template() -> None:
    config = entity(messages(make_cfg()), "gate_latency")
    body = detections([0, 2])
    total = json.loads(body)["latency_ms"]["total"]
    assert numeric_state(render(config["value_template"], body)) == round(total) == 35


def test_count_templates() -> None:
    msgs = messages(make_cfg())
    body = detections([0, 0, 2, 3, 4, 0, 9])  # 3 persons, 1 car, 1 bus, 1 traffic light, 1 unknown id
    assert numeric_state(render(entity(msgs, "gate_person_count")["value_template"], body)) == 3
    assert numeric_state(render(entity(msgs, "gate_car_count")["value_template"], body)) == 1
    assert numeric_state(render(entity(msgs, "street_bus_count")["value_template"], body)) == 1
    empty = detections([])
    assert render(entity(msgs, "gate_person_count")["value_template"], empty) == "0"


def test_detected_binary_sensors() -> None:
    msgs = messages(make_cfg())
    topics = Topics("edge-agent", "yard-01")
    person = entity(msgs, "gate_person_detected")
    assert person["name"] == "gate person detected"
    assert person["default_entity_id"] == "binary_sensor.edge_agent_yard_01_gate_person_detected"
    assert (person["state_topic"], person["device_class"]) == (topics.detections("gate"), "occupancy")
    assert (person["payload_on"], person["payload_off"]) == ("ON", "OFF")
    # The same source and expiry as the label's count sensor: the detections of the latest frame.
    count = entity(msgs, "gate_person_count")
    assert person["state_topic"] == count["state_topic"] and person["expire_after"] == count["expire_after"]
    assert check_home_assistant_config("binary_sensor", person) == []

    def state(object_id: str, body: bytes) -> str:
        return render(entity(msgs, object_id)["value_template"], body)

    frame = detections([0, 0, 2, 9])  # 2 persons, 1 car, 1 unknown id
    assert (state("gate_person_detected", frame), state("gate_car_detected", frame)) == ("ON", "ON")
    assert state("street_bus_detected", detections([3], camera="street")) == "ON"
    cars = detections([2])  # the person left: OFF with the next frame
    assert (state("gate_person_detected", cars), state("gate_car_detected", cars)) == ("OFF", "ON")
    empty = detections([])
    assert (state("gate_person_detected", empty), state("gate_car_detected", empty)) == ("OFF", "OFF")


@pytest.mark.parametrize("label", ["traffic light", 'it\'s "odd" }} {% x %}', "back\\slash", "čaj ☕ 🚗"])
def test_detected_template_takes_any_label(label: str) -> None:
    with_it = payload("detections", detections=[{"label": "car"}, {"label": label}])
    assert render(detected_template(label), with_it) == "ON"
    assert render(detected_template(label), payload("detections", detections=[{"label": "car"}])) == "OFF"


def test_snapshot_image_entity() -> None:
    msgs = messages(make_cfg())
    topics = Topics("edge-agent", "yard-01")
    image = entity(msgs, "gate_snapshot")
    topic = next(t for t, b in msgs.items() if b is image)
    assert topic == "homeassistant/image/edge-agent_yard-01/gate_snapshot/config"
    assert image["image_topic"] == topics.snapshot("gate") == "edge-agent/yard-01/cameras/gate/snapshot"
    assert image["content_type"] == "image/jpeg"
    assert image["name"] == "gate snapshot"
    assert image["default_entity_id"] == "image.edge_agent_yard_01_gate_snapshot"
    # The raw JPEG is the payload: no state topic, no template, no encoding; snapshots come on request or
    # on detection (at most every min_interval_s), so no expiry either.
    assert not {"state_topic", "value_template", "image_encoding", "url_topic", "expire_after"} & set(image)
    assert check_home_assistant_config("image", image) == []
    assert check_home_assistant_config("image", {**image, "url_topic": "x/y"})  # the checker does check
    # Every camera has one, whatever it publishes.
    off = messages(
        make_cfg(cameras={"c": {"url": "rtsp://a", "model": "detector", "publish": {"detections": "off"}}})
    )
    assert {t.split("/")[-2] for t in off} == {"c_streaming", "c_fps", "c_snapshot"}


@pytest.mark.parametrize("label", ["traffic light", 'it\'s "odd" }} {% x %}', "back\\slash", "čaj ☕ 🚗"])
def test_count_template_takes_any_label(label: str) -> None:
    body = payload("detections", detections=[{"label": label}, {"label": "car"}, {"label": label}])
    assert render(count_template(label), body) == "2"


@pytest.mark.parametrize("body", [b"", b"not json", b"{}", b"[]", b"42", b'{"state": 3}'])
def test_templates_tolerate_foreign_payloads(body: bytes) -> None:
    """Whatever lands on a topic (an empty retained delete, garbage), HA ignores it or shows unknown."""
    msgs = messages(make_cfg())
    for config in msgs.values():
        if "image_topic" in config:
            continue  # the image is the payload; HA shows whatever bytes arrive (nothing to render)
        out = render(config["value_template"], body, LENIENT)
        if "unit_of_measurement" in config or "state_class" in config:
            assert out == PAYLOAD_NONE, (config["name"], out)
        else:
            assert out in ("", config["payload_on"], config["payload_off"]), (config["name"], out)
        if "json_attributes_template" in config:
            assert isinstance(json.loads(render(config["json_attributes_template"], body, LENIENT)), dict)
        for a in config["availability"]:
            assert render(a["value_template"], body, LENIENT) in ("", "online", "offline")
    assert render(AVAILABILITY_TEMPLATE, b"", LENIENT) == ""  # an empty status leaves availability alone


def test_removed_topics() -> None:
    old = make_cfg()
    assert removed_topics(old, old) == []
    gate_only = make_cfg({"gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector", "fps": 5}})
    street = [t for t in config_topics(old) if "/street_" in t]
    assert len(street) == 8  # streaming, fps, snapshot, latency; person and bus: count and detected
    assert {t.split("/")[1] for t in street} == {"sensor", "binary_sensor", "image"}
    assert removed_topics(old, gate_only) == street
    disabled = make_cfg(
        {
            "gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector"},
            "street": {"url": "rtsp://b", "model": "detector", "enabled": False},
        }
    )
    assert removed_topics(old, disabled) == street
    reclassed = make_cfg(
        {
            "gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector"},
            "street": {"url": "rtsp://b", "model": "detector", "classes": ["person", "car"]},
        }
    )
    assert removed_topics(old, reclassed) == [
        t for t in street if t.endswith(("/street_bus_count/config", "/street_bus_detected/config"))
    ]
    # Discovery off, another discovery prefix, another node: every old config goes.
    for new in (
        make_cfg(homeassistant={"enabled": False}),
        make_cfg(homeassistant={"enabled": True, "discovery_prefix": "ha"}),
        make_cfg(device_id="yard-02"),
        make_cfg(mqtt={"prefix": "site"}),
    ):
        assert removed_topics(old, new) == config_topics(old)
    assert removed_topics(make_cfg(homeassistant={"enabled": False}), old) == []


def test_stale_topics() -> None:
    old, new = make_cfg(), make_cfg({"gate": {"url": "rtsp://a", "model": "detector", "fps": 5}})
    assert node_filter(new) == "homeassistant/+/edge-agent_yard-01/+/config"
    assert all(TOPIC_MATCHER.fullmatch(t.removeprefix("homeassistant/")) for t in config_topics(old))
    assert stale_topics(new, config_topics(old)) == sorted(removed_topics(old, new))
    assert stale_topics(new, config_topics(new)) == []
    assert stale_topics(make_cfg(homeassistant={"enabled": False}), config_topics(old)) == sorted(
        config_topics(old)
    )


def test_config_section() -> None:
    base = {"models": {"m": {"onnx": "/m.onnx"}}, "cameras": {}}
    with pytest.raises(ConfigError, match=r"homeassistant\.discovery_prefix: must be a topic prefix"):
        parse_config({**base, "homeassistant": {"discovery_prefix": "ha/#"}})
    with pytest.raises(ConfigError, match=r"homeassistant\.enable: unknown key"):
        parse_config({**base, "homeassistant": {"enable": True}})
    with pytest.raises(ConfigError, match=r"homeassistant\.count_labels: labels must be non-empty"):
        parse_config({**base, "homeassistant": {"count_labels": ["person", ""]}})


# ---- a real broker --------------------------------------------------------------------------------
def connect(port: int) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.connect("127.0.0.1", port, keepalive=10)
    client.loop_start()
    return client


def retained_now(
    make: Callable[..., Subscriber], port: int, n: int, topic_filter: str = "#"
) -> dict[str, bytes]:
    """What a client subscribing now (HA starting) receives: ``n`` retained messages, then nothing more."""
    sub = make(port, topic_filter)
    sub.wait_for(lambda m: len(m) >= n)
    time.sleep(0.3)
    msgs = sub.snapshot()
    assert len(msgs) == n, msgs
    assert all(retain for _, _, retain in msgs)
    return {topic: body for topic, body, _ in msgs}


def test_fresh_home_assistant_sees_configs_and_removals(
    mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    port = mqtt_broker.port
    old = make_cfg()
    topics = Topics(old.mqtt.prefix, old.device_id)
    sent = discovery_messages(old, topics, "0.1.0")
    publisher = connect(port)
    try:
        for topic, body in sent.items():
            publisher.publish(topic, body, qos=1, retain=True).wait_for_publish(5)
        # Home Assistant's own subscriptions see every config.
        assert retained_now(mqtt_subscribe, port, len(sent), "homeassistant/+/+/+/config") == sent
        running_ha = mqtt_subscribe(port, "homeassistant/#")
        assert running_ha.wait_for(lambda m: len(m) >= len(sent))

        # Camera "street" removed by a reload: the daemon clears its configs.
        new = make_cfg({"gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector", "fps": 5}})
        gone = removed_topics(old, new)
        assert len(gone) == 8 and any(t.startswith("homeassistant/image/") for t in gone)
        for topic in gone:
            publisher.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
        for topic, body in discovery_messages(new, topics, "0.1.0").items():  # republished after a reload
            publisher.publish(topic, body, qos=1, retain=True).wait_for_publish(5)

        # A running HA gets an empty config for each: it deletes those entities.
        def empties(m: list[Message]) -> list[str]:
            return [t for t, b, _ in m if b == b""]

        assert sorted(empties(running_ha.wait_for(lambda m: len(empties(m)) >= len(gone)))) == sorted(gone)
        # An HA started now never hears of "street".
        fresh = retained_now(mqtt_subscribe, port, len(sent) - len(gone), "homeassistant/#")
        assert fresh == discovery_messages(new, topics, "0.1.0")
        assert not [t for t in fresh if "street" in t]
    finally:
        publisher.disconnect()
        publisher.loop_stop()


def test_start_clears_configs_left_from_a_previous_run(
    mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    """A camera removed while the agent was stopped: at start, what the broker still holds is cleared."""
    port = mqtt_broker.port
    old = make_cfg()
    new = make_cfg({"gate": {"url": "rtsp://10.0.0.21/stream1", "model": "detector", "fps": 5}})
    topics = Topics(new.mqtt.prefix, new.device_id)
    publisher = connect(port)
    try:
        for topic, body in discovery_messages(old, topics, "0.1.0").items():  # the previous run
            publisher.publish(topic, body, qos=1, retain=True).wait_for_publish(5)
        # The next start: look at what is retained for this node, clear what no longer exists.
        found = retained_now(mqtt_subscribe, port, len(config_topics(old)), node_filter(new))
        stale = stale_topics(new, [t for t, body in found.items() if body])
        assert len(stale) == 8 and all("/street_" in t for t in stale)
        for topic in stale:
            publisher.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
        for topic, body in discovery_messages(new, topics, "0.1.0").items():
            publisher.publish(topic, body, qos=1, retain=True).wait_for_publish(5)
        fresh = retained_now(mqtt_subscribe, port, len(config_topics(new)), "homeassistant/#")
        assert fresh == discovery_messages(new, topics, "0.1.0")
    finally:
        publisher.disconnect()
        publisher.loop_stop()


AGENT = """
import json, sys, time
from agent.config import parse_config
from agent.homeassistant.discovery import discovery_messages
from agent.mqtt import MqttClient
from agent.mqtt.topics import Topics, payload

cfg = parse_config(json.loads(sys.argv[1]))
topics = Topics(cfg.mqtt.prefix, cfg.device_id)
mqtt = cfg.mqtt.model_copy(update={"host": "127.0.0.1", "port": int(sys.argv[2])})
client = MqttClient(mqtt, topics, birth=lambda: {"state": "online"})
client.start()
for topic, body in discovery_messages(cfg, topics, "0.1.0").items():
    client.publish(topic, body, qos=1, retain=True, kind="state")
for cam in cfg.cameras:
    fields = dict(state="streaming", fps_in=25.0, fps_out=24.9, reconnects=0, last_error=None)
    body = payload("camera-state", **fields)
    client.publish(topics.camera_state(cam), body, qos=1, retain=True, kind="state")
time.sleep(120)
"""


def test_entities_read_unavailable_after_kill_9(
    mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    """The daemon's MQTT client publishes the configs; kill -9; a fresh HA sees every entity unavailable."""
    port = mqtt_broker.port
    cfg = make_cfg()
    topics = Topics(cfg.mqtt.prefix, cfg.device_id)
    want = set(config_topics(cfg)) | {topics.status} | {topics.camera_state(c) for c in cfg.cameras}
    watcher = mqtt_subscribe(port, "#")
    data = cfg.model_dump(mode="json", include={"device_id", "models", "cameras", "homeassistant"})
    proc = subprocess.Popen([sys.executable, "-c", AGENT, json.dumps(data), str(port)], cwd=REPO)
    try:
        watcher.wait_for(lambda m: want <= {t for t, _, _ in m}, timeout=20)
        before = retained_now(mqtt_subscribe, port, len(want))
        assert json.loads(before[topics.status])["state"] == "online"
        configs = {t: json.loads(b) for t, b in before.items() if t.startswith("homeassistant/")}
        assert len(configs) == len(config_topics(cfg))
        assert all(available(c, before) for c in configs.values())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    watcher.wait_for(lambda m: any(t == topics.status and b"offline" in b for t, b, _ in m))
    after = retained_now(mqtt_subscribe, port, len(want))
    assert json.loads(after[topics.status])["state"] == "offline"  # the last will
    streaming = entity(configs, "gate_streaming")
    # The retained camera state still says streaming; availability is what makes HA show the truth.
    assert render(streaming["value_template"], after[streaming["state_topic"]]) == "ON"
    assert not any(available(c, after) for c in configs.values())


# ---- zones and lines (agent.events) ----
def zone_and_line_states(
    cfg: AgentConfig, camera: str, frames: list[list[tuple[float, int]]]
) -> dict[str, bytes]:
    """The retained zone/line payloads agent.events publishes after ``frames`` (each: objects as
    (bottom-centre x in pixels, class id)), latest per topic."""
    from agent.events import CameraEvents

    class Out:
        def __init__(self) -> None:
            self.topics = Topics(cfg.mqtt.prefix, cfg.device_id)
            self.retained: dict[str, bytes] = {}

        def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None:
            if state:
                self.retained[topic] = body

        def connected(self) -> bool:
            return True

    out = Out()
    events = CameraEvents(camera, cfg.cameras[camera], LABELS, "labels", out)
    events.publish_states()
    for i, objects in enumerate(frames):
        n = len(objects)
        boxes = np.asarray([(x - 10, 40, x + 10, 70) for x, _ in objects], np.float32).reshape(n, 4)
        dets = Detections(boxes, np.full(n, 0.9, np.float32), np.asarray([c for _, c in objects], np.int32))
        events(
            Frame(camera, i, np.zeros((72, 128, 3), np.uint8), 1000.0 + i / 25, {"captured": i / 25}), dets
        )
    return out.retained


def zones_cfg(**camera: Any) -> AgentConfig:
    gate = {
        "url": "rtsp://10.0.0.21/s",
        "model": "detector",
        "zones": {
            "drive.way": {
                "polygon": [[0.5, 0], [1, 0], [1, 1], [0.5, 1]],
                "labels": ["car", "traffic light"],
            },
            "porch": {"polygon": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]},
        },
        "lines": {"gate": {"points": [[0.5, 0], [0.5, 1]]}},
        **camera,
    }
    return make_cfg({"gate": gate})


def test_zone_and_line_entities_are_what_home_assistant_accepts() -> None:
    cfg = zones_cfg(classes=["person", "car", "traffic light"])
    msgs = messages(cfg)
    ids = {t.split("/")[-2] for t in msgs}
    assert {
        "gate_zone_drive_way_occupancy",
        "gate_zone_drive_way_car_count",
        "gate_zone_drive_way_traffic_light_count",
        "gate_zone_porch_occupancy",
        "gate_zone_porch_person_count",  # no labels of its own: the camera's classes
        "gate_zone_porch_car_count",
        "gate_line_gate_in",
        "gate_line_gate_out",
    } <= ids
    for topic, body in msgs.items():
        component = TOPIC_MATCHER.fullmatch(topic.removeprefix("homeassistant/"))
        assert component is not None
        assert check_home_assistant_config(component["component"], body) == [], (topic, body)
    topics = Topics("edge-agent", "yard-01")
    occupancy = entity(msgs, "gate_zone_drive_way_occupancy")
    assert occupancy["device_class"] == "occupancy" and occupancy["state_topic"] == topics.zone(
        "gate", "drive.way"
    )
    assert "expire_after" not in occupancy  # retained, on change: quiet for hours is normal
    line_in = entity(msgs, "gate_line_gate_in")
    assert line_in["state_class"] == "total_increasing" and line_in["state_topic"] == topics.line(
        "gate", "gate"
    )


def test_zone_and_line_templates_read_the_published_states() -> None:
    cfg = zones_cfg()
    msgs = messages(cfg)
    # A car drives from the left half across the line into the right half; a person stays left.
    frames = [[(20 + 4 * i, 2), (30, 0)] for i in range(25)]
    retained = zone_and_line_states(cfg, "gate", frames)
    topics = Topics("edge-agent", "yard-01")

    def state(object_id: str) -> str:
        config = entity(msgs, object_id)
        return render(config["value_template"], retained[config["state_topic"]])

    assert state("gate_zone_drive_way_occupancy") == "ON"
    assert state("gate_zone_drive_way_car_count") == "1"
    assert state("gate_zone_drive_way_traffic_light_count") == "0"
    assert state("gate_zone_porch_person_count") == "1" and state("gate_zone_porch_car_count") == "0"
    assert (state("gate_line_gate_in"), state("gate_line_gate_out")) == ("0", "1")
    assert topics.zone("gate", "porch") in retained
    for object_id in ("gate_zone_drive_way_car_count", "gate_line_gate_in"):
        template = entity(msgs, object_id)["value_template"]
        for foreign in (b"", b"not json", b"{}", b'{"counts": 3}'):
            assert render(template, foreign, LENIENT) == PAYLOAD_NONE


def test_publish_detections_off_drops_the_entities_that_read_detections() -> None:
    msgs = messages(zones_cfg(publish={"detections": "off"}))
    ids = {t.split("/")[-2] for t in msgs}
    assert "gate_streaming" in ids and "gate_zone_porch_occupancy" in ids
    assert "gate_snapshot" in ids  # snapshots do not come from the detections
    assert not any(
        i.endswith(("_latency", "_detected"))
        or (i.startswith("gate_") and "zone" not in i and i.endswith("_count"))
        for i in ids
    )
    old = zones_cfg()
    gone = removed_topics(old, zones_cfg(publish={"detections": "off"}))
    assert any(t.endswith("/gate_latency/config") for t in gone)
    assert any(t.endswith("/gate_person_detected/config") for t in gone)
    assert not removed_topics(old, old)
    assert {t for t in removed_topics(old, zones_cfg(zones={})) if "_zone_" in t}  # zones removed: deleted


def test_a_zone_rule_brings_its_sensor_loitering() -> None:
    """A zone with `loiter_s` gets the loitering rule's sensor (pipelines.rules: declared by the rule, not
    listed here), reading `loitering.count` of the zone's retained state; other zones get none."""
    porch = {"polygon": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]], "loiter_s": 0.5}
    cfg = zones_cfg(zones={**zones_cfg().cameras["gate"].model_dump()["zones"], "porch": porch})
    msgs = messages(cfg)
    ids = {t.split("/")[-2] for t in msgs}
    assert "gate_zone_porch_loitering" in ids and "gate_zone_drive_way_loitering" not in ids
    topic = next(t for t in msgs if t.split("/")[-2] == "gate_zone_porch_loitering")
    component = TOPIC_MATCHER.fullmatch(topic.removeprefix("homeassistant/"))
    assert component is not None and component["component"] == "sensor"
    loitering = msgs[topic]
    assert check_home_assistant_config("sensor", loitering) == []
    assert loitering["name"] == "gate porch loitering" and loitering["unit_of_measurement"] == "objects"
    assert loitering["state_class"] == "measurement" and "expire_after" not in loitering
    assert loitering["state_topic"] == Topics("edge-agent", "yard-01").zone("gate", "porch")
    # A person stands in the porch for a second (past loiter_s), a car drives through.
    retained = zone_and_line_states(cfg, "gate", [[(20 + 4 * i, 2), (30, 0)] for i in range(25)])
    assert render(loitering["value_template"], retained[loitering["state_topic"]]) == "1"
    before = zone_and_line_states(cfg, "gate", [[(30, 0)]] * 5)
    assert render(loitering["value_template"], before[loitering["state_topic"]]) == "0"
    for foreign in (b"", b"not json", b"{}", b'{"loitering": 3}', b'{"loitering": {"count": "x"}}'):
        assert render(loitering["value_template"], foreign, LENIENT) == PAYLOAD_NONE
    # loiter_s removed by a reload: the sensor's config is deleted.
    gone = removed_topics(cfg, zones_cfg())
    assert gone == [topic]
