"""Which runtime serves a model on this machine: the one answer the daemon and the CLI share.

    target = engine_target(ctx)   # None: ONNX Runtime serves by design (target.note says why)

- backend `onnxruntime`: ONNX Runtime, no engine.
- backend `auto`: TensorRT when a TensorRT flavour is importable *and* a GPU is visible, else ONNX Runtime.
- backend `tensorrt` / `tensorrt_rtx`: that flavour, GPU or not (TensorRT-RTX builds ahead of time
  without one); not importable is a configuration error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent.config import ConfigError
from agent.lifecycle.model import ModelContext
from engines.errors import EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.runtimes.base import Backend
from engines.runtimes.ort import OrtBackend
from engines.trt import TrtApi, import_trt


@dataclass(frozen=True)
class EngineTarget:
    api: TrtApi
    fingerprint: Fingerprint


@dataclass(frozen=True)
class OrtOnly:
    note: str  # why no engine is involved


def engine_target(ctx: ModelContext, gpu_index: int = 0) -> EngineTarget | OrtOnly:
    """The TensorRT flavour and device a model's engine is for, or why ONNX Runtime serves instead.

    Raises ConfigError (naming models.M.backend) when a flavour is asked for and cannot be imported.
    """
    cfg = ctx.cfg
    if cfg.backend == "onnxruntime":
        return OrtOnly("backend onnxruntime: no engine")
    try:
        api = import_trt(ctx.trt_flavor)
        api.require_execution()
        fp = probe_fingerprint(
            api, target_compute_capability=cfg.engine.target_compute_capability, gpu_index=gpu_index
        )
    except EngineError as exc:
        if cfg.backend != "auto":
            raise ConfigError(f"models.{ctx.name}.backend: {cfg.backend} requested, but {exc}") from None
        return OrtOnly(f"no TensorRT here ({exc}): ONNX Runtime serves")
    if cfg.backend == "auto" and not fp.has_gpu:
        return OrtOnly("backend auto and no CUDA GPU visible: ONNX Runtime serves")
    return EngineTarget(api, fp)


def open_ort(ctx: ModelContext) -> Backend:
    backend = OrtBackend(
        str(ctx.cfg.onnx), intra_threads=ctx.cfg.threads.intra, inter_threads=ctx.cfg.threads.inter
    )
    backend.load()
    return backend


def engine_runs_here(fp: Fingerprint) -> bool:
    """Engines execute only on a GPU (a TensorRT-RTX AOT build on a CPU machine cannot run there)."""
    return bool(fp.has_gpu)


def warm_up(backend: Backend) -> None:
    """One inference on zeros at the smallest profile shape: proves the engine executes here."""
    backend.infer(np.zeros(backend.warmup_shape, dtype=backend.input_spec.dtype))
