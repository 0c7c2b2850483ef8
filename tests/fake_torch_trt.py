"""A `fake_` TensorRT engine that runs a real ONNX model on the GPU (onnx2torch + PyTorch), for GPU tests.

TensorRT cannot be installed on the GPU box, so this stands in for ICudaEngine / IExecutionContext at the
level the agent's execution slots (engines.runtimes.slots) talk to: the slot binds device addresses with
set_tensor_address, sets the input shape, and calls execute_async_v3(stream); the fake context reads the
bound input address and writes every bound output address on that stream, like an engine would. The
network itself is the bundled NanoDet (or any ONNX) converted by onnx2torch, so detections are real.

    engine = fake_torch_engine(onnx_path, max_batch=16, contexts=2)
    backend = fake_trt_backend(engine, contexts=2)     # a Backend over the real SlotPool
    backend.load(); outputs = backend.infer(device_tensor)

Only the GPU box runs this (torch, onnx2torch and CuPy are there; CI has none of them).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from engines.runtimes.base import Backend, Batch, TensorSpec
from engines.runtimes.slots import IoSpec, SlotPool


def _torch() -> Any:
    import torch

    return torch


class fake_torch_context:
    """IExecutionContext over a torch module: one profile set, bound addresses, execute on a stream."""

    def __init__(self, engine: fake_torch_engine) -> None:
        self.engine = engine
        self.profile = 0
        self.shape: tuple[int, ...] | None = None
        self.addresses: dict[str, int] = {}
        self.executions = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return False
        self.profile, self.shape = index, None
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if name not in self.engine.names:
            return False
        self.addresses[name] = int(ptr)
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        lo, _, hi = self.engine.profiles[self.profile]
        if name != self.engine.input_name or not all(
            a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)
        ):
            return False
        self.shape = tuple(int(s) for s in shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        n = self.shape[0] if self.shape is not None else -1
        if name == self.engine.input_name:
            return (n, *self.engine.profiles[0][0][1:])
        return (n, *self.engine.output_shapes[name])

    def _view(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        import cupy as cp

        torch = _torch()
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        mem = cp.cuda.UnownedMemory(self.addresses[name], nbytes, self)
        arr = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device="cuda")

    def execute_async_v3(self, stream: int) -> bool:
        torch = _torch()
        assert self.shape is not None, "execute_async_v3 before set_input_shape"
        missing = set(self.engine.names) - set(self.addresses)
        assert not missing, f"execute_async_v3 without addresses for {sorted(missing)}"
        n = self.shape[0]
        with torch.cuda.stream(torch.cuda.ExternalStream(int(stream))), torch.inference_mode():
            x = self._view(self.engine.input_name, self.shape, np.float32)
            outs = self.engine.run(x)
            for name, value in zip(self.engine.output_names, outs, strict=True):
                dst = self._view(name, (n, *self.engine.output_shapes[name]), self.engine.output_dtypes[name])
                dst.copy_(value)
        self.executions += 1
        return True


class fake_torch_engine:
    """ICudaEngine over an ONNX model converted with onnx2torch; `contexts` profile sets (one each)."""

    def __init__(self, onnx_path: str, *, max_batch: int = 16, contexts: int = 1) -> None:
        import onnx
        from onnx2torch import convert

        torch = _torch()
        # FP32 means FP32 here (PyTorch would use TF32 convolutions on Ampere+), so outputs compare with
        # ONNX Runtime's to ~1e-4 rather than ~4e-3.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        model = onnx.load(onnx_path)
        graph_inputs = [
            i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}
        ]
        self.input_name = graph_inputs[0].name
        dims = [d.dim_value for d in graph_inputs[0].type.tensor_type.shape.dim]
        chw = tuple(dims[1:])
        self.fixed_batch = dims[0] == 1
        self.module = convert(model).cuda().eval()
        self._lock = threading.Lock()  # one module: contexts on two threads take turns in Python
        self.output_names = [o.name for o in model.graph.output]
        with torch.inference_mode():
            probe = self.run(torch.zeros((1, *chw), device="cuda"))
        self.output_shapes = {n: tuple(t.shape[1:]) for n, t in zip(self.output_names, probe, strict=True)}
        torch_to_np = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}
        self.output_dtypes = {n: torch_to_np[t.dtype] for n, t in zip(self.output_names, probe, strict=True)}
        self.names = [self.input_name, *self.output_names]
        profile = ((1, *chw), (max(1, max_batch // 2), *chw), (max_batch, *chw))
        self.profiles = [profile] * contexts
        self.contexts: list[fake_torch_context] = []

    def run(self, x: Any) -> list[Any]:
        torch = _torch()
        with self._lock:
            # A batch-1 export (the bundled NanoDet) reshapes to batch 1 inside: run it image by image,
            # as ONNX Runtime does in chunks (the TensorRT builder makes such a model's batch dynamic).
            parts = (
                [self.module(x[i : i + 1]) for i in range(x.shape[0])]
                if self.fixed_batch
                else [self.module(x)]
            )
        parts = [list(p) if isinstance(p, list | tuple) else [p] for p in parts]
        return [torch.cat(ts) for ts in zip(*parts, strict=True)] if len(parts) > 1 else parts[0]

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_execution_context(self) -> fake_torch_context:
        ctx = fake_torch_context(self)
        self.contexts.append(ctx)
        return ctx

    def get_tensor_profile_shape(self, name: str, profile: int) -> Any:
        return self.profiles[profile]


class fake_trt_backend(Backend):
    """A Backend over the agent's real SlotPool and a fake engine (what TensorRTBackend does after it
    deserialised a plan): device batches are bound where they lie."""

    name = "tensorrt"
    accepts_device_input = True

    def __init__(self, engine: fake_torch_engine, contexts: int = 1) -> None:
        super().__init__("fp32")
        self.engine, self._contexts = engine, contexts
        self._pool: SlotPool | None = None

    def _load_impl(self) -> None:
        io = [IoSpec(self.engine.input_name, True, np.dtype(np.float32))] + [
            IoSpec(n, False, np.dtype(self.engine.output_dtypes[n])) for n in self.engine.output_names
        ]
        self._pool = SlotPool.create(self.engine, io, self._contexts, "fake_torch_engine")  # type: ignore[arg-type]

    def _close_impl(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def input_spec(self) -> TensorSpec:
        return TensorSpec(
            self.engine.input_name, (None, *self.engine.profiles[0][0][1:]), np.dtype(np.float32)
        )

    @property
    def output_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(n, (None, *self.engine.output_shapes[n]), np.dtype(self.engine.output_dtypes[n]))
            for n in self.engine.output_names
        ]

    @property
    def max_batch(self) -> int:
        return int(self.engine.profiles[0][2][0])

    @property
    def slots(self) -> int:
        return len(self._pool.slots) if self._pool is not None else 1

    def _infer_impl(self, batch: Batch) -> dict[str, np.ndarray]:
        assert self._pool is not None
        outputs, self.last_gpu_ms = self._pool.run_timed(batch)
        return outputs
