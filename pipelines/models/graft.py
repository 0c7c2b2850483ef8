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
(pipelines.models.nms_matrix); TensorRT-RTX 1.7 builds it. "onnx" uses the NonMaxSuppression op
(pipelines.models.nms_op), which ONNX Runtime runs but TensorRT-RTX 1.7's builder rejects ("no runners that
implement it").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from pipelines.models.base import GRAFTED_OUTPUTS as OUTPUTS
from pipelines.models.base import ModelAdapter, decode_grafted
from pipelines.models.graph import GraphBuilder
from pipelines.models.nms_matrix import matrix_tail
from pipelines.models.nms_op import op_tail
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
        op_tail(g, boxes, scores, adapter.num_classes, score_threshold, iou_threshold, max_det, _opset(model))
    else:
        matrix_tail(g, boxes, scores, anchors, score_threshold, iou_threshold, max_det, pre_nms_top_k)
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

