"""Detector model adapters: preprocessing and output decoding per export format."""

from __future__ import annotations

import numpy as np

from engines.runtimes.base import TensorSpec
from pipelines.models.base import ModelAdapter, is_grafted
from pipelines.models.nanodet import NanoDetAdapter
from pipelines.models.yolov5 import YoloV5Adapter
from pipelines.models.yolov8 import YoloV8Adapter

__all__ = [
    "ADAPTERS",
    "ModelAdapter",
    "NanoDetAdapter",
    "YoloV5Adapter",
    "YoloV8Adapter",
    "check_outputs",
    "make_adapter",
    "probe_input",
]

ADAPTERS: dict[str, type[ModelAdapter]] = {
    "nanodet": NanoDetAdapter,
    "yolov8": YoloV8Adapter,
    "yolo11": YoloV8Adapter,  # YOLO11 detection exports use the YOLOv8 output layout
    "yolov5": YoloV5Adapter,
}

_DEFAULT_SIDE = 640  # used for a dynamic (None) H or W, the usual YOLO export size


def make_adapter(fmt: str, input_spec: TensorSpec, num_classes: int) -> ModelAdapter:
    """The adapter for `fmt`, sized from the model's NCHW input (dynamic H/W -> 640)."""
    cls = ADAPTERS.get(fmt.lower())
    if cls is None:
        raise ValueError(f"unknown model format {fmt!r}; valid formats: {', '.join(sorted(ADAPTERS))}")
    if len(input_spec.shape) != 4:
        raise ValueError(f"model input {input_spec.name!r} has shape {input_spec.shape}; expected 4-D NCHW")
    h, w = (d if d is not None else _DEFAULT_SIDE for d in input_spec.shape[2:4])
    return cls((h, w), num_classes)


def check_outputs(fmt: str, adapter: ModelAdapter, outputs: dict[str, np.ndarray]) -> None:
    """ValueError when a real inference's `outputs` are not what `fmt` decodes (a NanoDet declared yolov8
    would otherwise run with 0 detections and an error per batch). Only the layout is checked."""
    if is_grafted(outputs):  # decode + NMS grafted onto the graph: detections of fixed shape
        return
    try:
        adapter._decode(outputs, 1, 2.0)  # threshold above 1: nothing survives, no box maths
    except (ValueError, KeyError, IndexError) as exc:
        shapes = ", ".join(f"{name} {list(a.shape)}" for name, a in outputs.items())
        raise ValueError(f"the model's outputs ({shapes}) are not {fmt} outputs: {exc}") from None


def probe_input(spec: TensorSpec) -> np.ndarray:
    """A batch of one zero image for `spec` (dynamic H/W: 640, as make_adapter assumes)."""
    c = spec.shape[1] if spec.shape[1] is not None else 3
    h, w = (d if d is not None else _DEFAULT_SIDE for d in spec.shape[2:4])
    return np.zeros((1, c, h, w), dtype=np.float32)
