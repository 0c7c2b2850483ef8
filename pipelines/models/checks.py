"""Checks of a model's outputs and its probe input (the daemon and preflight run them on a real inference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.runtimes.base import TensorSpec
from pipelines.models.base import GRAFTED_OUTPUTS, ModelAdapter
from pipelines.models.registry import DEFAULT_SIDE


def check_outputs(fmt: str, adapter: ModelAdapter, outputs: dict[str, np.ndarray]) -> None:
    """ValueError when a real inference's `outputs` are not what the adapter decodes (a NanoDet declared
    yolov8 would otherwise run with 0 detections and an error per batch). Only the layout is checked."""
    if adapter.grafted:  # decode + NMS grafted onto the graph: detections of fixed shape
        missing = [name for name in GRAFTED_OUTPUTS if name not in outputs]
        if missing:
            raise ValueError(f"the grafted model's outputs ({', '.join(outputs)}) lack {', '.join(missing)}")
        return
    try:
        adapter._decode(outputs, 1, 2.0)  # threshold above 1: nothing survives, no box maths
    except (ValueError, KeyError, IndexError) as exc:
        shapes = ", ".join(f"{name} {list(a.shape)}" for name, a in outputs.items())
        raise ValueError(f"the model's outputs ({shapes}) are not {fmt} outputs: {exc}") from None


def probe_input(spec: TensorSpec) -> np.ndarray:
    """A batch of one zero image for `spec` (dynamic H/W: 640, as make_adapter assumes)."""
    c = spec.shape[1] if spec.shape[1] is not None else 3
    h, w = (d if d is not None else DEFAULT_SIDE for d in spec.shape[2:4])
    return np.zeros((1, c, h, w), dtype=np.float32)


def probe_outputs(path: Path) -> dict[str, np.ndarray]:
    """The model's outputs for one zero image, run on ONNX Runtime (CPU, one thread): exported detectors
    often leave output shapes dynamic, so only a real inference shows their layout. ONNX Runtime's own
    errors pass through (callers word them)."""
    from engines.runtimes.ort import OrtBackend

    backend = OrtBackend(str(path), intra_threads=1)
    backend.load()
    try:
        return backend.infer(probe_input(backend.input_spec))
    finally:
        backend.close()
