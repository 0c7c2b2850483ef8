"""What a build claim is on the wire, and who wins (docs/DESIGN.md "Fleet: engine cache, build claims,
rollouts"). No MQTT here: agent.fleet.claims moves these bytes, tests and tools read them.

    topic    {prefix}/_fleet/builds/{key}/{device}            retained; one per claiming device
    payload  {"device": D, "key": K, "claimed_at": unix s, "expires": unix s}
    release  an empty retained payload on the same topic

A device writes only its own topic, so a broker ACL (`pattern write {prefix}/_fleet/builds/+/%u`) keeps any
device from claiming, renewing or releasing as another. The winner is the unexpired claim with the smallest
(claimed_at, device); a renewal keeps claimed_at and moves `expires`, so the winner stays the winner.

Payloads come from the network: anything not exactly this shape (not JSON, wrong types, NaN, a device or
key other than the topic's, an absurd lifetime, too large) is no claim at all: it never wins.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.mqtt.topics import check_name

BUILDS = "_fleet/builds"
MAX_PAYLOAD = 1024  # a claim is ~120 bytes
# A claim renewed for longer than this is no build (config caps claim_ttl_s at a day): junk, ignored.
MAX_HELD_S = 2 * 86_400.0
# An OCI tag (the key is the cache artifact's tag): also one clean MQTT topic level.
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class ClaimsUnavailable(RuntimeError):
    """Claims cannot be made or read (broker unreachable, refused, an ACL that drops our claim). One line,
    safe to log: host and port, never credentials. The caller builds without agreement."""


def check_key(key: str) -> str:
    """`key` if it can name a claim (an OCI tag: letters, digits, '.', '_', '-', at most 128); ValueError."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(
            f"build claim key {str(key)[:80]!r}: must be an OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]*, "
            "at most 128 characters)"
        )
    return key


def key_filter(prefix: str, key: str) -> str:
    """The subscription for every device's claim on `key`."""
    return f"{prefix}/{BUILDS}/{check_key(key)}/+"


def claim_topic(prefix: str, key: str, device: str) -> str:
    return f"{prefix}/{BUILDS}/{check_key(key)}/{check_name(device, 'device')}"


def topic_parts(prefix: str, topic: str) -> tuple[str, str] | None:
    """(key, device) of a claim topic under `prefix`, None for any other topic."""
    head = f"{prefix}/{BUILDS}/"
    if not topic.startswith(head):
        return None
    levels = topic[len(head) :].split("/")
    if len(levels) != 2 or not all(levels) or not _KEY.fullmatch(levels[0]):
        return None
    return levels[0], levels[1]


@dataclass(frozen=True)
class Claim:
    device: str
    key: str
    claimed_at: float
    expires: float

    def live(self, now: float) -> bool:
        return now < self.expires

    def order(self) -> tuple[float, str]:
        return self.claimed_at, self.device

    def payload(self) -> bytes:
        body = {
            "device": self.device,
            "key": self.key,
            "claimed_at": self.claimed_at,
            "expires": self.expires,
        }
        return json.dumps(body, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # an integer of 309+ digits
        return None
    return out if math.isfinite(out) else None


def parse_claim(key: str, device: str, raw: bytes) -> Claim | None:
    """The claim in `raw` on topic (key, device); None for anything that is not a well-formed claim of that
    device on that key. Never raises."""
    if not raw or len(raw) > MAX_PAYLOAD:
        return None
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(body, dict) or body.get("device") != device or body.get("key") != key:
        return None
    claimed_at, expires = _number(body.get("claimed_at")), _number(body.get("expires"))
    if claimed_at is None or expires is None or not 0 <= expires - claimed_at <= MAX_HELD_S:
        return None
    return Claim(device, key, claimed_at, expires)


def winner(claims: Iterable[Claim], now: float) -> Claim | None:
    """The unexpired claim with the smallest (claimed_at, device), None when there is none."""
    return min((c for c in claims if c.live(now)), key=Claim.order, default=None)
