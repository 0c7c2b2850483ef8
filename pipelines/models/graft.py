"""Decode + NMS grafted onto a detector's ONNX graph: the engine's outputs are detections, not head maps.

    grafted = graft_nanodet(onnx.load(path), adapter, score_threshold=0.35, iou_threshold=0.5, max_det=100)
    outputs = backend.infer(batch)                     # det_boxes, det_scores, det_classes, det_count
    dets = decode_grafted(outputs, letterboxes)        # source pixels, as adapter.postprocess returns

Why in the graph: on the GPU path the raw NanoDet heads are 1.7 MB per frame to copy to the host and decode
there; grafted, a frame costs K * 24 + 4 bytes (K = max_det) and the decode runs where the engine runs.
Only standard ONNX ops (Softmax, MatMul, TopK, GatherElements, Loop, ...), which TensorRT's ONNX parser and
ONNX Runtime both take, so the CPU path can use the same graph.

Outputs have fixed shapes (TensorRT binds them once): det_boxes [B, K, 4] (x1, y1, x2, y2 in letterboxed
input pixels), det_scores [B, K], det_classes [B, K] int32, det_count [B] int32; rows past det_count are
zero, kept rows are best score first. The thresholds are constants of the grafted graph, so a changed
threshold is a different ONNX (and engine key). NMS is class-aware with one class per anchor (its best), as
the CPU path (pipelines.postprocess.nms) does.

Two NMS tails: "matrix" (default) is exact greedy NMS built from a pairwise-IoU matrix iterated in a Loop
(see _matrix_tail); TensorRT-RTX 1.7 builds it. "onnx" uses the NonMaxSuppression op, which ONNX Runtime
runs but TensorRT-RTX 1.7's builder rejects ("no runners that implement it").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from engines.build.islands import KEEP_FP32
from pipelines.models.base import GRAFTED_OUTPUTS as OUTPUTS
from pipelines.models.base import ModelAdapter, decode_grafted
from pipelines.models.graph import GraphBuilder
from pipelines.models.spec import GraftParams, GraftRecord, ModelSpec, write_record

__all__ = ["OUTPUTS", "decode_grafted", "graft_nanodet", "graft_postprocess", "graft_spec"]


def graft_spec(spec: ModelSpec, params: GraftParams) -> onnx.ModelProto:
    """The (host) model `spec`'s source ONNX with `params`' decode + NMS grafted on, its source recorded.
    Serve it as `spec.grafted_as(<where it was saved>, params)`."""
    return graft_postprocess(
        onnx.load(str(spec.source_onnx)),
        spec.adapter(),
        score_threshold=params.score_threshold,
        iou_threshold=params.iou_threshold,
        max_det=params.max_det,
        nms=params.nms,
        pre_nms_top_k=params.pre_nms_top_k,
        source=str(spec.source_onnx),
    )


def graft_postprocess(
    model: onnx.ModelProto,
    adapter: ModelAdapter,
    *,
    score_threshold: float,
    iou_threshold: float = 0.5,
    max_det: int = 100,
    nms: str = "matrix",
    pre_nms_top_k: int = 1000,
    source: str = "",
) -> onnx.ModelProto:
    """A copy of the model whose outputs are OUTPUTS (see the module docstring), for any format whose adapter
    has `graph_heads`; its metadata records the graft (pipelines.models.spec.GraftRecord; `source`: the ONNX
    grafted onto, as the caller names it).

    nms="matrix" (default): greedy NMS from MatMul/TopK/Loop over the best `pre_nms_top_k` anchors, which
    TensorRT-RTX builds; nms="onnx": the NonMaxSuppression op over all anchors (ONNX Runtime, TensorRT >= 8.5;
    TensorRT-RTX 1.7 has no builder implementation of it).
    """
    if nms not in ("matrix", "onnx"):
        raise ValueError(f"graft: nms must be 'matrix' or 'onnx', got {nms!r}")
    if max_det <= 0 or pre_nms_top_k <= 0:
        raise ValueError(f"graft: max_det and pre_nms_top_k must be positive, got {max_det}, {pre_nms_top_k}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model = _ensure_opset(model, 13)
    g = GraphBuilder(model.graph)
    boxes, scores, anchors = adapter.graph_heads(g, _output_shapes(model))
    if nms == "onnx":
        _tail(g, boxes, scores, adapter.num_classes, score_threshold, iou_threshold, max_det, _opset(model))
    else:
        _matrix_tail(g, boxes, scores, anchors, score_threshold, iou_threshold, max_det, pre_nms_top_k)
    del model.graph.output[:]
    b = "batch"
    model.graph.output.extend(
        [
            helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, [b, max_det, 4]),
            helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, [b, max_det]),
            helper.make_tensor_value_info("det_classes", TensorProto.INT32, [b, max_det]),
            helper.make_tensor_value_info("det_count", TensorProto.INT32, [b]),
        ]
    )
    params = GraftParams(score_threshold, iou_threshold, max_det, nms, pre_nms_top_k)
    write_record(model, GraftRecord(adapter.fmt, adapter.num_classes, params, source))
    onnx.checker.check_model(model)
    return model


graft_nanodet = graft_postprocess  # the first adapter it was written for


def _tail(
    g: GraphBuilder,
    boxes: str,
    scores: str,
    num_classes: int,
    score_threshold: float,
    iou_threshold: float,
    max_det: int,
    opset: int,
) -> None:
    """Best class per anchor, class-aware NMS, top K: the OUTPUTS, written into the graph."""
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
    kept = g.op("Mul", [best, keep])  # (B, N): suppressed and below-threshold anchors are 0
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


def _output_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Output shapes from one ONNX Runtime run on zeros (exporters often leave them symbolic)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
    outs = session.run(None, {inp.name: np.zeros(shape, np.float32)})
    return {o.name: tuple(v.shape) for o, v in zip(session.get_outputs(), outs, strict=True)}


def _opset(model: onnx.ModelProto) -> int:
    return next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), 13)


def _ensure_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """The grafted ops are written for opset >= 13 (ReduceSum/Squeeze/Unsqueeze take axes as inputs).

    An older model is converted, not relabelled: relabelling would change what its own Squeeze, Split or
    ReduceSum nodes mean."""
    if _opset(model) >= version:
        return model
    from onnx import version_converter

    return version_converter.convert_version(model, version)


def _matrix_tail(
    g: GraphBuilder,
    boxes: str,
    scores: str,
    anchors: int,
    score_threshold: float,
    iou_threshold: float,
    max_det: int,
    pre_nms_top_k: int,
) -> None:
    """OUTPUTS from greedy class-aware NMS without the NonMaxSuppression op.

    The T = min(N, pre_nms_top_k) best anchors (by best-class score) get a T x T "i suppresses j" matrix
    M (i ranks before j, same class, IoU > threshold). Greedy NMS keeps j iff no kept i has M[i, j], and
    keep' = valid * (keep @ M == 0) reaches exactly that: M is strictly upper triangular, so after k steps
    the first k entries are final and the only fixed point is the greedy answer. A Loop runs the step until
    keep stops changing (a few steps on real frames, at most T), so the result is exact, not an
    approximation like Fast/Matrix NMS. Anchors past the T best are dropped before NMS (as detectors' own
    pre-NMS top-k does); the host path has no such cut, so T must exceed the anchors over the threshold.
    """
    t = min(anchors, max(pre_nms_top_k, 1))
    k = min(max_det, t)
    z = g.const(np.zeros((), np.float32), "zero")
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

    # Pairwise IoU (B, T, T): rows i, columns j.
    x1, y1, x2, y2 = (f"graft/c{i}_{g.n}" for i in range(4))
    g.n += 1
    g.graph.node.append(
        helper.make_node("Split", [cand_boxes], [x1, y1, x2, y2], axis=2, name=f"{KEEP_FP32}{x1}_split")
    )
    perm = [0, 2, 1]
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
    m = g.op("Cast", [g.op("And", [g.op("And", [overlap, same]), upper])], to=TensorProto.FLOAT)

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
    keep = g.op("Reshape", [keep, g.const(np.array([0, -1], np.int64), "bt")])  # (B, T)
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
