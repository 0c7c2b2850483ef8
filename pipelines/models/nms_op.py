"""The "onnx" NMS tail of the graft (pipelines.models.graft): the NonMaxSuppression op over all anchors,
which ONNX Runtime and TensorRT >= 8.5 run but TensorRT-RTX 1.7's builder rejects ("no runners that
implement it"). Class-aware with one class per anchor (its best), as the host path.

The ops are appended in a fixed order, so a graft's node and constant names (GraphBuilder's counter) are
the same on every run.
"""

from __future__ import annotations

import numpy as np

from pipelines.models.graph import GraphBuilder


def op_tail(
    g: GraphBuilder,
    boxes: str,
    scores: str,
    num_classes: int,
    score_threshold: float,
    iou_threshold: float,
    max_det: int,
    opset: int,
) -> None:
    """The graft's OUTPUTS (pipelines.models.base.GRAFTED_OUTPUTS) from (B, N, 4) boxes and (B, N, C)
    scores: best class per anchor, class-aware NMS, top K, written into the graph."""
    best_class, kept = _kept(g, boxes, scores, num_classes, score_threshold, iou_threshold, max_det, opset)
    _outputs(g, boxes, best_class, kept, max_det)


def _kept(
    g: GraphBuilder,
    boxes: str,
    scores: str,
    num_classes: int,
    score_threshold: float,
    iou_threshold: float,
    max_det: int,
    opset: int,
) -> tuple[str, str]:
    """Each anchor's best class (B, N, 1) and its score where NMS kept it, else 0 (B, N)."""
    if opset >= 18:  # ReduceMax takes its axes as an input from opset 18
        best = g.op("ReduceMax", [scores, g.const(np.array([2], np.int64), "axes")], keepdims=0)
    else:
        best = g.op("ReduceMax", [scores], axes=[2], keepdims=0)  # (B, N)
    best_class = g.op("ArgMax", [scores], axis=2, keepdims=1)  # (B, N, 1)
    classes = g.const(np.arange(num_classes, dtype=np.int64), "classes")
    only_best = g.op("Equal", [best_class, classes])  # (B, N, C)
    masked = g.op("Where", [only_best, scores, g.const(np.zeros((), np.float32), "zero")])
    per_class = g.op("Transpose", [masked], perm=[0, 2, 1])  # (B, C, N) for NonMaxSuppression
    selected = g.op(
        "NonMaxSuppression",
        [
            boxes,
            per_class,
            g.const(np.array([max_det], np.int64), "k"),
            g.const(np.array([iou_threshold], np.float32), "iou"),
            # ONNX keeps scores > threshold, the CPU path >= threshold: nudge it down by one float step.
            g.const(np.array([np.nextafter(np.float32(score_threshold), np.float32(-1))], np.float32), "thr"),
        ],
    )  # (M, 3): batch, class, anchor
    where = g.op("Gather", [selected, g.const(np.array([0, 2], np.int64), "cols")], axis=1)  # (M, 2)
    ones = g.op("Cast", [g.op("Gather", [selected, g.const(np.array(1, np.int64), "col")], axis=1)], to=1)
    ones = g.op(
        "Add",
        [g.op("Mul", [ones, g.const(np.zeros((), np.float32), "z")]), g.const(np.ones((), np.float32), "o")],
    )
    keep = g.op("ScatterND", [g.op("Mul", [best, g.const(np.zeros((), np.float32), "z2")]), where, ones])
    return best_class, g.op("Mul", [best, keep])  # (B, N): suppressed and below-threshold anchors are 0


def _outputs(g: GraphBuilder, boxes: str, best_class: str, kept: str, max_det: int) -> None:
    """det_scores, det_boxes, det_classes (the max_det best kept) and det_count."""
    k = g.const(np.array([max_det], np.int64), "topk")
    top_scores = g.op("TopK", [kept, k], axis=1, out="graft/top_scores")
    g.graph.node[-1].output.append("graft/top_index")  # TopK's second output: the indices
    index = "graft/top_index"
    valid = g.op("Greater", [top_scores, g.const(np.zeros((), np.float32), "z3")])
    g.op("Where", [valid, top_scores, g.const(np.zeros((), np.float32), "z4")], out="det_scores")
    index4 = g.op(
        "Expand",
        [
            g.op("Unsqueeze", [index, g.const(np.array([2], np.int64), "ax")]),
            g.const(np.array([1, 1, 4], np.int64), "e4"),
        ],
    )
    picked = g.op("GatherElements", [boxes, index4], axis=1)
    g.op(
        "Mul",
        [picked, g.op("Cast", [g.op("Unsqueeze", [valid, g.const(np.array([2], np.int64), "ax2")])], to=1)],
        out="det_boxes",
    )
    cls = g.op(
        "GatherElements",
        [g.op("Squeeze", [best_class, g.const(np.array([2], np.int64), "sq")]), index],
        axis=1,
    )
    g.op("Cast", [g.op("Mul", [cls, g.op("Cast", [valid], to=7)])], to=6, out="det_classes")
    g.op(
        "Cast",
        [
            g.op(
                "ReduceSum", [g.op("Cast", [valid], to=6), g.const(np.array([1], np.int64), "rs")], keepdims=0
            )
        ],
        to=6,
        out="det_count",
    )
