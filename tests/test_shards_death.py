"""A shard killed with SIGKILL on the real agent (subprocess) over mosquitto: the supervisor closes what the
dead shard left open (every `new` of its camera gets its `end`, every `zone_enter` its `zone_leave`, reason
"shard_died"; its zone state goes back to empty), and the restarted shard's track ids repeat none of the
earlier ones (docs/DESIGN.md: ids are never reused while the agent runs)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
DEVICE = "death"
BASE = f"edge-agent/{DEVICE}"
pytestmark = pytest.mark.slow


def write(path: Path, port: int) -> Path:
    right = {"polygon": [[0.4, 0], [1, 0], [1, 1], [0.4, 1]]}
    cam = {
        "url": str(ASSETS / "bikes.mp4"),
        "model": "detector",
        "fps": 10,
        "zones": {"right": right},
        "publish": {"detections": "off"},
        "tracking": {"max_lost_s": 2.0},
    }
    cfg = {
        "device_id": DEVICE,
        "engine_dir": str(path.parent / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"a": {**cam, "shard": 0}, "b": {**cam, "shard": 1}},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 1},
        # The restart waits long enough for the test to read what the supervisor left retained meanwhile.
        "pipeline": {"shards": 2, "restart": {"min_s": 6, "max_s": 6}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def events(msgs: list[Message], camera: str = "a") -> list[dict[str, Any]]:
    return decoded(msgs, f"{BASE}/cameras/{camera}/events")


def open_now(evs: list[dict[str, Any]]) -> tuple[set[int], set[tuple[int, str]]]:
    """The tracks with `new` and no `end`, and the (track, zone) entries without a leave."""
    tracks: set[int] = set()
    inside: set[tuple[int, str]] = set()
    for e in evs:
        if e["type"] == "new":
            tracks.add(e["track_id"])
        elif e["type"] == "end":
            tracks.discard(e["track_id"])
        elif e["type"] == "zone_enter":
            inside.add((e["track_id"], e["zone"]))
        elif e["type"] == "zone_leave":
            inside.discard((e["track_id"], e["zone"]))
    return tracks, inside


def retained_now(port: int, topic_filter: str) -> dict[str, Any]:
    """What a client subscribing now receives retained (non-empty JSON)."""
    sub = Subscriber(port, topic_filter)
    try:
        time.sleep(0.7)
        return {t: json.loads(p) for t, p, r in sub.snapshot() if r and p}
    finally:
        sub.close()


def shard_pid(msgs: list[Message], k: int) -> int | None:
    for tele in reversed(decoded(msgs, f"{BASE}/telemetry")):
        for row in tele.get("shards", []):
            if row["shard"] == k and row["state"] == "running" and row.get("process"):
                return int(row["pid"])
    return None


def test_a_killed_shards_tracks_end_its_zones_reset_and_ids_do_not_repeat(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(write(tmp_path / "agent.yaml", port))

    def busy(m: list[Message]) -> bool:  # camera a has a track open and one inside its zone
        tracks, inside = open_now(events(m))
        return bool(tracks) and bool(inside) and shard_pid(m, 0) is not None

    msgs = wait(sub, busy, 120, agent, "camera a with an open track and one inside its zone")
    pid = shard_pid(msgs, 0)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    mark = len(msgs)
    before_ids = {e["track_id"] for e in events(msgs)}
    # While the shard waits for its restart, its zone is empty (retained): not the dead shard's count.
    topic = f"{BASE}/cameras/a/state"
    down = wait(
        sub,
        lambda m: any(t == topic and p and json.loads(p)["state"] == "reconnecting" for t, p, _ in m[mark:]),
        30,
        agent,
        "camera a reconnecting",
    )
    zone_topic = f"{BASE}/cameras/a/zones/right"
    retained = retained_now(port, zone_topic)[zone_topic]
    assert retained["count"] == 0 and retained["occupied"] is False, retained
    assert "restarting in 6.0 s" in agent.text()  # the zone above was read before the restart
    assert not any(t == topic and p and json.loads(p)["state"] == "streaming" for t, p, _ in down[mark:])

    def back(m: list[Message]) -> int | None:
        """Where camera a streams again after its shard's death (the restarted shard's first word)."""
        topic, down = f"{BASE}/cameras/a/state", False
        for i in range(mark, len(m)):
            t, body, _ = m[i]
            if t == topic and body:
                state = json.loads(body)["state"]
                down = down or state == "reconnecting"
                if down and state == "streaming":
                    return i
        return None

    def restarted(m: list[Message]) -> bool:  # the restarted shard published a `new`
        i = back(m)
        return i is not None and any(e["type"] == "new" for e in events(m[i:]))

    msgs = wait(sub, restarted, 90, agent, "a new track on camera a after the restart")
    up = back(msgs)
    assert up is not None
    # Before the restarted shard's first word: everything the dead one had open is closed.
    tracks, inside = open_now(events(msgs[:up]))
    assert not tracks and not inside, (tracks, inside)
    closed = [e for e in events(msgs[mark:up]) if e.get("reason") == "shard_died"]
    assert {e["type"] for e in closed} == {"end", "zone_leave"}, closed
    for e in closed:
        assert e["schema"] == "edge-agent/event/1" and e["camera"] == "a" and e["label"]
        if e["type"] == "end":
            assert e["zones"] == [] and e["snapshot"] is False and e["duration_s"] >= 0
    # No track id of the restarted shard was used before the kill.
    later = {e["track_id"] for e in events(msgs[up:]) if e["type"] == "new"}
    assert later and not later & before_ids, (sorted(later), sorted(before_ids))
    # The other shard never noticed.
    assert not [e for e in events(msgs, "b") if e.get("reason") == "shard_died"]
    rc, _ = agent.terminate(timeout=20)
    assert rc == 0, agent.text()[-3000:]
    assert "Traceback" not in agent.text()
