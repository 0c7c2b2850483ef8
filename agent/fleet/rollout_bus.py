"""The MQTT side of a rollout: one connection that watches the target devices and sends their commands.

Subscribed (again at every reconnect): `{prefix}/+/status` (online or offline: the LWT), the devices'
`{prefix}/+/deployments/{model}` and `{prefix}/+/cmd/{deploy,rollback}/result`. Every message gets a
sequence number as it arrives, so the runner can tell a state published after its command from one the
broker kept from before. Payloads come from the network: anything that is not a JSON object of sane size is
dropped (counted in `unreadable`).

`read_rollouts` reads the retained rollout documents (`fleet rollouts`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.fleet.rollout_state import Rollout, RolloutStateError, topic
from agent.mqtt.fleet import client_id
from agent.mqtt.tls import TlsFileError, TlsOptions, client_context

MAX_PAYLOAD = 256 * 1024  # an agent's state or answer is a few KB
ANSWERS_KEPT = 16  # per device and action


class BusError(RuntimeError):
    """The broker cannot be used (unreachable, refused, TLS): one line naming host and port only."""


@dataclass(frozen=True)
class Broker:
    host: str = "localhost"
    port: int = 1883
    prefix: str = "edge-agent"
    username: str | None = None
    password: str | None = None
    tls: TlsOptions | None = None

    @property
    def where(self) -> str:
        return f"broker {self.host}:{self.port}"


@dataclass(frozen=True)
class Seen:
    body: dict[str, Any]
    seq: int  # arrival order on this connection
    retained: bool


def _client(broker: Broker) -> paho.Client:
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id(), clean_session=True)
    if broker.username is not None:
        c.username_pw_set(broker.username, broker.password)
    if broker.tls is not None:
        try:
            c.tls_set_context(client_context(broker.tls))
        except TlsFileError as exc:
            raise BusError(f"tls {exc}") from None
        if broker.tls.insecure:
            c.tls_insecure_set(True)
    return c


def _connect(
    c: paho.Client, broker: Broker, ready: threading.Event, failed: list[str], timeout_s: float
) -> None:
    try:
        c.connect(broker.host, broker.port, keepalive=30)
    except (OSError, ValueError) as exc:
        raise BusError(f"{broker.where}: not reachable ({getattr(exc, 'strerror', None) or exc})") from None
    c.loop_start()
    deadline = time.monotonic() + timeout_s
    while not ready.is_set() and not failed and time.monotonic() < deadline:
        time.sleep(0.02)
    if failed or not ready.is_set():
        c.disconnect()
        c.loop_stop()
        raise BusError(f"{broker.where}: {failed[0] if failed else f'no answer within {timeout_s:g} s'}")


def _decode(raw: bytes) -> dict[str, Any] | None:
    if not raw or len(raw) > MAX_PAYLOAD:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


class Bus:
    """The devices of one model's rollout as the broker shows them, and their commands."""

    def __init__(self, broker: Broker, model: str, clock: Callable[[], float] = time.time) -> None:
        self.broker, self.model, self.clock = broker, model, clock
        self._head = f"{broker.prefix}/"
        self._lock = threading.Lock()
        self._seq = 0
        self._status: dict[str, tuple[bool, float]] = {}  # device -> (online, since)
        self._deploy: dict[str, Seen] = {}
        self._answers: dict[tuple[str, str], list[Seen]] = {}
        self.unreadable = 0
        self._ready = threading.Event()
        self._failed: list[str] = []
        self.started = clock()
        self._c = _client(broker)
        self._c.on_connect, self._c.on_subscribe = self._on_connect, self._on_subscribe
        self._c.on_message = self._on_message

    def connect(self, timeout_s: float = 10.0) -> Bus:
        _connect(self._c, self.broker, self._ready, self._failed, timeout_s)
        return self

    def close(self) -> None:
        self._c.disconnect()
        self._c.loop_stop()

    # ---- paho's network thread -----------------------------------------------------------------------
    def _on_connect(self, c: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            self._failed.append(f"refused the connection: {reason}")
            return
        p = self.broker.prefix
        c.subscribe(
            [
                (f"{p}/+/status", 1),
                (f"{p}/+/deployments/{self.model}", 1),
                (f"{p}/+/cmd/deploy/result", 1),
                (f"{p}/+/cmd/rollback/result", 1),
            ]
        )

    def _on_subscribe(self, _c: paho.Client, _u: Any, _mid: int, codes: Any, _p: Any) -> None:
        refused = [str(code) for code in codes if code.is_failure]
        if refused:
            self._failed.append(
                f"refused the subscriptions under {self.broker.prefix}/: {', '.join(refused)}"
            )
        self._ready.set()

    def _on_message(self, _c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        if not msg.topic.startswith(self._head):
            return
        levels = msg.topic[len(self._head) :].split("/")
        body = _decode(bytes(msg.payload))
        with self._lock:
            if body is None:
                self.unreadable += bool(msg.payload)
                return
            self._seq += 1
            seen = Seen(body, self._seq, bool(msg.retain))
            device = levels[0]
            if levels[1:] == ["status"]:
                online = body.get("state") != "offline"
                was = self._status.get(device)
                if was is None or was[0] != online:
                    self._status[device] = (online, self.clock())
            elif levels[1:] == ["deployments", self.model]:
                self._deploy[device] = seen
            elif len(levels) == 4 and levels[1] == "cmd" and levels[3] == "result":
                kept = self._answers.setdefault((device, levels[2]), [])
                kept.append(seen)
                del kept[:-ANSWERS_KEPT]

    # ---- what the runner reads -----------------------------------------------------------------------
    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def online(self, device: str) -> tuple[bool, float]:
        """(online, since when, wall clock); a device without a status is offline since the bus started."""
        with self._lock:
            return self._status.get(device, (False, self.started))

    def known(self, device: str) -> bool:
        with self._lock:
            return device in self._status

    def deployment(self, device: str) -> Seen | None:
        with self._lock:
            return self._deploy.get(device)

    def answer(self, device: str, action: str, request_id: Any, after: int) -> Seen | None:
        """The latest cmd/{action}/result of `device` that arrived after `after` and echoes `request_id`."""
        with self._lock:
            for seen in reversed(self._answers.get((device, action), [])):
                if seen.seq > after and seen.body.get("request_id") == request_id:
                    return seen
        return None

    # ---- what it sends --------------------------------------------------------------------------------
    def send(self, device: str, action: str, body: bytes) -> int:
        """Publish `{prefix}/{device}/cmd/{action}` (QoS 1); the sequence number answers come after."""
        mark = self.seq
        info = self._c.publish(f"{self.broker.prefix}/{device}/cmd/{action}", body, qos=1)
        # Not connected now: paho sends it at the reconnect, or the device's step fails it (no answer).
        with contextlib.suppress(RuntimeError, ValueError):
            info.wait_for_publish(10.0)
        return mark

    def save(self, rollout: Rollout) -> bool:
        """The retained rollout document (QoS 1); False when the broker did not take it within 10 s."""
        info = self._c.publish(topic(self.broker.prefix, rollout.id), rollout.payload(), qos=1, retain=True)
        try:
            info.wait_for_publish(10.0)
        except (
            RuntimeError,
            ValueError,
        ):  # not connected: paho keeps it queued; the next change sends it too
            return False
        return info.is_published()


def read_rollouts(
    broker: Broker, rollout_id: str | None = None, quiet_s: float = 0.5, timeout_s: float = 10.0
) -> dict[str, Rollout | RolloutStateError]:
    """Rollout id -> its retained document (or why it is unusable), as the broker holds them now."""
    found: dict[str, Rollout | RolloutStateError] = {}
    lock, ready, failed = threading.Lock(), threading.Event(), []
    last = [time.monotonic()]
    base = topic(broker.prefix, "")

    def on_connect(c: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            failed.append(f"refused the connection: {reason}")
        else:
            c.subscribe(topic(broker.prefix, rollout_id or "+"), 1)

    def on_subscribe(_c: paho.Client, _u: Any, _mid: int, codes: Any, _p: Any) -> None:
        if any(code.is_failure for code in codes):
            failed.append(f"refused the subscription to {base}+")
        last[0] = time.monotonic()
        ready.set()

    def on_message(_c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        rid = msg.topic[len(base) :]
        with lock:
            last[0] = time.monotonic()
            if not msg.payload:  # a deleted rollout
                found.pop(rid, None)
                return
            try:
                got = Rollout.from_payload(bytes(msg.payload))
            except RolloutStateError as exc:
                found[rid] = exc
                return
            found[rid] = got if got.id == rid else RolloutStateError("id: not the id of its topic")

    c = _client(broker)
    c.on_connect, c.on_subscribe, c.on_message = on_connect, on_subscribe, on_message
    _connect(c, broker, ready, failed, timeout_s)
    end = time.monotonic() + timeout_s  # a broker that never goes quiet still ends the read
    try:
        while time.monotonic() - last[0] < quiet_s and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        c.disconnect()
        c.loop_stop()
    with lock:
        return dict(found)
