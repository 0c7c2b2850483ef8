"""Values that travel through the pipeline: a captured frame and the detections made on it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

# Stage stamps, in order. Each is a time.monotonic() reading; latencies are differences. "submitted": the
# batch got an execution slot (between preprocessed and submitted it waited for one: pipeline "wait").
STAGES = ("captured", "dequeued", "preprocessed", "submitted", "inferred", "postprocessed", "published")


@dataclass(slots=True)
class Frame:
    camera: str
    frame_id: int
    image: np.ndarray  # HxWx3 uint8 BGR, owned by this frame (the reader never writes into it again)
    ts_capture: float  # wall clock (time.time()) at capture, for payloads
    stamps: dict[str, float] = field(default_factory=dict)  # stage -> time.monotonic()

    def stamp(self, stage: str) -> None:
        self.stamps[stage] = time.monotonic()


@dataclass(slots=True)
class Detections:
    """Detections of one frame as parallel arrays (no per-box objects on the hot path)."""

    boxes: np.ndarray  # (N, 4) float32 x1, y1, x2, y2 in source pixels
    scores: np.ndarray  # (N,) float32
    class_ids: np.ndarray  # (N,) int32

    @classmethod
    def empty(cls) -> Detections:
        return cls(np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), np.zeros((0,), np.int32))

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def select(self, keep: np.ndarray) -> Detections:
        """Subset by a boolean mask or an index array."""
        return Detections(self.boxes[keep], self.scores[keep], self.class_ids[keep])


def stage_latencies_ms(frame: Frame) -> dict[str, float]:
    """Per-stage latency of a frame from its stamps (queue, preprocess, wait, infer, postprocess, total).

    "wait" (for a free execution slot) appears only for frames that went through the pipelined worker.
    """
    s = frame.stamps
    out: dict[str, float] = {}
    infer_from = "submitted" if "submitted" in s else "preprocessed"
    for name, start, end in (
        ("queue", "captured", "dequeued"),
        ("preprocess", "dequeued", "preprocessed"),
        ("wait", "preprocessed", "submitted"),
        ("infer", infer_from, "inferred"),
        ("postprocess", "inferred", "postprocessed"),
    ):
        if start in s and end in s:
            out[name] = (s[end] - s[start]) * 1000.0
    last = s.get("published", s.get("postprocessed"))
    if "captured" in s and last is not None:
        out["total"] = (last - s["captured"]) * 1000.0
    return out
