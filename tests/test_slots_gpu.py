"""Execution slots (engines.runtimes.slots) on a real GPU, with a `fake_` TensorRT engine.

TensorRT cannot run here or on the device box, so `fake_engine` / `fake_context` stand in for
ICudaEngine / IExecutionContext with the methods slots.py calls, and the fake's execute_async_v3 launches
real CUDA kernels (CuPy) on the stream it is given, over the raw device addresses it was given by
set_tensor_address. Its network: input "images" [N, 3, H, W] float32 ->
    "sum"    [N, 4]        sum of image n + j (j = 0..3)
    "scaled" [N, 3, H, W]  2 * input
so a wrong buffer, a stale batch, a short copy or a wrong shape shows up as wrong numbers.
Run on the device box: `pytest -m gpu tests/test_slots_gpu.py` (CI has no GPU: this module is skipped).
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytest.importorskip("cuda.bindings")

from cuda.bindings import driver as cu  # noqa: E402
from cuda.bindings import runtime as rt  # noqa: E402

from engines.cuda.buffers import CudaError  # noqa: E402
from engines.errors import EngineError  # noqa: E402
from engines.runtimes.base import BackendError  # noqa: E402
from engines.runtimes.slots import IoSpec, SlotPool  # noqa: E402

pytestmark = pytest.mark.gpu

PLAN = "/var/lib/edge-agent/engines/fake-det-0123abcd.plan"
C, H, W = 3, 32, 32
F32 = np.dtype(np.float32)
MIB = 1 << 20

_SOURCE = r"""
extern "C" __global__ void fake_net(const float* x, float* scaled, float* sums, int n, int per_image) {
    int b = blockIdx.x;
    if (b >= n) return;
    const float* xi = x + (long long)b * per_image;
    float* si = scaled + (long long)b * per_image;
    __shared__ float partial[256];
    float acc = 0.f;
    for (int i = threadIdx.x; i < per_image; i += blockDim.x) {
        float v = xi[i];
        si[i] = 2.f * v;
        acc += v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x < 4) sums[b * 4 + threadIdx.x] = partial[0] + (float)threadIdx.x;
}

extern "C" __global__ void fake_spin(unsigned long long ns, unsigned long long* stamps) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    stamps[0] = t0;
    stamps[1] = t;
}
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    module = cp.RawModule(code=_SOURCE)
    return module.get_function("fake_net"), module.get_function("fake_spin")


def _allocation_size(ptr: int) -> int:
    """Bytes of the cudaMalloc allocation that starts at `ptr` (fails if `ptr` is not one)."""
    err, base, size = cu.cuMemGetAddressRange(ptr)
    assert err == cu.CUresult.CUDA_SUCCESS, f"{ptr:#x} is no device allocation: {err}"
    assert int(base) == ptr, f"{ptr:#x} is inside an allocation starting at {int(base):#x}"
    return int(size)


class fake_stream:
    """A raw cudaStream_t behind the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(handle: int) -> Any:
    """CuPy's view of a stream it does not own (ExternalStream is deprecated in CuPy 14)."""
    if hasattr(cp.cuda.Stream, "from_external"):
        return cp.cuda.Stream.from_external(fake_stream(handle))
    return cp.cuda.ExternalStream(handle)


Profile = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _profile(lo: int, opt: int, hi: int) -> Profile:
    return (lo, C, H, W), (opt, C, H, W), (hi, C, H, W)


SMALL, LARGE = _profile(1, 2, 2), _profile(3, 4, 8)


