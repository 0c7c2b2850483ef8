"""The memory of one execution slot (engines.runtimes.slots): its IO buffers and its activation block.

    buf = IoBuffers.allocate(spec, nbytes, cudart, unified)   # pinned host + device (or mapped) memory
    buf.device_ptr                                            # what the context's tensor address is
    buf.to_device(cudart, nbytes, stream); buf.to_host(cudart, nbytes, stream)   # queued, no host wait
    block = activation_block(api, engine, context, profiles, cudart)   # None where TensorRT needs none

IO buffers: pinned host memory for the async copies, and device memory, except on an integrated GPU
(Jetson: unified memory), where the host memory is mapped and the GPU reads and writes it in place: no
device copy, and the copies are skipped.

The activation block: a context created without activation memory (USER_MANAGED / ..._without_device_
memory) gets one block its slot allocates, sized for the profiles the slot owns. The rule: a block is
shared only by contexts that never run at once. The pool runs its slots at once (the scheduler keeps up
to `slots` batches in flight, each on its slot's stream), so each slot has its own block; within a slot
every profile uses the same one (one batch at a time). The block is freed after the context that used it.

Used by the thread that owns the slot (set-up, one batch, close); nothing here is shared. A failed
allocation raises CudaError and frees what the call had allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from engines.cuda.buffers import DeviceBuffer, MappedBuffer, PinnedBuffer, Stream, memcpy_async

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.trt.runtime import RuntimeCalls


@dataclass(frozen=True)
class IoSpec:
    name: str
    is_input: bool
    dtype: np.dtype


@dataclass
class IoBuffers:
    """One IO tensor's memory: pinned host memory, and device memory unless the device reads the host
    memory in place (mapped, unified memory: `device` None)."""

    spec: IoSpec
    device: DeviceBuffer | None
    host: PinnedBuffer

    @property
    def device_ptr(self) -> int:
        if self.device is not None:
            return self.device.ptr
        assert isinstance(self.host, MappedBuffer)
        return self.host.device_ptr

    @classmethod
    def allocate(cls, spec: IoSpec, nbytes: int, cudart: ModuleType, unified: bool) -> IoBuffers:
        if unified:
            return cls(spec, None, MappedBuffer(nbytes, cudart))
        device = DeviceBuffer(nbytes, cudart)
        try:
            return cls(spec, device, PinnedBuffer(nbytes, cudart))
        except BaseException:
            device.free()  # not held by anyone yet: nobody else would free it
            raise

    def to_device(self, cudart: ModuleType, nbytes: int, stream: Stream) -> None:
        """Queue the host -> device copy of the first `nbytes` (none where the device reads the host's)."""
        if self.device is not None:
            memcpy_async(cudart, self.device.ptr, self.host.ptr, nbytes, True, stream)

    def to_host(self, cudart: ModuleType, nbytes: int, stream: Stream) -> None:
        """Queue the device -> host copy of the first `nbytes` (none where the device wrote the host's)."""
        if self.device is not None and nbytes:
            memcpy_async(cudart, self.host.ptr, self.device.ptr, nbytes, False, stream)

    def free(self) -> None:
        self.host.free()
        if self.device is not None:
            self.device.free()


def activation_block(
    api: RuntimeCalls,
    engine: trt.ICudaEngine,
    context: trt.IExecutionContext,
    profiles: list[int],
    cudart: ModuleType,
) -> DeviceBuffer | None:
    """One activation block for a user-managed `context` that runs only `profiles`, set on it; the caller
    frees it after the context. None where TensorRT needs no memory (it accepts none then)."""
    nbytes = api.context_memory_size(engine, profiles)
    if nbytes <= 0:
        return None
    block = DeviceBuffer(nbytes, cudart)
    try:
        api.set_context_memory(context, block.ptr, nbytes)
    except BaseException:
        block.free()  # the context never got it
        raise
    return block
