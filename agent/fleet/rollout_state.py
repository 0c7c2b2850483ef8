"""The state of a rollout: the retained `{prefix}/_fleet/rollouts/{id}` document (edge-agent/rollout/1).

Written (retained, QoS 1) at every change by the CLI that drives the rollout, so that `fleet rollouts` shows
it from any machine and `fleet deploy --resume ID` goes on from it. It never holds the deployment document
itself (its artifact URLs may carry credentials): only its digest, model, version and request_id.

Everything read back comes from the network: `Rollout.from_payload` checks every field and raises
RolloutStateError (one line naming the field) for anything it cannot use; nothing read is trusted further.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.fleet.rollout_plan import PlanError, RolloutOptions, check_names

SCHEMA = "edge-agent/rollout/1"
MAX_PAYLOAD = 4 << 20  # 10,000 devices of a few hundred bytes each
MAX_TEXT = 512  # a reason; longer ones are cut
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Rollout status
RUNNING, HALTED, DONE, ROLLED_BACK = "running", "halted", "done", "rolled_back"
STATUSES = (RUNNING, HALTED, DONE, ROLLED_BACK)

# A device's stage in the rollout (its own deployment stage is `deployment`)
PENDING, DEPLOYING, SOAKING = "pending", "deploying", "soaking"
SUCCEEDED, FAILED, SKIPPED = "done", "failed", "skipped"
ROLLING_BACK, ROLLED_BACK_D, ROLLBACK_FAILED = "rolling_back", "rolled_back", "rollback_failed"
DEVICE_STAGES = (
    PENDING,
    DEPLOYING,
    SOAKING,
    SUCCEEDED,
    FAILED,
    SKIPPED,
    ROLLING_BACK,
    ROLLED_BACK_D,
    ROLLBACK_FAILED,
)
WAVE_OVER = frozenset({SUCCEEDED, FAILED, SKIPPED})  # a wave is over when each of its devices is in one


class RolloutStateError(ValueError):
    """A retained rollout document that cannot be used; the message names the field."""


def new_id(now: float | None = None) -> str:
    """`r-YYYYmmdd-HHMMSS-xxxx` (UTC; sorts by start time; 4 random hex digits against a clash)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"r-{stamp}-{secrets.token_hex(2)}"


def check_id(text: str) -> str:
    if not ID.fullmatch(text):
        raise PlanError(f"rollout id {text[:40]!r}: must be [A-Za-z0-9][A-Za-z0-9._-]* (at most 64)")
    return text


def topic(prefix: str, rollout_id: str) -> str:
    return f"{prefix}/_fleet/rollouts/{rollout_id}"


def clean(text: Any, limit: int = MAX_TEXT) -> str | None:
    """A device's text as shown: printable characters only (no terminal escapes), at most `limit`."""
    if text is None:
        return None
    s = "".join(c if c.isprintable() else " " for c in str(text)[: limit * 2])
    return s[:limit]


@dataclass
class DeviceRecord:
    """One device of a rollout. Times are wall-clock seconds (they are read back on another machine)."""

    device: str
    wave: int
    stage: str = PENDING
    deployment: str | None = None  # the device's deployment stage last seen (accepted ... serving)
    progress: float = 0.0
    reason: str | None = None
    sent_at: float | None = None
    serving_at: float | None = None
    ended_at: float | None = None
    promoted: bool = False  # this rollout's version was promoted on it (rolled back on a halt)
    already: bool = False  # it served the version already ("already serving": not changed by us)
    previous: str | None = None  # the version it served before (its deployment state's `previous`)

    def move(self, stage: str, reason: str | None = None, now: float | None = None) -> None:
        self.stage, self.reason = stage, clean(reason)
        if stage in WAVE_OVER or stage in (ROLLED_BACK_D, ROLLBACK_FAILED):
            self.ended_at = time.time() if now is None else now