class fake_context:
    """IExecutionContext: records calls; refuses shapes outside the active profile (as TensorRT does).

    Stricter than TensorRT in one way: a profile switch forgets the tensor addresses as well as the input
    shape, so a slot that does not bind again after switching fails here.
    """

    def __init__(self, engine: fake_engine) -> None:
        self.engine = engine
        self.profile = 0
        self.shape: tuple[int, ...] | None = None
        self.addresses: dict[str, int] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.streams: list[int] = []
        self.stamps: Any = None  # device [start, end] of the last spin (globaltimer ns)

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.calls.append(("set_optimization_profile_async", index, stream))
        if not 0 <= index < self.engine.num_optimization_profiles:
            return False
        self.profile, self.shape = index, None
        self.addresses.clear()
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.calls.append(("set_tensor_address", name, ptr))
        if name not in self.engine.names:
            return False
        self.addresses[name] = int(ptr)
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.calls.append(("set_input_shape", name, tuple(shape)))
        lo, _, hi = self.engine.profiles[self.profile]
        if name != "images" or len(shape) != len(lo):
            return False
        if not all(a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)):
            return False
        self.shape = tuple(int(s) for s in shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        n = self.shape[0] if self.shape is not None else -1
        return {
            "images": (n, C, H, W),
            "sum": (n, 4),
            "scaled": (n, C, H, W),
            "heat": (n, 1 << 35),
        }[name]

    def _device_array(self, name: str, shape: tuple[int, ...]) -> Any:
        ptr = self.addresses[name]
        nbytes = int(np.prod(shape)) * 4
        have = _allocation_size(ptr)
        assert have >= nbytes, f"{name}: {nbytes} bytes needed, the buffer has {have}"
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self, device_id=cp.cuda.Device().id)
        return cp.ndarray(shape, cp.float32, cp.cuda.MemoryPointer(mem, 0))

    def execute_async_v3(self, stream: int) -> bool:
        self.calls.append(("execute_async_v3", stream))
        self.streams.append(int(stream))
        assert self.shape is not None, "execute_async_v3 before set_input_shape (after the profile switch)"
        missing = set(self.engine.names) - set(self.addresses)
        assert not missing, f"execute_async_v3 without addresses for {sorted(missing)}"
        n = self.shape[0]
        x = self._device_array("images", self.shape)
        scaled = self._device_array("scaled", self.shape)
        sums = self._device_array("sum", (n, 4))
        net, spin = _kernels()
        with _cupy_stream(int(stream)):
            if self.engine.spin_ns:
                self.stamps = cp.zeros(2, cp.uint64)  # on this stream, before the spin
                spin((1,), (1,), (np.uint64(self.engine.spin_ns), self.stamps))
            net((n,), (256,), (x, scaled, sums, np.int32(n), np.int32(C * H * W)))
        return True


class fake_engine:
    """ICudaEngine: `profiles` is the whole profile list (the builder's set repeated once per context)."""

    def __init__(self, profiles: list[Profile], spin_ns: int = 0, heat: bool = False) -> None:
        self.profiles = profiles
        self.spin_ns = spin_ns
        self.names = ["images", "sum", "scaled"] + (["heat"] if heat else [])
        self.contexts: list[fake_context] = []

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_execution_context(self) -> fake_context:
        ctx = fake_context(self)
        self.contexts.append(ctx)
        return ctx

    def get_tensor_profile_shape(self, name: str, profile: int) -> Profile:
        assert name == "images", name
        return self.profiles[profile]


_COUNTED: dict[str, tuple[str, int]] = {
    "cudaMalloc": ("device", 1),
    "cudaFree": ("device", -1),
    "cudaMallocHost": ("pinned", 1),
    "cudaFreeHost": ("pinned", -1),
    "cudaStreamCreateWithFlags": ("stream", 1),
    "cudaStreamDestroy": ("stream", -1),
    "cudaEventCreate": ("event", 1),
    "cudaEventDestroy": ("event", -1),
}


class fake_cudart:
    """The real cuda.bindings.runtime, counting what is allocated and freed (`live` should end at 0)."""

    def __init__(self, fail_pinned: int | None = None) -> None:
        self.fail_pinned = fail_pinned  # this cudaMallocHost (0: the first) fails as out of memory
        self.live: Counter[str] = Counter()
        self.made: Counter[str] = Counter()
        self.pinned: list[int] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(rt, name)
        if name not in _COUNTED:
            return real
        kind, step = _COUNTED[name]

        def counted(*args: Any) -> Any:
            if name == "cudaMallocHost" and self.made["pinned"] == self.fail_pinned:
                return (rt.cudaError_t.cudaErrorMemoryAllocation, None)
            result = real(*args)
            if int(result[0]) == 0:
                self.live[kind] += step
                if step > 0:
                    self.made[kind] += 1
                if name == "cudaMallocHost":
                    self.pinned.append(int(result[1]))
            return result

        return counted


