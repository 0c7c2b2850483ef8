"""What a long run keeps stays bounded (issue 36.19): containers keyed by what the network sends, and what
a removed camera leaves behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from fixtures_agent import ASSETS, bundled_model, wait_until

from agent.mqtt.commands import CommandRouter, RateLimitedLog


def test_invented_action_names_do_not_grow_the_command_log_keys() -> None:
    router = CommandRouter()
    for i in range(500):  # any [A-Za-z0-9_-]{1,32} passes screen(): a flood of names nobody knows
        answer = router.handle(f"junk{i}", json.dumps({"request_id": i}).encode())
        assert answer is not None and not answer.ok
        router.handle(f"junk{i}", b"{")  # unreadable too
    assert len(router._log) <= 2, len(router._log)


def test_the_rate_limited_log_forgets_the_oldest_key_beyond_its_bound() -> None:
    rlog = RateLimitedLog(interval_s=10.0, keys=8)
    for i in range(100):
        rlog(10, f"k{i}", "message")
    assert len(rlog) == 8
    rlog(10, "k99", "again")  # the newest is still known: suppressed, not logged
    assert rlog._suppressed == {"k99": 1}


def test_subscriptions_never_acknowledged_do_not_pile_up() -> None:
    from agent.mqtt.refusals import Refusals

    refusals = Refusals("127.0.0.1:1883", "cmd/#")
    for mid in range(1, 1001):  # a broker that restarts before every SUBACK
        refusals.track_subscription(mid, ("edge-agent/x/cmd/+",))
    assert len(refusals._sub_filters) <= 64
    assert 1000 in refusals._sub_filters  # the newest is still answered


def test_deleted_retained_states_are_not_kept_for_every_reconnect() -> None:
    from agent.mqtt.outbox import Outbox

    outbox = Outbox(limit=10, status_topic="d/status")
    sent: list[tuple[str, bytes]] = []
    outbox.set_connected(True)
    for i in range(200):  # reloads renaming a zone: each old zone's state is deleted (empty, retained)
        outbox.keep(f"d/cameras/c/zones/z{i}", b'{"count": 1}', 1, True)
        outbox.keep(f"d/cameras/c/zones/z{i}", b"", 1, True)
    outbox.keep("d/cameras/c/zones/now", b'{"count": 2}', 1, True)
    assert outbox.states == 1
    # Offline, a deletion still goes out at the next connect.
    outbox.set_connected(False)
    outbox.keep("d/cameras/c/zones/now", b"", 1, True)
    outbox.flush(lambda topic, body, qos, retain: sent.append((topic, body)))
    assert sent == [("d/cameras/c/zones/now", b"")] and outbox.states == 0


def test_a_camera_removed_by_reload_leaves_no_last_frame(tmp_path: Path) -> None:
    from agent.cli.daemon import local_device
    from agent.config import load_config

    clip = str(ASSETS / "bikes.mp4")
    cams = {n: {"url": clip, "model": "detector", "fps": 5, "loop": True} for n in ("street", "side")}
    data: dict[str, Any] = {
        "device_id": "kept",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": cams,
        "mqtt": {"enabled": False},
        "console": False,
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    agent = local_device(load_config(path), console=False, config_path=path)
    try:
        agent.start()
        kept = agent.runtime.sinks._last_result
        assert wait_until(lambda: {"street", "side"} <= set(kept), 60)
        del data["cameras"]["side"]
        path.write_text(yaml.safe_dump(data))
        assert agent.reload()
        assert set(agent.runtime.cameras) == {"street"}
        assert "side" not in kept  # its last result held a whole frame for the life of the process
    finally:
        agent.stop()
