"""MQTT client of the daemon: availability (birth/LWT), offline queue, commands.

A thin layer over paho-mqtt 2.x (callback API v2, its own network thread via ``loop_start``).

Usage by the daemon::

    client = MqttClient(topics=Topics(prefix, device), host=..., port=..., username=...,
                        password=read_password_file(path), birth=status_fields)
    client.on_command("reload", handler)          # handler(request model) -> dict | None (agent.commands)
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

Connection model:
- TLS (``tls=True`` or ``TlsOptions``): the SSLContext comes from ``agent.tls``, the same builder that
  checks the config's files at load. No verification only with ``TlsOptions(insecure=True)``, warned.
- Retries: before each of paho's waits, ``backoff_delay`` (capped exponential with jitter) is set as
  paho's next delay, so a broker that is back is found within ``reconnect_max_delay``.
- Failures (unreachable, TLS, refused, closed) are logged once per outage and kind with host:port and
  the reason, never a credential or a traceback; ``stats()["last_error"]`` has the latest.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.commands import Answer, CommandRouter, Handler

if TYPE_CHECKING:
    from agent.config import MqttConfig
from agent.tls import TlsFileError, TlsOptions, client_context, describe_tls_failure
from agent.topics import Topics, payload

log = logging.getLogger(__name__)

Kind = Literal["state", "event"]
BirthProvider = Callable[[], Mapping[str, Any]]

_FLUSH_BATCH = 64  # events taken from the offline queue per lock acquisition during a flush
_MID_TRACK = 1024  # QoS>=1 publishes whose topic is kept until the broker acknowledges (or refuses) them
_REPORTED_MAX = 256  # distinct refused topics logged; later ones are only counted
_DUPLICATES_MAX = 16  # other instances remembered (and logged) at once
_DUPLICATE_LOGS_MAX = 16  # ERROR lines about new instances per process; later ones are only counted
_STATUS_MAX_BYTES = 65536  # a status on our topic larger than this is not an agent's
_INSTANCE = re.compile(r"[0-9a-f]{8}")
_ANSWER_INTERVAL_S = 1.0  # at most one status answer per second (someone may flood our status topic)
PROTOCOLS = ("5", "3.1.1")


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


class MqttError(ValueError):
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


def backoff_delay(attempt: int, min_delay: float, max_delay: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (0: the first after a failure or a loss).

    Capped exponential backoff with jitter: the ceiling doubles from ``min_delay`` up to ``max_delay``
    and the wait is drawn from [ceiling / 2, ceiling]. Agents that lost the same broker at the same
    moment thus spread their retries instead of arriving together, and a broker that is back is found
    within ``max_delay``.
    """
    ceiling = min(max_delay, min_delay * 2.0 ** min(attempt, 30))
    return rng.uniform(ceiling / 2, ceiling)


class _AttemptError(OSError):
    """A connection attempt that failed with something other than an OSError (see _Paho)."""


class _Paho(paho.Client):
    """paho's Client, keeping why the last connection attempt failed.

    paho catches the OSError of a failed attempt (DNS, refused, TLS handshake) and calls
    on_connect_fail without it. Any other exception would end paho's network thread for good, without
    a word (its loop catches only OSError there): it is passed on as an OSError so that paho retries
    and on_connect_fail reports it.
    """

    attempt_error: BaseException | None = None

    def reconnect(self) -> MQTTErrorCode:
        self.attempt_error = None
        try:
            return super().reconnect()
        except OSError as exc:
            self.attempt_error = exc
            raise
        except Exception as exc:
            self.attempt_error = exc
            raise _AttemptError(f"{type(exc).__name__}: {exc}") from exc


# paho reports why a read failed (a TLS alert, a reset) only in its log: on_log keeps the latest.
_TRANSPORT_ERRORS = ("failed to receive on socket: ", "timeout on socket: ")
_AUTH_REFUSALS = ("Not authorized", "Bad user name or password")
_ERRNO = re.compile(r"^\[Errno -?\d+\] ")


def _reason_name(code: Any) -> str:
    name = code.getName() if hasattr(code, "getName") else str(code)
    return f"{name} (0x{int(getattr(code, 'value', 0)):02x})"


