"""The agent's mosquitto ACL of docs/DESIGN.md ("Mosquitto ACL for the whole agent"), run as written: with
passwords and per-device users, a device claims builds under its own identity only. A claim, a forged
claim or a release published as another device is dropped by the broker, and that device's claim stands.
The claims' own connection uses the agent's TLS and credential settings, never showing a password."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import test_mqtt_tls as agent_tls
from fixtures_agent import REPO
from fixtures_mqtt import MOSQUITTO, Broker, Subscriber
from paho.mqtt.enums import CallbackAPIVersion
from test_mqtt_tls import AGENT_PASSWORD, Pki, TlsBroker, needs_tls_tools

from agent.config.mqtt import MqttConfig
from agent.fleet.claim_record import ClaimsUnavailable
from agent.fleet.claims import BuildClaims

# The TLS fixtures of the agent's own client tests (a test CA, a TLS mosquitto, a password file).
pki, passwd_file, tls_broker = agent_tls.pki, agent_tls.passwd_file, agent_tls.tls_broker
PASSWD = shutil.which("mosquitto_passwd")
USERS = {"orin-01": "pw-orin-01-secret", "orin-02": "pw-orin-02-secret", "ops": "pw-ops-secret"}
KEY = "trt10.3-orin-sm87-abc123"
PREFIX = "edge-agent"

pytestmark = pytest.mark.skipif(
    PASSWD is None or MOSQUITTO is None, reason="mosquitto(_passwd) not installed"
)


def design_acl() -> str:
    """The first fenced block after the ACL heading in docs/DESIGN.md (indented in its list item)."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    i = text.index("**Mosquitto ACL for the whole agent**")
    m = re.search(r"```\n(.*?)```", text[i:], re.S)
    assert m is not None
    return "\n".join(line.strip() for line in m.group(1).splitlines()) + "\n"


@pytest.fixture
def acl_broker(tmp_path: Path) -> Iterator[Broker]:
    if PASSWD is None or MOSQUITTO is None:
        pytest.skip("mosquitto(_passwd) not installed")
    pwfile = tmp_path / "passwd"
    pwfile.write_text("".join(f"{u}:{p}\n" for u, p in USERS.items()))
    subprocess.run([str(PASSWD), "-U", str(pwfile)], check=True)
    acl = tmp_path / "acl"
    acl.write_text(design_acl())
    broker = Broker(tmp_path, allow_anonymous=False)
    root = "user root\n" if os.geteuid() == 0 else ""  # as root mosquitto would drop to "mosquitto"
    broker.conf.write_text(broker.conf.read_text() + f"password_file {pwfile}\nacl_file {acl}\n{root}")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def login(broker: Broker, tmp_path: Path, user: str, protocol: str = "5") -> MqttConfig:
    """The agent's own mqtt settings for `user` (password from a file, as an agent reads it)."""
    pw = tmp_path / f"{user}.pw"
    pw.write_text(USERS[user] + "\n")
    return MqttConfig(host="127.0.0.1", port=broker.port, username=user, password_file=pw, protocol=protocol)


def claims(cfg: MqttConfig, device: str, **kw: float) -> BuildClaims:
    return BuildClaims(cfg, PREFIX, device, ttl_s=30.0, settle_s=0.3, timeout_s=kw.get("timeout_s", 5.0))


def retained(broker: Broker, key: str) -> dict[str, bytes]:
    """Retained claims on `key` as the operator's account reads them (device -> payload)."""
    ops = Subscriber(broker.port, f"{PREFIX}/#", username="ops", password=USERS["ops"])
    try:
        ops.publish(f"{PREFIX}/orin-02/cmd/reload", b"{}")  # ops may write commands; marks the retained end
        got = ops.wait_for(lambda m: any(t.endswith("/cmd/reload") for t, _, _ in m))
        head = f"{PREFIX}/_fleet/builds/{key}/"
        return {t[len(head) :]: p for t, p, r in got if r and t.startswith(head)}
    finally:
        ops.close()


def forge(broker: Broker, user: str, items: list[tuple[str, bytes]]) -> list[str]:
    """Publish `items` retained as `user` (MQTT 5, QoS 1); the reason codes the broker answered."""
    c = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    codes: list[str] = []
    c.on_publish = lambda client, userdata, mid, rc, props: codes.append(str(rc))
    c.username_pw_set(user, USERS[user])
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        for topic, body in items:
            c.publish(topic, body, qos=1, retain=True).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()
    return codes


