"""What a detector model needs around the runtime: its input normalisation and its output decoding."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from pipelines.frames import Detections
from pipelines.postprocess import nms
from pipelines.preprocess import Letterbox, Normalisation, letterbox_normalise, unletterbox

if TYPE_CHECKING:
    from pipelines.models.graph import GraphBuilder, GraphHeads

# One image's decoded candidates before NMS: boxes (K, 4) x1y1x2y2 in network pixels, scores (K,),
# class ids (K,).
Candidates = tuple[np.ndarray, np.ndarray, np.ndarray]


class ModelAdapter(ABC):
    """Turns BGR frames into the model's input batch and the model's outputs into Detections.

    Subclasses set the normalisation class attributes and implement `_decode`; thresholding happens
    in `_decode` (so cheap rejection comes before any box maths), NMS and the mapping back to source
    pixels are shared here. `graph_heads` writes the same decoding into an ONNX graph (the graft,
    pipelines.models.graft); a format without it serves `postprocess: host` only.

    `grafted` is decided once, when the adapter is made (pipelines.models.spec.ModelSpec.adapter): True,
    the engine's outputs are the grafted detections (GRAFTED_OUTPUTS) and only their letterbox is undone.
    """

    fmt = ""  # the registry name (pipelines.models.FORMATS); make_adapter sets the one it was made for

    # Normalisation, applied as (x * scale - mean) / std in the network's channel order.
    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    scale: float = 1.0
    swap_rb: bool = False  # True: network wants RGB (frames are BGR)
    pad_value: int = 114
    max_det: int = 300

    def __init__(self, input_hw: tuple[int, int], num_classes: int, *, grafted: bool = False) -> None:
        if num_classes <= 0:
            raise ValueError(f"num_classes must be positive, got {num_classes}")
        self.input_hw = input_hw
        self.num_classes = num_classes
        self.grafted = grafted
        # Folded once here, not per batch; GPU preprocessing reads the same values.
        self.normalisation = Normalisation.of(
            input_hw, self.mean, self.std, self.scale, self.swap_rb, self.pad_value
        )

    def preprocess(self, images: list[np.ndarray]) -> tuple[np.ndarray, list[Letterbox]]:
        """Letterbox each BGR frame to the input size and pack them into one NCHW float32 batch."""
        return letterbox_normalise(images, self.normalisation)

    def postprocess(
        self,
        outputs: dict[str, np.ndarray],
        letterboxes: list[Letterbox],
        score_threshold: float,
        iou_threshold: float = 0.5,
    ) -> list[Detections]:
        """Decode, threshold, class-aware NMS, map to source pixels: one Detections per batch item."""
        if self.grafted:  # the engine already decoded and suppressed (pipelines.models.graft)
            return decode_grafted(outputs, letterboxes)
        per_image = self._decode(outputs, len(letterboxes), score_threshold)
        results: list[Detections] = []
        for (boxes, scores, class_ids), lb in zip(per_image, letterboxes, strict=True):
            if scores.shape[0] == 0:
                results.append(Detections.empty())
                continue
            keep = nms(boxes, scores, class_ids, iou_threshold, self.max_det)
            results.append(
                Detections(
                    unletterbox(boxes[keep], lb),
                    scores[keep].astype(np.float32, copy=False),
                    class_ids[keep].astype(np.int32, copy=False),
                )
            )
        return results

    @abstractmethod
    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        """Candidates with score >= score_threshold (best class per box), one entry per batch item."""

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        """Write `_decode`'s boxes and per-class scores into the graph `g` (before threshold and NMS), from
        the model's output `shapes` (one run). What the graft needs of a format; none: host decoding only."""
        raise ValueError(f"graft: no graph decoding for {type(self).__name__} ({self.fmt or 'no format'})")

    def _split_by_image(
        self, image_idx: np.ndarray, boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, batch: int
    ) -> list[Candidates]:
        """Group flat candidates (tagged with their batch index) into one tuple per image."""
        if batch == 1:
            return [(boxes, scores, class_ids)]
        order = np.argsort(image_idx, kind="stable")
        bounds = np.searchsorted(image_idx[order], np.arange(batch + 1))
        return [
            (boxes[order[a:b]], scores[order[a:b]], class_ids[order[a:b]])
            for a, b in itertools.pairwise(bounds)
        ]


def cxcywh_to_xyxy(cxcywh: np.ndarray) -> np.ndarray:
    """(K, 4) centre/size boxes to corner boxes, float32."""
    half = cxcywh[:, 2:4] * np.float32(0.5)
    xyxy = np.concatenate([cxcywh[:, 0:2] - half, cxcywh[:, 0:2] + half], axis=1)
    return xyxy.astype(np.float32, copy=False)


def find_output(
    outputs: dict[str, np.ndarray], model: str, width: int, axes: tuple[int, ...]
) -> tuple[np.ndarray, int]:
    """The first 3-D output whose dim `axis` equals `width` (4+nc or 5+nc), trying `axes` in order.

    Returns (array, axis). Matching by shape rather than name keeps exports from different tools
    (output0, output, 1234) working.
    """
    matches = [
        (arr, axis) for axis in axes for arr in outputs.values() if arr.ndim == 3 and arr.shape[axis] == width
    ]
    if not matches:
        shapes = {name: arr.shape for name, arr in outputs.items()}
        raise ValueError(f"{model}: no output has a dim of {width} (4/5 + num_classes); outputs: {shapes}")
    return matches[0]


# Outputs of a graph with decode + NMS grafted on (pipelines.models.graft): detections, not head maps.
GRAFTED_OUTPUTS = ("det_boxes", "det_scores", "det_classes", "det_count")


def is_grafted(outputs: dict[str, np.ndarray] | list[str] | tuple[str, ...]) -> bool:
    """Whether these outputs (arrays by name, or the names) are the grafted ones."""
    return all(name in outputs for name in GRAFTED_OUTPUTS)


def decode_grafted(outputs: dict[str, np.ndarray], letterboxes: list[Letterbox]) -> list[Detections]:
    """Grafted outputs of a batch as Detections in source pixels (best score first). The graph applied
    its own score threshold; callers filter per camera (min_score, classes) as for host decoding."""
    counts = outputs["det_count"].astype(np.int64).reshape(-1)
    out = []
    for i, lb in enumerate(letterboxes):
        n = int(counts[i])
        out.append(
            Detections(
                unletterbox(outputs["det_boxes"][i, :n].astype(np.float32, copy=False), lb),
                outputs["det_scores"][i, :n].astype(np.float32, copy=False),
                outputs["det_classes"][i, :n].astype(np.int32, copy=False),
            )
        )
    return out