@dataclass
class Rollout:
    id: str
    model: str
    version: str
    request_id: str | int | None
    digest: str  # sha256 of the document's canonical form (agent.deploy.document.document_digest)
    targets: list[str]
    waves: list[list[str]]
    options: RolloutOptions
    status: str = RUNNING
    halted_reason: str | None = None
    wave: int = 0  # the wave under way (index into waves)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    driver: str | None = None  # host:pid of the CLI driving it (a `running` one whose driver died: resume)
    devices: dict[str, DeviceRecord] = field(default_factory=dict)

    @classmethod
    def create(
        cls, rid: str, doc: Any, digest: str, waves: list[list[str]], options: RolloutOptions
    ) -> Rollout:
        devices = {d: DeviceRecord(d, i) for i, wave in enumerate(waves) for d in wave}
        targets = [d for wave in waves for d in wave]
        return cls(
            rid, doc.model, doc.version, doc.request_id, digest, targets, waves, options, devices=devices
        )

    def failures(self) -> int:
        return sum(1 for r in self.devices.values() if r.stage == FAILED)

    def fields(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "id": self.id,
            "model": self.model,
            "version": self.version,
            "request_id": self.request_id,
            "digest": self.digest,
            "status": self.status,
            "halted_reason": self.halted_reason,
            "wave": self.wave,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "driver": self.driver,
            "options": self.options.fields(),
            "targets": list(self.targets),
            "waves": [list(w) for w in self.waves],
            "devices": {
                d: {k: v for k, v in asdict(r).items() if k != "device"} for d, r in self.devices.items()
            },
        }

    def payload(self) -> bytes:
        return json.dumps(self.fields(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_payload(cls, raw: bytes) -> Rollout:
        """The rollout of a retained payload; RolloutStateError (naming the field) for anything unusable."""
        if len(raw) > MAX_PAYLOAD:
            raise RolloutStateError(f"larger than {MAX_PAYLOAD} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise RolloutStateError("not JSON (UTF-8)") from None
        if not isinstance(body, dict):
            raise RolloutStateError("not a JSON object")
        if body.get("schema") != SCHEMA:
            raise RolloutStateError(f"schema: not {SCHEMA}")
        try:
            return _parse(body)
        except KeyError as exc:
            raise RolloutStateError(f"{exc.args[0]}: missing") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:  # PlanError: a ValueError
            raise RolloutStateError(clean(exc, 200) or "unusable") from None


def _text(body: dict[str, Any], key: str, optional: bool = False) -> Any:
    value = body[key]
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise TypeError(f"{key}: must be a string (at most {MAX_TEXT})")
    return value


def _num(body: dict[str, Any], key: str, optional: bool = False) -> Any:
    value = body[key]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{key}: must be a number")  # not NaN or Infinity: --json prints what it read
    return float(value)


def _parse(body: dict[str, Any]) -> Rollout:
    rid = check_id(_text(body, "id"))
    status = _text(body, "status")
    if status not in STATUSES:
        raise ValueError(f"status: not one of {', '.join(STATUSES)}")
    request_id = body["request_id"]
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, (str, int))):
        raise TypeError("request_id: must be a string, an integer or null")
    if not isinstance(body["options"], dict):
        raise TypeError("options: must be an object")
    waves_raw = body["waves"]
    if not isinstance(waves_raw, list) or not all(isinstance(w, list) for w in waves_raw):
        raise TypeError("waves: must be a list of lists of device ids")
    waves = [
        check_names(w, "waves") if all(isinstance(d, str) for d in w) else _bad("waves") for w in waves_raw
    ]
    targets = [d for w in waves for d in w]
    if len(set(targets)) != len(targets):
        raise ValueError("waves: a device is in two waves")
    wave = body["wave"]
    if type(wave) is not int or not 0 <= wave <= len(waves):
        raise ValueError("wave: must be an index of waves")
    devices_raw = body["devices"]
    if not isinstance(devices_raw, dict) or set(devices_raw) != set(targets):
        raise ValueError("devices: must hold exactly the devices of the waves")
    where = {d: i for i, w in enumerate(waves) for d in w}
    devices = {d: _device(d, where[d], devices_raw[d]) for d in targets}
    digest = _text(body, "digest")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError("digest: must be 64 lowercase hex digits")
    return Rollout(
        rid,
        _text(body, "model"),
        _text(body, "version"),
        request_id,
        digest,
        targets,
        waves,
        RolloutOptions.from_fields(body["options"]),
        status,
        _text(body, "halted_reason", True),
        wave,
        _num(body, "created_at"),
        _num(body, "updated_at"),
        _text(body, "driver", True),
        devices,
    )


def _bad(where: str) -> list[str]:
    raise TypeError(f"{where}: device ids must be strings")


def _device(device: str, wave: int, d: Any) -> DeviceRecord:
    if not isinstance(d, dict):
        raise TypeError(f"devices.{device}: must be an object")
    stage = d["stage"]
    if stage not in DEVICE_STAGES:
        raise ValueError(f"devices.{device}.stage: not a rollout stage")
    rec = DeviceRecord(device, wave, stage)
    rec.deployment = clean(_text(d, "deployment", True), 32)
    rec.progress = min(1.0, max(0.0, _num(d, "progress")))
    rec.reason = clean(_text(d, "reason", True))
    rec.sent_at, rec.serving_at = _num(d, "sent_at", True), _num(d, "serving_at", True)
    rec.ended_at = _num(d, "ended_at", True)
    for flag in ("promoted", "already"):
        if type(d[flag]) is not bool:
            raise TypeError(f"devices.{device}.{flag}: must be true or false")
        setattr(rec, flag, d[flag])
    rec.previous = _text(d, "previous", True)
    return rec
