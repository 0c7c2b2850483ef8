"""Values that travel through the pipeline: a captured frame and the detections made on it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# Stage stamps, in order. Each is a time.monotonic() reading; latencies are differences. "submitted": the
# batch got an execution slot (between preprocessed and submitted it waited for one: pipeline "wait").
STAGES = ("captured", "dequeued", "preprocessed", "submitted", "inferred", "postprocessed", "published")


class DeviceImage(Protocol):
    """A picture in device memory (pipelines.sources.nvdec.DeviceNv12): an image's size, pixels on request."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def download(self) -> np.ndarray: ...


def host_image(image: np.ndarray | DeviceImage) -> np.ndarray:
    """The frame's pixels as an HxWx3 BGR host array; a device picture is copied down (snapshots,
    calibration, the accuracy gate: the only places that need host pixels of an NVDEC camera)."""
    return image if isinstance(image, np.ndarray) else image.download()


@dataclass(slots=True)
class Frame:
    camera: str
    frame_id: int
    # HxWx3 uint8 BGR owned by this frame (the reader never writes into it again), or for NVDEC cameras an
    # NV12 picture in device memory that stays there until preprocessing (see host_image).
    image: np.ndarray | DeviceImage
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
