"""YOLOv8 / YOLO11 detection exports: one output [B, 4 + nc, N] of cx, cy, w, h (network pixels) and
class scores that are already sigmoided (no objectness)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipelines.models.base import Candidates, ModelAdapter, cxcywh_to_xyxy, find_output

if TYPE_CHECKING:
    from pipelines.models.graph import GraphBuilder, GraphHeads


class YoloV8Adapter(ModelAdapter):
    fmt = "yolov8"
    mean = None
    std = None
    scale = 1.0 / 255.0
    swap_rb = True  # Ultralytics models are trained on RGB
    pad_value = 114

    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        # Standard layout is channels-first; some converters transpose to [B, N, 4 + nc], accept both.
        out, axis = find_output(outputs, "yolov8", 4 + self.num_classes, axes=(1, 2))
        pred = out if axis == 2 else out.transpose(0, 2, 1)  # view as (B, N, 4 + nc)
        cls = pred[:, :, 4:]
        best = cls.max(axis=2)  # (B, N)
        b, a = np.nonzero(best >= score_threshold)
        rows = pred[b, a]  # (K, 4 + nc), gathered once
        return self._split_by_image(
            b,
            cxcywh_to_xyxy(rows[:, :4]),
            best[b, a].astype(np.float32, copy=False),
            rows[:, 4:].argmax(axis=1).astype(np.int32),
            batch,
        )

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        from pipelines.models.graph import yolo_heads

        return yolo_heads(g, self.num_classes, shapes, objectness=False)
