"""GPU letterbox (pipelines.preprocess_gpu): its numpy reference against OpenCV (no GPU needed), and the
CUDA kernel against the reference and the CPU path (marked gpu: run on the GPU box with
`PYTHONPATH=.:tests python3 -m pytest --noconftest -o addopts= -m gpu tests/test_preprocess_gpu.py`).

Tolerance: the reference and the kernel are the same integer arithmetic, so they must agree bit for bit.
Against the CPU path (cv2.resize + the float normalisation) they agree bit for bit where OpenCV rounds as
its x86 SIMD path does (this CI machine, the GPU box); other builds may differ by one grey level before
normalisation, i.e. |difference| <= max(|mul|) after it, which is what the non-x86 branch allows.
"""

from __future__ import annotations

import platform
from pathlib import Path

import cv2
import numpy as np
import pytest

from pipelines.models.nanodet import NanoDetAdapter
from pipelines.models.yolov8 import YoloV8Adapter
from pipelines.preprocess import Normalisation, letterbox_normalise, place
from pipelines.preprocess_reference import letterbox_reference, resize_reference

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
X86 = platform.machine() in ("x86_64", "AMD64")
# (h, w): the bundled clip's size, 1080p, odd sizes (down- and upscaled), exact fit, portrait, very wide.
SIZES = [(272, 640), (1080, 1920), (333, 517), (100, 100), (416, 416), (1920, 1080), (37, 1001), (832, 832)]
NORMS = {
    "nanodet": NanoDetAdapter((416, 416), 80).normalisation,  # BGR, mean/std, black pad
    "yolov8": YoloV8Adapter((384, 640), 80).normalisation,  # RGB, /255, grey pad, not square
}


def _frame(h: int, w: int) -> np.ndarray:
    """A real picture at (h, w): the clip's first frame resized (no flat areas to hide rounding in)."""
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    ok, image = cap.read()
    cap.release()
    assert ok
    noise = np.random.default_rng(h * 31 + w).integers(0, 8, (h, w, 3), dtype=np.uint8)
    return cv2.add(cv2.resize(image, (w, h)), noise)


def _assert_close_to_cpu(got: np.ndarray, cpu: np.ndarray, norm: Normalisation) -> float:
    """Exact on x86 OpenCV builds, one grey level elsewhere; returns the fraction of equal values."""
    if X86:
        np.testing.assert_array_equal(got, cpu)
    else:
        np.testing.assert_allclose(got, cpu, rtol=0, atol=float(np.abs(norm.mul).max()) * 1.0001)
    return float((got == cpu).mean())


@pytest.mark.parametrize("hw", SIZES)
def test_reference_resize_is_opencvs(hw: tuple[int, int]) -> None:
    image = _frame(*hw)
    _, new_w, new_h = place(hw[0], hw[1], 416, 416)
    ref = resize_reference(image, new_w, new_h)
    cv = cv2.resize(image, (new_w, new_h))
    diff = np.abs(ref.astype(np.int16) - cv.astype(np.int16))
    assert diff.max() <= (0 if X86 else 1), f"{int((diff > 0).sum())} values differ"


@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("norm_name", list(NORMS))
def test_reference_letterbox_is_the_cpu_path(hw: tuple[int, int], norm_name: str) -> None:
    norm = NORMS[norm_name]
    image = _frame(*hw)
    ref, lb = letterbox_reference(image, norm)
    cpu, lbs = letterbox_normalise([image], norm)
    assert lbs == [lb]
    _assert_close_to_cpu(ref, cpu[0], norm)


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():  # type: ignore[no-untyped-def]
    pytest.importorskip("cuda.bindings")
    from pipelines.preprocess_gpu import GpuLetterbox

    try:
        letterbox = GpuLetterbox()
    except Exception as exc:  # no driver, no device, no NVRTC
        pytest.skip(f"no usable CUDA device: {exc}")
    yield letterbox
    letterbox.close()