def _io(heat: bool = False) -> list[IoSpec]:
    io = [IoSpec("images", True, F32), IoSpec("sum", False, F32), IoSpec("scaled", False, F32)]
    return io + ([IoSpec("heat", False, F32)] if heat else [])


def _batch(n: int, seed: int) -> np.ndarray:
    # Whole numbers: every float32 sum below 2^24 is exact, whatever order the kernel adds in.
    return np.random.default_rng(seed).integers(0, 10, (n, C, H, W)).astype(np.float32)


def _check(outputs: dict[str, np.ndarray], batch: np.ndarray) -> None:
    n = batch.shape[0]
    assert set(outputs) == {"sum", "scaled"}
    expected_sum = batch.reshape(n, -1).sum(axis=1, dtype=np.float64)[:, None] + np.arange(4)
    assert outputs["sum"].shape == (n, 4)
    np.testing.assert_array_equal(outputs["sum"], expected_sum.astype(np.float32))
    assert outputs["scaled"].shape == batch.shape
    np.testing.assert_array_equal(outputs["scaled"], 2 * batch)


def _used_bytes() -> int:
    err, free, total = rt.cudaMemGetInfo()
    assert int(err) == 0
    return int(total) - int(free)


@pytest.fixture(scope="module", autouse=True)
def _gpu() -> None:
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # CuPy installed, no driver / no GPU
        pytest.skip(f"no CUDA device: {e}")
    if count < 1:
        pytest.skip("no CUDA device")
    _kernels()


def _profile_switches(ctx: fake_context) -> list[int]:
    return [c[1] for c in ctx.calls if c[0] == "set_optimization_profile_async"]


def test_outputs_match_numpy_for_each_batch_size_and_profile() -> None:
    engine = fake_engine([SMALL, LARGE] * 2)  # the builder's set, once per context
    pool = SlotPool.create(engine, _io(), contexts=2, plan=PLAN)
    try:
        assert len(pool.slots) == 2 and len(engine.contexts) == 2
        assert [p for p, _, _ in pool.slots[0].profiles] == [0, 1]
        assert [p for p, _, _ in pool.slots[1].profiles] == [2, 3]
        for s, slot in enumerate(pool.slots):
            ctx = slot.context
            assert isinstance(ctx, fake_context)
            switches_before = len(_profile_switches(ctx))
            for i, n in enumerate([1, 3, 8, 2, 2, 5]):
                batch = _batch(n, seed=100 * s + i)
                outputs, gpu_ms = slot.run(batch)
                _check(outputs, batch)
                assert gpu_ms > 0
                print(f"slot {s} batch {n}: profile {ctx.profile}, gpu_ms {gpu_ms:.4f}")
                assert ctx.profile == 2 * s + (0 if n <= 2 else 1)
                assert ctx.streams[-1] == slot.stream.handle
            # after allocation (last profile selected: large): small, large, small, (same), large
            assert _profile_switches(ctx)[switches_before:] == [2 * s, 2 * s + 1, 2 * s, 2 * s + 1]
            # each context stays inside its own profiles (contexts never share one)
            assert set(_profile_switches(ctx)) == {2 * s, 2 * s + 1}
        # through the pool (takes whichever slot is free), float64 input is cast
        for i, n in enumerate([8, 1, 3]):
            batch = _batch(n, seed=1000 + i)
            _check(pool.run(batch.astype(np.float64)), batch)
            assert pool.last_gpu_ms is not None and pool.last_gpu_ms > 0
        assert pool.admits((8, C, H, W)) and not pool.admits((9, C, H, W))
    finally:
        pool.close()


