"""Execution slots: the contexts one TensorRT engine runs batches on, each with its own CUDA stream.

    pool = SlotPool.create(engine, io, contexts=2, plan="/var/lib/.../det-1a2b.plan", profiles_per_context=1)
    outputs = pool.run(batch)              # any thread; waits for a free slot
    pool.last_gpu_ms                        # device time of the last batch that finished
    pool.close()                            # waits for running batches, frees in reverse order

A slot is one IExecutionContext with its own optimisation profiles (the builder builds the profile set
once per context it builds for, n profiles each, recorded as the manifest's build.profiles_per_context:
slot i owns profiles [i * n, (i + 1) * n), `slot_profiles`), so an engine built for 2 streams runs at most
2 slots whatever `contexts` asks at load; a non-blocking stream, two timing events,
and pinned host + device buffers per IO tensor sized for the largest shapes of its profiles, all
allocated once. A batch: pick the slot's profile that admits the shape (switch with
set_optimization_profile_async when needed) -> set_input_shape -> copy into pinned memory -> async H2D ->
execute_async_v3 -> async D2H of each output shaped by the context -> wait on the stream; the events
give the device time. Tensor addresses are set once (again after a profile switch). A profile switch is
queued on the slot's own stream, ahead of the batch: no host wait (and none while anything is held that
another thread needs: a slot belongs to one caller at a time, the pool's queue is not held while a slot
runs, so a thread blocked in a synchronize never stops another slot; tests/test_trt_runtime_review.py).

Given the TrtApi (`api`), as TensorRTBackend does:
- memory (engines.runtimes.slot_memory): each slot's context is created without activation memory and
  gets its own block, sized for the profiles it owns; on an integrated GPU (Jetson: unified memory) the
  IO buffers are mapped pinned memory the GPU reads in place: no device copy, no memcpy.
- errors by code: each context has its own IErrorRecorder; a failed batch names TensorRT's error codes.
- outputs whose shape only the data decides ([N, 6] detections of NMS-terminated exports) get an
  IOutputAllocator (engines.runtimes.dynamic_outputs); the slot copies back the rows TensorRT reports.

Written to the TensorRT docs (tensor-address API, TensorRT >= 8.5 and TensorRT-RTX); TensorRT itself
cannot run in this project's CI. The CUDA side and this control flow run on a GPU with a `fake_`
engine whose execute_async_v3 launches a real kernel (tests/test_slots_gpu.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from types import ModuleType
from typing import TYPE_CHECKING, cast

import numpy as np

from engines.cuda.buffers import CudaError, DeviceBuffer, Event, Stream, import_cudart, unified_memory
from engines.runtimes.base import BackendError, DeviceTensor
from engines.runtimes.dynamic_outputs import DynamicOutputs

# IoSpec, the slots' view of an IO tensor, is imported from here too (engines.runtimes.tensorrt, tests).
from engines.runtimes.slot_memory import IoBuffers, IoSpec, activation_block
from engines.trt.runtime import TrtErrorRecord, device_failure

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.trt.runtime import RuntimeCalls

log = logging.getLogger(__name__)
Shape = tuple[int, ...]


def _fits(shape: Shape, lo: Shape, hi: Shape) -> bool:
    return len(shape) == len(lo) and all(a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True))


def slot_profiles(total: int, per_context: int | None, contexts: int) -> list[list[int]]:
    """The optimisation profiles of each execution slot: slot i owns profile set i, i.e. profiles
    [i * per_context, (i + 1) * per_context), for at most `contexts` slots and as many as the engine has
    sets (`total // per_context`). Where `per_context` is unknown (None: built before the manifest recorded
    it) or does not divide `total`, it is guessed as today: `total / contexts` when that divides, else one
    slot owning every profile; a guess is right only while build and load use the same `streams`."""
    contexts = max(1, contexts)
    if per_context is None or per_context < 1 or total % per_context:
        per_context = total // contexts if total % contexts == 0 else total
    per_context = max(1, per_context)
    n = max(1, min(contexts, total // per_context))
    return [list(range(i * per_context, (i + 1) * per_context)) for i in range(n)]


class ExecutionSlot:
    def __init__(
        self,
        engine: trt.ICudaEngine,
        io: list[IoSpec],
        profiles: list[int],
        plan: str,
        cudart: ModuleType,
        api: RuntimeCalls | None = None,
        unified: bool = False,
    ) -> None:
        self.plan, self._rt, self._api, self._unified = plan, cudart, api, unified
        self._input = next(t for t in io if t.is_input)
        self._outputs = [t for t in io if not t.is_input]
        self._buffers: list[IoBuffers] = []
        self._input_ptr = 0  # where the input tensor's address points now
        self._events: list[Event] = []
        self.stream: Stream | None = None
        self.activations: DeviceBuffer | None = None  # the context's activation block (user-managed)
        self._dynamic: DynamicOutputs | None = None  # outputs of data-dependent shape, if any
        user_memory = False
        if api is not None:
            context, user_memory = api.create_context(engine, user_memory=True)
        else:
            context = engine.create_execution_context()
        if context is None:
            raise BackendError(f"cannot create an execution context for {plan} (device out of memory?)")
        self.context: trt.IExecutionContext = context
        self.recorder = api.error_recorder() if api is not None else None
        if self.recorder is not None and hasattr(context, "error_recorder"):
            context.error_recorder = self.recorder  # this slot's errors only, whichever thread runs it
        try:
            self.stream = Stream(cudart)
            self._events = [Event(cudart), Event(cudart)]
            # (index, min, max) of the input per profile this slot owns.
            self.profiles = [
                (p, *self._min_max(engine.get_tensor_profile_shape(self._input.name, p))) for p in profiles
            ]
            if user_memory:
                assert api is not None
                self.activations = activation_block(api, engine, context, profiles, cudart)
            self.active = -1
            self._allocate()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _min_max(shapes: list[trt.Dims]) -> tuple[Shape, Shape]:
        # Dims iterates through __getitem__/__len__, which mypy does not count as iterable.
        return tuple(shapes[0]), tuple(shapes[2])  # type: ignore[arg-type]

    def _allocate(self) -> None:
        """Buffers for the largest shapes of this slot's profiles (outputs as the context shapes them);
        outputs of data-dependent shape get the output allocator instead."""
        largest: dict[str, int] = {}
        dynamic: set[str] = set()
        for index, _lo, hi in self.profiles:
            self._select(index)
            self._set_input_shape(hi)
            shapes = {self._input.name: hi} | {o.name: self._output_shape(o) for o in self._outputs}
            for t in [self._input, *self._outputs]:
                if any(d < 0 for d in shapes[t.name]):
                    dynamic.add(t.name)
                    continue
                n = int(np.prod(shapes[t.name])) * t.dtype.itemsize
                largest[t.name] = max(largest.get(t.name, 0), n)
        if dynamic:  # before any buffer: an engine this TensorRT cannot serve is refused first
            specs = [t for t in self._outputs if t.name in dynamic]
            self._dynamic = DynamicOutputs(self.plan, specs, self._api, self._rt, self._unified)
        for t in [self._input, *self._outputs]:
            if t.name not in dynamic:
                self._buffers.append(IoBuffers.allocate(t, max(largest[t.name], 1), self._rt, self._unified))
        if self._dynamic is not None:
            self._dynamic.attach(self.context)
        self._bind()

    def _select(self, index: int) -> None:
        assert self.stream is not None
        if index != self.active:
            # Queued on this slot's stream, ahead of the batch that needs it: stream order suffices, so no
            # host wait (TensorRT's docs: syncing the profile stream with the enqueue stream is the caller's).
            if not self.context.set_optimization_profile_async(index, self.stream.handle):
                raise BackendError(f"{self.plan}: cannot select optimisation profile {index}")
            self.active = index
            if self._buffers:
                self._bind()

    def _bind(self) -> None:
        for b in self._buffers:
            if not self.context.set_tensor_address(b.spec.name, b.device_ptr):
                raise BackendError(f"{self.plan}: cannot set the address of tensor {b.spec.name!r}")
        self._input_ptr = self._buffers[0].device_ptr

    def _bind_input(self, ptr: int) -> None:
        """Point the input tensor at `ptr` (a device batch, or this slot's own buffer again)."""
        if ptr != self._input_ptr:
            if not self.context.set_tensor_address(self._input.name, ptr):
                raise BackendError(f"{self.plan}: cannot set the address of tensor {self._input.name!r}")
            self._input_ptr = ptr

    def _set_input_shape(self, shape: Shape) -> None:
        if not self.context.set_input_shape(self._input.name, shape):
            raise BackendError(f"{self.plan}: input {self._input.name!r} refuses shape {list(shape)}")

    def _output_shape(self, out: IoSpec) -> Shape:
        """The output's shape for the input shape set now; -1 dims: data-dependent (known only after
        the batch ran, from the output allocator)."""
        shape: Shape = tuple(self.context.get_tensor_shape(out.name))  # type: ignore[arg-type]  # Dims
        return shape

    def _failed(self, what: str) -> BackendError:
        """A BackendError for a failed TensorRT call, naming the errors this slot's recorder got."""
        records: list[TrtErrorRecord] = self.recorder.drain() if self.recorder is not None else []
        if not records:
            return BackendError(f"{self.plan}: {what} failed (see the TensorRT log)")
        side = "the device failed" if device_failure(records) else "TensorRT refused it"
        listed = "; ".join(str(r) for r in records)
        return BackendError(f"{self.plan}: {what} failed ({side}): {listed}")

    def admits(self, shape: Shape) -> bool:
        return any(_fits(shape, lo, hi) for _, lo, hi in self.profiles)

    def run(self, batch: np.ndarray | DeviceTensor) -> tuple[dict[str, np.ndarray], float]:
        """One batch through this slot; returns the outputs (copies) and the device time in ms.

        A DeviceTensor (GPU preprocessing) is read where it lies: the input tensor's address is set to it
        for this batch and the stream waits for its producer, so the batch never passes through the host.
        """
        assert self.stream is not None
        shape = tuple(batch.shape)
        index = next((p for p, lo, hi in self.profiles if _fits(shape, lo, hi)), None)
        if index is None:
            ranges = "; ".join(f"profile {p}: {list(lo)}..{list(hi)}" for p, lo, hi in self.profiles)
            raise BackendError(f"{self.plan}: input shape {list(shape)} is outside every profile ({ranges})")
        inp, outs = self._buffers[0], self._buffers[1:]
        if isinstance(batch, DeviceTensor) and batch.dtype != inp.spec.dtype:
            raise BackendError(
                f"{self.plan}: input {inp.spec.name!r} is {inp.spec.dtype}, the device batch {batch.dtype}"
            )
        try:
            self._select(index)
            self._set_input_shape(shape)
            if isinstance(batch, DeviceTensor):
                self._bind_input(batch.ptr)
                self.stream.wait(cast(Event, batch.ready))
            else:
                self._bind_input(inp.device_ptr)
                host_in = inp.host.view(inp.spec.dtype, shape)
                np.copyto(host_in, batch, casting="same_kind")
                inp.to_device(self._rt, host_in.nbytes, self.stream)
            if self._dynamic is not None:
                self._dynamic.begin()
            start, end = self._events
            start.record(self.stream)
            if not self.context.execute_async_v3(self.stream.handle):
                raise self._failed("execute_async_v3")
            end.record(self.stream)
            views = {}
            for b in outs:
                views[b.spec.name] = view = b.host.view(b.spec.dtype, self._output_shape(b.spec))
                b.to_host(self._rt, view.nbytes, self.stream)
            self.stream.synchronize()
            gpu_ms = end.ms_since(start)
            if self._dynamic is not None:
                views |= self._dynamic.collect(self.stream)
        except CudaError as exc:
            raise BackendError(f"{self.plan}: {exc}") from exc
        return {name: v.copy() for name, v in views.items()}, gpu_ms

    def close(self) -> None:
        """Free in reverse order of allocation; the context goes last (TensorRT frees it on release)."""
        if self.stream is not None:
            with contextlib.suppress(CudaError):
                self.stream.synchronize()
        for b in reversed(self._buffers):
            b.free()
        self._buffers = []
        if self._dynamic is not None:
            self._dynamic.free()
        for e in self._events:
            e.destroy()
        self._events = []
        if self.stream is not None:
            self.stream.destroy()
            self.stream = None
        self.context = None  # type: ignore[assignment]
        # The activation block after the context that used it (no work is queued: the stream is done).
        if self.activations is not None:
            self.activations.free()
            self.activations = None


class SlotPool:
    """The slots of one engine; `run` takes a free one (blocking), so callers on several threads overlap."""

    def __init__(self, slots: list[ExecutionSlot]) -> None:
        self.slots = slots
        self.plan = slots[0].plan if slots else "?"
        self._free: queue.Queue[ExecutionSlot | None] = queue.Queue()  # None: the pool is closed
        for s in slots:
            self._free.put(s)
        self.last_gpu_ms: float | None = None

    @classmethod
    def create(
        cls,
        engine: trt.ICudaEngine,
        io: list[IoSpec],
        contexts: int,
        plan: str,
        cudart: ModuleType | None = None,
        profiles_per_context: int | None = None,
        api: RuntimeCalls | None = None,
        unified: bool | None = None,
    ) -> SlotPool:
        """Up to `contexts` slots, each owning one profile set of the engine (slot_profiles): the builder
        repeated the set once per context it was built for, `profiles_per_context` profiles each (the
        manifest's build.profiles_per_context; None for engines built before it: guessed). `api`: the
        TrtApi (own activation blocks, error recorders, output allocators: the module docstring);
        `unified`: IO in mapped pinned memory (None: asked of CUDA, true on an integrated GPU)."""
        rt = cudart or import_cudart()
        if unified is None:
            unified = unified_memory(rt)
        total = engine.num_optimization_profiles
        if profiles_per_context is not None and (profiles_per_context < 1 or total % profiles_per_context):
            log.warning(
                "%s: %d profiles per context recorded, but the engine has %d profiles; guessing the split",
                plan,
                profiles_per_context,
                total,
            )
        sets = slot_profiles(total, profiles_per_context, contexts)
        if len(sets) < max(1, contexts):
            per = len(sets[0])
            log.warning(
                "%s: %d execution contexts configured, but the engine has %d profile set(s) (%d profiles, "
                "%d per context): %d execution slot(s)",
                plan,
                contexts,
                total // per,
                total,
                per,
                len(sets),
            )
        slots: list[ExecutionSlot] = []
        try:
            for profiles in sets:
                slots.append(ExecutionSlot(engine, io, profiles, plan, rt, api, unified))
        except BaseException:
            for s in reversed(slots):
                s.close()
            raise
        return cls(slots)

    def admits(self, shape: Shape) -> bool:
        return self.slots[0].admits(shape)

    def run(self, batch: np.ndarray | DeviceTensor) -> dict[str, np.ndarray]:
        outputs, self.last_gpu_ms = self.run_timed(batch)
        return outputs

    def run_timed(self, batch: np.ndarray | DeviceTensor) -> tuple[dict[str, np.ndarray], float]:
        """`run`, also returning this batch's device time (last_gpu_ms is any thread's latest)."""
        slot = self._free.get()
        if slot is None:  # closed: pass the word on to the next waiting caller
            self._free.put(None)
            raise BackendError(f"{self.plan}: execution slots used after close()")
        try:
            return slot.run(batch)
        finally:
            self._free.put(slot)

    def close(self, timeout: float = 10.0) -> None:
        """Wait for every slot to be free (no batch in flight), then free them in reverse order. A slot
        still running after `timeout` is left allocated (logged): freeing it under a running batch would
        be a use-after-free."""
        taken: list[ExecutionSlot] = []
        with contextlib.suppress(queue.Empty):
            while len(taken) < len(self.slots):
                slot = self._free.get(timeout=timeout)
                if slot is None:  # closed before
                    break
                taken.append(slot)
        if len(taken) < len(self.slots):
            log.error(
                "%s: %d execution slot(s) still running a batch after %.0f s; left allocated",
                self.plan,
                len(self.slots) - len(taken),
                timeout,
            )
        for s in reversed(self.slots):
            if s in taken:
                s.close()
        self.slots = []
        self._free.put(None)  # wakes callers blocked in run() (and later ones) with a BackendError