def _download(tensor) -> np.ndarray:  # type: ignore[no-untyped-def]
    from cuda.bindings import runtime as rt

    tensor.ready.synchronize()
    host = np.empty(tensor.shape, tensor.dtype)
    err = rt.cudaMemcpy(host.ctypes.data, tensor.ptr, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
    assert int(err[0]) == 0, err
    return host


@pytest.mark.gpu
@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("norm_name", list(NORMS))
def test_kernel_is_the_reference_bit_for_bit(gpu, hw: tuple[int, int], norm_name: str) -> None:  # type: ignore[no-untyped-def]
    norm = NORMS[norm_name]
    image = _frame(*hw)
    tensor, boxes, release = gpu.preprocess([image], norm)
    got = _download(tensor)[0]
    release()
    ref, lb = letterbox_reference(image, norm)
    assert boxes == [lb]
    np.testing.assert_array_equal(got, ref)
    cpu, _ = letterbox_normalise([image], norm)
    equal = _assert_close_to_cpu(got, cpu[0], norm)
    print(f"\n{hw[1]}x{hw[0]} {norm_name}: kernel == reference; vs CPU path: {100 * equal:.4f} % equal")


@pytest.mark.gpu
def test_batch_of_mixed_sizes_and_pool_reuse(gpu) -> None:  # type: ignore[no-untyped-def]
    norm = NORMS["nanodet"]
    images = [_frame(*hw) for hw in SIZES[:4]]
    for _ in range(50):  # buffers come back to the pool: it holds one batch's worth
        tensor, boxes, release = gpu.preprocess(images, norm)
        got = _download(tensor)
        release()
    assert gpu.pooled == 1
    for i, image in enumerate(images):
        ref, lb = letterbox_reference(image, norm)
        assert boxes[i] == lb
        np.testing.assert_array_equal(got[i], ref)
    # Two batches alive at once get two buffer sets.
    a = gpu.preprocess(images[:1], norm)
    b = gpu.preprocess(images[1:2], norm)
    assert a[0].ptr != b[0].ptr and gpu.pooled == 2
    np.testing.assert_array_equal(_download(a[0])[0], letterbox_reference(images[0], norm)[0])
    a[2]()
    b[2]()


@pytest.mark.gpu
def test_frames_already_on_the_device(gpu) -> None:  # type: ignore[no-untyped-def]
    """CuPy frames (a contiguous one and a crop with a row pitch), written on a stream of their own."""
    cp = pytest.importorskip("cupy")
    norm = NORMS["yolov8"]
    image = _frame(333, 517)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        frame = cp.asarray(image)
        canvas = cp.zeros((400, 700, 3), cp.uint8)
        canvas[20 : 20 + 333, 50 : 50 + 517] = frame
        crop = canvas[20 : 20 + 333, 50 : 50 + 517]
        assert crop.strides[0] == 700 * 3
        # Inside the stream's context: CuPy names it as the frames' stream, and the kernel waits for it.
        tensor, _, release = gpu.preprocess([frame, crop], norm)
    got = _download(tensor)
    release()
    ref, _ = letterbox_reference(image, norm)
    np.testing.assert_array_equal(got[0], ref)
    np.testing.assert_array_equal(got[1], ref)


@pytest.mark.gpu
def test_execution_slot_reads_the_device_batch(gpu) -> None:  # type: ignore[no-untyped-def]
    """GPU letterbox -> DeviceTensor -> an execution slot (the `fake_` engine of test_slots_gpu, whose
    execute_async_v3 runs a real kernel): the engine reads the letterboxed batch where it lies, and the
    slot's own input buffer is bound again for a host batch afterwards."""
    import test_slots_gpu as slots_gpu

    from engines.runtimes.slots import SlotPool

    slots_gpu._kernels()
    norm = Normalisation.of((slots_gpu.H, slots_gpu.W), None, None, 1.0 / 255.0, True, 114)
    profiles = [slots_gpu.SMALL, slots_gpu.LARGE] * 2  # 2 slots: a profile switch rebinds the addresses
    pool = SlotPool.create(slots_gpu.fake_engine(profiles), slots_gpu._io(), 2, slots_gpu.PLAN)
    try:
        images = [_frame(272, 640), _frame(1080, 1920), _frame(333, 517)]
        for round_ in range(3):
            tensor, _, release = gpu.preprocess(images, norm)
            outputs = pool.run(tensor)
            release()
            expected = np.stack([letterbox_reference(im, norm)[0] for im in images])
            np.testing.assert_array_equal(outputs["scaled"], 2 * expected)
            host, _ = letterbox_normalise(images[:2], norm)
            np.testing.assert_array_equal(pool.run(host)["scaled"], 2 * host)
            assert round_ >= 0
    finally:
        pool.close()


@pytest.mark.gpu
def test_worker_with_gpu_preprocessing_and_the_simulated_engine(gpu) -> None:  # type: ignore[no-untyped-def]
    """The pipelined worker letterboxes on the GPU for an engine that takes device input; every frame is
    delivered and the pool holds no more buffer sets than batches alive at once (slots + 1)."""
    import threading
    import time

    from engines.runtimes.base import TensorSpec
    from engines.runtimes.replay import ReplayBackend
    from pipelines.frames import Frame
    from pipelines.scheduler import CameraRoute, ModelWorker

    spec = TensorSpec("images", (1, 3, 416, 416), np.dtype(np.float32))
    recorded = [
        {
            "Identity:0": np.zeros((1, 2704, 80), np.float32),
            "Identity_3:0": np.zeros((1, 2704, 44), np.float32),
            "Identity_1:0": np.zeros((1, 676, 80), np.float32),
            "Identity_4:0": np.zeros((1, 676, 44), np.float32),
            "Identity_2:0": np.zeros((1, 169, 80), np.float32),
            "Identity_5:0": np.zeros((1, 169, 44), np.float32),
        }
    ]
    engine = ReplayBackend(spec, recorded, latency_ms=2.0, slots=2)
    engine.load()
    from pipelines.preprocess_gpu import GpuLetterbox

    own = GpuLetterbox()  # the worker closes the one it is given
    delivered: list[int] = []
    lock = threading.Lock()

    def sink(result) -> None:  # type: ignore[no-untyped-def]
        with lock:
            delivered.append(result.frame.frame_id)

    adapter = NanoDetAdapter((416, 416), 80)
    worker = ModelWorker("gpu", engine, adapter, [sink], max_batch=4, gpu_preprocess=own)
    slots = [worker.new_slot() for _ in range(4)]
    for i, s in enumerate(slots):
        worker.add_camera(CameraRoute(f"c{i}", s, None, 0.4))
    worker.start()
    image = _frame(1080, 1920)
    for k in range(200):
        for s in slots:
            frame = Frame("c", k, image, time.time())
            frame.stamp("captured")
            s.put(frame)
        time.sleep(0.004)
    deadline = time.monotonic() + 10
    while worker.frames + sum(s.dropped for s in slots) < 800 and time.monotonic() < deadline:
        time.sleep(0.01)
    pooled = own.pooled
    assert worker.stop(timeout=10) and worker.close_backends()
    assert worker.frames + sum(s.dropped for s in slots) == 800
    assert worker.frames == len(delivered) > 100
    assert 1 <= pooled <= engine.slots + 1


# --- NV12 pictures (NVDEC) ---------------------------------------------------------------------------------
NV12_SIZES = [(272, 640), (1080, 1920), (722, 1282)]


def _nv12(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """A real picture as NV12 planes: Y (h x w) and interleaved UV ((h/2) x w)."""
    i420 = cv2.cvtColor(_frame(h, w), cv2.COLOR_BGR2YUV_I420).reshape(-1)
    chroma = (h // 2) * (w // 2)
    y = i420[: h * w].reshape(h, w)
    u = i420[h * w : h * w + chroma].reshape(h // 2, w // 2)
    v = i420[h * w + chroma :].reshape(h // 2, w // 2)
    return y, np.stack([u, v], axis=-1).reshape(h // 2, w)


@pytest.mark.parametrize("hw", NV12_SIZES)
def test_nv12_reference_is_opencvs_conversion(hw: tuple[int, int]) -> None:
    from pipelines.preprocess_reference import nv12_to_bgr_reference

    h, w = hw
    rng = np.random.default_rng(h)
    for y, uv in (
        _nv12(h, w),
        (rng.integers(0, 256, (h, w), np.uint8), rng.integers(0, 256, (h // 2, w), np.uint8)),
    ):
        want = cv2.cvtColor(np.concatenate([y, uv]), cv2.COLOR_YUV2BGR_NV12)
        np.testing.assert_array_equal(nv12_to_bgr_reference(y, uv), want)


@pytest.mark.parametrize("matrix", ["bt601", "bt709", "bt2020"])
@pytest.mark.parametrize("full_range", [False, True])
def test_nv12_reference_matches_the_textbook_formula(matrix: str, full_range: bool) -> None:
    """Within one level of the float64 formula (fixed point rounds; OpenCV's BT.601 constants differ from
    the textbook ones in the fourth digit, which is also inside one level)."""
    from pipelines.preprocess_reference import _KR_KB, nv12_to_bgr_reference

    rng = np.random.default_rng(1)
    h, w = 64, 96
    y = rng.integers(0, 256, (h, w), np.uint8)
    uv = rng.integers(0, 256, (h // 2, w), np.uint8)
    kr, kb = _KR_KB[matrix]
    kg = 1 - kr - kb
    u = np.repeat(np.repeat(uv.reshape(h // 2, w // 2, 2)[..., 0].astype(float) - 128, 2, 0), 2, 1)
    v = np.repeat(np.repeat(uv.reshape(h // 2, w // 2, 2)[..., 1].astype(float) - 128, 2, 0), 2, 1)
    if full_range:
        yy, cs = y.astype(float), 1.0
    else:
        yy, cs = np.maximum(y.astype(float) - 16, 0) * 255 / 219, 255 / 224
    r = yy + 2 * (1 - kr) * cs * v
    b = yy + 2 * (1 - kb) * cs * u
    g = yy - (2 * (1 - kr) * kr * cs * v + 2 * (1 - kb) * kb * cs * u) / kg
    want = np.clip(np.rint(np.stack([b, g, r], -1)), 0, 255)
    got = nv12_to_bgr_reference(y, uv, matrix, full_range).astype(float)
    assert np.abs(got - want).max() <= 1


class fake_nv12_picture:
    """What pipelines.sources.nvdec.DeviceNv12 offers the kernel: device planes, a pitch, an event."""

    def __init__(
        self, y: np.ndarray, uv: np.ndarray, matrix: str, full_range: bool, pitch_pad: int = 0
    ) -> None:
        import cupy as cp

        from engines.cuda.buffers import Event, Stream

        h, w = y.shape
        self.height, self.width, self.pitch = h, w, w + pitch_pad
        self.matrix, self.full_range = matrix, full_range
        self._stream = Stream()
        with cp.cuda.Stream.null:
            planes = cp.zeros((h * 3 // 2, self.pitch), cp.uint8)
            planes[:h, :w] = cp.asarray(y)
            planes[h:, :w] = cp.asarray(uv)
            cp.cuda.Device().synchronize()
        self._planes = planes
        self.ptr = int(planes.data.ptr)
        self.uv_ptr = self.ptr + h * self.pitch
        self.event = Event(timing=False)
        self.event.record(self._stream)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("hw", NV12_SIZES)
@pytest.mark.parametrize("colour", [("bt601", False), ("bt709", False), ("bt709", True), ("bt2020", False)])
def test_nv12_kernel_is_the_reference_bit_for_bit(gpu, hw: tuple[int, int], colour: tuple[str, bool]) -> None:  # type: ignore[no-untyped-def]
    from pipelines.preprocess_reference import nv12_letterbox_reference

    norm = NORMS["nanodet"]
    y, uv = _nv12(*hw)
    pics = [fake_nv12_picture(y, uv, *colour), fake_nv12_picture(y, uv, *colour, pitch_pad=64)]
    tensor, boxes, release = gpu.preprocess(pics, norm)
    got = _download(tensor)
    release()
    ref, lb = nv12_letterbox_reference(y, uv, norm, *colour)
    assert boxes == [lb, lb]
    np.testing.assert_array_equal(got[0], ref)
    np.testing.assert_array_equal(got[1], ref)  # a row pitch wider than the picture


@pytest.mark.gpu
def test_mixed_batch_of_bgr_and_nv12(gpu) -> None:  # type: ignore[no-untyped-def]
    from pipelines.preprocess_reference import nv12_letterbox_reference

    norm = NORMS["yolov8"]
    y, uv = _nv12(272, 640)
    bgr = _frame(1080, 1920)
    for _ in range(20):
        tensor, _, release = gpu.preprocess([fake_nv12_picture(y, uv, "bt601", False), bgr], norm)
        got = _download(tensor)
        release()
    np.testing.assert_array_equal(got[0], nv12_letterbox_reference(y, uv, norm)[0])
    np.testing.assert_array_equal(got[1], letterbox_reference(bgr, norm)[0])
    assert gpu.pooled <= 2
