"""YOLOv5 detection exports: one output [B, N, 5 + nc] of cx, cy, w, h (network pixels), objectness
and per-class probabilities; a box's score is objectness x class probability."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipelines.models.base import Candidates, ModelAdapter, cxcywh_to_xyxy, find_output

if TYPE_CHECKING:
    from pipelines.models.graph import GraphBuilder, GraphHeads


class YoloV5Adapter(ModelAdapter):
    fmt = "yolov5"
    mean = None
    std = None
    scale = 1.0 / 255.0
    swap_rb = True  # trained on RGB
    pad_value = 114

    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        pred, _ = find_output(outputs, "yolov5", 5 + self.num_classes, axes=(2,))
        # score = obj * cls <= obj (probabilities), so objectness alone rejects most rows cheaply.
        b, a = np.nonzero(pred[:, :, 4] >= score_threshold)
        rows = pred[b, a]  # (K, 5 + nc)
        class_ids = rows[:, 5:].argmax(axis=1)
        scores = rows[:, 4] * rows[np.arange(rows.shape[0]), 5 + class_ids]
        ok = scores >= score_threshold
        return self._split_by_image(
            b[ok],
            cxcywh_to_xyxy(rows[ok, :4]),
            scores[ok].astype(np.float32, copy=False),
            class_ids[ok].astype(np.int32),
            batch,
        )

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        from pipelines.models.graph import yolo_heads

        return yolo_heads(g, self.num_classes, shapes, objectness=True)
