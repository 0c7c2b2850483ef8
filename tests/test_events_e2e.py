"""Tracking, zones and lines from the real agent (subprocess) on mosquitto: events and retained states with
`publish.detections: off`, a SIGHUP that changes zones without restarting the camera, stale zone states
cleared at start, and every zone entry matched by a leave once the agent stops."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber, publish

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
BASE = "edge-agent/ev"
pytestmark = pytest.mark.slow


def write(path: Path, port: int, zones: dict[str, Any], lines: dict[str, Any]) -> Path:
    cfg = {
        "device_id": "ev",
        "engine_dir": str(path.parent / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {
            "street": {
                "url": str(ASSETS / "bikes.mp4"),
                "model": "detector",
                "fps": 10,
                "zones": zones,
                "lines": lines,
                "publish": {"detections": "off"},
                "tracking": {"max_lost_s": 1.0},
            }
        },
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 2},
        "homeassistant": {"enabled": True},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def events(msgs: list[Message]) -> list[dict[str, Any]]:
    return decoded(msgs, "/cameras/street/events")


def retained_now(port: int, topic_filter: str) -> dict[str, Any]:
    """What a client subscribing now receives retained (non-empty)."""
    import time

    sub = Subscriber(port, topic_filter)
    try:
        time.sleep(0.7)
        return {t: json.loads(p) for t, p, r in sub.snapshot() if r and p}
    finally:
        sub.close()


def test_events_zones_lines_reload_and_stop(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    # A zone state left by an earlier run, for a zone the config no longer has: cleared at start.
    publish(port, f"{BASE}/cameras/street/zones/old", b'{"occupied": true}', retain=True)
    right = {"polygon": [[0.5, 0], [1, 0], [1, 1], [0.5, 1]], "labels": ["person", "car"]}
    mid = {"points": [[0.5, 0], [0.5, 1]]}
    config = write(tmp_path / "agent.yaml", port, {"right": right}, {"mid": mid})
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config)

    msgs = wait(
        sub,
        lambda m: {"new", "end", "zone_enter", "zone_leave"} <= {e["type"] for e in events(m)},
        60,
        agent,
        "new, end, zone_enter and zone_leave events",
    )
    assert not decoded(msgs, "/cameras/street/detections")  # publish.detections: off
    for e in events(msgs):
        assert e["schema"] == "edge-agent/event/1" and e["camera"] == "street" and e["track_id"] >= 1
        assert (
            e["label"] in ("person", "car", "bicycle", "motorbike", "truck", "bus")
            or e["type"] != "zone_enter"
        )
    enter = next(e for e in events(msgs) if e["type"] == "zone_enter")
    assert enter["zone"] == "right" and enter["label"] in ("person", "car")
    # The stale state was deleted; the live zone and line have retained states.
    wait(
        sub,
        lambda m: any(t.endswith("/zones/old") and not p for t, p, _ in m),
        10,
        agent,
        "the stale zone state deleted",
    )
    states = retained_now(port, f"{BASE}/cameras/street/+/+")
    assert set(states) == {f"{BASE}/cameras/street/zones/right", f"{BASE}/cameras/street/lines/mid"}
    assert states[f"{BASE}/cameras/street/zones/right"]["schema"] == "edge-agent/zone/1"
    discovery = retained_now(port, "homeassistant/#")
    assert any(t.endswith("street_zone_right_occupancy/config") for t in discovery)
    assert not any(t.endswith("street_latency/config") for t in discovery)  # detections are off
    tele = wait(
        sub,
        lambda m: any("tracking" in t["cameras"]["street"] for t in decoded(m, "/telemetry")),
        10,
        agent,
        "telemetry with tracking",
    )
    tracking = [t for t in decoded(tele, "/telemetry") if "tracking" in t["cameras"]["street"]][-1]
    assert tracking["cameras"]["street"]["tracking"]["tracks_started"] >= 1

    # SIGHUP: "right" goes, "left" comes; the camera keeps streaming (no restart).
    reconnects = decoded(sub.snapshot(), "/cameras/street/state")[-1]["reconnects"]
    left = {"polygon": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}
    write(config, port, {"left": left}, {"mid": mid})
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub,
        lambda m: any(s.get("last_reload") for s in decoded(m[mark:], "/status")),
        20,
        agent,
        "the reload's status",
    )
    reload = [s for s in decoded(msgs[mark:], "/status") if s.get("last_reload")][-1]["last_reload"]
    assert reload["ok"] is True and reload["changes"] == "camera analytics: street", reload
    wait(
        sub,
        lambda m: (
            any(t.endswith("/zones/right") and not p for t, p, _ in m[mark:])
            and any(t.endswith("/zones/left") and p for t, p, _ in m[mark:])
        ),
        10,
        agent,
        "right deleted, left published",
    )
    states = retained_now(port, f"{BASE}/cameras/street/+/+")
    assert set(states) == {f"{BASE}/cameras/street/zones/left", f"{BASE}/cameras/street/lines/mid"}
    wait(
        sub, lambda m: any(e.get("zone") == "left" for e in events(m[mark:])), 40, agent, "a left zone event"
    )
    assert decoded(sub.snapshot(), "/cameras/street/state")[-1]["reconnects"] == reconnects

    # Stop: every track ends, every entry has its leave, and the zones are empty.
    rc, _ = agent.terminate(timeout=10)
    assert rc == 0, agent.text()[-3000:]
    msgs = wait(
        sub, lambda m: any(s["state"] == "offline" for s in decoded(m, "/status")), 10, agent, "offline"
    )
    all_events = events(msgs)
    # Also "right", removed by the reload: its tracks left it then (reason zone_removed; issue 36.1).
    for zone in ("left", "right"):
        enters = sum(1 for e in all_events if e["type"] == "zone_enter" and e["zone"] == zone)
        leaves = sum(1 for e in all_events if e["type"] == "zone_leave" and e["zone"] == zone)
        assert enters == leaves >= 1, (zone, all_events)
    assert (
        retained_now(port, f"{BASE}/cameras/street/zones/left")[f"{BASE}/cameras/street/zones/left"]["count"]
        == 0
    )
    new_ids = {e["track_id"] for e in all_events if e["type"] == "new"}
    end_ids = [e["track_id"] for e in all_events if e["type"] == "end"]
    assert sorted(end_ids) == sorted(new_ids)  # exactly one end per object, none without a new


def test_zone_loitering_on_the_real_agent(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    """`loiter_s` on a zone: `zone_loiter` events (at most one per stay), the zone's retained `loitering`
    counts and its Home Assistant sensor, from the agent on the bundled clip."""
    port = mqtt_broker.port
    right = {"polygon": [[0.5, 0], [1, 0], [1, 1], [0.5, 1]], "loiter_s": 0.5}
    plain = {"polygon": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}
    config = write(tmp_path / "agent.yaml", port, {"right": right, "left": plain}, {})
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config)
    msgs = wait(
        sub,
        lambda m: any(e["type"] == "zone_loiter" for e in events(m)),
        60,
        agent,
        "a zone_loiter event",
    )
    loiter = next(e for e in events(msgs) if e["type"] == "zone_loiter")
    enter = next(
        e
        for e in events(msgs)
        if e["type"] == "zone_enter" and e["track_id"] == loiter["track_id"] and e["zone"] == "right"
    )
    assert loiter["schema"] == "edge-agent/event/1" and loiter["zone"] == "right"
    assert loiter["dwell_s"] >= 0.5 and loiter["ts"] - enter["ts"] == pytest.approx(
        loiter["dwell_s"], abs=0.01
    )
    assert loiter["count"] >= 1 and loiter["loitering"]["count"] >= 1 and loiter["loitering"]["total"] >= 1
    states = retained_now(port, f"{BASE}/cameras/street/zones/+")
    assert "loitering" in states[f"{BASE}/cameras/street/zones/right"]
    assert "loitering" not in states[f"{BASE}/cameras/street/zones/left"]  # no loiter_s: as before
    discovery = retained_now(port, "homeassistant/#")
    assert any(t.endswith("street_zone_right_loitering/config") for t in discovery)
    assert not any(t.endswith("street_zone_left_loitering/config") for t in discovery)

    rc, _ = agent.terminate(timeout=10)
    assert rc == 0, agent.text()[-3000:]
    msgs = wait(
        sub, lambda m: any(s["state"] == "offline" for s in decoded(m, "/status")), 10, agent, "offline"
    )
    all_events = events(msgs)
    for tid in {e["track_id"] for e in all_events if e["type"] == "zone_loiter"}:
        # Once per stay: each zone_loiter between the track's enter and its leave, none twice in a stay.
        kinds = [e["type"] for e in all_events if e["track_id"] == tid and e.get("zone") == "right"]
        stays = " ".join(kinds).split("zone_leave")
        assert all(s.count("zone_loiter") <= 1 for s in stays) and kinds.count("zone_leave") == kinds.count(
            "zone_enter"
        ), kinds
    totals = sum(1 for e in all_events if e["type"] == "zone_loiter")
    final = retained_now(port, f"{BASE}/cameras/street/zones/right")[f"{BASE}/cameras/street/zones/right"]
    assert final["loitering"] == {"count": 0, "total": totals} and final["count"] == 0
