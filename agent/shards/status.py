"""What the supervisor makes of its shards' reports: the device's progress (READY, STATUS, WATCHDOG) and
one telemetry payload for every shard, with each shard's process and each GPU's shards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from agent.service.supervisor import Progress
from agent.shards.host import ShardHost
from agent.shards.placement import ShardPlan
from agent.telemetry import StageWindow, sharded_telemetry
from engines.cuda.gpu_probe import NVML

STALE_S = 5.0  # a running shard's last report older than this: its models count as not running

Reports = Mapping[int, tuple[Progress, float]]  # shard -> its last progress and when (monotonic)


def progress(hosts: Sequence[ShardHost], plan: ShardPlan, reports: Reports, now: float) -> Progress:
    """Every shard's cameras and models (as "model (shard k)"); a shard waiting for its restart shows
    its cameras as reconnecting and no model; one that stopped reporting shows its models not running."""
    cams: dict[str, str] = {}
    models = {}
    fps = 0.0
    for host in hosts:
        k = host.index
        entry = reports.get(k) if host.state == "running" else None
        if entry is None:  # not reporting yet (starting), or waiting for its restart
            state = "starting" if host.state in ("starting", "running") else "reconnecting"
            cams.update({c: state for c in plan.of(k)})
            continue
        p, at = entry
        cams.update(p.cameras)
        fps += p.fps
        fresh = now - at <= STALE_S
        for name, m in p.models.items():
            models[f"{name} (shard {k})"] = replace(m, running=m.running and fresh)
    return Progress(cams, models, fps)


def hung(
    hosts: Sequence[ShardHost], reports: Reports, now: float, limit_s: float
) -> list[tuple[ShardHost, float]]:
    """Running shards whose last report is older than `limit_s` (a deadlock, a decoder stuck in a driver
    call), each with how long it has been silent."""
    out = []
    for host in hosts:
        entry = reports.get(host.index)
        if host.state == "running" and entry is not None and now - entry[1] > limit_s:
            out.append((host, now - entry[1]))
    return out


def telemetry_fields(
    hosts: Sequence[ShardHost],
    plan: ShardPlan,
    reports: Mapping[int, dict[str, Any]],
    stages: StageWindow,
    mqtt: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One telemetry payload's fields from every running shard's last report (`reports`, shard ->
    telemetry fields) and the stage windows they drained into `stages` (combined as agent.telemetry.fields
    declares)."""
    device_mb = NVML.process_memory()
    rows = [_shard_row(host, plan, device_mb) for host in hosts]
    running = {h.index: reports[h.index] for h in hosts if h.state == "running" and h.index in reports}
    return sharded_telemetry(rows, running, stages.summary(), mqtt)


def _shard_row(host: ShardHost, plan: ShardPlan, device_mb: Mapping[int, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"shard": host.index, "state": host.state, "pid": host.pid, "gpu": host.gpu}
    row.update(restarts=host.restarts, last_exit=host.last_exit, cameras=plan.of(host.index))
    row["device_memory_mb"] = device_mb.get(host.pid) if host.pid is not None else None
    if host.failure:
        row["failure"] = host.failure
    return row