def test_two_contexts_overlap_on_two_streams() -> None:
    spin_ms = 50
    engine = fake_engine([LARGE, LARGE], spin_ns=spin_ms * 1_000_000)
    pool = SlotPool.create(engine, _io(), contexts=2, plan=PLAN)
    try:
        a, b = pool.slots
        assert a.stream.handle != b.stream.handle
        batch = _batch(4, seed=7)
        for slot in pool.slots:  # warm up both contexts
            _check(slot.run(batch)[0], batch)
        singles = []
        for _ in range(2):
            t0 = time.perf_counter()
            _check(pool.run(batch), batch)
            singles.append(time.perf_counter() - t0)
        single = min(singles)

        before = [len(c.streams) for c in engine.contexts]
        results: dict[int, dict[str, np.ndarray]] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def worker(i: int) -> None:
            try:
                barrier.wait()
                results[i] = pool.run(batch)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        both = time.perf_counter() - t0
        assert not errors, errors
        for i in range(2):
            _check(results[i], batch)
        # one batch on each context, each on its own slot's stream
        assert [len(c.streams) - k for c, k in zip(engine.contexts, before, strict=True)] == [1, 1]
        assert {c.streams[-1] for c in engine.contexts} == {a.stream.handle, b.stream.handle}
        (s0, e0), (s1, e1) = (c.stamps.get().astype(np.int64) for c in engine.contexts)
        overlap_ms = (min(e0, e1) - max(s0, s1)) / 1e6
        print(
            f"spin {spin_ms} ms: single batch {single * 1e3:.1f} ms wall, two threads {both * 1e3:.1f} ms "
            f"wall (x{both / single:.2f}); device intervals [{0:.1f}, {(e0 - s0) / 1e6:.1f}] and "
            f"[{(s1 - s0) / 1e6:.1f}, {(e1 - s0) / 1e6:.1f}] ms, overlap {overlap_ms:.1f} ms"
        )
        assert overlap_ms > 0.5 * spin_ms
        assert both < 1.6 * single
    finally:
        pool.close()


def test_no_leak_over_10k_batches_and_close_twice() -> None:
    batches = {n: _batch(n, seed=n) for n in (1, 2, 5, 8)}
    warm = SlotPool.create(fake_engine([SMALL, LARGE] * 2), _io(), contexts=2, plan=PLAN)
    for b in batches.values():  # driver and CuPy set up what they lazily set up, before the baseline
        _check(warm.run(b), b)
    warm.close()
    gc.collect()

    cudart = fake_cudart()
    before = _used_bytes()
    pool = SlotPool.create(fake_engine([SMALL, LARGE] * 2), _io(), contexts=2, plan=PLAN, cudart=cudart)
    created = _used_bytes()
    pinned = list(cudart.pinned)
    host = rt.cudaMemoryType.cudaMemoryTypeHost
    assert all(rt.cudaPointerGetAttributes(p)[1].type == host for p in pinned)
    sizes = [1, 2, 5, 8]
    t0 = time.perf_counter()
    for i in range(10_000):
        n = sizes[i % 4]  # profile switches on most batches
        outputs = pool.run(batches[n])
        if i % 997 == 0:
            _check(outputs, batches[n])
    took = time.perf_counter() - t0
    ran = _used_bytes()
    slots = list(pool.slots)
    pool.close()
    pool.close()  # harmless
    for slot in slots:
        slot.close()  # harmless too
    with pytest.raises(BackendError, match="after close"):  # not a wait for a slot that never comes
        pool.run(batches[1])
    gc.collect()
    after = _used_bytes()
    print(
        f"device memory used: {before / MIB:.1f} MiB before, {created / MIB:.1f} after create, "
        f"{ran / MIB:.1f} after 10k batches ({took:.1f} s, {took / 10_000 * 1e6:.0f} us/batch), "
        f"{after / MIB:.1f} after close (drift {(after - before) / MIB:+.2f} MiB); made {dict(cudart.made)}, "
        f"live {dict(cudart.live)}"
    )
    assert cudart.made == Counter(device=6, pinned=6, stream=2, event=4)
    assert all(v == 0 for v in cudart.live.values()), f"not freed (or freed twice): {dict(cudart.live)}"
    unregistered = rt.cudaMemoryType.cudaMemoryTypeUnregistered
    assert all(rt.cudaPointerGetAttributes(p)[1].type == unregistered for p in pinned)
    assert abs(after - before) < 2 * MIB
    assert abs(ran - created) < 2 * MIB


