"""Annotated JPEG snapshots of a camera's last frame (MQTT `cameras/<name>/snapshot`)."""

from __future__ import annotations

import cv2
import numpy as np

from pipelines.frames import Detections

_COLOURS = np.array(
    [(56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207), (10, 249, 72)],
    dtype=np.uint8,
)


def annotate(image: np.ndarray, detections: Detections, labels: list[str]) -> np.ndarray:
    """A copy of `image` with boxes and "label score" captions (the frame itself is never drawn on)."""
    out = image.copy()
    boxes = np.round(detections.boxes).astype(np.int32)
    # Drawing is one OpenCV call per box: snapshots are rare (on request, or rate-limited), not the hot path.
    for (x1, y1, x2, y2), cid, score in zip(boxes, detections.class_ids, detections.scores, strict=True):
        colour = tuple(int(c) for c in _COLOURS[int(cid) % len(_COLOURS)])
        name = labels[cid] if 0 <= cid < len(labels) else str(int(cid))
        cv2.rectangle(out, (int(x1), int(y1)), (int(x2), int(y2)), colour, 2)
        origin = (int(x1), max(12, int(y1) - 4))
        cv2.putText(out, f"{name} {score:.2f}", origin, cv2.FONT_HERSHEY_SIMPLEX, 0.5, colour, 1)
    return out


def jpeg(image: np.ndarray, quality: int = 80) -> bytes:
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes()
