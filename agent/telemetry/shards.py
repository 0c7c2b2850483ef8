"""One telemetry payload of a sharded agent: the shards' reports combined as each field declares
(``Field.shards``), the supervisor's own readings, and which shards and NVDEC sessions each GPU has."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.telemetry.fields import FIELDS
from agent.telemetry.payload import build_telemetry
from agent.telemetry.process import process_stats
from agent.telemetry.spec import Field, Shards, walk
from agent.telemetry.window import StageRows


def combine(reports: Sequence[Mapping[str, Any]], fields: Sequence[Field] = FIELDS) -> dict[str, Any]:
    """The fields ``reports`` (one process's telemetry fields each) give, combined: OWNER sections (a
    camera's row, a model's backend) merged, each key from the report that has it; SUM, MEAN and COUNT
    per field. WINDOW and SUPERVISOR fields are not in it: the supervisor has them itself."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.shards is Shards.OWNER:
            section = f.path.split(".{", 1)[0]
            if section not in out:  # once per section: every field in it is its owner's
                merged: dict[str, Any] = {}
                for r in reports:
                    merged.update(r.get(section) or {})
                out[section] = merged
        elif f.shards in (Shards.SUM, Shards.MEAN, Shards.COUNT):
            if f.keys:
                raise ValueError(f"telemetry field {f.path}: {f.shards.value} of keyed fields is not defined")
            _put(out, f.path, _combined(f, reports))
    return out


def _combined(f: Field, reports: Sequence[Mapping[str, Any]]) -> Any:
    section = f.path.split(".", 1)[0]
    if f.shards is Shards.COUNT:
        return sum(1 for r in reports if section in r)
    values = [v for r in reports for _, v in walk(f.path, r) if v is not None]
    if f.shards is Shards.SUM:
        total = sum(values, 0.0)
        return round(total, f.digits) if f.digits is not None else total
    if not values:  # MEAN of nothing
        return None
    mean = float(np.mean(values))
    return round(mean, f.digits) if f.digits is not None else mean


def _put(out: dict[str, Any], path: str, value: Any) -> None:
    *parents, key = path.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    node[key] = value


def sharded_telemetry(
    rows: list[dict[str, Any]],
    reports: Mapping[int, Mapping[str, Any]],
    stages: StageRows,
    mqtt: Mapping[str, Any] | None,
    gpu: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One payload's fields: ``rows`` the supervisor's row of each shard process (payload ``shards``),
    ``reports`` the running shards' last telemetry fields (shard -> fields), ``stages`` the summary of the
    window they drained into, ``mqtt`` the supervisor's client's stats, ``gpu`` its NVML reading (None: read
    now). The supervisor's own process counts in ``process``; each row gets its shard's ``process``."""
    combined = combine([*reports.values(), {"process": process_stats()}])
    fields = build_telemetry(
        cameras=combined["cameras"],
        stages=stages,
        backend=combined["backend"],
        batch_fill=combined["batch_fill"],
        process=combined["process"],
        gpu=gpu,
        mqtt=mqtt,
    )
    for row in rows:
        report = reports.get(row["shard"])
        if report is not None:
            row["process"] = report.get("process") or {}
    fields["shards"] = rows
    cams = fields["cameras"]
    for idx, card in (fields.get("gpu") or {}).items():  # which shards and NVDEC sessions each GPU has
        mine = [s for s in rows if s["gpu"] is not None and str(s["gpu"]) == idx]
        card["shards"] = [s["shard"] for s in mine]
        names = {c for s in mine for c in s["cameras"]}
        card["nvdec_sessions"] = sum(
            1 for c, row in cams.items() if c in names and row.get("decoder") == "nvdec"
        )
    return fields
