"""The "matrix" NMS tail of the graft (pipelines.models.graft): exact greedy class-aware NMS written with
MatMul/TopK/Loop, without the NonMaxSuppression op (which TensorRT-RTX 1.7's builder rejects).

The T = min(N, pre_nms_top_k) best anchors (by best-class score) get a T x T "i suppresses j" matrix
M (i ranks before j, same class, IoU > threshold). Greedy NMS keeps j iff no kept i has M[i, j], and
keep' = valid * (keep @ M == 0) reaches exactly that: M is strictly upper triangular, so after k steps
the first k entries are final and the only fixed point is the greedy answer. A Loop runs the step until
keep stops changing (a few steps on real frames, at most T), so the result is exact, not an
approximation like Fast/Matrix NMS. Anchors past the T best are dropped before NMS (as detectors' own
pre-NMS top-k does); the host path has no such cut, so T must exceed the anchors over the threshold.

The ops are appended in a fixed order, so a graft's node and constant names (GraphBuilder's counter) are
the same on every run.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from engines.build.islands import KEEP_FP32
from pipelines.models.graph import GraphBuilder


def matrix_tail(
    g: GraphBuilder,
    boxes: str,
    scores: str,
    anchors: int,
    score_threshold: float,
    iou_threshold: float,
    max_det: int,
    pre_nms_top_k: int,
) -> None:
    """The graft's OUTPUTS (pipelines.models.base.GRAFTED_OUTPUTS) from (B, N, 4) boxes and (B, N, C)
    scores, written into the graph."""
    t = min(anchors, max(pre_nms_top_k, 1))
    z = g.const(np.zeros((), np.float32), "zero")
    cand_scores, cand_class, cand_boxes = _candidates(g, boxes, scores, t)
    m = _suppression(g, cand_boxes, cand_class, iou_threshold, t, z)
    keep = _greedy_keep(g, m, cand_scores, score_threshold, t, z)
    _outputs(g, cand_scores, cand_class, cand_boxes, keep, min(max_det, t), max_det, z)


def _candidates(g: GraphBuilder, boxes: str, scores: str, t: int) -> tuple[str, str, str]:
    """The T best anchors by best-class score, best first: scores (B, T), class (B, T), boxes (B, T, 4)."""
    best_class = g.op("ArgMax", [scores], axis=2, keepdims=0)  # (B, N) int64
    # ReduceMax's axes moved to an input at opset 18; Max over classes via TopK(1) avoids the split.
    best = g.op("TopK", [scores, g.const(np.array([1], np.int64), "one")], axis=2, out="graft/best_k")
    g.graph.node[-1].output.append("graft/best_k_index")
    best = g.op("Squeeze", [best, g.const(np.array([2], np.int64), "sq")])  # (B, N)
    cand_scores = g.op("TopK", [best, g.const(np.array([t], np.int64), "t")], axis=1, out="graft/cand_scores")
    g.graph.node[-1].output.append("graft/cand_index")
    cand_index = "graft/cand_index"  # (B, T), best first
    cand_class = g.op("GatherElements", [best_class, cand_index], axis=1)  # (B, T)
    index4 = g.op(
        "Expand",
        [
            g.op("Unsqueeze", [cand_index, g.const(np.array([2], np.int64), "ax")]),
            g.const(np.array([1, 1, 4], np.int64), "e4"),
        ],
    )
    cand_boxes = g.op("GatherElements", [boxes, index4], axis=1)  # (B, T, 4)
    return cand_scores, cand_class, cand_boxes


def _suppression(
    g: GraphBuilder, cand_boxes: str, cand_class: str, iou_threshold: float, t: int, z: str
) -> str:
    """M (B, T, T) as float: candidate i suppresses j (i ranks before j, same class, IoU > threshold)."""
    x1, y1, x2, y2 = (f"graft/c{i}_{g.n}" for i in range(4))
    g.n += 1
    g.graph.node.append(
        helper.make_node("Split", [cand_boxes], [x1, y1, x2, y2], axis=2, name=f"{KEEP_FP32}{x1}_split")
    )
    perm = [0, 2, 1]  # rows i, columns j
    x1t, y1t, x2t, y2t = (g.op("Transpose", [c], perm=perm) for c in (x1, y1, x2, y2))
    iw = g.op("Max", [g.op("Sub", [g.op("Min", [x2, x2t]), g.op("Max", [x1, x1t])]), z])
    ih = g.op("Max", [g.op("Sub", [g.op("Min", [y2, y2t]), g.op("Max", [y1, y1t])]), z])
    inter = g.op("Mul", [iw, ih])
    area = g.op("Mul", [g.op("Sub", [x2, x1]), g.op("Sub", [y2, y1])])  # (B, T, 1)
    union = g.op("Sub", [g.op("Add", [area, g.op("Transpose", [area], perm=perm)]), inter])
    # Zero-area pairs would divide 0 by 0; a tiny floor makes their IoU 0 (no suppression, as NaN > t is).
    iou = g.op("Div", [inter, g.op("Max", [union, g.const(np.array(1e-9, np.float32), "eps")])])
    overlap = g.op("Greater", [iou, g.const(np.array(iou_threshold, np.float32), "iou")])
    cls_col = g.op("Unsqueeze", [cand_class, g.const(np.array([2], np.int64), "ax2")])  # (B, T, 1)
    same = g.op("Equal", [cls_col, g.op("Transpose", [cls_col], perm=perm)])
    upper = g.const(np.triu(np.ones((t, t), bool), 1), "upper")  # i ranks before j
    return g.op("Cast", [g.op("And", [g.op("And", [overlap, same]), upper])], to=TensorProto.FLOAT)


def _greedy_keep(g: GraphBuilder, m: str, cand_scores: str, score_threshold: float, t: int, z: str) -> str:
    """Keep (B, T) as 0/1 floats: the fixed point of keep' = valid * (keep @ M == 0), run by a Loop."""
    # Valid = score >= threshold (the host keeps >=); also keeps zero-score padding out when N is small.
    thr = g.const(np.array(score_threshold, np.float32), "thr")
    valid = g.op("Cast", [g.op("Not", [g.op("Less", [cand_scores, thr])])], to=TensorProto.FLOAT)  # (B, T)
    valid_row = g.op("Unsqueeze", [valid, g.const(np.array([1], np.int64), "ax1")])  # (B, 1, T)

    # Loop body: keep_out = valid * (keep_in @ M == 0); continue while anything changed.
    step = f"{KEEP_FP32}graft/nms_step/"
    body_nodes = [
        helper.make_node("MatMul", ["keep_in", m], ["hits"], name=step + "hits"),
        helper.make_node("Equal", ["hits", z], ["free"], name=step + "free"),
        helper.make_node("Cast", ["free"], ["free_f"], to=TensorProto.FLOAT, name=step + "free_f"),
        helper.make_node("Mul", [valid_row, "free_f"], ["keep_out"], name=step + "keep_out"),
        helper.make_node("Sub", ["keep_out", "keep_in"], ["delta"], name=step + "delta"),
        helper.make_node("Abs", ["delta"], ["change"], name=step + "change"),
        helper.make_node("ReduceMax", ["change"], ["most"], keepdims=0, name=step + "most"),
        helper.make_node("Greater", ["most", z], ["cond_out"], name=step + "cond_out"),
    ]
    body = helper.make_graph(
        body_nodes,
        "graft_nms_step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("keep_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("keep_out", TensorProto.FLOAT, None),
        ],
    )
    keep = g.op(
        "Loop",
        [g.const(np.array(t + 1, np.int64), "trips"), g.const(np.array(True), "go"), valid_row],
        body=body,
    )
    return g.op("Reshape", [keep, g.const(np.array([0, -1], np.int64), "bt")])  # (B, T)