def _os_reason(error: OSError | None) -> str:
    if error is None:
        return "connection failed"
    return str(error.strerror or error or type(error).__name__)


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
        tls: bool | TlsOptions = False,
        keepalive: int = 30,
        qos: int = 0,
        offline_queue: int = 1000,
        birth: BirthProvider | None = None,
        offline: Callable[[str], Mapping[str, Any]] | None = None,
        quiet: bool = False,
        reconnect_min_delay: float = 1.0,
        reconnect_max_delay: float = 4.0,
        commands: CommandRouter | None = None,
        answer: Callable[[Answer], None] | None = None,
        groups: Iterable[str] = (),
        shared: bool = False,
        protocol: str = "5",
        shard: int | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise MqttError(f"mqtt protocol: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if qos not in (0, 1, 2):
            raise MqttError(f"mqtt qos: must be 0, 1 or 2, got {qos!r}")
        if not 1 <= port <= 65535:
            raise MqttError(f"mqtt port: must be 1..65535, got {port!r}")
        if offline_queue < 1:
            raise MqttError(f"mqtt offline_queue: must be >= 1, got {offline_queue!r}")
        if not 1 <= keepalive <= 65535:  # 16 bits in CONNECT: paho's thread died packing a larger one
            raise MqttError(f"mqtt keepalive: must be 1..65535 s, got {keepalive!r}")
        if not host or host != host.strip():
            raise MqttError("mqtt host: must be a non-empty host name or IP address")
        if not 0 < reconnect_min_delay <= reconnect_max_delay:
            raise MqttError("mqtt reconnect delays: must satisfy 0 < min <= max")
        self.topics = topics
        self.host, self.port, self.keepalive = host, port, keepalive
        self.tls: TlsOptions | None = TlsOptions() if tls is True else (tls or None)
        # One id per process, in the client id and every status payload. Random client ids: two processes with
        # one device id (a copied config, a restart while the old process still runs) must not take each
        # other's session at the broker in turn forever; the instance in `status` tells them apart (below).
        self.instance = secrets.token_hex(4)
        self.client_id = client_id or f"{topics.prefix.replace('/', '-')}-{topics.device}-{self.instance}"
        # A pipeline shard's client (agent.shards): its cameras' topics only. No will, no birth, no status,
        # no commands: the supervisor's client owns the device's availability and its command intake.
        self.shard = shard
        if shard is not None:
            self.client_id = f"{self.client_id}-shard{shard}"
        self.protocol = protocol
        # Fleet commands ({prefix}/_all, {prefix}/_group/<g>): same router, answered on our own result topic;
        # with `shared`, also the "any one agent" topics through MQTT shared subscriptions ($share/...).
        self.groups = tuple(groups)
        self.shared = shared
        self._fleet_filters = topics.fleet_filters(self.groups, shared=shared) if shard is None else ()
        self.qos = qos
        self._auth = username is not None
        self._birth = birth
        self._offline = offline
        # quiet: the demo tries a broker that may simply not exist; connection trouble goes to DEBUG.
        self._warn = logging.DEBUG if quiet else logging.WARNING
        self._info = logging.DEBUG if quiet else logging.INFO

        self._lock = threading.Lock()
        self._connected = False
        self._ever_connected = False
        self._link_up = False  # CONNACK accepted (``_connected`` waits for the offline flush too)
        self._down_since: float | None = None
        # Connection failures: each kind (unreachable, tls, refused, closed) is logged once per outage;
        # stats() shows the latest reason. Retry waits: backoff_delay(attempt) with this RNG.
        self._outage_kinds: set[str] = set()
        self._last_error: str | None = None
        self._refused = False
        self._transport_error: str | None = None
        self._attempt = 0
        self._delays = (reconnect_min_delay, reconnect_max_delay)
        self._rng = random.Random()
        self._connected_event = threading.Event()
        self._closed = False
        self._last_qos1: paho.MQTTMessageInfo | None = None  # a shard's close() waits for its ack
        self._states: dict[str, tuple[bytes, int]] = {}  # latest retained payload per topic
        self._pending_states: dict[str, tuple[bytes, int]] = {}  # changed while offline, not yet sent
        self._events: collections.deque[tuple[str, bytes, int]] = collections.deque(maxlen=offline_queue)
        counters = ("dropped_offline", "published", "reconnects", "errors", "connect_failures", "refused")
        self._counts = dict.fromkeys(counters, 0)
        # Broker refusals (MQTT 5 PUBACK/SUBACK reason codes, e.g. an ACL): mid -> topic until acknowledged.
        # Own lock, never held while calling paho (paho calls on_publish holding its callback mutex).
        self._mid_lock = threading.Lock()
        self._mid_topics: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._early_refusals: dict[int, str] = {}  # refused before _send recorded the mid
        self._sub_filters: dict[int, tuple[str, ...]] = {}
        self._reported: set[str] = set()
        self._last_refused: str | None = None
        # Other processes publishing as this device id: instance -> time last seen (see _on_own_status).
        self._duplicates: dict[str, float] = {}
        self._duplicates_gen = 0  # bumped on every change: a status built before it is stale (publish_status)
        self._duplicate_logs = 0
        self._next_answer = 0.0
        self._answer_timer: threading.Timer | None = None

        # Shared by the daemon across reconnections to another broker; answers go out through `answer`
        # (default: this client), so a command that replaced this client is still answered.
        self._watches: dict[str, Callable[[str, bytes], None]] = {}
        self._own_router = commands is None
        self.commands = commands if commands is not None else CommandRouter()
        if answer is not None:
            self._answer = answer  # type: ignore[method-assign]

        if protocol == "5":
            # MQTT 5: the broker says why it refuses a publish or a subscription (reason codes), which
            # is how an ACL that is too tight gets reported instead of messages vanishing silently.
            c = _Paho(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=paho.MQTTv5)
        else:
            c = _Paho(
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
        if self.tls is not None:
            self._set_up_tls(c, self.tls)
        if shard is None:
            c.will_set(topics.status, self._offline_payload("connection lost"), qos=1, retain=True)
        c.reconnect_delay_set(min_delay=reconnect_min_delay, max_delay=reconnect_max_delay)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        c.on_log = self._on_paho_log
        self._client = c
        self._started = False

    def _set_up_tls(self, c: paho.Client, opts: TlsOptions) -> None:
        try:
            c.tls_set_context(client_context(opts))
        except TlsFileError as exc:
            raise MqttError(f"mqtt tls {exc}") from None
        if opts.insecure:
            c.tls_insecure_set(True)  # the context checks nothing: paho must not check the name either
            # Always WARNING, even when quiet: this is a security decision, not connection noise.
            log.warning(
                "MQTT TLS to %s:%d WITHOUT certificate verification (mqtt.tls.insecure: true): anyone on"
                " the network path can pose as the broker and read the credentials and all data",
                self.host,
                self.port,
            )

    def __repr__(self) -> str:
        # Never the password (nor the username: it is half of a credential).
        state = "connected" if self._connected else "disconnected"
        auth = "with credentials" if self._auth else "anonymous"
        tls = "" if self.tls is None else (", TLS unverified" if self.tls.insecure else ", TLS")
        return f"MqttClient({self.host}:{self.port}{tls}, client_id={self.client_id!r}, {auth}, {state})"

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: MqttConfig, topics: Topics, **kwargs: Any) -> MqttClient:
        """A client for the validated `mqtt` section; kwargs: the owner's callbacks (birth, offline,
        commands, answer), quiet, shard."""
        return cls(
            topics=topics,
            host=cfg.host,
            port=cfg.port,
            username=cfg.username,
            password=cfg.read_password(),
            tls=cfg.tls.options() if cfg.tls is not None else False,
            keepalive=cfg.keepalive,
            reconnect_min_delay=cfg.reconnect_min_s,
            reconnect_max_delay=cfg.reconnect_max_s,
            qos=cfg.qos,
            offline_queue=cfg.offline_queue,
            groups=cfg.groups,
            shared=cfg.shared_subscriptions,
            protocol=cfg.protocol,
            **kwargs,
        )

    def start(self) -> None:
        """Start connecting in the background; returns at once even if the broker is down."""
        if self._started:
            return
        self._started = True
        self._refresh_will()  # the owner is set up by now (cameras opened): the will names them
        try:
            if self.protocol == "5":  # a clean session every time, as clean_session=True in 3.1.1
                self._client.connect_async(self.host, self.port, keepalive=self.keepalive, clean_start=True)
            else:
                self._client.connect_async(self.host, self.port, keepalive=self.keepalive)
        except (OSError, ValueError) as exc:  # e.g. an invalid host string
            raise MqttError(f"mqtt host {self.host!r} port {self.port}: {exc}") from None
        if self._own_router and self.shard is None:
            self.commands.start()
        self._client.loop_start()

    def _refresh_will(self) -> None:
        # The broker keeps the will it got in CONNECT; paho sends the one set now at the next (re)connect.
        if self.shard is not None:
            return
        will = self._offline_payload("connection lost")
        self._client.will_set(self.topics.status, will, qos=1, retain=True)

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
            if self._connected and self.shard is None:
                info = c.publish(self.topics.status, self._offline_payload("stopped"), qos=1, retain=True)
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    try:
                        info.wait_for_publish(timeout)
                    except (RuntimeError, ValueError) as exc:
                        log.debug("offline status not confirmed: %s", exc)
                    if not info.is_published():
                        log.log(self._warn, "MQTT: offline status not acknowledged within %.1f s", timeout)
            elif self._connected and self.shard is not None and self._last_qos1 is not None:
                # A shard has no offline status to wait for: its last QoS>=1 message (the cameras'
                # `stopped` states) instead, so that DISCONNECT does not overtake what was just published.
                try:
                    self._last_qos1.wait_for_publish(timeout)
                except (RuntimeError, ValueError) as exc:
                    log.debug("last message not confirmed: %s", exc)
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
        if self._own_router:
            self.commands.stop(timeout=0.5)

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
            info = self._client.publish(topic, body, qos=qos, retain=retain)
        except Exception as exc:  # paho raises for what publish() validated; never on the flush path
            with self._lock:
                self._counts["errors"] += 1
            log.warning("MQTT publish to %s failed: %s", topic, exc)
            return
        rc = info.rc
        if qos > 0 and rc in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            self._track(info.mid, topic)
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
            if qos > 0:
                self._last_qos1 = info
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
                "last_error": self._last_error,  # why the latest attempt failed; None once connected
                "last_refused": self._last_refused,  # the latest publish/subscription the broker refused
                "duplicates": sorted(self._duplicates),  # other live instances using our device id
            }

    def status_payload(self, fields: Mapping[str, Any]) -> bytes:
        """The `status` body for `fields`, with this process's `instance` and any `duplicates` added: every
        status this agent publishes (birth, updates, offline, LWT) goes through here."""
        with self._lock:
            dups = sorted(self._duplicates)
        extra: dict[str, Any] = {"instance": self.instance}
        if dups:
            extra["duplicates"] = dups
        return payload("status", **{**fields, **extra})

    def publish_status(self, fields: Mapping[str, Any]) -> None:
        """Publish the retained `status` for `fields` from the daemon's thread. A duplicate seen on the
        network thread between building the body and queueing it would leave a stale body (no `duplicates`)
        as the last word on the topic: then the status is answered again, fresh, after it."""
        with self._lock:
            gen = self._duplicates_gen
        self.publish(self.topics.status, self.status_payload(fields), qos=1, retain=True, kind="state")
        with self._lock:
            stale = gen != self._duplicates_gen
        if stale:
            self._answer_status()

    # ---- paho callbacks (network thread) -----------------------------------------------------
    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if reason.is_failure:
            # Refused (bad credentials, not authorised, ...): paho retries; we are NOT connected. The
            # on_disconnect that follows schedules the retry.
            name = reason.getName() if hasattr(reason, "getName") else str(reason)
            hint = " (check mqtt.username and the password)" if name in _AUTH_REFUSALS else ""
            if "protocol version" in name.lower() and self.protocol == "5":
                hint = ' (an MQTT 3.1.1 broker: set mqtt.protocol: "3.1.1")'
            with self._lock:
                self._refused = True
            self._attempt_failed("refused", f"refused the connection: {name}{hint}")
            return
        with self._lock:
            self._link_up = True
        try:
            self._reclaim_unacked()
            self._subscribe(client)
            if self.shard is None:
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
            self._outage_kinds = set()
            self._last_error = None
            self._attempt = 0
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

    def _subscribe(self, client: paho.Client) -> None:
        """Our commands, the fleet's, the daemon's watches and our own status topic (duplicate ids), in one
        SUBSCRIBE so that one SUBACK says which of them the broker refused."""
        filters = (self.topics.cmd_filter, *self._fleet_filters, *self._watches, self.topics.status)
        if self.shard is not None:
            filters = tuple(self._watches)
            if not filters:
                return
        if self.protocol == "5":
            # noLocal: our own status publishes do not come back to us. retainAsPublished on the command
            # filters: a broker clears the retain flag of what it forwards to a live subscription unless asked
            # to keep it, so a command published retained while we are connected would run like any other
            # (and stay retained). With the flag kept it is seen, ignored and deleted (_on_message).
            commands = {self.topics.cmd_filter, *self._fleet_filters}
            subs: list[tuple[str, Any]] = [
                (f, SubscribeOptions(qos=1, noLocal=f == self.topics.status, retainAsPublished=f in commands))
                for f in filters
            ]
        else:
            # MQTT 3.1.1 has no such option: the flag is seen only on the retained messages sent at subscribe
            # (each connect), which are deleted; one published retained while we are connected runs once.
            subs = [(f, 1) for f in filters]
        result, mid = client.subscribe(subs)
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
            log.warning("MQTT subscribe to %s failed: %s", ", ".join(filters), paho.error_string(result))
            return
        with self._mid_lock:
            self._sub_filters[mid] = filters

    def _on_subscribe(
        self, client: paho.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        with self._mid_lock:
            filters = self._sub_filters.pop(mid, ())
        for topic_filter, code in zip(filters, reason_codes, strict=False):
            if getattr(code, "is_failure", False):
                what = "commands there will not arrive" if "/cmd/" in topic_filter else "not watched"
                self._refusal(f"subscription to {topic_filter}", f"{_reason_name(code)}; {what}")

    def _track(self, mid: int, topic: str) -> None:
        with self._mid_lock:
            early = self._early_refusals.pop(mid, None)
            if early is None:
                self._mid_topics[mid] = topic
                self._mid_topics.move_to_end(mid)
                while len(self._mid_topics) > _MID_TRACK:
                    self._mid_topics.popitem(last=False)
        if early is not None:
            self._refusal(f"publish to {topic}", early)

    def _on_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason_code: Any, properties: Any
    ) -> None:
        refused = getattr(reason_code, "is_failure", False)
        with self._mid_lock:
            topic = self._mid_topics.pop(mid, None)
            if topic is None and refused:  # acknowledged before _send recorded the mid: _track reports it
                self._early_refusals[mid] = _reason_name(reason_code)
                if len(self._early_refusals) > _MID_TRACK:
                    self._early_refusals.pop(next(iter(self._early_refusals)))
                return
        if refused and topic is not None:
            self._refusal(f"publish to {topic}", _reason_name(reason_code))

    def _refusal(self, what: str, reason: str) -> None:
        """The broker refused a publish or a subscription (MQTT 5 reason code, e.g. its ACL): counted, kept
        for stats()/telemetry, logged once per topic."""
        line = f"{what}: {reason}"
        with self._lock:
            self._counts["refused"] += 1
            self._last_refused = line
            first = what not in self._reported and len(self._reported) < _REPORTED_MAX
            if first:
                self._reported.add(what)
        if first:
            log.error(
                "MQTT broker %s:%d refused the %s (the agent needs %s/# and %s/_all/..., see the broker ACL)",
                self.host,
                self.port,
                line,
                self.topics.base,
                self.topics.prefix,
            )

    def _on_own_status(self, raw: bytes, retained: bool) -> None:
        """A status on our own topic from another process (its `instance` differs): a second agent with our
        device id, or the will of an earlier run of ours that the broker publishes late.

        Retained copies (sent at subscribe) are skipped: an earlier run that crashed left one that says
        online. A live agent is seen anyway: it answers our birth with its own (below). Each new instance is
        reported once (ERROR, `duplicates` in our status and stats) and answered with our birth; an offline
        status from another instance replaced ours at the broker, so ours is published again."""
        if retained or self._closed or len(raw) > _STATUS_MAX_BYTES:
            return
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return
        other = body.get("instance") if isinstance(body, dict) else None
        if not isinstance(other, str) or not _INSTANCE.fullmatch(other) or other == self.instance:
            return
        now = time.monotonic()
        with self._lock:
            if body.get("state") == "offline":
                known = self._duplicates.pop(other, None) is not None
                new = False
                self._duplicates_gen += known
            else:
                new = other not in self._duplicates
                if new and len(self._duplicates) >= _DUPLICATES_MAX:
                    self._duplicates.pop(min(self._duplicates, key=self._duplicates.__getitem__))
                self._duplicates[other] = now
                self._duplicates_gen += new
                known = False
            tell = new and self._duplicate_logs < _DUPLICATE_LOGS_MAX
            self._duplicate_logs += tell
        if tell:
            log.error(
                "MQTT: another agent publishes as device id %r (its instance %s, this one %s): both share"
                " every topic, command and retained state; give each agent its own device_id",
                self.topics.device,
                other,
                self.instance,
            )
        elif known:
            log.warning(
                "MQTT: the other agent with device id %r (instance %s) went offline",
                self.topics.device,
                other,
            )
        if new or body.get("state") == "offline":
            self._answer_status()

    def _answer_status(self) -> None:
        """Publish our status again, at most once per _ANSWER_INTERVAL_S: a later request within the interval
        is served once at its end (with the status of that moment), so the last word is always ours."""
        now = time.monotonic()
        with self._lock:
            wait = self._next_answer - now
            if wait > 0:
                if self._answer_timer is not None:
                    return
                self._answer_timer = timer = threading.Timer(wait, self._answer_status_later)
                timer.daemon = True
            else:
                self._next_answer = now + _ANSWER_INTERVAL_S
                timer = None
        if timer is not None:
            timer.start()
            return
        self._send(self.topics.status, self._birth_payload(), 1, True)

    def _answer_status_later(self) -> None:
        with self._lock:
            self._answer_timer = None
            self._next_answer = time.monotonic() + _ANSWER_INTERVAL_S
            live = self._link_up and not self._closed
        if live:
            self._send(self.topics.status, self._birth_payload(), 1, True)

    def _offline_payload(self, reason: str) -> bytes:
        fields: dict[str, Any] = {"state": "offline", "reason": reason}
        if self._offline is not None:
            try:
                fields = dict(self._offline(reason))
            except Exception:
                log.exception("MQTT offline status provider failed; publishing state offline only")
        return self.status_payload(fields)

    def _birth_payload(self) -> bytes:
        fields: dict[str, Any] = {"state": "online"}
        if self._birth is not None:
            try:
                fields = dict(self._birth())
            except Exception:
                log.exception("MQTT birth status provider failed; publishing state online only")
        return self.status_payload(fields)

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
        # DNS, TCP or the TLS handshake failed; _Paho kept the exception paho swallowed.
        error = self._client.attempt_error
        if isinstance(error, ssl.SSLError):
            self._attempt_failed("tls", f"TLS handshake failed: {describe_tls_failure(error)}")
        elif error is None or isinstance(error, OSError):
            self._attempt_failed("unreachable", f"not reachable ({_os_reason(error)})")
        else:  # passed on by _Paho
            why = f"{type(error).__name__}: {error}"
            self._attempt_failed("unexpected", f"connection attempt failed unexpectedly ({why})")
        self._schedule_retry()

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if not self._closed:
            self._refresh_will()  # for the reconnect: cameras may have come or gone since
        with self._lock:
            was_up, self._link_up = self._link_up, False
            self._connected = False
            self._connected_event.clear()
            refused, self._refused = self._refused, False
            if was_up:
                self._down_since = time.monotonic()
                self._outage_kinds = {"unreachable"}  # the "lost" line says it; TCP retries add nothing
        transport, self._transport_error = self._transport_error, None
        if self._closed:
            return
        if was_up:
            from_broker = getattr(flags, "is_disconnect_packet_from_server", False)
            lost = _ERRNO.sub("", transport) if transport else "closed or timed out"
            why = f"broker sent DISCONNECT: {reason}" if from_broker else lost
            with self._lock:
                self._last_error = f"connection lost ({why})"
            log.log(
                self._warn,
                "MQTT connection to %s:%d lost (%s); retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                why,
                self._events.maxlen,
            )
        elif not refused:
            # Connected, but closed before a CONNACK: a TLS alert after the handshake (TLS 1.3 reports a
            # missing client certificate only here), or a broker that hung up on what it got.
            if transport is not None and "[SSL" in transport:
                self._attempt_failed("tls", f"TLS handshake failed: {describe_tls_failure(transport)}")
            else:
                why = _ERRNO.sub("", transport) if transport else "no reason given"
                if self.tls is None:
                    why += "; a TLS port, while mqtt.tls is off?"
                self._attempt_failed("closed", f"closed the connection before accepting it ({why})")
        self._schedule_retry()

    def _on_paho_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        # Network thread only, as is its reader (_on_disconnect): no lock needed.
        if level == paho.MQTT_LOG_ERR and buf.startswith(_TRANSPORT_ERRORS):
            self._transport_error = buf.split(": ", 1)[1]

    def _attempt_failed(self, kind: str, reason: str) -> None:
        """Count a failed connection attempt and keep its reason for stats(); log each kind once per
        outage (paho retries every few seconds: one line, not a line per retry)."""
        with self._lock:
            self._counts["connect_failures"] += 1
            self._last_error = reason
            if self._down_since is None:
                self._down_since = time.monotonic()
            first = kind not in self._outage_kinds
            self._outage_kinds.add(kind)
        if first:
            log.log(
                self._warn,
                "MQTT broker %s:%d: %s; retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                reason,
                self._events.maxlen,
            )

    def _schedule_retry(self) -> None:
        """Set paho's wait before its next attempt (paho's own backoff has no jitter)."""
        with self._lock:
            delay = backoff_delay(self._attempt, *self._delays, self._rng)
            self._attempt += 1
        # reconnect_delay_set() also resets paho's doubling, so its next wait is exactly `delay`
        # (annotated int, but paho sleeps float seconds). Every wait follows on_connect_fail or
        # on_disconnect, where this runs.
        self._client.reconnect_delay_set(min_delay=delay, max_delay=delay)  # type: ignore[arg-type]

    # ---- commands ----------------------------------------------------------------------------
    def on_command(self, action: str, handler: Handler) -> None:
        """Register ``handler(request) -> dict | None`` for ``{prefix}/{device}/cmd/{action}``; `request` is
        the action's validated model (agent.commands). Handlers run one at a time on the router's thread."""
        self.commands.register(action, handler)

    def watch(self, topic_filter: str, callback: Callable[[str, bytes], None]) -> None:
        """Subscribe to `topic_filter` at every connect (before start()); `callback(topic, payload)` runs on
        the network thread and must not block (e.g. the daemon's Home Assistant clean-up)."""
        self._watches[topic_filter] = callback

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            if msg.topic == self.topics.status:
                self._on_own_status(bytes(msg.payload), bool(msg.retain))
                return
            action = self.topics.action_of(msg.topic)
            shared = False
            if action is None:
                action = self.topics.fleet_action_of(msg.topic, self.groups, self.shared)
                shared = action is not None
            if action is None:
                for topic_filter, callback in self._watches.items():
                    if paho.topic_matches_sub(topic_filter, msg.topic):
                        callback(msg.topic, bytes(msg.payload))
                return
            raw = bytes(msg.payload)
            why = self.commands.screen(action, raw, bool(msg.retain), shared=shared)
            if why == "retained" and not shared:  # a shared topic is not ours to clear
                self._send(msg.topic, b"", 1, True)  # an empty retained message deletes it at the broker
            if why is None:
                self.commands.submit(action, raw, self._answer)
        except Exception:
            log.exception("MQTT command on %s failed", msg.topic)

    def _answer(self, answer: Answer) -> None:
        body = payload("cmd-result", **{**answer.body(), "device": self.topics.device})
        self.publish(self.topics.cmd_result(answer.action), body, qos=1)
