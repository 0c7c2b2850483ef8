"""The model formats: one line each, from which the config's `format` choices derive (as Frigate's detector
registry). A new format is an adapter module (pipelines.models.base.ModelAdapter: `_decode`, and
`graph_heads` for `postprocess: graph`) plus its line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.runtimes.base import TensorSpec
    from pipelines.models.base import ModelAdapter

# "module:Class" is imported on first use, so the config can list the names without loading the adapters
# (and OpenCV with them); a class works too (a plug-in registering itself, the toy format of the tests).
FORMATS: dict[str, str | type[ModelAdapter]] = {
    "nanodet": "pipelines.models.nanodet:NanoDetAdapter",
    "yolov8": "pipelines.models.yolov8:YoloV8Adapter",
    "yolo11": "pipelines.models.yolov8:YoloV8Adapter",  # YOLO11 detection exports use the YOLOv8 layout
    "yolov5": "pipelines.models.yolov5:YoloV5Adapter",
    "end2end": "pipelines.models.end2end:End2EndAdapter",  # the model ends in NMS: [B, N, 6] or EfficientNMS
}

DEFAULT_SIDE = 640  # used for a dynamic (None) H or W, the usual YOLO export size


def formats() -> tuple[str, ...]:
    """The format names the config accepts, in registry order."""
    return tuple(FORMATS)


def adapter_class(fmt: str) -> type[ModelAdapter]:
    entry = FORMATS.get(fmt.lower())
    if entry is None:
        raise ValueError(f"unknown model format {fmt!r}; valid formats: {', '.join(sorted(FORMATS))}")
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        cls: type[ModelAdapter] = getattr(importlib.import_module(module), name)
        return cls
    return entry


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
