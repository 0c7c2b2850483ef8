"""`edge-agent fleet status`: a table of every agent on a broker, built from retained messages only.

No fleet server: every agent keeps its `status`, camera states and engine states retained under
``{prefix}/{device}/...``, so one subscription to those topics returns the whole fleet at once (the broker
sends the retained copies right after SUBACK). Collection ends when the broker has been quiet for a moment.

Everything read here comes from the network: payloads may be missing, not JSON, of the wrong types or
hostile (terminal escapes in a device name); each field is checked and shown as "?" when unusable.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.mqtt.tls import TlsFileError, TlsOptions, client_context

MAX_PAYLOAD = 256 * 1024  # an agent's retained messages are a few hundred bytes
COLUMNS = ("device", "state", "version", "cameras", "fps", "engines", "tensorrt", "last_seen")


class FleetError(RuntimeError):
    """The broker could not be read (unreachable, refused, TLS); the message names host and port only."""


@dataclass
class DeviceView:
    """What the broker holds for one device id."""

    status: dict[str, Any] | None = None
    cameras: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    unreadable: int = 0  # retained payloads that were not JSON objects
    last_ts: float | None = None

    def seen(self, body: Mapping[str, Any]) -> None:
        ts = _number(body.get("ts"))
        if ts is not None and (self.last_ts is None or ts > self.last_ts):
            self.last_ts = ts


def client_id() -> str:
    """This reader's MQTT client id: ``edge-agent-fleet.<16 hex>``. An agent's is
    ``{prefix}-{device}-<8 hex>`` (``-shard<k>`` added in a shard), so it always ends in ``-`` and 8 hex
    digits or in ``-shard<k>``; this one's last 9 characters are hex digits, so whatever the prefix and
    device ids, it never equals one: a broker would otherwise drop the agent's session for ours (same
    client id). The reader only subscribes: no will, no publish, nothing on any device's topics."""
    return f"edge-agent-fleet.{secrets.token_hex(8)}"


def filters(prefix: str) -> list[str]:
    return [f"{prefix}/+/status", f"{prefix}/+/cameras/+/state", f"{prefix}/+/engines/+"]


def collect(
    host: str,
    port: int,
    prefix: str,
    *,
    username: str | None = None,
    password: str | None = None,
    tls: TlsOptions | None = None,
    quiet_s: float = 0.5,
    timeout_s: float = 10.0,
) -> dict[str, DeviceView]:
    """Device id -> DeviceView from the retained messages under ``prefix``; FleetError if the broker cannot
    be read within ``timeout_s``."""
    if not prefix or any(ch in prefix for ch in "+#\x00") or prefix.startswith("/") or prefix.endswith("/"):
        raise FleetError(f"prefix {prefix!r}: must be a topic prefix without '+', '#' or an outer '/'")
    if not 1 <= port <= 65535:
        raise FleetError(f"port {port}: must be 1..65535")
    if not host or host != host.strip():
        raise FleetError(f"host {host!r}: must be a host name or IP address")
    if not (0 <= quiet_s < math.inf and 0 < timeout_s < math.inf):  # NaN fails both
        raise FleetError(f"quiet_s {quiet_s!r}, timeout_s {timeout_s!r}: must be finite, >= 0 and > 0")
    reader = _Reader(prefix)
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id(), clean_session=True)
    if username is not None:
        c.username_pw_set(username, password)
    if tls is not None:
        try:
            c.tls_set_context(client_context(tls))
        except TlsFileError as exc:
            raise FleetError(f"tls {exc}") from None
        if tls.insecure:
            c.tls_insecure_set(True)
    c.on_connect, c.on_subscribe, c.on_message = reader.on_connect, reader.on_subscribe, reader.on_message
    where = f"broker {host}:{port}"
    try:
        c.connect(host, port, keepalive=30)
    except (OSError, ValueError) as exc:
        raise FleetError(f"{where}: not reachable ({getattr(exc, 'strerror', None) or exc})") from None
    c.loop_start()
    try:
        return reader.wait(where, quiet_s, timeout_s)
    finally:
        c.disconnect()
        c.loop_stop()


