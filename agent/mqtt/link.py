"""The connection to the broker: paho's client, reconnect backoff, and what each failure is reported as.

- TLS (``mqtt.tls``): the SSLContext comes from ``agent.mqtt.tls``, the same builder that checks the config's
  files at load. No verification only with ``insecure: true``, warned.
- Retries: before each of paho's waits, ``backoff_delay`` (capped exponential with jitter) is set as
  paho's next delay, so a broker that is back is found within ``reconnect_max_s``.
- Failures (unreachable, TLS, refused, closed) are logged once per outage and kind with host:port and
  the reason, never a credential or a traceback; ``last_error`` has the latest.
"""

from __future__ import annotations

import logging
import random
import re
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from agent.mqtt.errors import MqttError
from agent.mqtt.settings import MqttSettings
from agent.mqtt.tls import TlsFileError, TlsOptions, client_context, describe_tls_failure

# One logger for the whole client (its name is what operators filter on), paho's below it.
log = logging.getLogger("agent.mqtt")


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


_paho_log = logging.getLogger("agent.mqtt.paho")
_paho_log.addFilter(_DemotePahoErrors())

# paho reports why a read failed (a TLS alert, a reset) only in its log: on_log keeps the latest.
_TRANSPORT_ERRORS = ("failed to receive on socket: ", "timeout on socket: ")
_AUTH_REFUSALS = ("Not authorized", "Bad user name or password")
_ERRNO = re.compile(r"^\[Errno -?\d+\] ")


