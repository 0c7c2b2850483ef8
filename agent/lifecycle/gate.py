"""The accuracy gate: does a lower precision still detect what FP32 detects, on held-out frames?

    report = run_gate(ctx, "best")          # int8 -> fp16 -> fp32, first that passes: a GateReport
    write_report(cset, report)              # {engine_dir}/{model}/calibration/validation-best.json
    report.validation()                     # the engine manifest's `validation` object
    gate = Gate(ctx, cset); gate.evaluate(Step("fp16"))   # one candidate (the precision job's way)

The reference is the source ONNX in FP32 on ONNX Runtime. The candidate is the graph the engine is
built from (FP16 ONNX, or the INT8 Q/DQ ONNX calibrated on the calibration split), run wherever it can
run: ONNX Runtime here (`ort_factory`), a TensorRT runtime on a device (pass another BackendFactory).
Both use the inference adapter, the model's camera score threshold and its NMS IoU. The metric is
pipelines.agreement.detection_agreement; the gate passes when map50 >= accuracy_gate.min_agreement.
A Gate given `progress(phase, step, total)` reports as it goes: "accuracy gate fp16: fp32 reference"
and "...: candidate" frame by frame (batch by batch), "...: calibrate" per calibration frame quantised,
"...: convert graph" around the FP16 conversion.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import ConfigError
from agent.lifecycle.calibration import (
    CalibrationSet,
    calibration_batches,
    load_calibration_set,
    model_adapter,
    read_frames,
)
from agent.lifecycle.model import ModelContext
from engines.errors import EngineError
from engines.fsutil import atomic_write_bytes
from engines.plan import Step, candidates
from engines.precision import convert_fp16
from engines.quantize import RECIPE, make_qdq_onnx, sha256_of
from engines.runtimes.base import Backend, BackendError
from engines.runtimes.ort import OrtBackend
from pipelines.agreement import detection_agreement
from pipelines.frames import Detections
from pipelines.models import ModelAdapter

log = logging.getLogger(__name__)

# (candidate ONNX path, precision) -> an unloaded Backend that runs it.
BackendFactory = Callable[[Path, str], Backend]
Progress = Callable[[str, int, int], None]  # (phase, step, total)
INFER_BATCH = 8
# The candidate is decoded down to this fraction of the reference's score threshold. mAP ranks the
# candidate's detections; cutting them at exactly the deployment threshold turns tiny score jitter of
# boxes scored just above it into misses (NanoDet scores cluster at 0.4-0.5). Measured on the bundled
# clip, INT8 minmax: 0.78 with the same threshold, 0.98 at 0.75x; FP16 1.0 either way. 1.0 = strict.
CANDIDATE_SLACK = 0.75


def ort_factory(intra_threads: int = 0) -> BackendFactory:
    """Candidates on ONNX Runtime (CPU): the FP16 graph and Q/DQ graph run there as they are."""

    def make(path: Path, precision: str) -> Backend:
        backend = OrtBackend(path, intra_threads=intra_threads)
        backend.precision = precision  # ORT runs the graph's own types; the label is for reports
        return backend

    return make


@dataclass(frozen=True)
class Candidate:
    precision: str
    method: str | None
    onnx: Path
    info: dict[str, Any]


# ---- candidate models ----------------------------------------------------------------------------


def _cached(meta_path: Path, want: dict[str, Any], onnx_path: Path) -> dict[str, Any] | None:
    """The sidecar of a derived model when it was made from the same inputs and is intact."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("inputs") != want or not onnx_path.is_file():
        return None
    if sha256_of(onnx_path) != meta.get("info", {}).get("sha256"):
        return None
    return meta["info"]


PERCENTILE = 99.99  # the percentile method's clip point (engines.quantize's default)


def _candidate_spec(
    ctx: ModelContext,
    precision: str,
    cset: CalibrationSet,
    method: str,
    exclude_nodes: list[str] | None,
    percentile: float,
    fold: bool,
) -> tuple[Path, dict[str, Any]]:
    """Where a derived graph lives and the inputs it is cached against (fp16 or int8)."""
    models = cset.directory / "models"
    if precision == "fp16":
        return models / "fp16.onnx", {"source_sha256": sha256_of(ctx.cfg.onnx)}
    if precision != "int8":
        raise ConfigError(f"models.{ctx.name}.precision: {precision!r} is not fp32, fp16 or int8")
    path = models / f"int8-{method}{'-folded' if fold else ''}.onnx"
    return path, {
        "source_sha256": sha256_of(ctx.cfg.onnx),
        "calibration_id": cset.id,
        "method": method,
        "exclude_nodes": exclude_nodes,
        "percentile": percentile,
        "recipe": RECIPE,
        "fold": fold,
    }


def cached_candidate(
    ctx: ModelContext, step: Step, cset: CalibrationSet, method: str | None = None
) -> Path | None:
    """The graph a step's engine is built from when it already exists intact (never makes one)."""
    if step.precision == "fp32":
        return ctx.cfg.onnx
    method = method or ctx.cfg.calibration.method
    path, want = _candidate_spec(ctx, step.precision, cset, method, None, PERCENTILE, step.folded)
    return path if _cached(path.with_suffix(".json"), want, path) is not None else None


