"""Decode + NMS grafted onto a detector's ONNX graph: the engine's outputs are detections, not head maps.

    grafted = graft_nanodet(onnx.load(path), adapter, score_threshold=0.35, iou_threshold=0.5, max_det=100)
    outputs = backend.infer(batch)                     # det_boxes, det_scores, det_classes, det_count
    dets = decode_grafted(outputs, letterboxes)        # source pixels, as adapter.postprocess returns

Why in the graph: on the GPU path the raw NanoDet heads are 1.7 MB per frame to copy to the host and decode
there; grafted, a frame costs K * 24 + 4 bytes (K = max_det) and the decode runs where the engine runs.
Only standard ONNX ops (Softmax, MatMul, ArgMax, NonMaxSuppression, ScatterND, TopK, GatherElements), which
TensorRT's ONNX parser and ONNX Runtime both take, so the CPU path can use the same graph.

Outputs have fixed shapes (TensorRT binds them once): det_boxes [B, K, 4] (x1, y1, x2, y2 in letterboxed
input pixels), det_scores [B, K], det_classes [B, K] int32, det_count [B] int32; rows past det_count are
zero. The thresholds are constants of the grafted graph, so a changed threshold is a different ONNX (and
engine key). NMS is class-aware with one class per anchor (its best), as the CPU path
(pipelines.postprocess.nms) does: NonMaxSuppression gets each anchor's score in its best class only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipelines.models.base import GRAFTED_OUTPUTS as OUTPUTS
from pipelines.models.base import ModelAdapter, decode_grafted
from pipelines.models.nanodet import NanoDetAdapter
from pipelines.models.yolov5 import YoloV5Adapter
from pipelines.models.yolov8 import YoloV8Adapter

__all__ = ["OUTPUTS", "decode_grafted", "graft_nanodet", "graft_postprocess"]


class _Graph:
    """Appends nodes and constants to a graph with unique names."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph, self.n = graph, 0

    def const(self, value: np.ndarray, name: str) -> str:
        full = f"graft/{name}_{self.n}"
        self.n += 1
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), full))
        return full

    def op(self, kind: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        name = out or f"graft/{kind}_{self.n}"
        self.n += 1
        self.graph.node.append(helper.make_node(kind, inputs, [name], name=name, **attrs))
        return name


def graft_postprocess(
    model: onnx.ModelProto,
    adapter: ModelAdapter,
    *,
    score_threshold: float,
    iou_threshold: float = 0.5,
    max_det: int = 100,
) -> onnx.ModelProto:
    """A copy of the model whose outputs are OUTPUTS (see the module docstring): NanoDet, YOLOv5, YOLOv8."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    _ensure_opset(model, 13)
    g = _Graph(model.graph)
    shapes = _output_shapes(model)
    if isinstance(adapter, NanoDetAdapter):
        boxes, scores = _nanodet_heads(g, adapter, shapes)
    elif isinstance(adapter, YoloV8Adapter):
        boxes, scores = _yolo_heads(g, adapter, shapes, objectness=False)
    elif isinstance(adapter, YoloV5Adapter):
        boxes, scores = _yolo_heads(g, adapter, shapes, objectness=True)
    else:
        raise ValueError(f"graft: no graph decoding for {type(adapter).__name__}")
    _tail(g, boxes, scores, adapter.num_classes, score_threshold, iou_threshold, max_det, _opset(model))
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
    onnx.checker.check_model(model)
    return model


graft_nanodet = graft_postprocess  # the first adapter it was written for


def _nanodet_heads(g: _Graph, adapter: NanoDetAdapter, shapes: dict[str, tuple[int, ...]]) -> tuple[str, str]:
    """(boxes (B, N, 4) x1y1x2y2, scores (B, N, C)) from the GFL heads, as NanoDetAdapter._decode."""
    # The adapter pairs score and box maps and finds each level's stride; zeros of the right shapes suffice.
    dummies = {name: np.zeros((1, *shape[1:]), np.float32) for name, shape in shapes.items()}
    names = {id(arr): name for name, arr in dummies.items()}
    box_parts, score_parts = [], []
    for stride, grid_w, score_map, box_map in adapter._levels(dummies):
        n, bins = box_map.shape[1], box_map.shape[2] // 4
        dist = g.op("Reshape", [names[id(box_map)], g.const(np.array([-1, n, 4, bins], np.int64), "shape")])
        dist = g.op("Softmax", [dist], axis=-1)
        proj = g.const((np.arange(bins, dtype=np.float32) * np.float32(stride)).reshape(bins, 1), "proj")
        dist = g.op("Reshape", [g.op("MatMul", [dist, proj]), g.const(np.array([-1, n, 4], np.int64), "s")])
        a = np.arange(n)
        centre = np.stack([(a % grid_w + 0.5) * stride, (a // grid_w + 0.5) * stride], 1).astype(np.float32)
        sign = g.const(np.array([-1, -1, 1, 1], np.float32), "sign")
        corners = g.const(np.concatenate([centre, centre], 1)[None], "centre")  # (1, n, 4): cx cy cx cy
        box_parts.append(g.op("Add", [corners, g.op("Mul", [dist, sign])]))
        score_parts.append(names[id(score_map)])
    return g.op("Concat", box_parts, axis=1), g.op("Concat", score_parts, axis=1)


# cx, cy, w, h -> x1, y1, x2, y2 as one MatMul (the zeros add nothing, so the values equal the host's).
_CXCYWH_TO_XYXY = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [-0.5, 0, 0.5, 0], [0, -0.5, 0, 0.5]], np.float32)


def _yolo_heads(
    g: _Graph, adapter: ModelAdapter, shapes: dict[str, tuple[int, ...]], *, objectness: bool
) -> tuple[str, str]:
    """YOLOv8 (B, 4 + C, N) or (B, N, 4 + C); YOLOv5 (B, N, 5 + C) with score = objectness x class."""
    width = (5 if objectness else 4) + adapter.num_classes
    name, shape = next(
        (
            (n, s)
            for n, s in shapes.items()
            if len(s) == 3 and (s[2] == width or (not objectness and s[1] == width))
        ),
        (None, None),
    )
    if name is None or shape is None:
        raise ValueError(f"graft: no output of width {width} among {shapes}")
    pred = name if shape[2] == width else g.op("Transpose", [name], perm=[0, 2, 1])  # (B, N, width)

    def cols(lo: int, hi: int) -> str:
        return g.op(
            "Slice",
            [
                pred,
                g.const(np.array([lo], np.int64), "lo"),
                g.const(np.array([hi], np.int64), "hi"),
                g.const(np.array([2], np.int64), "axis"),
            ],
        )

    boxes = g.op("MatMul", [cols(0, 4), g.const(_CXCYWH_TO_XYXY, "xyxy")])
    scores = cols(width - adapter.num_classes, width)
    if objectness:
        scores = g.op("Mul", [cols(4, 5), scores])  # obj >= 0: the best class is the best class score's
    return boxes, scores


def _tail(
    g: _Graph,
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


def _ensure_opset(model: onnx.ModelProto, version: int) -> None:
    """ReduceMax/ReduceSum with `axes` as attribute vs input changed at 18; pin the default domain >= 13."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version < version:
            imp.version = version
