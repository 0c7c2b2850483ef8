"""The agreement floor: does the candidate see what the serving model sees, on the same live frames?

    serving = Side(serving_backend, serving_spec); candidate = Side(candidate_backend, candidate_spec)
    result = run_gate(serving, candidate, images, score_threshold, iou_threshold, min_agreement)

The serving model's detections are the reference; the candidate's are compared with
pipelines.agreement.detection_agreement (mAP50), as the precision gate compares an INT8 engine with FP32
(agent.lifecycle.gate: the same decode, the same slack on the candidate's score threshold). Classes are
matched by LABEL NAME, not index: a version whose labels file is shuffled names other classes at the same
indices and must fail here. Default floor (deploy.gate.min_agreement) measured by
tools/deploy_gate_agreement.py (docs/DESIGN.md "Deployments").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.lifecycle.gate import CANDIDATE_SLACK, detect
from engines.runtimes.base import Backend
from pipelines.agreement import detection_agreement
from pipelines.frames import Detections
from pipelines.models.spec import ModelSpec


@dataclass
class Side:
    """One model of a comparison: a loaded backend and the spec that decodes its outputs."""

    backend: Backend
    spec: ModelSpec

    def __post_init__(self) -> None:
        self.adapter = self.spec.adapter()

    def detect(self, images: list[np.ndarray], score: float, iou: float) -> tuple[list[Detections], float]:
        return detect(self.backend, self.adapter, images, score, iou)


@dataclass(frozen=True)
class GateResult:
    agreement: float  # mAP50 of the candidate against the serving model
    mean_iou: float
    threshold: float
    frames: int

    @property
    def passed(self) -> bool:
        return self.agreement >= self.threshold

    def checks(self) -> dict[str, Any]:
        return {
            "agreement": self.agreement,
            "mean_iou": self.mean_iou,
            "threshold": self.threshold,
            "frames": self.frames,
        }

    def reason(self) -> str | None:
        if self.passed:
            return None
        return (
            f"gate: agreement with the serving model {self.agreement:.3f} < min_agreement "
            f"{self.threshold:g} on {self.frames} live frames"
        )


def relabel(dets: list[Detections], labels: tuple[str, ...], onto: tuple[str, ...]) -> list[Detections]:
    """`dets` (class ids into `labels`) with class ids into `onto` by name; a name `onto` lacks gets -1
    (a class the reference does not know: noise to the metric, as detection_agreement says)."""
    index = {name: i for i, name in enumerate(onto)}
    table = np.array([index.get(name, -1) for name in labels] + [-1], dtype=np.int32)
    out = []
    for d in dets:
        ids = np.where((d.class_ids >= 0) & (d.class_ids < len(labels)), d.class_ids, len(labels))
        out.append(Detections(d.boxes, d.scores, table[ids]))
    return out


def agreement_of(
    serving: Side, candidate: Side, images: list[np.ndarray], score: float, iou: float
) -> dict[str, float | int]:
    reference, _ = serving.detect(images, score, iou)
    dets, _ = candidate.detect(images, score * CANDIDATE_SLACK, iou)
    dets = relabel(dets, candidate.spec.labels, serving.spec.labels)
    return detection_agreement(reference, dets)


def run_gate(
    serving: Side, candidate: Side, images: list[np.ndarray], score: float, iou: float, min_agreement: float
) -> GateResult:
    if not images:
        raise ValueError("gate: no live frames to compare on")
    a = agreement_of(serving, candidate, images, score, iou)
    return GateResult(round(float(a["map50"]), 4), round(float(a["mean_iou"]), 4), min_agreement, len(images))
