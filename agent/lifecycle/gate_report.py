"""The gate's verdict: what one step measured (GateEntry), what a requested precision kept (GateReport).

    report = GateReport.decide(gate, "best", tried)   # the first entry that passed, else the last tried
    write_report(cset, report)                        # {calibration dir}/validation-best.json
    report.validation(), report.state()               # for the engine manifest / the MQTT state

A report is stored next to the held-out frames it was measured on; a job reads it back to know which
engine the last gate kept (agent.lifecycle.job.resolved_settings).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from agent.lifecycle.calibration import CalibrationSet
from agent.lifecycle.candidates import write_json
from agent.lifecycle.model import ModelContext
from engines.precision import Built, Precision


class Measured(Protocol):
    """What a report reads of the gate that measured it (agent.lifecycle.gate.Gate)."""

    @property
    def threshold(self) -> float: ...
    @property
    def images(self) -> Sequence[Any]: ...
    @property
    def score_threshold(self) -> float: ...
    @property
    def slack(self) -> float: ...
    @property
    def cset(self) -> CalibrationSet: ...
    def reference(self) -> tuple[Any, float]: ...


@dataclass
class GateEntry:
    """One step measured (or refused): the graph gate on ONNX Runtime, a build, or the engine itself."""

    precision: Built
    passed: bool
    reason: str | None = None
    method: str | None = None
    folded: bool = False
    runtime: str = "onnxruntime"  # where it was measured; "tensorrt" for the built engine
    value: float | None = None
    mean_iou: float | None = None
    infer_ms: float | None = None
    onnx: str | None = None
    sha256: str | None = None

    @property
    def label(self) -> str:
        what = self.precision + (f"/{self.method}" if self.method else "")
        what += " (folded graph)" if self.folded else ""
        return what + (" [engine]" if self.runtime == "tensorrt" else "")


@dataclass
class GateReport:
    """The gate's verdict for a requested precision: what was kept, measured how, and what was tried."""

    requested: Precision
    precision: Built  # the precision kept (the last one tried when none passed)
    passed: bool
    value: float
    mean_iou: float
    threshold: float
    frames: int
    method: str | None
    score_threshold: float
    candidate_score_threshold: float
    reference_infer_ms: float
    calibration_id: str
    tried: list[GateEntry] = field(default_factory=list)
    folded: bool = False
    runtime: str = "onnxruntime"
    reference: str = "fp32"
    metric: str = "map50"

    @classmethod
    def decide(
        cls, gate: Measured, requested: Precision, tried: list[GateEntry], final: GateEntry | None = None
    ) -> GateReport:
        """The report of `final` (default: the first entry that passed, else the last one tried)."""
        final = final or next((t for t in tried if t.passed), tried[-1])
        return cls(
            requested=requested,
            precision=final.precision,
            passed=final.passed,
            value=final.value or 0.0,
            mean_iou=final.mean_iou or 0.0,
            threshold=gate.threshold,
            frames=len(gate.images),
            method=final.method,
            score_threshold=gate.score_threshold,
            candidate_score_threshold=round(gate.score_threshold * gate.slack, 4),
            reference_infer_ms=round(gate.reference()[1], 2),
            calibration_id=gate.cset.id,
            tried=list(tried),
            folded=final.folded,
            runtime=final.runtime,
        )

    def validation(self) -> dict[str, Any]:
        """The engine manifest's `validation` object (DESIGN.md), plus what it was measured with."""
        return {
            "reference": self.reference,
            "metric": self.metric,
            "value": self.value,
            "threshold": self.threshold,
            "passed": self.passed,
            "frames": self.frames,
            "mean_iou": self.mean_iou,
            "precision": self.precision,
            "requested": self.requested,
            "runtime": self.runtime,
        }

    def state(self) -> dict[str, Any]:
        """The MQTT engine state's `validation` (DESIGN.md: metric, value, threshold, passed)."""
        v = self.validation()
        return {k: v[k] for k in ("metric", "value", "threshold", "passed", "precision", "requested")}

    def to_json(self) -> dict[str, Any]:
        return {"schema": REPORT_SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GateReport:
        """Raises ValueError on a report of another schema or with missing fields."""
        if not isinstance(d, dict) or d.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"not a {REPORT_SCHEMA} report")
        names = {f.name for f in fields(cls)}
        entry_names = {f.name for f in fields(GateEntry)}
        try:
            tried = [GateEntry(**{k: v for k, v in t.items() if k in entry_names}) for t in d["tried"]]
            return cls(**{**{k: v for k, v in d.items() if k in names}, "tried": tried})
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"malformed gate report: {exc}") from None


REPORT_SCHEMA = "edge-agent/validation/2"


def report_path(directory: Path, requested: Precision) -> Path:
    return directory / f"validation-{requested}.json"


def write_report(cset: CalibrationSet, report: GateReport) -> Path:
    """Store the gate result next to the held-out frames it was measured on (atomic)."""
    path = report_path(cset.directory, report.requested)
    write_json(path, report.to_json())
    return path


def read_report(ctx: ModelContext, requested: Precision) -> GateReport | None:
    """The last gate result for (model, requested precision); None when there is none (or unreadable)."""
    try:
        return GateReport.from_json(json.loads(report_path(ctx.calibration_dir, requested).read_text()))
    except (OSError, ValueError):
        return None


def format_report(model: str, r: GateReport) -> str:
    verdict = "PASS" if r.passed else "FAIL"
    lines = [
        f"{model}: {verdict} precision {r.precision}"
        + (f" ({r.method})" if r.method else "")
        + f", requested {r.requested}",
        f"  {r.metric} {r.value:.3f} vs {r.reference} (min_agreement {r.threshold:g}), mean IoU "
        f"{r.mean_iou:.3f}, {r.frames} held-out frames, score >= {r.score_threshold:g} "
        f"(candidate >= {r.candidate_score_threshold:g})",
    ]
    for t in r.tried:
        state = "pass" if t.passed else f"fail: {t.reason}"
        extra = (
            f" map50 {t.value:.3f} IoU {t.mean_iou:.3f} {t.infer_ms:.1f} ms/frame"
            if t.value is not None and t.mean_iou is not None and t.infer_ms is not None
            else ""
        )
        lines.append(f"  - {t.precision}{' ' + t.method if t.method else ''}:{extra} ({state})")
    return "\n".join(lines)
