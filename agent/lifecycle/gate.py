"""The accuracy gate: does a lower precision still detect what FP32 detects, on held-out frames?

    report = run_gate(ctx, "best")          # int8 -> fp16 -> fp32, first that passes: a GateReport
    gate = Gate(ctx, cset); gate.evaluate(Step("fp16"))   # one candidate (the precision job's way)

The verdict (GateReport, stored next to the frames) is agent.lifecycle.gate_report's; the graphs
measured are agent.lifecycle.candidates'.

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

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from agent.lifecycle.calibration import CalibrationSet, load_calibration_set, model_adapter, read_frames
from agent.lifecycle.candidates import PERCENTILE, Candidate, Progress, candidate_model
from agent.lifecycle.gate_report import GateEntry, GateReport
from agent.lifecycle.model import ModelContext
from engines.errors import EngineError
from engines.plan import Step, candidates
from engines.precision import Built, Precision
from engines.runtimes.base import Backend, BackendError
from engines.runtimes.ort import OrtBackend
from pipelines.agreement import detection_agreement
from pipelines.frames import Detections
from pipelines.models import ModelAdapter

log = logging.getLogger(__name__)

# (candidate ONNX path, precision) -> an unloaded Backend that runs it.
BackendFactory = Callable[[Path, Built], Backend]
INFER_BATCH = 8
# The candidate is decoded down to this fraction of the reference's score threshold. mAP ranks the
# candidate's detections; cutting them at exactly the deployment threshold turns tiny score jitter of
# boxes scored just above it into misses (NanoDet scores cluster at 0.4-0.5). Measured on the bundled
# clip, INT8 minmax: 0.78 with the same threshold, 0.98 at 0.75x; FP16 1.0 either way. 1.0 = strict.
CANDIDATE_SLACK = 0.75


def ort_factory(intra_threads: int = 0) -> BackendFactory:
    """Candidates on ONNX Runtime (CPU): the FP16 graph and Q/DQ graph run there as they are."""

    def make(path: Path, precision: Built) -> Backend:
        backend = OrtBackend(path, intra_threads=intra_threads)
        backend.precision = precision  # ORT runs the graph's own types; the label is for reports
        return backend

    return make


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
    precision: Precision | None = None,
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
