"""Detections after decoding: class-aware NMS, score/class filtering, label files."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from pipelines.frames import Detections


def nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou_threshold: float,
    max_det: int = 300,
) -> np.ndarray:
    """Class-aware NMS over (N, 4) x1y1x2y2 boxes; returns kept indices (int64), best score first.

    Boxes of different classes never suppress each other.
    """
    if boxes.shape[0] == 0:
        return np.zeros((0,), dtype=np.int64)
    xywh = np.asarray(boxes, dtype=np.float32).copy()
    xywh[:, 2:] -= xywh[:, :2]  # OpenCV wants x, y, w, h
    # NMSBoxesBatched separates classes by offsetting them class_id * (max coordinate + 1), which only
    # works for non-negative coordinates: boxes left of or above the input (negative x/y, common at the
    # edges) of one class overlapped another class's and were suppressed by it. Shifting everything into
    # the positive quadrant changes no IoU.
    xywh[:, :2] -= min(float(xywh[:, :2].min()), 0.0)
    keep = cv2.dnn.NMSBoxesBatched(
        xywh,
        np.asarray(scores, dtype=np.float32),
        np.asarray(class_ids, dtype=np.int32),
        # Scores are thresholded by the caller; OpenCV drops score <= this, so go below any score.
        score_threshold=-1.0,
        nms_threshold=float(iou_threshold),
        # OpenCV's top_k cuts the candidates before suppression (a crowded frame lost detections that
        # survive NMS); max_det is applied to what NMS kept, as detectors define it.
        top_k=0,
    )
    return np.asarray(keep, dtype=np.int64).reshape(-1)[: int(max_det)]


def filter_detections(dets: Detections, class_mask: np.ndarray | None, min_score: float) -> Detections:
    """Keep detections with score >= min_score whose class is enabled in `class_mask` (None = all).

    Class ids outside the mask are dropped rather than raising, so a mask sized for a smaller label
    set cannot crash the pipeline.
    """
    keep = dets.scores >= min_score
    if class_mask is not None:
        mask = np.asarray(class_mask, dtype=bool)
        ids = dets.class_ids
        in_range = (ids >= 0) & (ids < mask.shape[0])
        if mask.shape[0] == 0:
            keep[:] = False
        else:
            keep &= in_range & mask[np.where(in_range, ids, 0)]
    return dets.select(keep)


def load_labels(path: str | Path) -> list[str]:
    """One class name per line (blank lines ignored), in model output order."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FileNotFoundError(f"cannot read label file {p}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"label file {p} is not UTF-8 text (byte {e.start})") from None
    labels = [line.strip() for line in text.splitlines() if line.strip()]
    if not labels:
        raise ValueError(f"label file {p} has no labels")
    return labels
