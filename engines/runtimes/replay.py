"""A backend that replays recorded outputs: measures the pipeline's own cost with inference excluded."""

from __future__ import annotations

import numpy as np

from engines.runtimes.base import Backend, TensorSpec


class ReplayBackend(Backend):
    """Returns previously recorded per-frame outputs in a cycle (batch items stacked on axis 0)."""

    name = "replay"

    def __init__(
        self, input_spec: TensorSpec, recorded: list[dict[str, np.ndarray]], max_batch: int = 64
    ) -> None:
        super().__init__("fp32")
        if not recorded:
            raise ValueError("ReplayBackend needs at least one recorded output")
        self._input = input_spec
        self._recorded = recorded
        self._max_batch = max_batch
        self._i = 0
        self._outputs = [TensorSpec(k, (None, *v.shape[1:]), v.dtype) for k, v in recorded[0].items()]

    @property
    def input_spec(self) -> TensorSpec:
        return self._input

    @property
    def output_specs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def _load_impl(self) -> None:
        pass

    def _infer_impl(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        n = batch.shape[0]
        picks = [self._recorded[(self._i + k) % len(self._recorded)] for k in range(n)]
        self._i += n
        if n == 1:
            return picks[0]
        return {name: np.concatenate([p[name] for p in picks], axis=0) for name in picks[0]}
