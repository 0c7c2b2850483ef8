"""The model formats: one line each, from which the config's `format` choices derive (as Frigate's detector
registry). A new format is an adapter module (pipelines.models.base.ModelAdapter: `_decode`, and
`graph_heads` for `postprocess: graph`) plus its line here."""

from __future__ import annotations

from engines.runtimes.base import TensorSpec
from pipelines.models.base import ModelAdapter
from pipelines.models.nanodet import NanoDetAdapter
from pipelines.models.yolov5 import YoloV5Adapter
from pipelines.models.yolov8 import YoloV8Adapter

FORMATS: dict[str, type[ModelAdapter]] = {
    "nanodet": NanoDetAdapter,
    "yolov8": YoloV8Adapter,
    "yolo11": YoloV8Adapter,  # YOLO11 detection exports use the YOLOv8 output layout
    "yolov5": YoloV5Adapter,
}

DEFAULT_SIDE = 640  # used for a dynamic (None) H or W, the usual YOLO export size


def formats() -> tuple[str, ...]:
    """The format names the config accepts, in registry order."""
    return tuple(FORMATS)


def adapter_class(fmt: str) -> type[ModelAdapter]:
    cls = FORMATS.get(fmt.lower())
    if cls is None:
        raise ValueError(f"unknown model format {fmt!r}; valid formats: {', '.join(sorted(FORMATS))}")
    return cls


def make_adapter(
    fmt: str, input_spec: TensorSpec, num_classes: int, *, grafted: bool = False
) -> ModelAdapter:
    """The adapter for `fmt`, sized from the model's NCHW input (dynamic H/W -> 640). `grafted`: the model's
    outputs are the grafted detections (a ModelSpec in graph mode decides it, pipelines.models.spec)."""
    cls = adapter_class(fmt)
    if len(input_spec.shape) != 4:
        raise ValueError(f"model input {input_spec.name!r} has shape {input_spec.shape}; expected 4-D NCHW")
    h, w = (d if d is not None else DEFAULT_SIDE for d in input_spec.shape[2:4])
    adapter = cls((h, w), num_classes, grafted=grafted)
    adapter.fmt = fmt.lower()
    return adapter