def candidate_model(
    ctx: ModelContext,
    precision: str,
    cset: CalibrationSet,
    method: str | None = None,
    exclude_nodes: list[str] | None = None,
    percentile: float = PERCENTILE,
    adapter: ModelAdapter | None = None,
    fold: bool = False,
    progress: Progress | None = None,
    phase: str = "",
) -> Candidate:
    """The ONNX an engine of `precision` is built from; derived ones are cached in the calibration dir.

    fp32: the configured ONNX. fp16: engines.precision.convert_fp16. int8: engines.quantize Q/DQ,
    calibrated on the calibration split only. `progress`: reported under `phase` (see Gate).
    """
    mcfg = ctx.cfg
    if precision == "fp32":
        return Candidate("fp32", None, mcfg.onnx, {})
    method = method or mcfg.calibration.method
    path, want = _candidate_spec(ctx, precision, cset, method, exclude_nodes, percentile, fold)
    info = _cached(path.with_suffix(".json"), want, path)
    if info is not None:
        return Candidate(precision, method if precision == "int8" else None, path, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda _phase, _step, _total: None)
    if precision == "fp16":
        report(f"{phase}convert graph", 0, 1)
        atomic_write_bytes(path, convert_fp16(mcfg.onnx))
        info = {"sha256": sha256_of(path)}
        report(f"{phase}convert graph", 1, 1)
    else:
        t0 = time.monotonic()
        total = len(cset.calibration_paths)
        report(f"{phase}calibrate", 0, total)
        info = make_qdq_onnx(
            mcfg.onnx,
            path,
            _counted(
                calibration_batches(cset, adapter or model_adapter(ctx)), f"{phase}calibrate", total, report
            ),
            method,  # type: ignore[arg-type]
            exclude_nodes,
            percentile,
            fold=fold,
        )
        info["quantize_s"] = round(time.monotonic() - t0, 2)
    _write_json(path.with_suffix(".json"), {"inputs": want, "info": info})
    return Candidate(precision, method if precision == "int8" else None, path, info)


def _counted(
    batches: Iterator[np.ndarray], phase: str, total: int, progress: Progress
) -> Iterator[np.ndarray]:
    """`batches`, reporting the frames handed out so far."""
    done = 0
    for batch in batches:
        yield batch
        done += int(batch.shape[0])
        progress(phase, min(done, total), total)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


# ---- running ---------------------------------------------------------------------------------


def detect(
    backend: Backend,
    adapter: ModelAdapter,
    images: list[np.ndarray],
    score_threshold: float,
    iou_threshold: float,
    on_frames: Callable[[int], None] | None = None,
) -> tuple[list[Detections], float]:
    """Detections per image and the mean inference time per frame in ms (preprocess excluded).
    `on_frames(n)`: called after each batch with the frames done so far."""
    out: list[Detections] = []
    infer_s = 0.0
    step = min(INFER_BATCH, backend.max_batch)
    for i in range(0, len(images), step):
        batch, boxes = adapter.preprocess(images[i : i + step])
        t0 = time.perf_counter()
        outputs = backend.infer(batch)
        infer_s += time.perf_counter() - t0
        out.extend(adapter.postprocess(outputs, boxes, score_threshold, iou_threshold))
        if on_frames is not None:
            on_frames(len(out))
    return out, 1000.0 * infer_s / max(1, len(images))


def _run(
    backend: Backend, *args: Any, on_frames: Callable[[int], None] | None = None
) -> tuple[list[Detections], float]:
    backend.load()
    try:
        return detect(backend, *args, on_frames=on_frames)
    finally:
        backend.close()


@dataclass
class GateEntry:
    """One step measured (or refused): the graph gate on ONNX Runtime, a build, or the engine itself."""

    precision: str
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

    requested: str
    precision: str  # the precision kept (the last one tried when none passed)
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
        cls, gate: Gate, requested: str, tried: list[GateEntry], final: GateEntry | None = None
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


