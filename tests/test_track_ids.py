"""Track ids never repeat in a run (docs/DESIGN.md): a camera removed and added again by a reload, or moved
to another shard, numbers its tracks above its earlier ids (the real agent over mosquitto); the epochs the
shard supervisor hands out (agent.shards.tracks.TrackEpochs); what a shard mirrors to its supervisor (every
event type of the rules) and the zone states a dead shard's are reset to (with its zone rules' fields)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber

from agent.config import parse_config
from agent.events.publisher import EVENT_TYPES
from agent.shards.link import MIRRORED, ShardLink
from agent.shards.protocol import TrackEvent
from agent.shards.tracks import ID_EPOCH, OpenTracks, TrackEpochs
from pipelines.rules import event_types

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
DEVICE = "ids"
BASE = f"edge-agent/{DEVICE}"


# ---- the supervisor's epochs -----------------------------------------------------------------------------
def test_first_starts_number_from_1_and_every_later_epoch_is_new() -> None:
    epochs = TrackEpochs()
    assert [epochs.start(0) for _ in range(3)] == [1, 1, 1]  # each shard's first start, as one process
    drawn: list[int] = []

    def draw() -> None:
        for i in range(200):
            drawn.append(epochs.start(1) if i % 2 else epochs.fresh())  # restarts and hand-overs

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(drawn)) == len(drawn) == 800  # never one epoch twice, from any thread
    assert all(first > ID_EPOCH and (first - 1) % ID_EPOCH == 0 for first in drawn)


# ---- what a shard mirrors, and what a dead shard's zones are reset to --------------------------------------
def test_a_shard_mirrors_every_event_type_of_the_rules() -> None:
    assert set(event_types()) <= MIRRORED and set(EVENT_TYPES) == MIRRORED
    assert {"zone_loiter", "line_cross"} <= MIRRORED
    ours, theirs = Pipe()
    link = ShardLink(0, theirs)
    body = {"schema": "edge-agent/event/1", "camera": "a", "type": "zone_loiter", "track_id": 3, "zone": "z"}
    link.mirror("edge-agent/d/cameras/a/events", json.dumps(body).encode(), False)
    assert ours.poll(5)
    assert ours.recv() == TrackEvent("a", body)


def loitering_config() -> Any:
    square = [[0, 0], [1, 0], [1, 1], [0, 1]]
    cam: dict[str, Any] = {"url": "rtsp://cam/a", "model": "m"}
    cam |= {"zones": {"door": {"polygon": square, "loiter_s": 5}, "yard": {"polygon": square}}}
    return parse_config({"models": {"m": {"onnx": "/m.onnx"}}, "cameras": {"a": cam}})


def test_a_dead_shards_zone_states_reset_with_the_fields_of_their_rules() -> None:
    t = OpenTracks()
    for name, ruled in (("door", {"loitering": {"count": 1, "total": 4}}), ("yard", {})):
        state = {"schema": "edge-agent/zone/1", "ts": 1.0, "camera": "a", "zone": name, "occupied": True}
        state |= {"count": 1, "counts": {"person": 1}, **ruled}
        t.region(f"p/d/cameras/a/zones/{name}", json.dumps(state).encode())
    _, states = t.close(now=5.0, cfg=loitering_config())
    got = {topic.rsplit("/", 1)[1]: json.loads(body) for topic, body in states}
    # As a fresh start publishes them: the loitering zone with its rule's fields at zero, the other without.
    assert got["door"]["loitering"] == {"count": 0, "total": 0}
    assert got["door"]["count"] == 0 and got["door"]["occupied"] is False
    assert "loitering" not in got["yard"] and got["yard"]["counts"] == {"person": 0}


# ---- the real agent ------------------------------------------------------------------------------------
def write(path: Path, port: int, cameras: dict[str, dict[str, Any]], shards: int = 1) -> None:
    cam = {
        "url": str(ASSETS / "bikes.mp4"),
        "model": "detector",
        "fps": 10,
        "publish": {"detections": "off"},
        "tracking": {"max_lost_s": 1.0},
    }
    cfg: dict[str, Any] = {
        "device_id": DEVICE,
        "engine_dir": str(path.parent / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {name: {**cam, **extra} for name, extra in cameras.items()},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 30},
    }
    if shards > 1:
        cfg["pipeline"] = {"shards": shards}
    path.write_text(yaml.safe_dump(cfg))


def new_ids(msgs: list[Message], camera: str = "a") -> list[int]:
    return [e["track_id"] for e in decoded(msgs, f"{BASE}/cameras/{camera}/events") if e["type"] == "new"]


def reload_to(
    sub: Subscriber, agent: AgentProcess, path: Path, port: int, cameras: dict[str, dict], shards: int
) -> int:
    """Write the cameras and SIGHUP; once the reload is applied (its status), where the messages after it
    start in `sub`."""
    write(path, port, cameras, shards)
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    status = f"{BASE}/status"

    def outcome(m: list[Message]) -> int | None:
        for i in range(mark, len(m)):
            topic, body, _ = m[i]
            if topic == status and body and "last_reload" in json.loads(body):
                assert json.loads(body)["last_reload"]["ok"] is True, body
                return i + 1
        return None

    msgs = wait(sub, lambda m: outcome(m) is not None, 60, agent, "the reload applied")
    applied = outcome(msgs)
    assert applied is not None
    return applied


@pytest.mark.slow
def test_a_camera_removed_and_added_again_by_sighup_numbers_above_its_earlier_ids(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port, path = mqtt_broker.port, tmp_path / "agent.yaml"
    sub = mqtt_subscribe(port, f"{BASE}/#")
    write(path, port, {"a": {}, "b": {}})
    agent = start_agent(path)
    wait(sub, lambda m: len(new_ids(m)) >= 2, 90, agent, "tracks on camera a")
    reload_to(sub, agent, path, port, {"b": {}}, 1)
    mark = reload_to(sub, agent, path, port, {"a": {}, "b": {}}, 1)
    msgs = wait(sub, lambda m: len(new_ids(m[mark:])) >= 2, 90, agent, "new tracks on camera a again")
    before, later = new_ids(msgs[:mark]), new_ids(msgs[mark:])
    assert min(later) > max(before), (later, before)
    rc, _ = agent.terminate(timeout=20)
    assert rc == 0, agent.text()[-3000:]


@pytest.mark.slow
def test_a_camera_moved_to_another_shard_repeats_none_of_its_ids(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port, path = mqtt_broker.port, tmp_path / "agent.yaml"
    sub = mqtt_subscribe(port, f"{BASE}/#")
    write(path, port, {"a": {"shard": 0}, "b": {"shard": 1}}, shards=2)
    agent = start_agent(path)
    wait(sub, lambda m: len(new_ids(m)) >= 2 and len(new_ids(m, "b")) >= 1, 120, agent, "tracks on a and b")
    mark = reload_to(sub, agent, path, port, {"a": {"shard": 1}, "b": {"shard": 1}}, 2)
    msgs = wait(sub, lambda m: len(new_ids(m[mark:])) >= 2, 90, agent, "new tracks on camera a in shard 1")
    before, later = new_ids(msgs[:mark]), new_ids(msgs[mark:])
    # Shard 1 had numbered camera b from 1: camera a comes with an epoch of its own, above all it had.
    assert min(later) > max(before), (later, before)
    rc, _ = agent.terminate(timeout=20)
    assert rc == 0, agent.text()[-3000:]
