"""Fleet rollouts (issue 38): one signed deployment document to many devices in waves, over MQTT only.

    from agent.fleet.rollout import Broker, RolloutOptions, Targets, parse_batch, run_rollout
    final = run_rollout(Path("v2.json").read_bytes(), Broker(port=1883),
                        targets=Targets(devices=["a", "b", "c"]),
                        options=RolloutOptions(canary=1, batch=parse_batch("2"), soak_s=10))
    final.status        # done | halted | rolled_back (running: stopped at its deadline, resumable)

The pieces: rollout_plan (options, waves), rollout_state (the retained document), rollout_step (one
device's next move), rollout_run (the waves, halt and rollback), rollout_bus (MQTT), rollout_table (what
the operator sees). The CLI is agent/cli/fleet_rollout.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.fleet.rollout_bus import Broker, Bus, BusError, read_rollouts
from agent.fleet.rollout_plan import PlanError, RolloutOptions, check_names, parse_batch, plan_waves
from agent.fleet.rollout_run import OnChange, Runner, resumable
from agent.fleet.rollout_state import Rollout, RolloutStateError, check_id, new_id
from agent.mqtt.commands import MAX_PAYLOAD as MAX_COMMAND

__all__ = [
    "Broker",
    "BusError",
    "PlanError",
    "Rollout",
    "RolloutOptions",
    "Targets",
    "load_document",
    "parse_batch",
    "read_rollouts",
    "run_rollout",
]
DISCOVER_QUIET_S = 0.5  # the broker sends every retained status at once after the subscription


@dataclass(frozen=True)
class Targets:
    """Exactly one of: explicit device ids, a group (`mqtt.groups` in the devices' status), all devices."""

    devices: tuple[str, ...] = ()
    group: str | None = None
    all: bool = False


@dataclass(frozen=True)
class Document:
    model: str
    version: str
    request_id: str | int | None
    digest: str
    wire: bytes  # what cmd/deploy carries: the document (signature included) as compact JSON


def load_document(
    raw: bytes, where: str, trusted: Mapping[str, Path] | None = None, allow_unsigned: bool = False
) -> Document:
    """The document checked as a device will (fields; its signature against `trusted` when given, else
    only that one is present unless `allow_unsigned`); PlanError naming `where` and the field."""
    from agent.deploy.document import document_digest, parse_document
    from agent.deploy.errors import DeployError
    from agent.deploy.signing import verify_document

    try:
        doc, body = parse_document(raw, where)
        if trusted:
            verify_document(body, trusted, allow_unsigned)
        elif body.get("signature") is None and not allow_unsigned:
            raise DeployError(f"{where}: signature: the document is not signed (edge-agent models sign)")
    except DeployError as exc:
        raise PlanError(exc.reason if exc.reason.startswith(where) else f"{where}: {exc.reason}") from None
    wire = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(wire) > MAX_COMMAND:
        raise PlanError(f"{where}: {len(wire)} bytes, more than the {MAX_COMMAND} an MQTT command may carry")
    return Document(doc.model, doc.version, doc.request_id, document_digest(body), wire)


def resolve_targets(broker: Broker, targets: Targets) -> list[str]:
    """The target device ids, sorted; PlanError for unknown devices or an empty set. Devices are those
    with a retained status under the prefix (online or not)."""
    from agent.mqtt.fleet import FleetError, collect

    chosen = sum((bool(targets.devices), targets.group is not None, targets.all))
    if chosen != 1:
        raise PlanError("give exactly one of --devices a,b, --group G or --all")
    try:
        views = collect(
            broker.host,
            broker.port,
            broker.prefix,
            username=broker.username,
            password=broker.password,
            tls=broker.tls,
            quiet_s=DISCOVER_QUIET_S,
        )
    except FleetError as exc:
        raise BusError(str(exc)) from None
    known = {d: v for d, v in views.items() if v.status is not None}
    if targets.devices:
        wanted = check_names(targets.devices, "--devices")
        unknown = [d for d in wanted if d not in known]
        if unknown:
            said = ", ".join(unknown[:10])
            raise PlanError(
                f"--devices: unknown device(s) {said} (no retained status under {broker.prefix}/)"
            )
        return wanted
    if targets.group is not None:
        check_names([targets.group], "--group")
        members = [d for d, v in known.items() if targets.group in _groups(v.status)]
        if not members:
            raise PlanError(
                f"--group {targets.group}: no device of {broker.prefix}/ is in it (status.groups)"
            )
        return sorted(members)
    if not known:
        raise PlanError(f"--all: no device has a retained status under {broker.prefix}/")
    return check_names(known, "--all")


def _groups(status: Mapping[str, Any] | None) -> list[str]:
    groups = (status or {}).get("groups")
    return [g for g in groups if isinstance(g, str)] if isinstance(groups, list) else []


def plan(
    doc: Document, targets: list[str], options: RolloutOptions, rollout_id: str | None = None
) -> Rollout:
    waves = plan_waves(targets, options.check().canary, options.batch)
    return Rollout.create(check_id(rollout_id or new_id()), doc, doc.digest, waves, options)


def find_rollout(broker: Broker, rollout_id: str, doc: Document) -> Rollout:
    """The retained rollout to resume; PlanError when it is missing, unusable, over or of another document."""
    found = read_rollouts(broker, check_id(rollout_id)).get(rollout_id)
    if found is None:
        raise PlanError(f"--resume {rollout_id}: no such rollout under {broker.prefix}/_fleet/rollouts/")
    if isinstance(found, RolloutStateError):
        raise PlanError(f"--resume {rollout_id}: its retained state is unusable ({found})")
    if found.digest != doc.digest:
        raise PlanError(f"--resume {rollout_id}: DOC is not the document of this rollout (digest differs)")
    why = resumable(found)
    if why is not None:
        raise PlanError(f"--resume {rollout_id}: {why}")
    return found


def run_rollout(
    document: bytes,
    broker: Broker,
    *,
    targets: Targets | None = None,
    options: RolloutOptions | None = None,
    resume: str | None = None,
    trusted: Mapping[str, Path] | None = None,
    allow_unsigned: bool = False,
    on_start: Callable[[Rollout], None] | None = None,
    on_change: OnChange | None = None,
    deadline_s: float | None = None,
    poll_s: float = 0.2,
    where: str = "DOC",
) -> Rollout:
    """Plan (or find, with `resume`) a rollout and drive it to its end; its final state. PlanError: bad
    input (nothing sent); BusError: the broker cannot be used."""
    doc = load_document(document, where, trusted, allow_unsigned)
    if resume is not None:
        rollout = find_rollout(broker, resume, doc)
    else:
        rollout = plan(doc, resolve_targets(broker, targets or Targets()), options or RolloutOptions())
    bus = Bus(broker, rollout.model).connect()
    try:
        bus_settle(bus)
        if on_start is not None:
            on_start(rollout)
        deadline = None if deadline_s is None else time.time() + deadline_s
        return Runner(bus, rollout, doc.wire, on_change=on_change, poll_s=poll_s).run(deadline)
    finally:
        bus.close()


def bus_settle(bus: Bus, quiet_s: float = DISCOVER_QUIET_S, limit_s: float = 5.0) -> None:
    """Until the retained messages the broker sends after the subscriptions have come (quiet_s of quiet)."""
    end = time.monotonic() + limit_s
    last, seq, since = -1, bus.seq, time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.05)
        last, seq = seq, bus.seq
        if seq != last:
            since = time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
