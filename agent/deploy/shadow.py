"""Shadow: the candidate runs beside the serving model on live frames, publishing nothing.

Frame by frame both infer the same image (interleaved, so a machine busy with something else slows both
alike); the figures: inference p95 of each and their ratio, detections per frame of each and their ratio,
the candidate's errors. Refused beyond deploy.shadow's limits (max_latency_ratio, the detections ratio
band, max_errors). The serving model's own pipeline is not involved: the host gives a separate backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.config.deploy import DeployShadowConfig
from agent.deploy.gate import Side
from engines.errors import EngineError
from engines.runtimes.base import BackendError


@dataclass
class ShadowResult:
    frames: int
    serving_p95_ms: float
    candidate_p95_ms: float
    serving_detections: float  # per frame
    candidate_detections: float
    errors: int
    first_error: str | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def latency_ratio(self) -> float:
        return self.candidate_p95_ms / max(self.serving_p95_ms, 1e-6)

    @property
    def detections_ratio(self) -> float | None:
        """None when the serving model saw nothing (no ratio to hold the candidate to)."""
        if self.serving_detections <= 0:
            return None
        return self.candidate_detections / self.serving_detections

    def checks(self) -> dict[str, Any]:
        ratio = self.detections_ratio
        return {
            "frames": self.frames,
            "latency_ratio": round(self.latency_ratio, 3),
            "serving_p95_ms": round(self.serving_p95_ms, 2),
            "candidate_p95_ms": round(self.candidate_p95_ms, 2),
            "detections_ratio": None if ratio is None else round(ratio, 3),
            "serving_detections_per_frame": round(self.serving_detections, 3),
            "candidate_detections_per_frame": round(self.candidate_detections, 3),
            "errors": self.errors,
        }

    def judge(self, cfg: DeployShadowConfig, max_latency_ratio: float | None = None) -> str | None:
        """Why the candidate is refused, or None."""
        limit = cfg.max_latency_ratio if max_latency_ratio is None else max_latency_ratio
        reasons = []
        if self.errors > cfg.max_errors:
            reasons.append(
                f"{self.errors} inference errors (max {cfg.max_errors}; first: {self.first_error})"
            )
        if self.frames and self.latency_ratio > limit:
            reasons.append(
                f"latency p95 {self.candidate_p95_ms:.1f} ms is {round(self.latency_ratio, 3):.2f}x the "
                f"serving model's {self.serving_p95_ms:.1f} ms (max {limit:g}x)"
            )
        ratio = self.detections_ratio
        if ratio is not None and not cfg.min_detections_ratio <= ratio <= cfg.max_detections_ratio:
            reasons.append(
                f"detections per frame {self.candidate_detections:.2f} vs "
                f"{self.serving_detections:.2f} serving (ratio {ratio:.2f}, allowed "
                f"{cfg.min_detections_ratio:g}-{cfg.max_detections_ratio:g})"
            )
        self.reasons = reasons
        return ("shadow: " + "; ".join(reasons)) if reasons else None


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95)) if values else 0.0


def _timed(side: Side, image: np.ndarray, score: float, iou: float) -> tuple[float, int]:
    batch, boxes = side.adapter.preprocess([image])
    t0 = time.perf_counter()
    outputs = side.backend.infer(batch)
    ms = 1000.0 * (time.perf_counter() - t0)
    return ms, len(side.adapter.postprocess(outputs, boxes, score, iou)[0])


def run_shadow(
    serving: Side, candidate: Side, images: list[np.ndarray], score: float, iou: float
) -> ShadowResult:
    """Both models on `images`, one frame at a time."""
    s_ms: list[float] = []
    c_ms: list[float] = []
    s_dets = c_dets = errors = 0
    first: str | None = None
    for image in images:
        ms, n = _timed(serving, image, score, iou)
        s_ms.append(ms)
        s_dets += n
        try:
            ms, n = _timed(candidate, image, score, iou)
        except (BackendError, EngineError, ValueError, RuntimeError) as exc:
            errors += 1
            first = first or str(exc)[:200]
            continue
        c_ms.append(ms)
        c_dets += n
    n = max(1, len(images))
    return ShadowResult(len(images), _p95(s_ms), _p95(c_ms), s_dets / n, c_dets / n, errors, first)
