"""Exports that end in their own NMS ("end-to-end"): their outputs are the detections, so decoding is a
threshold and the letterbox undone, with no NMS on top. Two layouts:

- one output [B, N, 6] or [N, 6]: x1, y1, x2, y2 (input pixels), score, class id per row; padded rows
  (score 0) fall under the threshold. Ultralytics YOLOv10 / YOLO26 exports and `nms=True` exports give
  [B, 300, 6]; a graph ending in NonMaxSuppression + Gather gives [N, 6], N decided by the data (TensorRT
  hands such an output out through engines.runtimes.dynamic_outputs). [N, 6] holds one image's rows.
- four outputs, EfficientNMS_TRT's (YOLOv7/v6/v9 `--end2end` exports): num_dets [B, 1], det_boxes
  [B, K, 4], det_scores [B, K], det_classes [B, K]; rows past num_dets are padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipelines.frames import Detections
from pipelines.models.base import Candidates, ModelAdapter
from pipelines.preprocess import Letterbox, unletterbox

if TYPE_CHECKING:
    from pipelines.models.graph import GraphBuilder, GraphHeads

# EfficientNMS roles, told apart by name (scores and classes share a shape): a substring of each.
_ROLES = {"count": ("num", "count"), "boxes": ("box",), "scores": ("score",), "classes": ("class", "label")}

# Per batch item: boxes (B, K, 4), scores (B, K), class ids (B, K) as the model gave them, rows in use
# (B, K) bool, and the name of the output holding the class ids (for errors).
_Table = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, str]


def _shape(arr: np.ndarray) -> list[int]:
    return [int(d) for d in arr.shape]


class End2EndAdapter(ModelAdapter):
    fmt = "end2end"
    mean = None
    std = None
    scale = 1.0 / 255.0
    swap_rb = True  # the exports this serves (Ultralytics, YOLOv7/v6/v9) are trained on RGB
    pad_value = 114

    def postprocess(
        self,
        outputs: dict[str, np.ndarray],
        letterboxes: list[Letterbox],
        score_threshold: float,
        iou_threshold: float = 0.5,
    ) -> list[Detections]:
        """Threshold and map to source pixels; the model suppressed already, so no NMS here."""
        if self.grafted:
            return super().postprocess(outputs, letterboxes, score_threshold, iou_threshold)
        per_image = self._decode(outputs, len(letterboxes), score_threshold)
        return [
            Detections(unletterbox(boxes, lb), scores, class_ids) if scores.size else Detections.empty()
            for (boxes, scores, class_ids), lb in zip(per_image, letterboxes, strict=True)
        ]

    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        boxes, scores, classes, used, classes_name = self._table(outputs, batch)
        keep = scores >= score_threshold
        if used is not None:
            keep &= used
        b, a = np.nonzero(keep)
        picked = classes[b, a]
        ids = (np.rint(picked) if picked.dtype.kind == "f" else picked).astype(np.int32, copy=False)
        bad = (ids < 0) | (ids >= self.num_classes)
        if bad.any():  # a labels file shorter than the model's classes: no name to give these
            raise ValueError(
                f"end2end: output {classes_name!r} has class id {int(ids[bad][0])} on a detection over the "
                f"threshold, outside the {self.num_classes} labels"
            )
        return self._split_by_image(
            b,
            boxes[b, a].astype(np.float32, copy=False),
            scores[b, a].astype(np.float32, copy=False),
            ids,
            batch,
        )

    def _table(self, outputs: dict[str, np.ndarray], batch: int) -> _Table:
        """The detections of `batch` images as per-image tables; ValueError naming the output that does not
        fit either layout."""
        roles = _efficient_nms_roles(outputs)
        if roles is not None:
            return _efficient_nms(outputs, roles, batch)
        if len(outputs) != 1:
            shapes = {name: _shape(a) for name, a in outputs.items()}
            raise ValueError(
                f"end2end: outputs {shapes} are neither one [B, N, 6] / [N, 6] detections output nor the "
                "four EfficientNMS outputs (num_dets, det_boxes, det_scores, det_classes)"
            )
        ((name, out),) = outputs.items()
        if out.ndim == 2 and out.shape[1] == 6:
            if batch > 1:
                raise ValueError(
                    f"end2end: output {name!r} {_shape(out)} holds one image's detections and cannot be "
                    f"split into a batch of {batch}: serve this model with batch max 1, or export it with a "
                    "batch dim"
                )
            out = out[None]
        elif not (out.ndim == 3 and out.shape[2] == 6):
            raise ValueError(
                f"end2end: output {name!r} has shape {_shape(out)}; expected [B, N, 6] or [N, 6] rows of "
                "x1, y1, x2, y2, score, class"
            )
        if out.shape[0] < batch:
            raise ValueError(f"end2end: output {name!r} {_shape(out)} has fewer than {batch} images")
        out = out[:batch]
        return out[:, :, :4], out[:, :, 4], out[:, :, 5], None, name

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        raise ValueError("graft: an end2end model ends in its own NMS; serve it with postprocess: host")


def _efficient_nms_roles(outputs: dict[str, np.ndarray]) -> dict[str, str] | None:
    """Output name per EfficientNMS role, when the four outputs are there; None otherwise."""
    if len(outputs) != 4:
        return None
    roles: dict[str, str] = {}
    for role, parts in _ROLES.items():
        names = [n for n in outputs if any(p in n.lower() for p in parts) and n not in roles.values()]
        if len(names) != 1:
            return None
        roles[role] = names[0]
    return roles


def _efficient_nms(outputs: dict[str, np.ndarray], roles: dict[str, str], batch: int) -> _Table:
    count, boxes = outputs[roles["count"]], outputs[roles["boxes"]]
    scores, classes = outputs[roles["scores"]], outputs[roles["classes"]]
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"end2end: output {roles['boxes']!r} has shape {_shape(boxes)}; expected [B, K, 4]")
    b, k = boxes.shape[:2]
    for role in ("scores", "classes"):
        arr = outputs[roles[role]]
        if arr.shape != (b, k):
            raise ValueError(f"end2end: output {roles[role]!r} has shape {_shape(arr)}; expected [{b}, {k}]")
    if count.reshape(-1).shape[0] != b or count.ndim > 2:
        raise ValueError(f"end2end: output {roles['count']!r} has shape {_shape(count)}; expected [{b}, 1]")
    if b < batch:
        raise ValueError(f"end2end: output {roles['boxes']!r} {_shape(boxes)} has fewer than {batch} images")
    used = np.arange(k)[None, :] < count.reshape(-1)[:batch, None].astype(np.int64)
    return boxes[:batch], scores[:batch], classes[:batch], used, roles["classes"]
