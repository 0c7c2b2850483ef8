"""The outputs of one execution slot whose shape only the data decides, and the IOutputAllocator that
TensorRT asks for their memory.

    outs = DynamicOutputs(plan, specs, api, cudart, unified)  # BackendError: this TensorRT has no allocator
    outs.attach(context)             # at set-up: TensorRT asks the allocator for these outputs' memory
    outs.begin()                     # before each execute_async_v3
    views = outs.collect(stream)     # after the batch's stream is done: {name: host view, TensorRT's shape}
    outs.free()

An output is data-dependent when it keeps -1 dims once the input shape is set: the [N, 6] detections of
NMS-terminated exports (EfficientNMS plugin, YOLOv10/RT-DETR style). During execute_async_v3 TensorRT asks
the allocator (engines.trt.runtime.RuntimeCalls.output_allocator) for at least `size` bytes, an upper
bound, and then tells it the real shape; the buffers grow to the largest asked for and never shrink, so
after the first batches nothing is allocated on the hot path.

Threads: TensorRT calls the allocator from inside execute_async_v3, on the thread running the slot's batch;
the slot runs one batch at a time and its previous batch is finished (run() waited for its stream), so a
buffer that is replaced is not in use. Failures: an allocation that fails returns 0 to TensorRT (logged by
the allocator), which fails the batch with FAILED_ALLOCATION on the slot's error recorder; a batch after
which TensorRT gave no shape or no memory for an output raises BackendError naming the output.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.cuda.buffers import Stream
from engines.runtimes.base import BackendError
from engines.runtimes.slot_memory import IoBuffers, IoSpec

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.trt.runtime import RuntimeCalls


class DynamicOutputs:
    """The data-dependent outputs `specs` of one slot: their memory (pinned host + device, or mapped on
    unified memory, as the slot's other buffers) and the allocator that hands it to TensorRT."""

    def __init__(
        self, plan: str, specs: list[IoSpec], api: RuntimeCalls | None, cudart: ModuleType, unified: bool
    ) -> None:
        self.plan, self._rt, self._unified = plan, cudart, unified
        self._specs = {s.name: s for s in specs}
        # Each output's memory, grown on TensorRT's request (None: none asked for yet).
        self._held: dict[str, IoBuffers | None] = dict.fromkeys(self._specs)
        allocator = api.output_allocator(self._reallocate) if api is not None else None
        if allocator is None:
            raise BackendError(
                f"{plan}: outputs {sorted(self._specs)} have a data-dependent shape and this TensorRT has no "
                "IOutputAllocator to receive them"
            )
        self.allocator: Any = allocator

    def attach(self, context: trt.IExecutionContext) -> None:
        """Make the allocator the source of these outputs' memory on `context`."""
        for name in self._specs:
            if not context.set_output_allocator(name, self.allocator):
                raise BackendError(f"{self.plan}: cannot set the output allocator of tensor {name!r}")

    def _reallocate(self, name: str, nbytes: int) -> int:
        """At least `nbytes` for output `name`, asked by TensorRT during execute_async_v3: its device
        address (grown, never shrunk)."""
        spec = self._specs[name]
        held = self._held.get(name)
        if held is None or held.host.nbytes < nbytes:
            if held is not None:
                self._held[name] = None
                held.free()
            held = self._held[name] = IoBuffers.allocate(spec, max(int(nbytes), 1), self._rt, self._unified)
        return held.device_ptr

    def begin(self) -> None:
        """Forget the shapes of the last batch, so a shape TensorRT does not tell is not taken from it."""
        self.allocator.clear()

    def collect(self, stream: Stream) -> dict[str, np.ndarray]:
        """The outputs of the batch that just finished on `stream`, shaped as TensorRT notified (views of
        the host memory: the caller copies them before the slot's next batch)."""
        views: dict[str, np.ndarray] = {}
        for name, held in self._held.items():
            shape = self.allocator.shapes.get(name)
            if shape is None or held is None:
                raise BackendError(f"{self.plan}: TensorRT gave no shape or memory for output {name!r}")
            views[name] = view = held.host.view(held.spec.dtype, shape)
            held.to_host(self._rt, view.nbytes, stream)
        if any(h is not None and h.device is not None for h in self._held.values()):
            stream.synchronize()
        return views

    def free(self) -> None:
        """Free every output's memory (the slot's stream is done; the context no longer runs)."""
        for name, held in list(self._held.items()):
            self._held[name] = None
            if held is not None:
                held.free()
