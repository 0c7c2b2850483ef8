"""Build claims on a real mosquitto (agent.fleet.claims): racing devices agree on one builder, a live builder
keeps its claim by renewing it, a killed one loses it by expiry, junk under the claim topics never wins."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_agent import REPO
from fixtures_mqtt import Broker, Subscriber, publish, retain

from agent.config.mqtt import MqttConfig
from agent.fleet.claim_record import ClaimsUnavailable, parse_claim
from agent.fleet.claims import BuildClaims

PREFIX = "edge-agent"
KEY = "trt10.3-orin-sm87-abc123"


def settings(port: int, **extra: object) -> MqttConfig:
    return MqttConfig(host="127.0.0.1", port=port, reconnect_min_s=0.2, reconnect_max_s=1.0, **extra)


@pytest.fixture
def make_claims(mqtt_broker: Broker) -> Iterator[type]:
    made: list[BuildClaims] = []

    def make(device: str, ttl_s: float = 30.0, settle_s: float = 0.5) -> BuildClaims:
        c = BuildClaims(
            settings(mqtt_broker.port), PREFIX, device, ttl_s=ttl_s, settle_s=settle_s, timeout_s=10
        )
        made.append(c)
        return c.open()

    yield make  # type: ignore[misc]
    for c in made:
        c.close()


def race(claimers: list[BuildClaims], key: str) -> dict[str, bool]:
    """Every claimer calls claim(key) at the same moment (one thread each)."""
    start, results = threading.Barrier(len(claimers)), {}

    def one(c: BuildClaims) -> None:
        start.wait()
        results[c.device] = c.claim(key)

    threads = [threading.Thread(target=one, args=(c,)) for c in claimers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def retained_claims(port: int, key: str) -> dict[str, dict]:
    """What a newcomer gets from the broker for `key`: device -> payload (releases leave nothing)."""
    sub = Subscriber(port, f"{PREFIX}/_fleet/#")
    try:
        # Retained copies are sent at SUBACK, before anything published after it: this marks their end.
        publish(port, f"{PREFIX}/_fleet/sentinel", b"end")
        got = sub.wait_for(lambda m: any(t.endswith("/sentinel") for t, _, _ in m))
        head = f"{PREFIX}/_fleet/builds/{key}/"
        return {t[len(head) :]: json.loads(p) for t, p, r in got if r and p and t.startswith(head)}
    finally:
        sub.close()


@pytest.mark.parametrize("n", [2, 3])
def test_racing_devices_agree_on_exactly_one_builder(make_claims: type, mqtt_broker: Broker, n: int) -> None:
    claimers = [make_claims(f"orin-{i:02d}") for i in range(n)]
    for key in (f"{KEY}-a", f"{KEY}-b", f"{KEY}-c"):
        results = race(claimers, key)
        winners = [d for d, won in results.items() if won]
        assert len(results) == n and len(winners) == 1, results
        assert {c.holder(key) for c in claimers} == {winners[0]}
        # The losers withdrew: the broker keeps the winner's claim only, for the key and this device.
        kept = retained_claims(mqtt_broker.port, key)
        assert list(kept) == winners and kept[winners[0]]["key"] == key
        # A late device neither wins nor disturbs the claim.
        late = make_claims("orin-late")
        assert late.claim(key) is False and late.holder(key) == winners[0]
        late.close()


def test_release_clears_the_claim_and_another_device_wins(make_claims: type, mqtt_broker: Broker) -> None:
    a, b = make_claims("orin-a"), make_claims("orin-b")
    assert a.claim(KEY) is True
    assert b.claim(KEY) is False and b.holder(KEY) == "orin-a"
    a.release(KEY)
    assert a.held() == ()
    assert make_claims("orin-newcomer").holder(KEY) is None
    assert retained_claims(mqtt_broker.port, KEY) == {}
    assert b.claim(KEY) is True and a.holder(KEY) == "orin-b"


def test_renewals_keep_a_live_builders_claim(make_claims: type) -> None:
    ttl = 2.0
    builder, other = make_claims("orin-builder", ttl_s=ttl), make_claims("orin-other")
    assert builder.claim(KEY) is True
    first = other.holder(KEY)
    end = time.monotonic() + 3 * ttl  # three lifetimes: without renewals the claim would be gone
    while time.monotonic() < end:
        assert other.holder(KEY) == "orin-builder"
        time.sleep(0.2)
    assert first == "orin-builder" and other.claim(KEY) is False
    builder.close()  # close releases what it holds
    assert other.holder(KEY) is None


HOLDER = """
import sys, time
from agent.config.mqtt import MqttConfig
from agent.fleet.claims import BuildClaims
cfg = MqttConfig(host="127.0.0.1", port=int(sys.argv[1]))
c = BuildClaims(cfg, "edge-agent", "orin-doomed", ttl_s=float(sys.argv[3]), settle_s=0.2).open()
print("won" if c.claim(sys.argv[2]) else "lost", flush=True)
time.sleep(600)
"""


def test_a_killed_builders_claim_expires_and_another_device_wins(
    make_claims: type, mqtt_broker: Broker
) -> None:
    ttl = 2.0
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mqtt_broker.port), KEY, str(ttl)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "won"
        waiter = make_claims("orin-waiter")
        assert waiter.claim(KEY) is False and waiter.holder(KEY) == "orin-doomed"
        time.sleep(2 * ttl)  # alive: it renews
        assert waiter.holder(KEY) == "orin-doomed"
        proc.send_signal(signal.SIGKILL)  # no release, no goodbye: only the expiry frees the key
        proc.wait(10)
        assert "orin-doomed" in retained_claims(mqtt_broker.port, KEY)  # the stale claim is still retained
        deadline = time.monotonic() + 10 * ttl
        while waiter.holder(KEY) is not None:
            assert time.monotonic() < deadline, "the dead builder's claim never expired"
            time.sleep(0.2)
        assert waiter.claim(KEY) is True
        assert make_claims("orin-third").holder(KEY) == "orin-waiter"
    finally:
        proc.kill()
        proc.wait()


def junk(now: float) -> dict[str, bytes]:
    """Retained payloads under the claim topics of KEY that must never count as a claim; each would win
    (claimed_at older than any real claim) if it were taken for one."""

    def body(device: str, **over: object) -> bytes:
        fields = {"device": device, "key": KEY, "claimed_at": now - 30, "expires": now + 600, **over}
        return json.dumps(fields).encode()

    return {
        "j-text": b"not json at all",
        "j-binary": b"\xff\xfe\x00\x01",
        "j-list": b"[1, 2, 3]",
        "j-null": b"null",
        "j-deep": b"[" * 500 + b"]" * 500,
        "j-string-time": body("j-string-time", claimed_at=str(now - 30)),
        "j-bool-time": body("j-bool-time", claimed_at=True),
        "j-nan": f'{{"device":"j-nan","key":"{KEY}","claimed_at":NaN,"expires":{now + 600}}}'.encode(),
        "j-infinite": f'{{"device":"j-infinite","key":"{KEY}","claimed_at":0,"expires":1e999}}'.encode(),
        "j-mismatch": body("orin-real"),  # payload names another device than its topic
        "j-other-key": body("j-other-key", key="another-key"),
        "j-no-device": json.dumps({"key": KEY, "claimed_at": now - 30, "expires": now + 600}).encode(),
        "j-huge": body("j-huge", pad="x" * 100_000),
        "j-expired": body("j-expired", claimed_at=now - 100, expires=now - 50),
        "j-forever": body("j-forever", claimed_at=1.0),  # "renewed" for 56 years
        "j-backwards": body("j-backwards", claimed_at=now + 10, expires=now),
    }


def test_junk_under_the_claim_topics_neither_crashes_nor_wins(make_claims: type, mqtt_broker: Broker) -> None:
    now = time.time()
    items = [(f"{PREFIX}/_fleet/builds/{KEY}/{device}", raw) for device, raw in junk(now).items()]
    items.append(
        (f"{PREFIX}/_fleet/builds/{KEY}/j-deeper/level", json.dumps({"device": "j-deeper"}).encode())
    )
    retain(mqtt_broker.port, items)
    builder = make_claims("orin-real")
    assert builder.holder(KEY) is None  # all of it read (the subscription's barrier passed): nothing counts
    assert builder.claim(KEY) is True
    # More junk while it builds, live this time: the claim stands, the client still answers.
    for topic, raw in items:
        publish(mqtt_broker.port, topic, raw)
    assert builder.holder(KEY) == "orin-real"
    newcomer = make_claims("orin-newcomer")
    assert newcomer.claim(KEY) is False and newcomer.holder(KEY) == "orin-real"


def test_parse_claim_accepts_exactly_the_wire_format() -> None:
    good = {"device": "d", "key": "k", "claimed_at": 100.0, "expires": 160}
    claim = parse_claim("k", "d", json.dumps(good).encode())
    assert claim is not None and (claim.claimed_at, claim.expires) == (100.0, 160.0)
    assert parse_claim("k", "d", claim.payload()) == claim
    assert parse_claim("k", "d", b"") is None  # the release
    assert parse_claim("k", "e", json.dumps(good).encode()) is None
    for raw in junk(1000.0).values():
        assert parse_claim(KEY, "j-text", raw) is None


def test_bad_names_and_a_dead_broker_are_clear_errors(mqtt_broker_stopped: Broker) -> None:
    cfg = settings(mqtt_broker_stopped.port)
    with pytest.raises(ValueError, match="device"):
        BuildClaims(cfg, PREFIX, "a/b")
    claims = BuildClaims(cfg, PREFIX, "orin-a", timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match="OCI tag"):
            claims.claim("bad key/with+wildcards")
        with pytest.raises(ClaimsUnavailable, match=f"127.0.0.1:{mqtt_broker_stopped.port}"):
            claims.claim(KEY)
    finally:
        claims.close()


def test_a_claim_survives_a_broker_restart(make_claims: type, mqtt_broker: Broker, tmp_path: Path) -> None:
    """persistence false: the broker forgets every retained claim; the holder re-asserts its own."""
    builder = make_claims("orin-builder", ttl_s=30.0)
    assert builder.claim(KEY) is True
    mqtt_broker.stop()
    mqtt_broker.start()
    waiter = make_claims("orin-waiter")
    deadline = time.monotonic() + 20
    while waiter.holder(KEY) != "orin-builder":
        assert time.monotonic() < deadline, "the claim was not re-asserted after the broker came back"
        time.sleep(0.2)
    assert waiter.claim(KEY) is False
