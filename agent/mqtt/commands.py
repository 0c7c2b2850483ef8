"""MQTT commands: `{prefix}/{device}/cmd/{action}` -> one pydantic request model per action -> one answer.

Every payload that can be read gets exactly one answer on `.../cmd/{action}/result`: `ok`, `error` (naming
the field), `request_id` echoed when it was valid. What cannot be read at all (not UTF-8, not JSON, too
large, nested too deep, NaN/Infinity, an action name that is no name) is answered with `request_id: null`
while answers stay under a rate limit; beyond it, it is dropped and counted. Nothing from a payload is
ever logged (a 1 MB field must not fill the disk): rejections are logged as counts, at most once per
interval. Retained commands are ignored and cleared (they would run again at every connect), those that
arrive live too: agent.mqtt subscribes to commands with retain-as-published (MQTT 5) so their flag stays
visible; with MQTT 3.1.1 only those sent at subscribe carry it. An empty payload is the broker's way of
deleting a retained message and is ignored.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from engines.precision import REQUESTABLE

log = logging.getLogger("agent.commands")  # its lines keep the name they had (journald, greps)

MAX_PAYLOAD = 16 * 1024  # bytes; the largest real command is well under 1 KB
MAX_DEPTH = 8  # nesting of objects/arrays
_ACTION = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_NAME = r"^[A-Za-z0-9_.-]{1,128}$"  # config names (agent.config.names), bounded

RequestId = Annotated[str, Field(max_length=128)] | Annotated[StrictInt, Field(ge=-(2**53), le=2**53)]


class CommandRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: RequestId | None = None


class RebuildRequest(CommandRequest):
    model: Annotated[str, Field(pattern=_NAME)] | None = None
    force: StrictBool = False
    precision: Literal[REQUESTABLE] | None = None  # type: ignore[valid-type]


class ReloadRequest(CommandRequest):
    pass


class SnapshotRequest(CommandRequest):
    camera: Annotated[str, Field(pattern=_NAME)]


class DeployRequest(CommandRequest):
    """cmd/deploy: the payload is a deployment document. Only request_id is checked here; the document
    itself is checked, strictly (a key given twice included), from the payload's bytes (`raw`) by
    agent.deploy.document, and refused there naming its field."""

    model_config = ConfigDict(extra="allow", frozen=True)
    _raw: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _keep_raw(self, info: ValidationInfo) -> DeployRequest:
        self._raw = (info.context or {}).get("raw", b"")
        return self

    @property
    def raw(self) -> bytes:
        return self._raw


class RollbackRequest(CommandRequest):
    """cmd/rollback {model, to?}: serve the previous version (or `to`) of a deployed model now."""

    model: Annotated[str, Field(pattern=_NAME)]
    to: Annotated[str, Field(pattern=_NAME)] | None = None


REQUESTS: dict[str, type[CommandRequest]] = {
    "rebuild": RebuildRequest,
    "reload": ReloadRequest,
    "snapshot": SnapshotRequest,
    "deploy": DeployRequest,
    "rollback": RollbackRequest,
}

Handler = Callable[[Any], "Mapping[str, Any] | None"]


class CommandError(Exception):
    """A request that was valid but cannot be done (unknown model, camera without a frame, ...);
    `fields` go into the answer beside the error (a deployment's refusal: field, stage, model)."""

    def __init__(self, message: str, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.fields = dict(fields or {})


@dataclass(frozen=True)
class Answer:
    action: str
    ok: bool
    error: str | None
    request_id: str | int | None
    fields: Mapping[str, Any]

    def body(self) -> dict[str, Any]:
        body = {"action": self.action, "ok": self.ok, "error": self.error, **self.fields}
        body["request_id"] = self.request_id
        return body


def _short(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth(obj: Any, limit: int) -> bool:
    """True when `obj` nests at most `limit` containers deep (iterative: no recursion on input)."""
    stack = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return True


def decode(raw: bytes) -> dict[str, Any]:
    """Bytes -> a JSON object within the limits; ValueError with the reason (never the content)."""
    if len(raw) > MAX_PAYLOAD:
        raise ValueError(f"payload too large ({len(raw)} bytes, at most {MAX_PAYLOAD})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"payload is not UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"payload nested too deeply (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ValueError(f"payload is not valid JSON ({where}: {exc.msg})") from None
    except ValueError as exc:  # NaN/Infinity (ours), integers over Python's digit limit
        raise ValueError(f"payload is not valid JSON ({_short(str(exc), 80)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"payload must be a JSON object, got {type(data).__name__}")
    if not _depth(data, MAX_DEPTH):
        raise ValueError(f"payload nested too deeply (at most {MAX_DEPTH} levels)")
    return data


def _field_error(exc: ValidationError) -> str:
    """The first problem, naming the field; pydantic's input values are never included."""
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    loc = ".".join(_short(str(p)) for p in err["loc"])
    kind = err["type"]
    messages = {
        "extra_forbidden": "unknown field",
        "missing": "required field is missing",
        "bool_type": "must be true or false",
        "string_type": "must be a string",
        "int_type": "must be an integer",
        "literal_error": "not an allowed value",
        "string_pattern_mismatch": "must be a name of letters, digits, '_', '-', '.' (at most 128)",
        "string_too_long": "too long",
        "less_than_equal": "out of range",
        "greater_than_equal": "out of range",
    }
    msg = messages.get(kind, _short(str(err["msg"]), 80))
    if kind == "literal_error" and loc == "precision":
        msg = f"must be one of {', '.join(REQUESTABLE)}"
    if loc.startswith("request_id"):
        loc, msg = "request_id", "must be a string (at most 128 characters) or an integer within +-2^53"
    return f"field '{loc}': {msg}"


class RateLimitedLog:
    """At most one line per `interval_s` per key; the lines in between are counted and reported."""

    def __init__(self, interval_s: float = 10.0, keys: int = 64) -> None:
        self._interval = interval_s
        self._lock = threading.Lock()
        # Bounded: keys come from topics (action names) anyone allowed to publish may invent; the key
        # logged longest ago goes first (its suppressed count with it).
        self._keys = keys
        self._last: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._suppressed: dict[str, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._last)

    def __call__(self, level: int, key: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            self._last.move_to_end(key)
            while len(self._last) > self._keys:
                self._suppressed.pop(self._last.popitem(last=False)[0], None)
            suppressed = self._suppressed.pop(key, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.log(level, "%s%s", message, more)


class CommandRouter:
    """Parses, validates and runs commands; see the module docstring. Thread-safe."""

    def __init__(
        self,
        enabled: frozenset[str] | None = None,
        answers_per_s: float = 20.0,
        log_interval_s: float = 10.0,
        backlog: int = 32,
    ) -> None:
        self._handlers: dict[str, Handler] = {}
        # Commands run one at a time on one thread (never on MQTT's network thread); a flood waits in a
        # bounded queue and what does not fit is dropped and counted.
        self._queue: queue.Queue[tuple[str, bytes, Callable[[Answer], None]] | None] = queue.Queue(backlog)
        self._thread: threading.Thread | None = None
        self._enabled = enabled  # None: every registered action
        self._lock = threading.Lock()
        self._rate = answers_per_s
        self._tokens = answers_per_s
        self._refilled = time.monotonic()
        self._log = RateLimitedLog(log_interval_s)
        self.counts = dict.fromkeys(("accepted", "rejected", "dropped", "retained_ignored", "failed"), 0)

    def register(self, action: str, handler: Handler) -> None:
        if action not in REQUESTS:
            raise ValueError(f"no request model for action {action!r}")
        self._handlers[action] = handler

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mqtt-commands", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # full: the daemon thread ends with the process
                self._queue.put_nowait(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, action: str, raw: bytes, answer: Callable[[Answer], None]) -> None:
        """From the network thread: queue the command for the worker (or drop it when the queue is full)."""
        try:
            self._queue.put_nowait((action, raw, answer))
        except queue.Full:
            self._count("dropped")
            self._log(logging.WARNING, "backlog", "MQTT commands dropped: too many waiting")

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            action, raw, answer = item
            try:
                result = self.handle(action, raw)
                if result is not None:
                    answer(result)
            except Exception:  # never let one command end the worker
                log.exception("command %s: answering failed", action)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _may_answer(self) -> bool:
        """Token bucket for answers to unreadable payloads: a flood must not become a reply flood."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
            self._refilled = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def screen(self, action: str, raw: bytes, retained: bool, shared: bool = False) -> str | None:
        """On the network thread, cheap: None to go on with `handle`, else why the message is ignored
        ("retained": the caller clears it unless `shared`, a fleet topic; "empty"; "bad action")."""
        if not _ACTION.match(action):
            self._count("dropped")
            self._log(logging.WARNING, "bad-action", "MQTT command with an invalid action name dropped")
            return "bad action"
        if not raw:
            return "empty"
        if retained:
            self._count("retained_ignored")
            done = "ignored (left on the shared fleet topic)" if shared else "ignored and cleared"
            self._log(
                logging.WARNING,
                f"retained-{action}",
                f"command {action}: retained message {done} (retained commands would run "
                "again at every connect; publish commands with retain=false)",
            )
            return "retained"
        return None

    def handle(self, action: str, raw: bytes) -> Answer | None:
        """Decode, validate and run one command; the answer to publish, or None when dropped."""
        try:
            data = decode(raw)
        except ValueError as exc:
            return self._reject(action, None, str(exc), readable=False)
        model = REQUESTS.get(action)
        if model is None:
            known = ", ".join(sorted(self._handlers)) or "none"
            return self._reject(action, _valid_id(data), f"unknown action {action!r} (known: {known})")
        if self._enabled is not None and action not in self._enabled:
            return self._reject(action, _valid_id(data), f"action {action!r} is disabled (mqtt.commands)")
        try:
            request = model.model_validate(data, context={"raw": raw})
        except ValidationError as exc:
            return self._reject(action, _valid_id(data), _field_error(exc))
        handler = self._handlers.get(action)
        if handler is None:
            return self._reject(action, request.request_id, f"action {action!r} is not available here")
        try:
            fields = handler(request) or {}
        except CommandError as exc:
            return self._reject(action, request.request_id, str(exc), fields=exc.fields)
        except Exception as exc:  # a bug in a handler: its traceback helps; the caller still gets an answer
            self._count("failed")
            log.exception("command %s failed", action)
            return Answer(action, False, f"internal error: {type(exc).__name__}", request.request_id, {})
        self._count("accepted")
        log.info("command %s accepted", action)
        return Answer(action, True, None, request.request_id, dict(fields))

    def _reject(
        self,
        action: str,
        request_id: Any,
        error: str,
        readable: bool = True,
        fields: Mapping[str, Any] | None = None,
    ) -> Answer | None:
        if not readable and not self._may_answer():
            self._count("dropped")
            self._log(logging.WARNING, "dropped", "MQTT commands dropped: unreadable payloads over the limit")
            return None
        self._count("rejected")
        # One key for every unknown action: invented names must not each get a line (and a key).
        key = f"rejected-{action}" if action in REQUESTS else "rejected-unknown"
        self._log(logging.WARNING, key, f"command {action} rejected: {error}")
        return Answer(action, False, error, request_id, dict(fields or {}))


def _valid_id(data: Mapping[str, Any]) -> str | int | None:
    """The request_id to echo in an error answer: only one that is itself valid."""
    rid = data.get("request_id")
    if isinstance(rid, str) and len(rid) <= 128:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and abs(rid) <= 2**53:
        return rid
    return None
