"""The one interface every inference runtime implements (ONNX Runtime now, TensorRT later).

Shaped after Polygraphy's runners: public load/infer/close guard state, subclasses fill in *_impl.
load() raises BackendError; PlanRefusedError (a subclass) where the compiled artifact itself was refused,
which a rebuild can fix (the daemon rebuilds once: agent.lifecycle.manager).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class BackendError(RuntimeError):
    """A runtime could not load a model or run it; the message names the path or tensor."""


class PlanRefusedError(BackendError):
    """The runtime refused the compiled plan itself (TensorRT's deserialiser returned None for a reason in
    the plan, e.g. a TensorRT patch the manifest's fingerprint does not tell apart): rebuilding it here can
    help, unlike for "no GPU visible" or a CUDA failure. `reason` is the runtime's own message."""

    def __init__(self, message: str, plan: str, reason: str) -> None:
        super().__init__(message)
        self.plan = plan
        self.reason = reason


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model input or output. Dynamic dims are None."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype


class ReadyEvent(Protocol):
    """What a consumer of a DeviceTensor waits on (engines.cuda.buffers.Event)."""

    @property
    def raw(self) -> object: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class DeviceTensor:
    """An NCHW batch already in device memory (GPU preprocessing), for backends with
    ``accepts_device_input``. The producer's writes are complete once ``ready`` has fired: a consumer
    makes its stream wait on it (or synchronises it) before reading. ``ptr`` stays valid until the
    producer takes the buffer back, which the scheduler does only after the batch's infer() returned."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    ready: ReadyEvent

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


Batch = np.ndarray | DeviceTensor


class Backend(ABC):
    """Load a model, describe its input, infer a batch.

    `infer` takes one NCHW batch (N <= max_batch) and returns every output by name, each with N
    as its first dimension. Up to `slots` calls may run at once on different threads (1 unless the
    runtime has several execution slots, as TensorRT with several contexts has); `load` and `close`
    must not overlap any of them.
    """

    name: str = "backend"
    # True where infer() also takes a DeviceTensor (the input never leaves the device).
    accepts_device_input: bool = False

    def __init__(self, precision: str = "fp32") -> None:
        self.precision = precision
        self._loaded = False
        # Per thread: with several slots, two threads' batches finish in any order.
        self._timing = threading.local()
        self.last_gpu_ms = None

    @property
    def last_gpu_ms(self) -> float | None:
        """Device time of the last batch this thread ran, where the runtime measures it."""
        return getattr(self._timing, "gpu_ms", None)

    @last_gpu_ms.setter
    def last_gpu_ms(self, value: float | None) -> None:
        self._timing.gpu_ms = value

    @property
    def slots(self) -> int:
        """How many batches this backend runs at once (its execution slots); the scheduler keeps up to
        this many in flight."""
        return 1

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        if not self._loaded:
            self._load_impl()
            self._loaded = True

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if not self._loaded:
            raise BackendError(f"{self.name}: infer() called before load()")
        if isinstance(batch, DeviceTensor) and not self.accepts_device_input:
            raise BackendError(f"{self.name}: takes host arrays only, got a batch in device memory")
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
    def _infer_impl(self, batch: Batch) -> dict[str, np.ndarray]:
        """One batch; a DeviceTensor reaches it only where accepts_device_input is True."""

    def _close_impl(self) -> None:  # noqa: B027 - optional hook
        pass
