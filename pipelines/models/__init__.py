"""Detector model adapters: preprocessing and output decoding per export format, the format registry and the
resolved model (ModelSpec). Names load on first use: the config reads the registry's format names without
importing the adapters (and OpenCV with them)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.models.base import ModelAdapter
    from pipelines.models.checks import check_outputs, probe_input, probe_outputs
    from pipelines.models.nanodet import NanoDetAdapter
    from pipelines.models.registry import DEFAULT_SIDE, FORMATS, formats, make_adapter
    from pipelines.models.spec import GraftParams, GraftRecord, ModelSpec, SpecError, resolve_onnx
    from pipelines.models.yolov5 import YoloV5Adapter
    from pipelines.models.yolov8 import YoloV8Adapter

_WHERE = {
    "DEFAULT_SIDE": "registry",
    "FORMATS": "registry",
    "formats": "registry",
    "make_adapter": "registry",
    "GraftParams": "spec",
    "GraftRecord": "spec",
    "ModelSpec": "spec",
    "SpecError": "spec",
    "resolve_onnx": "spec",
    "ModelAdapter": "base",
    "NanoDetAdapter": "nanodet",
    "YoloV5Adapter": "yolov5",
    "YoloV8Adapter": "yolov8",
    "check_outputs": "checks",
    "probe_input": "checks",
    "probe_outputs": "checks",
}

__all__ = [
    "DEFAULT_SIDE",
    "FORMATS",
    "GraftParams",
    "GraftRecord",
    "ModelAdapter",
    "ModelSpec",
    "NanoDetAdapter",
    "SpecError",
    "YoloV5Adapter",
    "YoloV8Adapter",
    "check_outputs",
    "formats",
    "make_adapter",
    "probe_input",
    "probe_outputs",
    "resolve_onnx",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pipelines.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pipelines.models.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
