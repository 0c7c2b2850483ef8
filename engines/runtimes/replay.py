"""A backend that replays recorded outputs: the pipeline's own cost with inference excluded, and, with a
fixed per-batch latency, a simulated engine.

    engine = ReplayBackend(spec, recorded, latency_ms=2.0, slots=2)   # 2 ms per batch, 2 batches at once
    engine.load(); engine.infer(batch)                                 # any thread, up to `slots` at once
    engine.busy_s                                                      # summed simulated device time

The latency is a sleep, which releases the GIL like a real runtime waiting for its device, so the
benchmark shows whether the pipeline keeps an engine of that speed busy. It also takes a DeviceTensor
(GPU preprocessing): it waits for the tensor's producer to finish, as an engine reading it would.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from engines.runtimes.base import Backend, Batch, DeviceTensor, TensorSpec


class ReplayBackend(Backend):
    """Returns previously recorded per-frame outputs in a cycle (batch items stacked on axis 0)."""

    name = "replay"
    accepts_device_input = True

    def __init__(
        self,
        input_spec: TensorSpec,
        recorded: list[dict[str, np.ndarray]],
        max_batch: int = 64,
        *,
        latency_ms: float = 0.0,
        slots: int = 1,
    ) -> None:
        super().__init__("fp32")
        if not recorded:
            raise ValueError("ReplayBackend needs at least one recorded output")
        if latency_ms < 0 or slots < 1:
            raise ValueError(f"ReplayBackend: need latency_ms >= 0 and slots >= 1, got {latency_ms}, {slots}")
        self._input = input_spec
        self._max_batch = max_batch
        self._latency_s = latency_ms / 1000.0
        self._slots = slots
        self._outputs = [TensorSpec(k, (None, *v.shape[1:]), v.dtype) for k, v in recorded[0].items()]
        # All recorded frames stacked once, read-only: a batch is a slice (no copy) unless it wraps.
        self._stacked = {k: np.concatenate([r[k] for r in recorded], axis=0) for k in recorded[0]}
        for arr in self._stacked.values():
            arr.setflags(write=False)
        self._count = len(recorded)
        self._lock = threading.Lock()
        self._i = 0
        self.busy_s = 0.0  # simulated device time, summed over batches
        self.batches = 0

    @property
    def input_spec(self) -> TensorSpec:
        return self._input

    @property
    def output_specs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def slots(self) -> int:
        return self._slots

    def _load_impl(self) -> None:
        pass

    def _infer_impl(self, batch: Batch) -> dict[str, np.ndarray]:
        if isinstance(batch, DeviceTensor):
            batch.ready.synchronize()  # an engine reads its input only once the producer wrote it
        n = batch.shape[0]
        with self._lock:
            start, self._i = self._i, (self._i + n) % self._count
            self.busy_s += self._latency_s
            self.batches += 1
        if self._latency_s:
            time.sleep(self._latency_s)
            self.last_gpu_ms = self._latency_s * 1000.0
        if start + n <= self._count:
            return {k: v[start : start + n] for k, v in self._stacked.items()}
        picks = np.arange(start, start + n) % self._count
        outputs = {k: v[picks] for k, v in self._stacked.items()}
        for arr in outputs.values():
            arr.setflags(write=False)  # like the slices: read-only whichever way a batch falls
        return outputs
