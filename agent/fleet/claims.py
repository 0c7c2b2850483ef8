"""Build claims over MQTT: one build per compatibility key across the fleet (issue 38 item 2).

    with BuildClaims(cfg.mqtt, cfg.mqtt.prefix, cfg.device_id, ttl_s=engines.claim_ttl_s) as claims:
        if claims.claim(key):          # True: this device builds; the claim is renewed until release()
            try: build_and_push()
            finally: claims.release(key)
        else:
            claims.holder(key)         # who builds (None: nobody any more: pull, then claim again)

The wire format and the winner rule are agent.fleet.claim_record's. Why a connection of its own, not the
agent's client: the claim needs what the agent's client does not do (subscribe to one key on demand, know
when the broker's retained claims have all arrived, see its own claim come back), it must be usable from
any process that runs a build (the daemon, `edge-agent rebuild`, a test) with only the `mqtt` settings, and
a claim must not be delayed behind a queue of detections. It connects with the agent's settings (TLS,
credentials: never logged) under its own client id, `{prefix}-{device}.claims.<12 hex>`.

How a claim is decided (every device that takes part sees the same claims, so all reach the same answer):
1. subscribe to `{prefix}/_fleet/builds/{key}/+`; an UNSUBSCRIBE of a topic we never had is answered after
   every retained claim the broker had (it answers in order): then the view is complete;
2. another device's unexpired claim wins already: False, nothing published;
3. otherwise publish ours (retained, QoS 1), wait until it comes back through the subscription (every claim
   the broker took before ours has then arrived too), then `settle_s` more for claims racing ours;
4. the winner rule decides; a loser releases its claim at once (the retained state converges on one). A
   device that stalled between looking and publishing concedes to a rival whose claim reached the broker
   more than settle_s before its own (that rival may have decided without seeing it).
Exactly one winner as long as the devices' clocks agree within `settle_s` (NTP does); beyond that two may
build, which costs a build, never an engine: a push never overwrites a tag.

A held claim is renewed every ttl_s/3 (`expires` moves, `claimed_at` stays) by a thread of this object;
a builder that dies stops renewing and its claim expires after at most ttl_s. Thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode

from agent.fleet.claim_record import (
    Claim,
    ClaimsUnavailable,
    check_key,
    claim_topic,
    key_filter,
    parse_claim,
    topic_parts,
    winner,
)
from agent.fleet.claims_link import claims_client
from agent.mqtt.link import reason_name
from agent.mqtt.settings import MqttSettings

log = logging.getLogger("agent.fleet.claims")
MAX_DEVICES = 4096  # claims kept per key: more devices than any fleet on one broker


class BuildClaims:
    """See the module docstring. `clock`: wall-clock seconds (claims cross machines); `timeout_s` bounds each
    wait on the broker (connect, subscription, our claim's echo): ClaimsUnavailable past it."""

    def __init__(
        self,
        settings: MqttSettings,
        prefix: str,
        device: str,
        *,
        ttl_s: float = 120.0,
        settle_s: float = 1.0,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        claim_topic(prefix, "k", device)  # ValueError naming a bad prefix or device, before any connection
        if not ttl_s > 0 or settle_s < 0 or not timeout_s > 0:
            raise ValueError("BuildClaims: ttl_s and timeout_s must be > 0, settle_s >= 0")
        self.prefix, self.device, self.ttl_s, self.settle_s = prefix, device, ttl_s, settle_s
        self.timeout_s, self.clock = timeout_s, clock
        self.where = f"MQTT broker {settings.host}:{settings.port}"
        self.client_id = f"{prefix.replace('/', '-')}-{device}.claims.{secrets.token_hex(6)}"
        self._settings = settings
        self._cond = threading.Condition()
        self._views: dict[str, dict[str, Claim]] = {}  # key -> device -> its claim (watched keys only)
        self._arrived: dict[tuple[str, str], float] = {}  # (key, device) -> when its claim first came
        self._ready: set[str] = set()  # keys whose retained claims have all arrived on this connection
        self._barriers: dict[int, str] = {}  # UNSUBSCRIBE mid -> key (sent from the network thread)
        self._acks: dict[tuple[str, int], Any] = {}  # ("sub" | "unsub" | "pub", mid) -> reason code(s)
        self._echo: dict[str, tuple[bytes, float]] = {}  # key -> our payload as it came back, when
        self._held: dict[str, Claim] = {}
        self._connected = False
        self._error: str | None = None  # why the latest connection attempt failed
        self._stop = threading.Event()
        self._paho: paho.Client | None = None
        self._renewer: threading.Thread | None = None

    def __repr__(self) -> str:  # never credentials
        return f"BuildClaims({self.where}, device={self.device!r}, held={sorted(self._held)})"

    # ---- connection ------------------------------------------------------------------------------
    def __enter__(self) -> BuildClaims:
        return self  # connects at the first call: a broker that is away raises there, and __exit__ still runs

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> BuildClaims:
        """Connect (once); ClaimsUnavailable when the broker does not accept us within timeout_s."""
        if self._paho is None:
            self._paho = self._make_client()
            try:
                self._paho.connect_async(self._settings.host, self._settings.port, self._settings.keepalive)
            except (OSError, ValueError) as exc:
                raise ClaimsUnavailable(f"{self.where}: {exc}") from None
            self._paho.loop_start()
            self._renewer = threading.Thread(target=self._renew_loop, name="claims-renew", daemon=True)
            self._renewer.start()
        self._wait(lambda: self._connected, "no connection")
        return self

    def close(self) -> None:
        """Release every claim held (bounded), stop renewing, disconnect."""
        if self._paho is None or self._stop.is_set():
            return
        for key in list(self._held):
            self.release(key)
        self._stop.set()
        self._paho.disconnect()
        # paho's thread may sit in a connect attempt to a broker that is away: bounded, as the agent's close
        stopper = threading.Thread(target=self._paho.loop_stop, name="claims-stop", daemon=True)
        stopper.start()
        stopper.join(self.timeout_s)

    def _make_client(self) -> paho.Client:
        c = claims_client(self._settings, self.client_id)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        c.on_subscribe, c.on_unsubscribe, c.on_publish = self._on_sub, self._on_unsub, self._on_pub
        c.on_connect_fail = self._on_connect_fail
        return c

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until done(); ClaimsUnavailable naming `what` after timeout_s."""
        with self._cond:
            if (
                not self._cond.wait_for(lambda: done() or self._stop.is_set(), self.timeout_s)
                or self._stop.is_set()
            ):
                why = self._error if not self._connected and self._error else what
                raise ClaimsUnavailable(f"{self.where}: {why} (waited {self.timeout_s:g} s)")

    # ---- the three calls -------------------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """True: this device builds `key` (its claim is renewed until release()). False: another device
        holds it (holder()). ClaimsUnavailable where the broker cannot be used for this."""
        check_key(key)
        self.open()
        self._watch(key)
        now = self.clock()
        with self._cond:
            current = winner(self._views[key].values(), now)
            stale_own = key in self._views and self.device in self._views[key]
        if current is not None and current.device != self.device:
            if stale_own:
                self.release(key)  # an old claim of ours (a previous run) must not linger
            return False
        # Our own live claim (this device restarted mid-build) keeps its place in the order.
        mine = Claim(self.device, key, current.claimed_at if current else now, now + self.ttl_s)
        try:
            echoed_at = self._publish(mine, wait=True)
        except ClaimsUnavailable:
            self._send_release(
                key
            )  # in case the broker took it after all: nobody waits for a claim we dropped
            raise
        time.sleep(self.settle_s)  # claims that raced ours reach us within this
        with self._cond:
            now = self.clock()
            others = [c for d, c in self._views[key].items() if d != self.device and c.live(now)]
            first = winner([*others, mine], now)
            # A rival at the broker settle_s before ours (we stalled before publishing) may have decided
            # without seeing ours: it builds, we concede even where the rule would favour us.
            overtaken = any(
                echoed_at - self._arrived.get((key, c.device), echoed_at) > self.settle_s for c in others
            )
        if first is mine and not overtaken:
            with self._cond:
                self._held[key] = mine
            log.info("build claim %s: this device builds (renewed every %.0f s)", key, self.ttl_s / 3)
            return True
        self.release(key)  # conceded: acknowledged before we answer
        return False

    def holder(self, key: str) -> str | None:
        """The device whose unexpired claim wins `key` now; None when nobody holds it."""
        check_key(key)
        self.open()
        self._watch(key)
        with self._cond:
            w = winner(self._views[key].values(), self.clock())
        return None if w is None else w.device

    def release(self, key: str) -> None:
        """Stop renewing and clear our claim (empty retained payload); waits for the broker's ack up to
        timeout_s, never raises for a broker that is gone: the claim then expires by itself."""
        check_key(key)
        with self._cond:
            self._held.pop(key, None)
        if self._paho is not None and not self._stop.is_set():
            try:
                self._send_release(key, wait=True)
            except ClaimsUnavailable as exc:
                log.warning("build claim %s: release not confirmed (%s); it expires by itself", key, exc)

    def held(self) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._held)

    # ---- publishing and subscribing ----------------------------------------------------------------
    def _publish(self, claim: Claim, wait: bool) -> float:
        """Publish `claim` retained; with `wait`, until it comes back (returns when, by our clock) or the
        broker refuses it (MQTT 5 says so; 3.1.1 only stays silent: timeout)."""
        body = claim.payload()
        with self._cond:
            self._echo.pop(claim.key, None)
        mid = self._send(claim_topic(self.prefix, claim.key, self.device), body)
        if not wait:
            return 0.0
        topic = claim_topic(self.prefix, claim.key, self.device)
        self._wait(
            lambda: self._echo.get(claim.key, (b"",))[0] == body or self._refused(mid),
            f"our claim on {topic} did not come back (may this user write and read it? see the ACL lines)",
        )
        with self._cond:
            code = self._acks.pop(("pub", mid), None)
            if getattr(code, "is_failure", False):
                raise ClaimsUnavailable(f"{self.where} refused our claim on {topic}: {reason_name(code)}")
            return self._echo[claim.key][1]

    def _send_release(self, key: str, wait: bool = False) -> None:
        mid = self._send(claim_topic(self.prefix, key, self.device), b"")
        if wait:
            self._wait(lambda: ("pub", mid) in self._acks or self._refused(mid), "no ack of the release")
            with self._cond:
                self._acks.pop(("pub", mid), None)

    def _send(self, topic: str, body: bytes) -> int:
        assert self._paho is not None
        info = self._paho.publish(topic, body, qos=1, retain=True)
        if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            raise ClaimsUnavailable(f"{self.where}: publish to {topic} failed: {paho.error_string(info.rc)}")
        return info.mid

    def _refused(self, mid: int) -> bool:
        code = self._acks.get(("pub", mid))
        return code is not None and bool(getattr(code, "is_failure", False))

    def _watch(self, key: str) -> None:
        """Subscribe to `key`'s claims (once per connection) and wait until the retained ones are in."""
        with self._cond:
            if key in self._ready:
                return
            self._views.setdefault(key, {})
        assert self._paho is not None
        rc, sub_mid = self._paho.subscribe(key_filter(self.prefix, key), qos=0)
        rc2, barrier_mid = self._paho.unsubscribe(f"{claim_topic(self.prefix, key, self.device)}/barrier")
        if MQTTErrorCode.MQTT_ERR_NO_CONN in (rc, rc2):
            self._wait(lambda: key in self._ready, "no subscription")  # made again at reconnect
            return
        sub, barrier = int(sub_mid or 0), int(barrier_mid or 0)
        self._wait(lambda: ("unsub", barrier) in self._acks, f"no answer to the subscription of {key}")
        with self._cond:
            self._acks.pop(("unsub", barrier), None)
            codes = self._acks.pop(("sub", sub), [])
            refused = [c for c in codes if getattr(c, "is_failure", False)]
            if refused:
                what = f"{key_filter(self.prefix, key)}: {reason_name(refused[0])}"
                raise ClaimsUnavailable(f"{self.where} refused the subscription to {what}")
            self._ready.add(key)

    # ---- renewals ------------------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._renew_all()

    def _renew_all(self) -> None:
        now = self.clock()
        with self._cond:
            held = dict(self._held)
        for key, claim in held.items():
            if not claim.live(now):  # not renewed in time (the broker was away): another may build now
                log.warning("build claim %s expired before it could be renewed; building on", key)
                with self._cond:
                    self._held.pop(key, None)
                continue
            renewed = replace(claim, expires=now + self.ttl_s)
            with self._cond:
                if key not in self._held:  # released meanwhile
                    continue
                self._held[key] = renewed
            try:
                self._publish(renewed, wait=False)
            except ClaimsUnavailable as exc:
                log.warning("build claim %s: renewal failed (%s)", key, exc)

    # ---- paho callbacks (network thread): take the condition briefly, never call paho under it ------
    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            with self._cond:
                self._error = f"refused the connection: {reason_name(reason)}"
            return
        with self._cond:
            self._connected, self._error = True, None
            self._ready.clear()
            keys = list(self._views)
            self._cond.notify_all()
        for key in keys:  # subscriptions do not survive a clean session
            client.subscribe(key_filter(self.prefix, key), qos=0)
            _, mid = client.unsubscribe(f"{claim_topic(self.prefix, key, self.device)}/barrier")
            with self._cond:
                self._barriers[int(mid or 0)] = key
        self._renew_all()  # a held claim, re-asserted at once

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        with self._cond:  # paho keeps the cause to itself; the agent's own client logs it in detail
            self._error = "not reachable, or the TLS handshake failed (see the agent's MQTT log lines)"

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self._cond:
            if self._connected and not self._stop.is_set():
                log.warning("build claims: %s lost (%s); reconnecting", self.where, reason)
            self._connected = False
            self._error = self._error or "connection lost"
            self._cond.notify_all()

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        parts = topic_parts(self.prefix, msg.topic)
        if parts is None:
            return
        key, device = parts
        raw = bytes(msg.payload)
        claim = parse_claim(key, device, raw)
        with self._cond:
            view = self._views.get(key)
            if view is None:
                return
            before = view.get(device)
            if claim is None:  # a release, or junk: neither holds the key
                view.pop(device, None)
                self._arrived.pop((key, device), None)
            elif before is not None or len(view) < MAX_DEVICES:
                view[device] = claim
                if before is None or before.claimed_at != claim.claimed_at:  # new, not a renewal
                    self._arrived[(key, device)] = self.clock()
            if device == self.device:
                self._echo[key] = (raw, self.clock())
            self._cond.notify_all()

    def _ack(self, kind: str, mid: int, codes: Any) -> None:
        with self._cond:
            if len(self._acks) > 1024:  # acks nobody waits for (timed out): drop the oldest
                for old in list(self._acks)[:512]:
                    del self._acks[old]
            self._acks[(kind, mid)] = codes
            key = self._barriers.pop(mid, None) if kind == "unsub" else None
            if key is not None:
                self._ready.add(key)
            self._cond.notify_all()

    def _on_sub(self, client: paho.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self._ack("sub", mid, list(codes))

    def _on_unsub(self, client: paho.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self._ack("unsub", mid, codes)

    def _on_pub(self, client: paho.Client, userdata: Any, mid: int, code: Any, props: Any) -> None:
        self._ack("pub", mid, code)
