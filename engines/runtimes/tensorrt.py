"""TensorRT / TensorRT-RTX runtime: load a stored plan (sha256 verified), describe its IO tensors.

    backend = TensorRTBackend(store, "detector", check_result.key)   # key from engines.compat.check
    backend.load()       # BackendError when no GPU, plan corrupt, or TensorRT refuses the plan
    backend.input_spec, backend.output_specs, backend.max_batch

Written to the TensorRT docs (Runtime.deserialize_cuda_engine, num_io_tensors / get_tensor_name /
get_tensor_mode / get_tensor_shape / get_tensor_profile_shape, create_execution_context); it cannot
run on this project's CI (no supported GPU), where only the "no GPU" refusal and the logic around
TensorRT (with tests/fake_tensorrt.py) are exercised. Execution arrives with the multi-stream work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.errors import EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.runtimes.base import Backend, BackendError, TensorSpec
from engines.store import EngineStore
from engines.trt_api import IoTensor, TrtApi, import_trt


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(
        self,
        store: EngineStore,
        model: str,
        key: str,
        *,
        api: TrtApi | None = None,
        fingerprint: Fingerprint | None = None,
        precision: str | None = None,
    ) -> None:
        if precision is None:
            try:
                manifest = store.manifest(model, key)
            except EngineError:  # reported by load(), which reads the manifest again
                manifest = None
            precision = manifest.build["precision"] if manifest else "fp32"
        super().__init__(precision)
        self.store, self.model, self.key = store, model, key
        self._api = api
        self._fingerprint = fingerprint
        self._runtime: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._io: list[IoTensor] = []

    @property
    def plan_path(self) -> str:
        return str(self.store.plan_path(self.model, self.key))

    def _load_impl(self) -> None:
        try:
            api = self._api or import_trt()
            fp = self._fingerprint or probe_fingerprint(api)
        except EngineError as e:
            raise BackendError(f"{self.name}: cannot load {self.plan_path}: {e}") from e
        self.name = api.flavor
        if not fp.has_gpu:
            # Deserialising needs a CUDA GPU for every flavour; say so instead of TensorRT's cudaError 35.
            raise BackendError(
                f"{api.flavor}: cannot load {self.plan_path}: no CUDA GPU is visible "
                "(install cuda-python or pynvml, check the driver)"
            )
        try:
            plan = self.store.read_plan(self.model, self.key)  # sha256 verified before TensorRT sees it
        except EngineError as e:
            raise BackendError(f"{api.flavor}: {e}") from e
        logger = api.logger()
        runtime, engine = api.deserialize(plan, logger)
        if engine is None:
            raise BackendError(
                f"{api.flavor}: TensorRT refused {self.plan_path}: "
                + ("; ".join(logger.errors) or "no reason given")
            )
        context = engine.create_execution_context()
        if context is None:
            raise BackendError(
                f"{api.flavor}: cannot create an execution context for {self.plan_path}: "
                + ("; ".join(logger.errors) or "no reason given")
            )
        io = api.io_tensors(engine)
        inputs = [t for t in io if t.is_input]
        if len(inputs) != 1 or len(inputs[0].shape) != 4:
            raise BackendError(
                f"{api.flavor}: {self.plan_path} has inputs "
                f"{[(t.name, t.shape) for t in inputs]}; expected exactly one NCHW input"
            )
        # The runtime objects keep each other alive in this order (runtime -> engine -> context).
        self._runtime, self._engine, self._context, self._io = runtime, engine, context, io

    def _close_impl(self) -> None:
        self._context = self._engine = self._runtime = None
        self._io = []

    def _require(self) -> list[IoTensor]:
        if not self._io:
            raise BackendError(f"{self.name}: {self.plan_path} is not loaded; call load() first")
        return self._io

    @staticmethod
    def _spec(t: IoTensor) -> TensorSpec:
        return TensorSpec(t.name, tuple(d if d >= 0 else None for d in t.shape), np.dtype(t.dtype))

    @property
    def input_spec(self) -> TensorSpec:
        return self._spec(next(t for t in self._require() if t.is_input))

    @property
    def output_specs(self) -> list[TensorSpec]:
        return [self._spec(t) for t in self._require() if not t.is_input]

    @property
    def max_batch(self) -> int:
        """Batch dim of the profile's max shape (a fixed-batch engine: its fixed batch)."""
        inp = next(t for t in self._require() if t.is_input)
        if inp.shape[0] >= 0:
            return int(inp.shape[0])
        assert inp.profile is not None
        return int(inp.profile[2][0])

    def _infer_impl(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError("execution arrives with the multi-stream work")