def _outputs(
    g: GraphBuilder,
    cand_scores: str,
    cand_class: str,
    cand_boxes: str,
    keep: str,
    k: int,
    max_det: int,
    z: str,
) -> None:
    """det_scores, det_boxes, det_classes (the K best kept, padded to max_det rows) and det_count."""
    kept = g.op("Mul", [cand_scores, keep])  # suppressed and below-threshold candidates are 0
    top_scores = g.op("TopK", [kept, g.const(np.array([k], np.int64), "k")], axis=1, out="graft/top_scores")
    g.graph.node[-1].output.append("graft/top_index")
    index = "graft/top_index"
    ok = g.op("Greater", [top_scores, z])  # (B, K)
    ok_f = g.op("Cast", [ok], to=TensorProto.FLOAT)
    pad = max_det - k  # fewer anchors than max_det: pad the K axis so the outputs keep their fixed shape

    def padded(x: str, rank: int, out: str) -> str:
        if pad == 0:
            return g.op("Identity", [x], out=out)
        pads = [0] * (2 * rank)
        pads[rank + 1] = pad
        return g.op("Pad", [x, g.const(np.array(pads, np.int64), "pads")], out=out)

    padded(g.op("Mul", [top_scores, ok_f]), 2, "det_scores")
    index4 = g.op(
        "Expand",
        [
            g.op("Unsqueeze", [index, g.const(np.array([2], np.int64), "ax3")]),
            g.const(np.array([1, 1, 4], np.int64), "e4b"),
        ],
    )
    picked = g.op("GatherElements", [cand_boxes, index4], axis=1)
    ok_col = g.op("Unsqueeze", [ok_f, g.const(np.array([2], np.int64), "ax4")])
    padded(g.op("Mul", [picked, ok_col]), 3, "det_boxes")
    cls = g.op("Cast", [g.op("GatherElements", [cand_class, index], axis=1)], to=TensorProto.INT32)
    ok_i = g.op("Cast", [ok], to=TensorProto.INT32)
    padded(g.op("Mul", [cls, ok_i]), 2, "det_classes")
    count = g.op("ReduceSum", [ok_i, g.const(np.array([1], np.int64), "rs")])  # (B, 1)
    g.op("Reshape", [count, g.const(np.array([-1], np.int64), "flat")], out="det_count")
