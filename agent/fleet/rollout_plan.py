"""A rollout's plan: its options, checked, and its waves (pure functions; agent/fleet/rollout.py runs them).

    opts = RolloutOptions(canary=1, batch=parse_batch("25%"), max_failures=0, soak_s=60)
    waves = plan_waves(["a", "b", "c", "d", "e"], opts.canary, opts.batch)   # [["a"], ["b", "c"], ["d", "e"]]

The canary wave takes the first `canary` devices of the target set (sorted, so the same set plans the same
waves on any machine); the rest go in batches of `batch.count` devices, or `batch.percent` % of the rest
rounded up (at least one device).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agent.config.names import name_problem

MAX_DEVICES = 10_000  # a target set larger than this is a mistake, not a fleet
_BATCH = re.compile(r"(?P<n>[0-9]{1,6})(?P<pct>%?)")


class PlanError(ValueError):
    """Bad rollout input: one line naming the option (exit 2 in the CLI)."""


@dataclass(frozen=True)
class Batch:
    """A batch: `count` devices, or `percent` of the devices after the canary (then count is 0)."""

    count: int = 0
    percent: float = 0.0

    def size(self, rest: int) -> int:
        if self.percent:
            return max(1, math.ceil(rest * self.percent / 100.0))
        return max(1, self.count)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent else str(self.count)


def parse_batch(text: str) -> Batch:
    """`N` (devices, >= 1) or `P%` (1..100 % of the devices after the canary)."""
    m = _BATCH.fullmatch(text.strip())
    if m is None:
        raise PlanError(
            f"--batch {text[:40]!r}: must be a number of devices (3) or a share of the rest (25%)"
        )
    n = int(m["n"])
    if m["pct"]:
        if not 1 <= n <= 100:
            raise PlanError(f"--batch {n}%: must be 1% to 100%")
        return Batch(percent=float(n))
    if n < 1:
        raise PlanError("--batch 0: a batch has at least one device")
    return Batch(count=n)


@dataclass(frozen=True)
class RolloutOptions:
    """What a rollout was started with (kept in its state: --resume goes on with the same)."""

    canary: int = 1
    batch: Batch = Batch(percent=25.0)
    max_failures: int = 0  # more failures than this halt the rollout
    soak_s: float = 60.0  # each device holds `serving` this long before it counts as done
    rollback_on_halt: bool = False
    skip_offline: bool = False
    offline_timeout_s: float = 60.0  # an offline device counts as a failure after this (unless skipped)
    device_timeout_s: float = 3600.0  # from cmd/deploy to serving (an engine build may take long)

    def check(self) -> RolloutOptions:
        """Itself, or PlanError naming the first bad option."""
        if not 0 <= self.canary <= MAX_DEVICES:
            raise PlanError(f"--canary {self.canary}: must be 0..{MAX_DEVICES}")
        if not 0 <= self.max_failures <= MAX_DEVICES:
            raise PlanError(f"--max-failures {self.max_failures}: must be 0..{MAX_DEVICES}")
        for flag, value, low in (
            ("--soak", self.soak_s, 0.0),
            ("--offline-timeout", self.offline_timeout_s, 0.0),
            ("--device-timeout", self.device_timeout_s, 1.0),
        ):
            if not low <= value <= 7 * 86_400:  # NaN fails too
                raise PlanError(f"{flag} {value!r}: must be {low:g}..604800 seconds")
        return self

    def fields(self) -> dict[str, Any]:
        body = asdict(self)
        body["batch"] = str(self.batch)
        return body

    @classmethod
    def from_fields(cls, d: dict[str, Any]) -> RolloutOptions:
        """The options of a state document (ValueError/TypeError/PlanError on anything unusable)."""
        kinds = {"canary": int, "max_failures": int, "rollback_on_halt": bool, "skip_offline": bool}
        kw: dict[str, Any] = {}
        for name, kind in kinds.items():
            value = d[name]
            if type(value) is not kind:  # bool is an int: exact types only
                raise TypeError(f"options.{name}: must be {kind.__name__}")
            kw[name] = value
        for name in ("soak_s", "offline_timeout_s", "device_timeout_s"):
            value = d[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"options.{name}: must be a number")
            kw[name] = float(value)
        if not isinstance(d["batch"], str):
            raise TypeError("options.batch: must be a string")
        return cls(batch=parse_batch(d["batch"]), **kw).check()


def check_names(names: Iterable[str], what: str) -> list[str]:
    """`names` sorted without duplicates, each a device id / group name; PlanError naming `what`."""
    out = sorted(set(names))
    for name in out:
        problem = name_problem(name)
        if problem is not None:
            raise PlanError(f"{what}: {name[:40]!r}: {problem}")
    if len(out) > MAX_DEVICES:
        raise PlanError(f"{what}: {len(out)} devices, more than {MAX_DEVICES}")
    return out


def split_devices(text: str) -> list[str]:
    """`a,b,c` -> the ids (spaces around them ignored; empty items refused)."""
    items = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in items):
        raise PlanError(f"--devices {text[:40]!r}: a comma-separated list of device ids (a,b)")
    return check_names(items, "--devices")


def plan_waves(targets: Sequence[str], canary: int, batch: Batch) -> list[list[str]]:
    """The waves over `targets` (in the given order): the canary's first, then batches of the rest."""
    if not targets:
        raise PlanError("no target device: the target set is empty")
    if len(set(targets)) != len(targets):
        raise PlanError("the target set names a device twice")
    if canary > len(targets):
        raise PlanError(f"--canary {canary}: more than the {len(targets)} target devices")
    waves: list[list[str]] = [list(targets[:canary])] if canary else []
    rest = list(targets[canary:])
    size = batch.size(len(rest))
    waves += [rest[i : i + size] for i in range(0, len(rest), size)]
    return waves


def failures_exceeded(failed: int, max_failures: int) -> bool:
    """More than `max_failures` failures halt the rollout."""
    return failed > max_failures
