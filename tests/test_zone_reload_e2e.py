"""Issue 36.1 on the real agent (subprocess) and mosquitto: SIGHUPs that change one zone and remove another
while objects are inside them. Every enter has its leave across the reloads (reason ``zone_changed`` /
``zone_removed``, before the new zone starts), the objects re-enter the changed zone by the normal rule,
and their ``end`` still names the zone they entered."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures_agent import AgentProcess, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber
from test_events_e2e import BASE, events, write

pytestmark = pytest.mark.slow

WHOLE = [[0, 0], [1, 0], [1, 1], [0, 1]]  # every object is inside as soon as it is confirmed
SMALLER = [[0, 0], [1, 0], [1, 0.99], [0, 0.99]]
FIRST = {"all": {"polygon": WHOLE}, "gone": {"polygon": WHOLE}}


def test_changed_and_removed_zones_give_their_leaves_on_sighup(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    config = tmp_path / "agent.yaml"
    write(config, port, FIRST, {})
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config)

    def reload(zones: dict[str, Any]) -> list[Message]:
        """SIGHUP with ``zones``; the messages from the reload on, once its status is out."""
        write(config, port, zones, {})
        mark = len(sub.snapshot())
        before = reload_times(sub.snapshot())
        agent.proc.send_signal(signal.SIGHUP)
        msgs = wait(sub, lambda m: bool(reload_times(m) - before), 20, agent, "the reload's status")
        return msgs[mark:]

    def reload_with_leaves(zones: dict[str, Any], zone: str, reason: str) -> None:
        """Reload to ``zones`` while ``zone`` is occupied, until that reload gives ``zone`` leaves with
        ``reason``: the tracks may all end between the look and the reload (a clip's loop); then the zones
        go back to the first config and once more."""
        for attempt in range(4):
            if attempt:
                reload(FIRST)
            wait(sub, lambda m: occupied(m, zone), 60, agent, f"an object inside zone {zone}")
            left = [e for e in events(reload(zones)) if e["type"] == "zone_leave" and e["zone"] == zone]
            if any(e["reason"] == reason for e in left):
                return
        raise AssertionError(f"no {reason} leave of zone {zone} in 4 reloads: {events(sub.snapshot())}")

    # "all" changes (twice: a changed zone may change again), "gone" goes.
    mark = len(sub.snapshot())
    reload_with_leaves({"all": {"polygon": SMALLER}, "gone": {"polygon": WHOLE}}, "all", "zone_changed")
    reload_with_leaves({"all": {"polygon": WHOLE}}, "gone", "zone_removed")
    # The objects inside re-enter the changed zone by the normal rule, after their leave.
    msgs = wait(
        sub,
        lambda m: any(e["type"] == "zone_enter" and e["zone"] == "all" for e in after_leave(m[mark:])),
        40,
        agent,
        "a re-enter of the changed zone",
    )

    rc, _ = agent.terminate(timeout=10)
    assert rc == 0, agent.text()[-3000:]
    msgs = wait(
        sub, lambda m: any(s["state"] == "offline" for s in decoded(m, "/status")), 10, agent, "offline"
    )
    everything = events(msgs)
    for zone in ("all", "gone"):
        enters = [e["track_id"] for e in everything if e["type"] == "zone_enter" and e["zone"] == zone]
        leaves = [e["track_id"] for e in everything if e["type"] == "zone_leave" and e["zone"] == zone]
        assert sorted(enters) == sorted(leaves), (zone, everything)
    entered = {e["track_id"] for e in everything if e["type"] == "zone_enter" and e["zone"] == "all"}
    for end in (e for e in everything if e["type"] == "end" and e["track_id"] in entered):
        assert "all" in end["entered_zones"], end


def reload_times(msgs: list[Message]) -> set[float]:
    """When each reload the status reported so far happened (a status repeats its last one)."""
    return {s["last_reload"]["at"] for s in decoded(msgs, "/status") if s.get("last_reload")}


def occupied(msgs: list[Message], zone: str) -> bool:
    """The zone's last event leaves somebody inside."""
    mine = [e for e in events(msgs) if e.get("zone") == zone]
    return bool(mine) and mine[-1]["count"] > 0


def after_leave(msgs: list[Message]) -> list[dict]:
    """The events after the first reload leave of zone "all" in ``msgs``."""
    evs = events(msgs)
    first = next((i for i, e in enumerate(evs) if e.get("reason") in ("zone_changed",)), None)
    return [] if first is None else evs[first + 1 :]