def backoff_delay(attempt: int, min_delay: float, max_delay: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (0: the first after a failure or a loss).

    Capped exponential backoff with jitter: the ceiling doubles from ``min_delay`` up to ``max_delay``
    and the wait is drawn from [ceiling / 2, ceiling]. Agents that lost the same broker at the same
    moment thus spread their retries instead of arriving together, and a broker that is back is found
    within ``max_delay``.
    """
    ceiling = min(max_delay, min_delay * 2.0 ** min(attempt, 30))
    return rng.uniform(ceiling / 2, ceiling)


def reason_name(code: Any) -> str:
    """An MQTT reason code as 'Name (0xNN)'."""
    name = code.getName() if hasattr(code, "getName") else str(code)
    return f"{name} (0x{int(getattr(code, 'value', 0)):02x})"


def _os_reason(error: OSError | None) -> str:
    if error is None:
        return "connection failed"
    return str(error.strerror or error or type(error).__name__)


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


def _make_paho(cfg: MqttSettings, client_id: str) -> _Paho:
    if cfg.protocol == "5":
        # MQTT 5: the broker says why it refuses a publish or a subscription (reason codes), which
        # is how an ACL that is too tight gets reported instead of messages vanishing silently.
        c = _Paho(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    else:
        c = _Paho(
            CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True, protocol=paho.MQTTv311
        )
    # A bug in a callback must not kill paho's network thread (it would silently stop reconnecting).
    c.suppress_exceptions = True
    c.enable_logger(_paho_log)
    if cfg.username is not None:
        c.username_pw_set(cfg.username, cfg.read_password())
    c.reconnect_delay_set(min_delay=cfg.reconnect_min_s, max_delay=cfg.reconnect_max_s)  # type: ignore[arg-type]
    return c


class Link:
    """paho's client and the state of the connection: up or not, since when, why the last attempt failed.

    `on_up(client)` runs on the network thread once the broker accepted the connection (the session is
    restored there), `on_down()` when it is gone; `queue_limit` is only told in the log lines."""

    def __init__(
        self,
        cfg: MqttSettings,
        client_id: str,
        *,
        quiet: bool,
        queue_limit: int,
        on_up: Callable[[paho.Client], None],
        on_down: Callable[[], None],
    ) -> None:
        self.host, self.port, self.keepalive, self.protocol = cfg.host, cfg.port, cfg.keepalive, cfg.protocol
        self.tls: TlsOptions | None = cfg.tls.options() if cfg.tls is not None else None
        self.closed = False
        # quiet: the demo tries a broker that may simply not exist; connection trouble goes to DEBUG.
        self.warn_level = logging.DEBUG if quiet else logging.WARNING
        self._info = logging.DEBUG if quiet else logging.INFO
        self._queue_limit = queue_limit
        self._on_up, self._on_down = on_up, on_down
        self._lock = threading.Lock()
        self._ever_connected = False
        self.up = False  # CONNACK accepted (the client counts as connected once its offline queue is sent)
        self._down_since: float | None = None
        # Each kind of failure (unreachable, tls, refused, closed) is logged once per outage.
        self._outage_kinds: set[str] = set()
        self.last_error: str | None = None
        self._refused = False
        self._transport_error: str | None = None
        self._attempt = 0
        self._delays = (cfg.reconnect_min_s, cfg.reconnect_max_s)
        self._rng = random.Random()
        self.counts = {"reconnects": 0, "connect_failures": 0}
        c = self.paho = _make_paho(cfg, client_id)
        if self.tls is not None:
            self._set_up_tls(self.tls)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_log = self._on_paho_log

    def _set_up_tls(self, opts: TlsOptions) -> None:
        try:
            self.paho.tls_set_context(client_context(opts))
        except TlsFileError as exc:
            raise MqttError(f"mqtt tls {exc}") from None
        if opts.insecure:
            self.paho.tls_insecure_set(
                True
            )  # the context checks nothing: paho must not check the name either
            # Always WARNING, even when quiet: this is a security decision, not connection noise.
            log.warning(
                "MQTT TLS to %s:%d WITHOUT certificate verification (mqtt.tls.insecure: true): anyone on"
                " the network path can pose as the broker and read the credentials and all data",
                self.host,
                self.port,
            )

    def connect(self) -> None:
        """Set up the first attempt (made by the network thread, see run())."""
        try:
            if self.protocol == "5":  # a clean session every time, as clean_session=True in 3.1.1
                self.paho.connect_async(self.host, self.port, keepalive=self.keepalive, clean_start=True)
            else:
                self.paho.connect_async(self.host, self.port, keepalive=self.keepalive)
        except (OSError, ValueError) as exc:  # e.g. an invalid host string
            raise MqttError(f"mqtt host {self.host!r} port {self.port}: {exc}") from None

    def run(self) -> None:
        self.paho.loop_start()

    def stop(self, graceful: bool, deadline: float) -> None:
        """DISCONNECT (graceful) and end the network thread by `deadline` (monotonic) at the latest; not
        graceful: drop the socket without DISCONNECT, so the broker publishes the will."""
        c = self.paho
        if graceful:
            c.disconnect()
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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "last_error": self.last_error}

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
            self.up = True
        self._on_up(client)
        with self._lock:
            reconnect = self._ever_connected
            if reconnect:
                self.counts["reconnects"] += 1
            self._ever_connected = True
            self._outage_kinds = set()
            self.last_error = None
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

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        # DNS, TCP or the TLS handshake failed; _Paho kept the exception paho swallowed.
        error = self.paho.attempt_error
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
        self._on_down()
        with self._lock:
            was_up, self.up = self.up, False
            refused, self._refused = self._refused, False
            if was_up:
                self._down_since = time.monotonic()
                self._outage_kinds = {"unreachable"}  # the "lost" line says it; TCP retries add nothing
        transport, self._transport_error = self._transport_error, None
        if self.closed:
            return
        if was_up:
            from_broker = getattr(flags, "is_disconnect_packet_from_server", False)
            lost = _ERRNO.sub("", transport) if transport else "closed or timed out"
            why = f"broker sent DISCONNECT: {reason}" if from_broker else lost
            with self._lock:
                self.last_error = f"connection lost ({why})"
            log.log(
                self.warn_level,
                "MQTT connection to %s:%d lost (%s); retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                why,
                self._queue_limit,
            )
        elif not refused:
            self._closed_before_accepting(transport)
        self._schedule_retry()

    def _closed_before_accepting(self, transport: str | None) -> None:
        # Connected, but closed before a CONNACK: a TLS alert after the handshake (TLS 1.3 reports a
        # missing client certificate only here), or a broker that hung up on what it got.
        if transport is not None and "[SSL" in transport:
            self._attempt_failed("tls", f"TLS handshake failed: {describe_tls_failure(transport)}")
            return
        why = _ERRNO.sub("", transport) if transport else "no reason given"
        if self.tls is None:
            why += "; a TLS port, while mqtt.tls is off?"
        self._attempt_failed("closed", f"closed the connection before accepting it ({why})")

    def _on_paho_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        # Network thread only, as is its reader (_on_disconnect): no lock needed.
        if level == paho.MQTT_LOG_ERR and buf.startswith(_TRANSPORT_ERRORS):
            self._transport_error = buf.split(": ", 1)[1]

    def _attempt_failed(self, kind: str, reason: str) -> None:
        """Count a failed connection attempt and keep its reason for stats(); log each kind once per
        outage (paho retries every few seconds: one line, not a line per retry)."""
        with self._lock:
            self.counts["connect_failures"] += 1
            self.last_error = reason
            if self._down_since is None:
                self._down_since = time.monotonic()
            first = kind not in self._outage_kinds
            self._outage_kinds.add(kind)
        if first:
            log.log(
                self.warn_level,
                "MQTT broker %s:%d: %s; retrying in the background, queueing up to %d events",
                self.host,
                self.port,
                reason,
                self._queue_limit,
            )

    def _schedule_retry(self) -> None:
        """Set paho's wait before its next attempt (paho's own backoff has no jitter)."""
        with self._lock:
            delay = backoff_delay(self._attempt, *self._delays, self._rng)
            self._attempt += 1
        # reconnect_delay_set() also resets paho's doubling, so its next wait is exactly `delay`
        # (annotated int, but paho sleeps float seconds). Every wait follows on_connect_fail or
        # on_disconnect, where this runs.
        self.paho.reconnect_delay_set(min_delay=delay, max_delay=delay)  # type: ignore[arg-type]
