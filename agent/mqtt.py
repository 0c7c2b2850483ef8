"""MQTT client of the daemon: availability (birth/LWT), offline queue, commands.

A thin layer over paho-mqtt 2.x (callback API v2, its own network thread via ``loop_start``).

Usage by the daemon::

    client = MqttClient(topics=Topics(prefix, device), host=..., port=..., username=...,
                        password=read_password_file(path), birth=status_fields)
    client.on_command("reload", handler)          # handler(args: dict) -> dict | None
    client.start()                                # never blocks, never fails on a dead broker
    client.publish(topics.camera_state(cam), body, qos=1, retain=True, kind="state")
    client.publish(topics.detections(cam), body, kind="event")   # qos defaults to the detections qos
    ...
    client.close()                                # status offline (retained), <= ~3 s

Delivery model (why it is this way):
- ``publish`` never blocks on the broker. While connected it hands the message to paho; while not
  connected it keeps it: "state" messages (retained) as the latest value per topic, "event" messages in
  one bounded deque shared by all event topics (oldest dropped first, counted in ``dropped_offline``).
- On every (re)connect the network thread publishes, in this order: the birth status (from ``birth()``,
  which reflects the present), the latest value of every retained state topic (the present again,
  so consumers see current camera/engine states before old events), then the queued events in the
  order they were published. Callers keep queueing while this flush runs and the client only counts
  as connected once the queue is empty, so order is preserved without holding a lock during the flush.
- The MQTT session is clean (clean_session=True): this class, not the broker, owns redelivery.
  QoS>=1 messages that paho still held unacknowledged when the link dropped are taken back from paho
  at reconnect (``drop_out_messages``) and re-queued, instead of paho resending them after our
  flush (which would reorder them) or both of us sending them (duplicates).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from agent.topics import Topics, check_name, payload

log = logging.getLogger(__name__)

Kind = Literal["state", "event"]
CommandHandler = Callable[[dict[str, Any]], "Mapping[str, Any] | None"]
BirthProvider = Callable[[], Mapping[str, Any]]

_FLUSH_BATCH = 64  # events taken from the offline queue per lock acquisition during a flush


class _DemotePahoErrors(logging.Filter):
    """paho logs connection trouble at ERROR ("failed to receive on socket" at each loss, "Client is
    not connected" after every failed reconnect attempt). Our own messages report each transition
    once, so paho's are demoted to DEBUG; only "Caught exception in <callback>" (a bug) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and not str(record.msg).startswith("Caught exception"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # The level check ran before this filter: drop the demoted record unless DEBUG is on.
            return _paho_log.isEnabledFor(logging.DEBUG)
        return True


_paho_log = logging.getLogger(f"{__name__}.paho")
_paho_log.addFilter(_DemotePahoErrors())


class MqttError(Exception):
    """Configuration or usage error of the MQTT client (the message never contains secrets)."""


def read_password_file(path: str | Path) -> str:
    """The password stored in ``path`` (trailing newline removed); MqttError naming the path."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise MqttError(f"mqtt password_file {p}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise MqttError(f"mqtt password_file {p}: not UTF-8 text") from None
    password = text.rstrip("\r\n")
    if not password:
        raise MqttError(f"mqtt password_file {p}: file is empty")
    return password


class MqttClient:
    """See the module docstring. Thread-safe: ``publish``/``stats`` may be called from any thread."""

    def __init__(
        self,
        *,
        topics: Topics,
        host: str = "localhost",
        port: int = 1883,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        keepalive: int = 30,
        qos: int = 0,
        offline_queue: int = 1000,
        birth: BirthProvider | None = None,
        quiet: bool = False,
        reconnect_min_delay: int = 1,
        reconnect_max_delay: int = 30,
    ) -> None:
        if qos not in (0, 1, 2):
            raise MqttError(f"mqtt qos: must be 0, 1 or 2, got {qos!r}")
        if not 1 <= port <= 65535:
            raise MqttError(f"mqtt port: must be 1..65535, got {port!r}")
        if offline_queue < 1:
            raise MqttError(f"mqtt offline_queue: must be >= 1, got {offline_queue!r}")
        if keepalive < 1:
            raise MqttError(f"mqtt keepalive: must be >= 1 s, got {keepalive!r}")
        self.topics = topics
        self.host, self.port, self.tls, self.keepalive = host, port, tls, keepalive
        self.client_id = client_id or f"{topics.prefix.replace('/', '-')}-{topics.device}"
        self.qos = qos
        self._auth = username is not None
        self._birth = birth
        # quiet: the demo tries a broker that may simply not exist; connection trouble goes to DEBUG.
        self._warn = logging.DEBUG if quiet else logging.WARNING
        self._info = logging.DEBUG if quiet else logging.INFO

        self._lock = threading.Lock()
        self._connected = False
        self._ever_connected = False
        self._outage_logged = False
        self._last_refusal: str | None = None
        self._down_since: float | None = None
        self._connected_event = threading.Event()
        self._closed = False
        self._states: dict[str, tuple[bytes, int]] = {}  # latest retained payload per topic
        self._pending_states: dict[str, tuple[bytes, int]] = {}  # changed while offline, not yet sent
        self._events: collections.deque[tuple[str, bytes, int]] = collections.deque(maxlen=offline_queue)
        counters = ("dropped_offline", "published", "reconnects", "errors", "connect_failures")
        self._counts = dict.fromkeys(counters, 0)

        self._handlers: dict[str, CommandHandler] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mqtt-cmd")

        c = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=True,
            protocol=paho.MQTTv311,
        )
        # A bug in a callback must not kill paho's network thread (it would silently stop reconnecting).
        c.suppress_exceptions = True
        c.enable_logger(_paho_log)
        if username is not None:
            c.username_pw_set(username, password)
        if tls:
            try:
                c.tls_set()  # system CA store
            except (OSError, ValueError) as exc:
                raise MqttError(f"mqtt tls: cannot set up TLS ({exc})") from None
        c.will_set(topics.status, payload("status", state="offline"), qos=1, retain=True)
        c.reconnect_delay_set(min_delay=reconnect_min_delay, max_delay=reconnect_max_delay)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        self._client = c
        self._started = False

    def __repr__(self) -> str:
        # Never the password (nor the username: it is half of a credential).
        state = "connected" if self._connected else "disconnected"
        auth = "with credentials" if self._auth else "anonymous"
        return f"MqttClient({self.host}:{self.port}, client_id={self.client_id!r}, {auth}, {state})"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start connecting in the background; returns at once even if the broker is down."""
        if self._started:
            return
        self._started = True
        try:
            self._client.connect_async(self.host, self.port, keepalive=self.keepalive)
        except (OSError, ValueError) as exc:  # e.g. an invalid host string
            raise MqttError(f"mqtt host {self.host!r} port {self.port}: {exc}") from None
        self._client.loop_start()

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected (and the offline queue flushed) or ``timeout``; for start-up and tests."""
        return self._connected_event.wait(timeout)

    def close(self, graceful: bool = True, timeout: float = 2.0) -> None:
        """Stop the client; returns within about ``timeout`` + 1 s even if the broker is gone.

        graceful: publish status ``offline`` (retained, QoS 1, waiting up to ``timeout`` for the ack),
        then DISCONNECT (the broker discards the LWT). Not graceful: drop the connection without
        DISCONNECT, so the broker publishes the LWT, as if the process had died.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout + 1.0
        c = self._client
        if self._started and graceful:
            if self._connected:
                info = c.publish(self.topics.status, payload("status", state="offline"), qos=1, retain=True)
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    try:
                        info.wait_for_publish(timeout)
                    except (RuntimeError, ValueError) as exc:
                        log.debug("offline status not confirmed: %s", exc)
                    if not info.is_published():
                        log.log(self._warn, "MQTT: offline status not acknowledged within %.1f s", timeout)
            c.disconnect()
        self._connected = False
        self._connected_event.clear()
        if self._started:
            # loop_stop() joins paho's thread, which can sit in a connect attempt (paho's own 5 s
            # timeout) or a reconnect sleep; join from a helper thread so close() keeps its bound.
            stopper = threading.Thread(target=c.loop_stop, name="mqtt-stop", daemon=True)
            stopper.start()
            stopper.join(max(0.1, deadline - time.monotonic()))
            if stopper.is_alive():
                log.debug("MQTT network thread still busy after close(); left to exit on its own")
            if not graceful:
                sock = c.socket()
                if sock is not None:
                    sock.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

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
        with self._lock:
            if kind == "state":
                self._states[topic] = (payload, qos)
            if not self._connected:
                if kind == "state":
                    self._pending_states[topic] = (payload, qos)
                else:
                    self._enqueue_event_locked(topic, payload, qos)
                return
        self._send(topic, payload, qos, retain)

    def _enqueue_event_locked(self, topic: str, body: bytes, qos: int) -> None:
        if len(self._events) == self._events.maxlen:
            self._counts["dropped_offline"] += 1  # deque(maxlen) drops the oldest on append
        self._events.append((topic, body, qos))

    def _send(self, topic: str, body: bytes, qos: int, retain: bool) -> None:
        try:
            rc = self._client.publish(topic, body, qos=qos, retain=retain).rc
        except Exception as exc:  # paho raises for what publish() validated; never on the flush path
            with self._lock:
                self._counts["errors"] += 1
            log.warning("MQTT publish to %s failed: %s", topic, exc)
            return
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
            with self._lock:
                self._counts["published"] += 1
        elif rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            # The link dropped between our check and paho's send. A QoS>=1 message stays in paho's
            # store and is taken back at reconnect (see _reclaim_unacked); states are re-sent anyway.
            if qos == 0 and not retain:
                with self._lock:
                    self._enqueue_event_locked(topic, body, qos)
        else:
            with self._lock:
                self._counts["errors"] += 1
            log.warning("MQTT publish to %s failed: %s", topic, paho.error_string(rc))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "connected": self._connected,
                "queued": len(self._events),
                "states_pending": len(self._pending_states),
                **self._counts,
            }

    # ---- paho callbacks (network thread) -----------------------------------------------------
    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if reason.is_failure:
            # Refused (bad credentials, not authorised, ...): paho retries; we are NOT connected.
            name = reason.getName() if hasattr(reason, "getName") else str(reason)
            with self._lock:
                self._counts["connect_failures"] += 1
                first = name != self._last_refusal
                self._last_refusal = name
                self._outage_logged = True
            if first:
                log.log(
                    self._warn, "MQTT broker %s:%d refused the connection: %s", self.host, self.port, name
                )
            return
        try:
            self._reclaim_unacked()
            result, _mid = client.subscribe(self.topics.cmd_filter, qos=1)
            if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
                log.warning("MQTT subscribe %s failed: %s", self.topics.cmd_filter, paho.error_string(result))
            self._send(self.topics.status, self._birth_payload(), 1, True)
        except Exception:  # a bug here must neither stop the network thread nor block publishing
            log.exception("MQTT on_connect handling failed")
        try:
            self._flush()
        except Exception:
            log.exception("MQTT offline queue flush failed; publishing directly from now on")
            with self._lock:
                self._connected = True
                self._connected_event.set()
        with self._lock:
            reconnect = self._ever_connected
            if reconnect:
                self._counts["reconnects"] += 1
            self._ever_connected = True
            self._outage_logged = False
            self._last_refusal = None
            down = None if self._down_since is None else time.monotonic() - self._down_since
            self._down_since = None
        if reconnect:
            log.log(
                self._info,
                "MQTT connection to %s:%d restored after %.1f s",
                self.host,
                self.port,
                down or 0.0,
            )
        else:
            log.log(self._info, "MQTT connected to %s:%d", self.host, self.port)

    def _birth_payload(self) -> bytes:
        fields: dict[str, Any] = {"state": "online"}
        if self._birth is not None:
            try:
                fields = dict(self._birth())
            except Exception:
                log.exception("MQTT birth status provider failed; publishing state online only")
        return payload("status", **fields)

    def _reclaim_unacked(self) -> None:
        """Take QoS>=1 messages paho kept from the previous connection back into our queue."""
        old = self._client.drop_out_messages()
        events = [(m.topic, bytes(m.payload), m.qos) for m in old if not m.retain]
        # Retained ones are superseded by the birth and the re-published latest states.
        if not events:
            return
        with self._lock:
            merged = events + list(self._events)  # these were published before anything queued now
            overflow = max(0, len(merged) - (self._events.maxlen or len(merged)))
            self._counts["dropped_offline"] += overflow
            self._events.clear()
            self._events.extend(merged[overflow:])

    def _flush(self) -> None:
        """Send states then queued events; mark connected once nothing is left (see module doc)."""
        with self._lock:
            # Every retained state, not only those changed while offline: the broker may have lost
            # them (restart without persistence). The status topic is the birth's job.
            self._pending_states = {**self._states, **self._pending_states}
            self._pending_states.pop(self.topics.status, None)
        while True:
            with self._lock:
                if self._pending_states:
                    states = list(self._pending_states.items())
                    self._pending_states.clear()
                    batch: list[tuple[str, bytes, int, bool]] = [(t, b, q, True) for t, (b, q) in states]
                elif self._events:
                    n = min(_FLUSH_BATCH, len(self._events))
                    batch = [(*self._events.popleft(), False) for _ in range(n)]
                else:
                    self._connected = True
                    self._connected_event.set()
                    return
            for topic, body, qos, retain in batch:
                self._send(topic, body, qos, retain)

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        with self._lock:
            self._counts["connect_failures"] += 1
            first = not self._outage_logged
            self._outage_logged = True
            if self._down_since is None:
                self._down_since = time.monotonic()
        if first:
            log.log(
                self._warn,
                "MQTT broker %s:%d not reachable; retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                self._events.maxlen,
            )

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        with self._lock:
            was_connected = self._connected
            self._connected = False
            self._connected_event.clear()
            if was_connected:
                self._down_since = time.monotonic()
                self._outage_logged = True
        if was_connected and not self._closed:
            from_broker = getattr(flags, "is_disconnect_packet_from_server", False)
            why = f"broker sent DISCONNECT: {reason}" if from_broker else "connection closed or timed out"
            log.log(
                self._warn,
                "MQTT connection to %s:%d lost (%s); retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                why,
                self._events.maxlen,
            )

    # ---- commands ----------------------------------------------------------------------------
    def on_command(self, action: str, handler: CommandHandler) -> None:
        """Register ``handler(args) -> dict | None`` for ``{prefix}/{device}/cmd/{action}``.

        The handler runs on a single worker thread (commands are serialised, never on the network
        thread). Its dict is merged into ``{"ok": true}``; it may return ``ok: False`` with an
        ``error`` for a soft failure; an exception becomes ``{"ok": false, "error": str(exc)}``.
        ``args`` is the request object without ``request_id``.
        """
        check_name(action, "action")
        self._handlers[action] = handler

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            action = self.topics.action_of(msg.topic)
            if action is None:
                return
            self._handle_command(action, msg.topic, msg.payload)
        except Exception:
            log.exception("MQTT command on %s failed", msg.topic)

    def _handle_command(self, action: str, topic: str, raw: bytes) -> None:
        try:
            args = json.loads(raw) if raw.strip() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._reply(action, None, f"{topic}: payload is not valid JSON ({exc})")
            return
        if not isinstance(args, dict):
            self._reply(action, None, f"{topic}: payload must be a JSON object, got {type(args).__name__}")
            return
        request_id = args.pop("request_id", None)
        handler = self._handlers.get(action)
        if handler is None:
            known = ", ".join(sorted(self._handlers)) or "none"
            self._reply(action, request_id, f"unknown action {action!r} (known: {known})")
            return
        try:
            self._executor.submit(self._run_handler, action, handler, args, request_id)
        except RuntimeError:  # executor shut down: we are closing
            log.debug("command %s dropped: client closing", action)

    def _run_handler(
        self, action: str, handler: CommandHandler, args: dict[str, Any], request_id: Any
    ) -> None:
        try:
            result = handler(args)
            if result is not None and not isinstance(result, Mapping):
                raise TypeError(f"handler returned {type(result).__name__}, expected a dict or None")
        except Exception as exc:
            log.warning("command %s failed: %s", action, exc, exc_info=True)
            self._reply(action, request_id, f"{self.topics.cmd(action)}: {exc or type(exc).__name__}")
            return
        self._reply(action, request_id, None, dict(result or {}))

    def _reply(
        self, action: str, request_id: Any, error: str | None, fields: Mapping[str, Any] | None = None
    ) -> None:
        body: dict[str, Any] = {"action": action, "ok": error is None, "error": error}
        body.update(fields or {})
        body["request_id"] = request_id
        if error is not None:
            log.info("command %s rejected: %s", action, error)
        try:
            data = payload("cmd-result", **body)
        except (TypeError, ValueError) as exc:  # a handler returned something JSON cannot carry
            data = payload(
                "cmd-result",
                action=action,
                ok=False,
                error=f"result not serialisable: {exc}",
                request_id=request_id,
            )
        self.publish(self.topics.cmd_result(action), data, qos=1, kind="event")