def test_a_device_claims_only_as_itself(
    acl_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    b = claims(login(acl_broker, tmp_path, "orin-02"), "orin-02").open()
    try:
        assert b.claim(KEY) is True
        before = retained(acl_broker, KEY)
        assert list(before) == ["orin-02"]
        # orin-01 with a copied config saying device_id orin-02: its claim never reaches the broker's state.
        impostor = claims(login(acl_broker, tmp_path, "orin-01"), "orin-02")
        with pytest.raises(
            ClaimsUnavailable, match=r"refused our claim on .*/orin-02: Not authorized \(0x87\)"
        ):
            impostor.open().claim("another-key")
        impostor.close()
        # Forged by hand: a release of orin-02's claim, an older claim in its name, one under orin-01's own
        # topic naming orin-02. The first two are refused, the third is stored but names the wrong device.
        old = json.dumps({"device": "orin-02", "key": KEY, "claimed_at": 1.0, "expires": 9e9}).encode()
        topic_b = f"{PREFIX}/_fleet/builds/{KEY}/orin-02"
        codes = forge(acl_broker, "orin-01", [(topic_b, b""), (topic_b, old), (f"{topic_b[:-2]}01", old)])
        assert codes[:2] == ["Not authorized", "Not authorized"] and codes[2] == "Success", codes
        after = retained(acl_broker, KEY)
        assert after["orin-02"] == before["orin-02"] and json.loads(after["orin-01"])["device"] == "orin-02"
        # orin-01 as itself: reads the claim, loses to it; claims a free key under its own name.
        a = claims(login(acl_broker, tmp_path, "orin-01"), "orin-01").open()
        try:
            assert a.holder(KEY) == "orin-02" and a.claim(KEY) is False and b.holder(KEY) == "orin-02"
            assert a.claim("another-key") is True and b.holder("another-key") == "orin-01"
        finally:
            a.close()
    finally:
        b.close()
    assert retained(acl_broker, KEY).get("orin-02") is None  # its own release went through
    for secret in USERS.values():
        assert secret not in caplog.text


def test_under_mqtt_3_1_1_a_refused_claim_is_reported_as_such(acl_broker: Broker, tmp_path: Path) -> None:
    """3.1.1 has no reason codes: the broker drops the claim silently; it never comes back, and we say so."""
    impostor = claims(login(acl_broker, tmp_path, "orin-01", protocol="3.1.1"), "orin-02", timeout_s=1.5)
    try:
        with pytest.raises(ClaimsUnavailable, match=r"did not come back .*ACL"):
            impostor.open().claim(KEY)
    finally:
        impostor.close()
    assert retained(acl_broker, KEY) == {}


def test_wrong_credentials_are_a_clear_error_without_the_password(acl_broker: Broker, tmp_path: Path) -> None:
    cfg = login(acl_broker, tmp_path, "orin-01")
    (tmp_path / "orin-01.pw").write_text("not-the-password\n")
    c = claims(cfg, "orin-01", timeout_s=1.5)
    try:
        with pytest.raises(ClaimsUnavailable, match="refused the connection") as err:
            c.open()
        assert "not-the-password" not in str(err.value) and USERS["orin-01"] not in str(err.value)
    finally:
        c.close()


@needs_tls_tools
def test_claims_over_tls_with_a_password_file(
    tmp_path: Path,
    pki: Pki,
    passwd_file: Path,
    tls_broker: Callable[..., TlsBroker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent's TLS and credentials carry over to the claims' own connection; nothing secret shows."""
    caplog.set_level(logging.DEBUG)
    broker = tls_broker(password_file=passwd_file)
    (tmp_path / "agent.pw").write_text(AGENT_PASSWORD + "\n")
    tls = {"ca_file": pki.ca}
    cfg = MqttConfig(
        host="127.0.0.1", port=broker.port, tls=tls, username="agent", password_file=tmp_path / "agent.pw"
    )
    a, b = claims(cfg, "orin-a"), claims(cfg, "orin-b")
    try:
        assert a.claim(KEY) is True and b.claim(KEY) is False and b.holder(KEY) == "orin-a"
        assert AGENT_PASSWORD not in repr(a)
    finally:
        a.close()
        b.close()
    untrusted = cfg.model_copy(update={"tls": MqttConfig(tls={"ca_file": pki.other_ca}).tls})
    c = claims(untrusted, "orin-c", timeout_s=1.5)
    try:
        with pytest.raises(ClaimsUnavailable, match=f"127.0.0.1:{broker.port}"):
            c.claim(KEY)
    finally:
        c.close()
    assert AGENT_PASSWORD not in caplog.text
