"""Issue 36.1 on the real agent (subprocess) and mosquitto: a SIGHUP that changes one zone and removes
another while objects are inside them. Every enter has its leave across the reload (reason
``zone_changed`` / ``zone_removed``), the objects re-enter the changed zone by the normal rule, and their
``end`` still names the zone they entered."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_agent import AgentProcess, decoded, wait
from fixtures_mqtt import Broker, Subscriber
from test_events_e2e import BASE, events, write

pytestmark = pytest.mark.slow

WHOLE = [[0, 0], [1, 0], [1, 1], [0, 1]]  # every object is inside as soon as it is confirmed


def test_changed_and_removed_zones_give_their_leaves_on_sighup(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    config = write(tmp_path / "agent.yaml", port, {"all": {"polygon": WHOLE}, "gone": {"polygon": WHOLE}}, {})
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config)

    def occupied(m: list) -> bool:  # the last "all" event leaves somebody inside
        zone = [e for e in events(m) if e.get("zone") == "all"]
        return bool(zone) and zone[-1]["count"] > 0

    wait(sub, occupied, 60, agent, "an object inside zone all")
    smaller = [[0, 0], [1, 0], [1, 0.99], [0, 0.99]]
    write(config, port, {"all": {"polygon": smaller}}, {})
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub,
        lambda m: any(e["type"] == "zone_enter" and e["zone"] == "all" for e in events(m[mark:])),
        40,
        agent,
        "a re-enter of the changed zone",
    )
    after = events(msgs[mark:])
    changed = [e for e in after if e["type"] == "zone_leave" and e["zone"] == "all"]
    removed = [e for e in after if e["type"] == "zone_leave" and e["zone"] == "gone"]
    assert changed and {e["reason"] for e in changed[:1]} == {"zone_changed"}, after
    assert removed and {e["reason"] for e in removed} == {"zone_removed"}, after
    first_enter = next(i for i, e in enumerate(after) if e["type"] == "zone_enter")
    assert after.index(changed[0]) < first_enter  # the leave goes out before the new zone starts

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