class _Reader:
    """The retained messages under `prefix`, as paho's network thread delivers them."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self._head = prefix, f"{prefix}/"
        self._views: dict[str, DeviceView] = {}
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._failed: list[str] = []
        self._last = time.monotonic()

    def wait(self, where: str, quiet_s: float, timeout_s: float) -> dict[str, DeviceView]:
        """The views once nothing new came for `quiet_s` after the subscription; FleetError on a refusal or
        when the broker does not answer within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._failed:
            if self._subscribed.is_set() and time.monotonic() - self._last >= quiet_s:
                break
            time.sleep(0.05)
        if self._failed:
            raise FleetError(f"{where}: {self._failed[0]}")
        if not self._subscribed.is_set():
            raise FleetError(f"{where}: no answer within {timeout_s:g} s")
        with self._lock:
            return dict(self._views)

    def on_connect(self, c: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            self._failed.append(f"refused the connection: {reason}")
            return
        c.subscribe([(f, 1) for f in filters(self.prefix)])

    def on_subscribe(self, _c: paho.Client, _u: Any, _mid: int, codes: Any, _p: Any) -> None:
        refused = [str(code) for code in codes if code.is_failure]
        if refused:
            self._failed.append(f"refused the subscription to {self.prefix}/+/...: {', '.join(refused)}")
        self._last = time.monotonic()
        self._subscribed.set()

    def on_message(self, _c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        if not msg.topic.startswith(self._head) or not msg.payload:  # empty: a deleted retained message
            return
        levels = msg.topic[len(self._head) :].split("/")
        with self._lock:
            self._last = time.monotonic()
            view = self._views.setdefault(levels[0], DeviceView())
            try:
                body = json.loads(msg.payload) if len(msg.payload) <= MAX_PAYLOAD else None
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                body = None
            if not isinstance(body, dict):
                view.unreadable += 1
                return
            view.seen(body)
            if levels[1:] == ["status"]:
                view.status = body
            elif len(levels) == 4 and levels[1] == "cameras":
                view.cameras[levels[2]] = body
            elif len(levels) == 3 and levels[1] == "engines":
                view.engines[levels[2]] = body


def rows(views: Mapping[str, DeviceView], now: float | None = None) -> list[dict[str, Any]]:
    """One row per device (sorted by id): the COLUMNS plus `reason`, `duplicates` and `unreadable`."""
    now = time.time() if now is None else now
    out = []
    for device in sorted(views):
        v = views[device]
        st = v.status or {}
        up, total = _int(st.get("cameras_up")), _int(st.get("cameras_total"))
        fps = [_number(c.get("fps_out")) for c in v.cameras.values() if c.get("state") == "streaming"]
        dups = st.get("duplicates")
        out.append(
            {
                "device": device,
                "state": _word(st.get("state")) if v.status is not None else "no status",
                "reason": _word(st.get("reason")) if st.get("reason") is not None else None,
                "version": _word(st.get("version")),
                "cameras": f"{_show(up)}/{_show(total)}" if v.status is not None else "?",
                "fps": round(sum(f for f in fps if f is not None), 1),
                "engines": {_word(m): _word(e.get("state")) for m, e in sorted(v.engines.items())},
                # built | cache | store: the engine's (a sharded device's: its supervisor's job's, as every
                # shard serves it); None before a model has one
                "origins": {_word(m): _origin(e) for m, e in sorted(v.engines.items())},
                "tensorrt": sorted({_runtime(e) for e in v.engines.values()}),
                "last_seen": None if v.last_ts is None else round(max(0.0, now - v.last_ts), 1),
                "duplicates": len(dups) if isinstance(dups, list) else 0,
                "unreadable": v.unreadable,
            }
        )
    return out


def render(table: list[dict[str, Any]]) -> str:
    """A plain-text table: one line per device, offline agents with their reason, duplicates flagged."""
    if not table:
        return "no agents found (no retained status under this prefix)"
    lines = [list(COLUMNS)]
    for r in table:
        state = r["state"] + (f" ({r['reason']})" if r["reason"] else "")
        if r["duplicates"]:
            state += f" DUPLICATE ID: {r['duplicates'] + 1} agents"
        origins = r.get("origins") or {}
        engines = ", ".join(_engine_cell(m, s, origins.get(m)) for m, s in r["engines"].items()) or "-"
        seen = "?" if r["last_seen"] is None else _ago(r["last_seen"])
        lines.append(
            [
                r["device"],
                state,
                r["version"],
                r["cameras"],
                f"{r['fps']:g}",
                engines,
                ", ".join(r["tensorrt"]) or "-",
                seen,
            ]
        )
    widths = [max(len(_cell(line[i])) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(_cell(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


# ---- untrusted values -> display ----------------------------------------------------------------
def _cell(value: Any) -> str:
    # Device ids come from topic levels anyone with write access chose: no control characters on a terminal.
    text = str(value)
    return "".join(ch if ch.isprintable() else "?" for ch in text)[:64]


def _origin(engine: Mapping[str, Any]) -> str | None:
    origin = engine.get("origin")
    return None if origin is None else _word(origin)


def _engine_cell(model: str, state: str, origin: str | None) -> str:
    """"detector:ready (cache)": the state, and where the engine came from when it has one."""
    return f"{model}:{state}" + (f" ({origin})" if origin else "")


def _word(value: Any) -> str:
    return _cell(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "?"


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _show(value: int | None) -> str:
    return "?" if value is None else str(value)


def _runtime(engine: Mapping[str, Any]) -> str:
    """What serves the model: the engine's TensorRT (flavour and version) while one is loaded, else the
    backend the state names (an engine built but not loaded, in fallback, does not serve: issue 36.2)."""
    fp = engine.get("fingerprint")
    serving = engine.get("loaded") is not False and engine.get("state") != "fallback"
    if serving and isinstance(fp, dict) and fp.get("trt_version") is not None:
        flavor = "TensorRT-RTX" if fp.get("trt_flavor") == "tensorrt_rtx" else "TensorRT"
        return f"{flavor} {_word(fp.get('trt_version'))}"
    backend = engine.get("backend")
    return _word(backend) if backend is not None else "?"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"
