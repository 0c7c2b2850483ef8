"""The engine of a sweep point: ONNX Runtime itself, or the simulated one (recorded outputs replayed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.bench.args import BenchOptions
from engines.runtimes.base import Backend, TensorSpec
from engines.runtimes.ort import OrtBackend
from engines.runtimes.replay import ReplayBackend


def make_backend(opts: BenchOptions, spec: TensorSpec, recorded: list[dict[str, np.ndarray]]) -> Backend:
    """--engine ort: ONNX Runtime on the model; sim: `recorded` replayed at --engine-ms per batch."""
    backend: Backend
    if opts.engine == "ort":
        backend = OrtBackend(str(opts.model), intra_threads=opts.threads)
    else:
        backend = ReplayBackend(spec, recorded, latency_ms=opts.engine_ms, slots=opts.slots)
    backend.load()
    return backend


def gpu_letterbox() -> Any:
    """--preprocess gpu: the CUDA letterbox (imported only then: it needs cuda-python)."""
    from pipelines.preprocess_gpu import GpuLetterbox

    return GpuLetterbox()


def engine_description(opts: BenchOptions) -> dict[str, Any]:
    if opts.engine == "ort":
        return {"kind": "onnxruntime", "threads": opts.threads}
    return {"kind": "simulated", "ms_per_batch": opts.engine_ms, "slots": opts.slots}