class Gate:
    """The gate of one model on one calibration set: FP32 reference once, then candidates one by one."""

    def __init__(
        self,
        ctx: ModelContext,
        cset: CalibrationSet,
        *,
        method: str | None = None,
        exclude_nodes: list[str] | None = None,
        percentile: float = PERCENTILE,
        score_threshold: float | None = None,
        min_agreement: float | None = None,
        candidate_slack: float = CANDIDATE_SLACK,
        progress: Progress | None = None,
    ) -> None:
        if not 0.0 < candidate_slack <= 1.0:
            raise ValueError(f"candidate_slack must be in (0, 1], got {candidate_slack}")
        self.ctx, self.cset = ctx, cset
        mcfg = ctx.cfg
        self.method = method or mcfg.calibration.method
        self._exclude, self._percentile = exclude_nodes, percentile
        self.threshold = mcfg.accuracy_gate.min_agreement if min_agreement is None else min_agreement
        self.score_threshold = ctx.score_threshold if score_threshold is None else score_threshold
        self.slack = candidate_slack
        self.adapter = model_adapter(ctx)
        self.images = list(read_frames(cset.held_out_paths))
        self._reference: tuple[list[Detections], float] | None = None
        self._progress = progress
        self._phase = "accuracy gate"

    def _frames(self, phase: str) -> Callable[[int], None] | None:
        """A detect() callback reporting `phase` frame by frame (None without a progress callback)."""
        progress, total = self._progress, len(self.images)
        if progress is None:
            return None
        progress(phase, 0, total)
        return lambda n: progress(phase, n, total)

    def reference(self) -> tuple[list[Detections], float]:
        if self._reference is None:
            backend = ort_factory(self.ctx.cfg.threads.intra)(self.ctx.cfg.onnx, "fp32")
            args = (self.adapter, self.images, self.score_threshold, self.ctx.cfg.iou_threshold)
            self._reference = _run(backend, *args, on_frames=self._frames(f"{self._phase}: fp32 reference"))
        return self._reference

    def candidate(self, step: Step) -> Candidate:
        return candidate_model(
            self.ctx,
            step.precision,
            self.cset,
            self.method,
            self._exclude,
            self._percentile,
            self.adapter,
            step.folded,
            self._progress,
            f"{self._phase}: ",
        )

    def evaluate(self, step: Step, backend: Backend | None = None) -> GateEntry:
        """Measure `step`'s graph on ONNX Runtime, or `backend` (the built engine, loaded: it is not
        closed here) against the FP32 reference."""
        prec = step.precision
        entry = GateEntry(prec, False, method=self.method if prec == "int8" else None, folded=step.folded)
        if backend is not None:
            entry.runtime = "tensorrt" if backend.name.startswith("tensorrt") else backend.name
        self._phase = f"accuracy gate {step.label}" + (" [engine]" if backend is not None else "")
        try:
            reference, ref_ms = self.reference()
            cand = self.candidate(step)
            args = (self.adapter, self.images, self.score_threshold * self.slack, self.ctx.cfg.iou_threshold)
            if backend is not None:
                dets, ms = detect(backend, *args, on_frames=self._frames(f"{self._phase}: candidate"))
            elif prec == "fp32":
                dets, ms = reference, ref_ms  # the reference itself
            else:
                backend_ = ort_factory(self.ctx.cfg.threads.intra)(cand.onnx, prec)
                dets, ms = _run(backend_, *args, on_frames=self._frames(f"{self._phase}: candidate"))
            agreement = detection_agreement(reference, dets)
        except (EngineError, BackendError, OSError) as e:
            entry.reason = f"{step.label}: could not be evaluated: {e}"
            log.warning("gate %s: %s", self.ctx.name, entry.reason)
            return entry
        # Decide on the value as reported, so a report's own number reproduces its verdict.
        value = round(agreement["map50"], 4)
        entry.passed = value >= self.threshold
        entry.value, entry.mean_iou = value, round(agreement["mean_iou"], 4)
        entry.infer_ms, entry.onnx = round(ms, 2), str(cand.onnx)
        entry.reason = None if entry.passed else f"map50 {value:.3f} < min_agreement {self.threshold:g}"
        if cand.info:
            entry.sha256 = cand.info.get("sha256")
        log.info("gate %s %s: %s", self.ctx.name, step.label, entry)
        return entry


def run_gate(
    ctx: ModelContext,
    precision: str | None = None,
    *,
    method: str | None = None,
    exclude_nodes: list[str] | None = None,
    percentile: float = PERCENTILE,
    score_threshold: float | None = None,
    min_agreement: float | None = None,
    candidate_slack: float = CANDIDATE_SLACK,
    fold: bool = False,
) -> GateReport:
    """The graph gate for `precision` (default: the model's); `best` tries int8 -> fp16 -> fp32 and
    keeps the first that passes. Raises CalibrationError without a calibration set."""
    requested = precision or ctx.cfg.precision
    gate = Gate(
        ctx,
        load_calibration_set(ctx),
        method=method,
        exclude_nodes=exclude_nodes,
        percentile=percentile,
        score_threshold=score_threshold,
        min_agreement=min_agreement,
        candidate_slack=candidate_slack,
    )
    order = candidates(requested) if requested == "best" else (requested,)
    tried: list[GateEntry] = []
    for prec in order:
        tried.append(gate.evaluate(Step(prec, folded=fold and prec == "int8")))
        if tried[-1].passed:
            break
    return GateReport.decide(gate, requested, tried)


def report_path(directory: Path, requested: str) -> Path:
    return directory / f"validation-{requested}.json"


def write_report(cset: CalibrationSet, report: GateReport) -> Path:
    """Store the gate result next to the held-out frames it was measured on (atomic)."""
    path = report_path(cset.directory, report.requested)
    _write_json(path, report.to_json())
    return path


def read_report(ctx: ModelContext, requested: str) -> GateReport | None:
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
