"""MQTT client of the daemon: availability (birth/LWT), offline queue, commands.

A thin layer over paho-mqtt 2.x (callback API v2, its own network thread via ``loop_start``), made of one
part per job: the connection and its backoff (agent.mqtt.link), the offline queue and retained states
(agent.mqtt.outbox), broker refusals (agent.mqtt.refusals), other instances with our device id
(agent.mqtt.duplicates) and command intake (agent.mqtt.intake).

Usage by the daemon::

    client = MqttClient(cfg.mqtt, Topics(prefix, device), birth=status_fields)  # the validated section
    client.on_command("reload", handler)          # handler(request model) -> dict | None (mqtt.commands)
    client.start()                                # never blocks, never fails on a dead broker
    client.publish(topics.camera_state(cam), body, qos=1, retain=True, kind="state")
    client.publish(topics.detections(cam), body, kind="event")   # qos defaults to the detections qos
    ...
    client.close()                                # status offline (retained), <= ~3 s

Delivery model (why it is this way):
- ``publish`` never blocks on the broker. While connected it hands the message to paho; while not
  connected the outbox keeps it (states as the latest value per topic, events in a bounded queue).
- On every (re)connect the network thread publishes, in this order: the birth status (from ``birth()``,
  which reflects the present), then the outbox: the latest value of every retained state topic, then the
  queued events in the order they were published.
- The MQTT session is clean (clean_session=True): this class, not the broker, owns redelivery.
  QoS>=1 messages that paho still held unacknowledged when the link dropped are taken back from paho
  at reconnect (``drop_out_messages``) and re-queued, instead of paho resending them after our
  flush (which would reorder them) or both of us sending them (duplicates).
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode

from agent.mqtt.commands import Answer, CommandRouter, Handler
from agent.mqtt.duplicates import Duplicates, StatusAnswers
from agent.mqtt.intake import Intake, Watch
from agent.mqtt.link import Link
from agent.mqtt.outbox import Outbox
from agent.mqtt.refusals import Refusals
from agent.mqtt.settings import MqttSettings
from agent.mqtt.topics import Topics, payload

log = logging.getLogger("agent.mqtt")

Kind = Literal["state", "event"]
BirthProvider = Callable[[], Mapping[str, Any]]


class MqttClient:
    """See the module docstring. Thread-safe: ``publish``/``stats`` may be called from any thread.

    `cfg` is the validated `mqtt` section. The owner's hooks: `birth()` and `offline(reason)` give the
    status fields; `commands` is a router shared across clients (the daemon replaces its client when the
    broker changes) and `answer` publishes its answers (default: this client); `quiet` puts connection
    trouble at DEBUG; `shard` makes a pipeline shard's client (agent.shards): its cameras' topics only, no
    will, birth, status or commands, which the supervisor's client owns."""

    def __init__(
        self,
        cfg: MqttSettings,
        topics: Topics,
        *,
        birth: BirthProvider | None = None,
        offline: Callable[[str], Mapping[str, Any]] | None = None,
        quiet: bool = False,
        commands: CommandRouter | None = None,
        answer: Callable[[Answer], None] | None = None,
        shard: int | None = None,
    ) -> None:
        self.topics, self.qos, self.shard = topics, cfg.qos, shard
        # One id per process, in the client id and every status payload (agent.mqtt.duplicates).
        self.instance = secrets.token_hex(4)
        self.client_id = f"{topics.prefix.replace('/', '-')}-{topics.device}-{self.instance}"
        if shard is not None:
            self.client_id = f"{self.client_id}-shard{shard}"
        self._auth = cfg.username is not None
        self._birth, self._offline = birth, offline
        self._closed = False
        self._started = False
        self._last_qos1: paho.MQTTMessageInfo | None = None  # a shard's close() waits for its ack
        self._counts_lock = threading.Lock()
        self._counts = {"published": 0, "errors": 0}
        self._outbox = Outbox(cfg.offline_queue, topics.status)
        self._duplicates = Duplicates(topics.device, self.instance)
        self._answers = StatusAnswers(self._send_birth, lambda: self._link.up and not self._closed)
        self._own_router = commands is None
        self.commands = commands if commands is not None else CommandRouter()
        self._intake = Intake(
            topics,
            groups=tuple(cfg.groups),
            shared=cfg.shared_subscriptions,
            shard=shard is not None,
            router=self.commands,
            answer=answer or self._answer,
            own_status=self._on_own_status,
            send=self._send,
        )
        self._link = link = Link(
            cfg,
            self.client_id,
            quiet=quiet,
            queue_limit=self._outbox.limit,
            on_up=self._on_link_up,
            on_down=self._on_link_down,
        )
        needs = f"{topics.base}/# and {topics.prefix}/_all/..."
        self._refusals = Refusals(f"{link.host}:{link.port}", needs)
        self._refresh_will()
        link.paho.on_message = self._intake.on_message
        link.paho.on_publish = self._refusals.on_publish
        link.paho.on_subscribe = self._refusals.on_subscribe

    @classmethod
    def from_config(cls, cfg: MqttSettings, topics: Topics, **hooks: Any) -> MqttClient:
        """The client for the validated `mqtt` section (the same as ``MqttClient(cfg, topics, **hooks)``)."""
        return cls(cfg, topics, **hooks)

    @property
    def host(self) -> str:
        return self._link.host

    @property
    def port(self) -> int:
        return self._link.port

    def __repr__(self) -> str:
        # Never the password (nor the username: it is half of a credential).
        state = "connected" if self.connected else "disconnected"
        auth = "with credentials" if self._auth else "anonymous"
        tls = self._link.tls
        tls_text = "" if tls is None else (", TLS unverified" if tls.insecure else ", TLS")
        return f"MqttClient({self.host}:{self.port}{tls_text}, client_id={self.client_id!r}, {auth}, {state})"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start connecting in the background; returns at once even if the broker is down."""
        if self._started:
            return
        self._started = True
        self._refresh_will()  # the owner is set up by now (cameras opened): the will names them
        self._link.connect()
        if self._own_router and self.shard is None:
            self.commands.start()
        self._link.run()

    def _refresh_will(self) -> None:
        # The broker keeps the will it got in CONNECT; paho sends the one set now at the next (re)connect.
        if self.shard is None:
            will = self._offline_payload("connection lost")
            self._link.paho.will_set(self.topics.status, will, qos=1, retain=True)

    @property
    def connected(self) -> bool:
        return self._outbox.connected

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected (and the offline queue flushed) or ``timeout``; for start-up and tests."""
        return self._outbox.connected_event.wait(timeout)

    def close(self, graceful: bool = True, timeout: float = 2.0) -> None:
        """Stop the client; returns within about ``timeout`` + 1 s even if the broker is gone.

        graceful: publish status ``offline`` (retained, QoS 1, waiting up to ``timeout`` for the ack),
        then DISCONNECT (the broker discards the LWT). Not graceful: drop the connection without
        DISCONNECT, so the broker publishes the LWT, as if the process had died.
        """
        if self._closed:
            return
        self._closed = self._link.closed = True
        deadline = time.monotonic() + timeout + 1.0
        if self._started and graceful and self.connected:
            self._confirm_last_word(timeout)
        self._outbox.set_connected(False)
        if self._started:
            self._link.stop(graceful, deadline)
        if self._own_router:
            self.commands.stop(timeout=0.5)

    def _confirm_last_word(self, timeout: float) -> None:
        """Before DISCONNECT: the offline status, acknowledged; a shard has none, and waits for its last
        QoS>=1 message instead (the cameras' `stopped` states), so that DISCONNECT does not overtake it."""
        if self.shard is None:
            body = self._offline_payload("stopped")
            info = self._link.paho.publish(self.topics.status, body, qos=1, retain=True)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return
        elif self._last_qos1 is not None:
            info = self._last_qos1
        else:
            return
        try:
            info.wait_for_publish(timeout)
        except (RuntimeError, ValueError) as exc:
            log.debug("%s not confirmed: %s", "offline status" if self.shard is None else "last message", exc)
        if self.shard is None and not info.is_published():
            log.log(self._link.warn_level, "MQTT: offline status not acknowledged within %.1f s", timeout)

    # ---- publishing --------------------------------------------------------------------------
    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int | None = None,
        retain: bool | None = None,
        kind: Kind = "event",
    ) -> None:
        """Publish without ever blocking on the network.

        kind "state": retained (``retain`` must not be False); only the latest per topic is kept while
        offline and every state is re-published at each reconnect. kind "event": not retained; queued
        in the bounded offline queue while offline. ``qos`` defaults to 1 for states, to the client's
        detections qos for events.
        """
        if kind == "state":
            if retain is False:
                raise ValueError(f"publish {topic}: kind 'state' is retained; retain=False contradicts it")
            retain, qos = True, 1 if qos is None else qos
        elif kind == "event":
            if retain:
                raise ValueError(f"publish {topic}: kind 'event' is not retained; use kind='state'")
            retain, qos = False, self.qos if qos is None else qos
        else:
            raise ValueError(f"publish {topic}: kind must be 'state' or 'event', got {kind!r}")
        # Checked here, in the caller's thread: a message queued while offline must not fail later
        # inside the network thread's flush.
        if not topic or "+" in topic or "#" in topic:
            raise ValueError(f"publish: topic {topic!r} must be non-empty without wildcards")
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"publish {topic}: payload must be bytes, got {type(payload).__name__}")
        if qos not in (0, 1, 2):
            raise ValueError(f"publish {topic}: qos must be 0, 1 or 2, got {qos!r}")
        if self._closed:
            return
        if self._outbox.keep(topic, payload, qos, state=kind == "state"):
            self._send(topic, payload, qos, retain)

    def _send(self, topic: str, body: bytes, qos: int, retain: bool) -> None:
        try:
            info = self._link.paho.publish(topic, body, qos=qos, retain=retain)
        except Exception as exc:  # paho raises for what publish() validated; never on the flush path
            self._count("errors")
            log.warning("MQTT publish to %s failed: %s", topic, exc)
            return
        rc = info.rc
        if qos > 0 and rc in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            self._refusals.track(info.mid, topic)
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
            if qos > 0:
                self._last_qos1 = info
            self._count("published")
        elif rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            # The link dropped between our check and paho's send. A QoS>=1 message stays in paho's
            # store and is taken back at reconnect (see _on_link_up); states are re-sent anyway.
            if qos == 0 and not retain:
                self._outbox.requeue(topic, body, qos)
        else:
            self._count("errors")
            log.warning("MQTT publish to %s failed: %s", topic, paho.error_string(rc))

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def stats(self) -> dict[str, Any]:
        outbox, link, refusals = self._outbox.stats(), self._link.stats(), self._refusals.stats()
        with self._counts_lock:
            published, errors = self._counts["published"], self._counts["errors"]
        return {
            "connected": self.connected,
            "queued": outbox["queued"],
            "states_pending": outbox["states_pending"],
            "dropped_offline": outbox["dropped_offline"],
            "published": published,
            "reconnects": link["reconnects"],
            "errors": errors,
            "connect_failures": link["connect_failures"],
            "refused": refusals["refused"],
            "last_error": link["last_error"],  # why the latest attempt failed; None once connected
            "last_refused": refusals["last_refused"],  # the latest publish/subscription the broker refused
            "duplicates": self._duplicates.current(),  # other live instances using our device id
        }

    # ---- status --------------------------------------------------------------------------------
    def status_payload(self, fields: Mapping[str, Any]) -> bytes:
        """The `status` body for `fields`, with this process's `instance` and any `duplicates` added: every
        status this agent publishes (birth, updates, offline, LWT) goes through here."""
        dups = self._duplicates.current()
        extra: dict[str, Any] = {"instance": self.instance}
        if dups:
            extra["duplicates"] = dups
        return payload("status", **{**fields, **extra})

    def publish_status(self, fields: Mapping[str, Any]) -> None:
        """Publish the retained `status` for `fields` from the daemon's thread. A duplicate seen on the
        network thread between building the body and queueing it would leave a stale body (no `duplicates`)
        as the last word on the topic: then the status is answered again, fresh, after it."""
        generation = self._duplicates.generation
        self.publish(self.topics.status, self.status_payload(fields), qos=1, retain=True, kind="state")
        if generation != self._duplicates.generation:
            self._answers.request()

    def _on_own_status(self, raw: bytes, retained: bool) -> None:
        if not self._closed and self._duplicates.observe(raw, retained):
            self._answers.request()

    def _status_from(
        self, provider: Callable[[], Mapping[str, Any]] | None, default: dict[str, Any], what: str
    ) -> bytes:
        fields = default
        if provider is not None:
            try:
                fields = dict(provider())
            except Exception:
                log.exception(
                    "MQTT %s status provider failed; publishing state %s only", what, default["state"]
                )
        return self.status_payload(fields)

    def _offline_payload(self, reason: str) -> bytes:
        provider = None if self._offline is None else functools.partial(self._offline, reason)
        return self._status_from(provider, {"state": "offline", "reason": reason}, "offline")

    def _send_birth(self) -> None:
        self._send(self.topics.status, self._status_from(self._birth, {"state": "online"}, "birth"), 1, True)

    # ---- connection events (network thread) ----------------------------------------------------
    def _on_link_up(self, client: paho.Client) -> None:
        """The broker accepted us: take back what paho held unacknowledged, subscribe, birth, then the
        outbox. Marked connected once the outbox is empty, or at once if this fails (a bug must neither
        stop the network thread nor block publishing)."""
        try:
            # Retained ones are superseded by the birth and the re-published latest states.
            old = self._link.paho.drop_out_messages()
            self._outbox.reclaim((m.topic, bytes(m.payload), m.qos) for m in old if not m.retain)
            sent = self._intake.subscribe(client, self._link.protocol)
            if sent is not None:
                self._refusals.track_subscription(*sent)
            if self.shard is None:
                self._send_birth()
        except Exception:
            log.exception("MQTT on_connect handling failed")
        try:
            self._outbox.flush(self._send)
        except Exception:
            log.exception("MQTT offline queue flush failed; publishing directly from now on")
            self._outbox.set_connected(True)

    def _on_link_down(self) -> None:
        if not self._closed:
            self._refresh_will()  # for the reconnect: cameras may have come or gone since
        self._outbox.set_connected(False)

    # ---- commands ----------------------------------------------------------------------------
    def on_command(self, action: str, handler: Handler) -> None:
        """Register ``handler(request) -> dict | None`` for ``{prefix}/{device}/cmd/{action}``; `request` is
        the action's validated model (agent.mqtt.commands). Handlers run one at a time on the router's
        thread."""
        self.commands.register(action, handler)

    def watch(self, topic_filter: str, callback: Watch) -> None:
        """Subscribe to `topic_filter` at every connect (before start()); `callback(topic, payload)` runs on
        the network thread and must not block (e.g. the daemon's Home Assistant clean-up)."""
        self._intake.watches[topic_filter] = callback

    def _answer(self, answer: Answer) -> None:
        body = payload("cmd-result", **{**answer.body(), "device": self.topics.device})
        self.publish(self.topics.cmd_result(answer.action), body, qos=1)