def test_shape_outside_every_profile_names_plan_and_profiles() -> None:
    pool = SlotPool.create(fake_engine([SMALL, LARGE] * 2), _io(), contexts=2, plan=PLAN)
    try:
        for shape in [(9, C, H, W), (2, C, H + 1, W), (2, C, H, W, 1)]:
            with pytest.raises(BackendError) as info:
                pool.run(np.zeros(shape, np.float32))
            message = str(info.value)
            print(message)
            assert PLAN in message and str(list(shape)) in message
            assert f"[1, {C}, {H}, {W}]..[2, {C}, {H}, {W}]" in message
            assert f"[3, {C}, {H}, {W}]..[8, {C}, {H}, {W}]" in message
        batch = _batch(3, seed=3)  # the pool still works (the slot went back)
        _check(pool.run(batch), batch)
        _check(pool.run(batch), batch)
    finally:
        pool.close()


HUGE = _profile(1, 1, 1 << 26)  # 768 GiB of float32 input at the max batch


@pytest.mark.parametrize(
    ("profiles", "heat", "fail_pinned", "call", "made"),
    [
        pytest.param(
            [SMALL, HUGE] * 2, False, None, f"cudaMalloc({(1 << 26) * C * H * W * 4})", {}, id="input"
        ),
        pytest.param(
            [SMALL, LARGE] * 2,
            True,
            None,
            f"cudaMalloc({8 * (1 << 35) * 4})",
            {"device": 3, "pinned": 3},
            id="output",
        ),
        pytest.param(
            [SMALL, LARGE, SMALL, HUGE],
            False,
            None,
            f"cudaMalloc({(1 << 26) * C * H * W * 4})",
            {"device": 3, "pinned": 3, "stream": 2, "event": 4},
            id="input-second-slot",
        ),
        pytest.param(  # the device buffer of "sum" is made, its pinned buffer fails
            [SMALL, LARGE] * 2,
            False,
            1,
            f"cudaMallocHost({8 * 4 * 4})",
            {"device": 2, "pinned": 1},
            id="pinned",
        ),
    ],
)
def test_out_of_memory_at_load_is_clean(
    profiles: list[Profile], heat: bool, fail_pinned: int | None, call: str, made: dict[str, int]
) -> None:
    cudart = fake_cudart(fail_pinned)
    gc.collect()
    before = _used_bytes()
    with pytest.raises(EngineError) as info:
        SlotPool.create(fake_engine(profiles, heat=heat), _io(heat), contexts=2, plan=PLAN, cudart=cudart)
    rt.cudaGetLastError()  # the failed cudaMalloc is the runtime's last error: clear it
    gc.collect()
    after = _used_bytes()
    message = str(info.value)
    print(f"{message}; device memory used {before / MIB:.1f} MiB before, {after / MIB:.1f} after")
    assert isinstance(info.value, CudaError)
    assert call in message and "cudaErrorMemoryAllocation" in message
    for kind, count in made.items():  # what was made before the failure (then freed)
        assert cudart.made[kind] >= count, (kind, dict(cudart.made))
    assert all(v == 0 for v in cudart.live.values()), f"not freed (or freed twice): {dict(cudart.live)}"
    # The counts above are exact. cudaMemGetInfo moved by one 2 MiB step of the driver's own here (H100,
    # driver 580: -2 MiB in the "input" case, +2 MiB back in "input-second-slot", every allocation counted
    # freed; a failed cudaMalloc alone, or a stream and two events made and destroyed, moved nothing in a
    # fresh process). So: no more than one such step.
    assert after - before <= 2 * MIB
