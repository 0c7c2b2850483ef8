"""What the overhead and sweep sections run: the model's input and adapter, its labels, the outputs recorded
with ONNX Runtime for the simulated engine to replay, and the clip's frames."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.runtimes.base import TensorSpec
from pipelines.models import ModelAdapter


@dataclass(frozen=True)
class Workload:
    spec: TensorSpec  # the model's input tensor
    recorded: list[dict[str, np.ndarray]]  # ONNX Runtime's outputs on the first frames
    adapter: ModelAdapter
    labels: list[str]
    images: list[np.ndarray]  # the clip's frames (at --resolution)
