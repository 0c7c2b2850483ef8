"""ONNX Runtime backend: the reference runtime (CPU by default), and the fallback where TensorRT is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from engines.runtimes.base import Backend, BackendError, TensorSpec

# ORT type strings -> numpy dtypes for the tensor types a detector plausibly uses.
_ORT_DTYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(bool)": np.dtype(np.bool_),
}


def _spec(arg: ort.NodeArg) -> TensorSpec:
    # ORT reports a symbolic dim as a str ("batch") and an unknown one as None: both are dynamic.
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    dtype = _ORT_DTYPES.get(arg.type)
    if dtype is None:
        raise BackendError(f"onnxruntime: tensor {arg.name!r} has unsupported type {arg.type}")
    return TensorSpec(arg.name, shape, dtype)


class OrtBackend(Backend):
    """Runs an ONNX file with ONNX Runtime.

    Models exported with a fixed batch dim (NanoDet's is fixed at 1) still take any batch up to
    `max_batch`: the batch is run in chunks of the fixed size and the outputs concatenated. ORT on
    CPU parallelises inside each op, so this costs little versus a batched run, and it lets the
    scheduler batch frames the same way for every model (a fixed-batch ONNX file cannot be fed a
    larger batch at all).
    """

    name = "onnxruntime"
    # Upper bound on frames per infer() call, dynamic or fixed batch: bounds peak memory per call.
    MAX_BATCH = 64

    def __init__(
        self,
        onnx_path: str | Path,
        intra_threads: int = 0,
        inter_threads: int = 0,
        providers: list[str] | None = None,
        precision: str = "fp32",
    ) -> None:
        if precision != "fp32":
            # ORT runs the graph in the precision it was exported in; there is no build step to lower it.
            raise BackendError(f"onnxruntime: precision {precision!r} is not supported (only 'fp32')")
        super().__init__(precision)
        self.onnx_path = Path(onnx_path)
        self.intra_threads = intra_threads
        self.inter_threads = inter_threads
        self.providers = list(providers) if providers else ["CPUExecutionProvider"]
        self._session: ort.InferenceSession | None = None
        self._input: TensorSpec | None = None
        self._outputs: list[TensorSpec] = []

    def _load_impl(self) -> None:
        path = self.onnx_path
        if not path.is_file():
            raise BackendError(f"onnxruntime: cannot load {path}: no such file")
        available = ort.get_available_providers()
        missing = [p for p in self.providers if p not in available]
        if missing:
            # ORT would only warn and silently fall back to CPU; a wrong provider should be loud.
            raise BackendError(
                f"onnxruntime: cannot load {path}: providers {missing} not available (have {available})"
            )
        opts = ort.SessionOptions()
        if self.intra_threads > 0:
            opts.intra_op_num_threads = self.intra_threads
        if self.inter_threads > 0:
            opts.inter_op_num_threads = self.inter_threads
        try:
            session = ort.InferenceSession(str(path), sess_options=opts, providers=self.providers)
        except Exception as e:  # ORT raises its own pybind exception types (InvalidProtobuf, Fail, ...)
            raise BackendError(f"onnxruntime: cannot load {path}: {e}") from e

        inputs = session.get_inputs()
        if len(inputs) != 1:
            names = [i.name for i in inputs]
            raise BackendError(f"onnxruntime: {path} has inputs {names}; expected exactly one image input")
        self._input = _spec(inputs[0])
        if len(self._input.shape) != 4:
            raise BackendError(
                f"onnxruntime: {path} input {self._input.name!r} has shape {self._input.shape}; expected NCHW"
            )
        self._outputs = [_spec(o) for o in session.get_outputs()]
        self._session = session

    def _close_impl(self) -> None:
        self._session = None

    def _require_loaded(self) -> TensorSpec:
        if self._input is None:
            raise BackendError(f"onnxruntime: {self.onnx_path} is not loaded; call load() first")
        return self._input

    @property
    def input_spec(self) -> TensorSpec:
        return self._require_loaded()

    @property
    def output_specs(self) -> list[TensorSpec]:
        self._require_loaded()
        return list(self._outputs)

    @property
    def max_batch(self) -> int:
        return self.MAX_BATCH

    def _infer_impl(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        spec = self._require_loaded()
        assert self._session is not None  # set together with _input
        for axis in (1, 2, 3):
            want = spec.shape[axis]
            if want is not None and batch.shape[axis] != want:
                raise BackendError(
                    f"onnxruntime: input {spec.name!r} wants shape {spec.shape}, got {batch.shape}"
                )
        # ORT needs C-contiguous memory of the right dtype; this is a no-op for the usual float32 batch.
        batch = np.ascontiguousarray(batch, dtype=spec.dtype)
        fixed = spec.shape[0]
        n = batch.shape[0]
        if fixed is None or n == fixed:
            return self._run(spec.name, batch)

        # Fixed batch dim: run in chunks of that size, zero-padding the last one, then trim.
        chunks: list[dict[str, np.ndarray]] = []
        for start in range(0, n, fixed):
            part = batch[start : start + fixed]
            if part.shape[0] < fixed:
                pad = np.zeros((fixed - part.shape[0], *part.shape[1:]), dtype=part.dtype)
                part = np.concatenate([part, pad])
            chunks.append(self._run(spec.name, part))
        return {name: np.concatenate([c[name] for c in chunks])[:n] for name in chunks[0]}

    def _run(self, input_name: str, batch: np.ndarray) -> dict[str, np.ndarray]:
        assert self._session is not None
        try:
            values = self._session.run(None, {input_name: batch})
        except Exception as e:  # ORT's pybind exceptions; keep the model path in the message
            raise BackendError(f"onnxruntime: inference failed for {self.onnx_path}: {e}") from e
        return {spec.name: value for spec, value in zip(self._outputs, values, strict=True)}
