"""The one interface every inference runtime implements (ONNX Runtime now, TensorRT later).

Shaped after Polygraphy's runners: public load/infer/close guard state, subclasses fill in *_impl.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class BackendError(RuntimeError):
    """A runtime could not load a model or run it; the message names the path or tensor."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model input or output. Dynamic dims are None."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype


class Backend(ABC):
    """Load a model, describe its input, infer a batch.

    `infer` takes one NCHW batch (N <= max_batch) and returns every output by name, each with N
    as its first dimension. Not thread-safe: use one instance per worker/stream.
    """

    name: str = "backend"

    def __init__(self, precision: str = "fp32") -> None:
        self.precision = precision
        self._loaded = False
        self.last_gpu_ms: float | None = None  # device time of the last batch, where the runtime measures it

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        if not self._loaded:
            self._load_impl()
            self._loaded = True

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if not self._loaded:
            raise BackendError(f"{self.name}: infer() called before load()")
        if batch.ndim != 4:
            raise BackendError(f"{self.name}: expected an NCHW batch, got shape {batch.shape}")
        if batch.shape[0] > self.max_batch:
            raise BackendError(f"{self.name}: batch of {batch.shape[0]} exceeds max batch {self.max_batch}")
        return self._infer_impl(batch)

    def close(self) -> None:
        if self._loaded:
            self._close_impl()
            self._loaded = False

    def __enter__(self) -> Backend:
        self.load()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    @abstractmethod
    def input_spec(self) -> TensorSpec: ...

    @property
    @abstractmethod
    def output_specs(self) -> list[TensorSpec]: ...

    @property
    @abstractmethod
    def max_batch(self) -> int: ...

    @property
    def warmup_shape(self) -> tuple[int, ...]:
        """The smallest input shape the model takes (dynamic dims as 1)."""
        return tuple(1 if d is None else d for d in self.input_spec.shape)

    @abstractmethod
    def _load_impl(self) -> None: ...

    @abstractmethod
    def _infer_impl(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def _close_impl(self) -> None:  # noqa: B027 - optional hook
        pass
