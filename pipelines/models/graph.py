"""Writing decode ops into a detector's ONNX graph: the builder the graft (pipelines.models.graft) hands each
adapter's `graph_heads`, and the head decoding the YOLO layouts share.

Imported only when a graph is grafted, so loading an adapter does not load onnx.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engines.build.islands import KEEP_FP32


class GraphHeads(NamedTuple):
    """What the graft's NMS tail starts from, as tensor names in the graph."""

    boxes: str  # (B, N, 4) x1 y1 x2 y2 in letterboxed input pixels
    scores: str  # (B, N, C) per-class scores in [0, 1]
    anchors: int  # N, static (from the output shapes of one run)


class GraphBuilder:
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
        # Node names mark the FP32 island (engines.build.islands): precision routes leave these nodes alone.
        self.graph.node.append(helper.make_node(kind, inputs, [name], name=KEEP_FP32 + name, **attrs))
        return name


# cx, cy, w, h -> x1, y1, x2, y2 as one MatMul (the zeros add nothing, so the values equal the host's).
_CXCYWH_TO_XYXY = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [-0.5, 0, 0.5, 0], [0, -0.5, 0, 0.5]], np.float32)


def yolo_heads(
    g: GraphBuilder, num_classes: int, shapes: dict[str, tuple[int, ...]], *, objectness: bool
) -> GraphHeads:
    """YOLOv8 (B, 4 + C, N) or (B, N, 4 + C); YOLOv5 (B, N, 5 + C) with score = objectness x class."""
    width = (5 if objectness else 4) + num_classes
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
    channels_last = shape[2] == width
    pred = name if channels_last else g.op("Transpose", [name], perm=[0, 2, 1])  # (B, N, width)

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
    scores = cols(width - num_classes, width)
    if objectness:
        scores = g.op("Mul", [cols(4, 5), scores])  # obj >= 0: the best class is the best class score's
    return GraphHeads(boxes, scores, shape[1] if channels_last else shape[2])
