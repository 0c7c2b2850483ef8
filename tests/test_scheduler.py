"""The pipelined ModelWorker on real components: NanoDet outputs recorded from ONNX Runtime, replayed by the
simulated engine (ReplayBackend with a per-batch latency), frames of the bundled clip.

Every check counts or orders events (recorded intervals, frame ids, shares of batches); none asserts a
frame rate or a duration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
from fixtures_agent import wait_until

from engines.runtimes.base import Backend, BackendError, DeviceTensor
from engines.runtimes.ort import OrtBackend
from engines.runtimes.replay import ReplayBackend
from pipelines.frames import Frame
from pipelines.models import ModelAdapter, make_adapter
from pipelines.postprocess import load_labels
from pipelines.preprocess import Letterbox, Normalisation
from pipelines.routes import Routes
from pipelines.scheduler import CameraRoute, ModelWorker, NotifyingSlot, Result
from pipelines.sources import FrameSlot

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
LABELS = load_labels(ASSETS / "coco.names")


@pytest.fixture(scope="module")
def clip() -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    images = []
    while len(images) < 8:
        ok, image = cap.read()
        assert ok
        images.append(image)
    cap.release()
    return images


@pytest.fixture(scope="module")
def recorded(clip: list[np.ndarray]) -> tuple[OrtBackend, list[dict[str, np.ndarray]]]:
    with OrtBackend(ASSETS / "nanodet-m-416.onnx") as ort:
        adapter = make_adapter("nanodet", ort.input_spec, len(LABELS))
        outputs = [ort.infer(adapter.preprocess([im])[0]) for im in clip]
        return ort, outputs


class RecordingEngine(ReplayBackend):
    """The simulated engine, recording each batch: (start, end, frames) and how many ran at once."""

    def __init__(self, recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], **kw: object) -> None:
        ort, outputs = recorded
        super().__init__(ort.input_spec, outputs, **kw)  # type: ignore[arg-type]
        self.lock = threading.Lock()
        self.intervals: list[tuple[float, float, int]] = []
        self.active = 0
        self.most_active = 0
        self.closed_while_in_use = 0
        self.infers_after_close = 0
        self.close_calls = 0
        self.hold: threading.Event | None = None  # set: infer waits for it (a stuck device)

    def infer(self, batch: np.ndarray | DeviceTensor) -> dict[str, np.ndarray]:
        with self.lock:
            if self.close_calls:
                self.infers_after_close += 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        start = time.monotonic()
        try:
            if self.hold is not None:
                self.hold.wait(10)
            return super().infer(batch)
        finally:
            with self.lock:
                self.active -= 1
                self.intervals.append((start, time.monotonic(), batch.shape[0]))

    def close(self) -> None:
        with self.lock:
            self.close_calls += 1
            if self.active:
                self.closed_while_in_use += 1
        super().close()


def _engine(recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], **kw: object) -> RecordingEngine:
    engine = RecordingEngine(recorded, **kw)
    engine.load()
    return engine


class RecordingAdapter:
    """Wraps the real NanoDet adapter, recording when each preprocess ran."""

    def __init__(self, inner: ModelAdapter) -> None:
        self.inner = inner
        self.normalisation: Normalisation = inner.normalisation
        self.preprocessed: list[tuple[float, float]] = []
        self.second_started = threading.Event()

    def preprocess(self, images: list[np.ndarray]) -> tuple[np.ndarray, list[Letterbox]]:
        start = time.monotonic()
        if len(self.preprocessed) >= 1:
            self.second_started.set()
        out = self.inner.preprocess(images)
        self.preprocessed.append((start, time.monotonic()))
        return out

    def postprocess(self, *args: object, **kw: object) -> object:
        return self.inner.postprocess(*args, **kw)  # type: ignore[arg-type]


class EndlessSlot(NotifyingSlot):
    """A camera faster than any model: its slot always holds a new frame (ids count up), and the next one
    arrives (wakes the worker) as soon as one is taken."""

    def __init__(self, wake: threading.Event, camera: str, image: np.ndarray) -> None:
        super().__init__(wake)
        self.camera, self.image, self.next_id = camera, image, 0
        self._put_at = time.monotonic()

    def get(self, timeout: float | None = None) -> Frame | None:
        with self._cond:
            frame = Frame(self.camera, self.next_id, self.image, time.time())
            self.next_id += 1
            self._put_at = time.monotonic()
        frame.stamp("captured")
        self._wake.set()
        return frame


class Rig:
    """A worker over cameras (`endless`: always a frame ready; `dead`: never one; `fed`: put by the test)."""

    def __init__(
        self,
        engine: Backend,
        adapter: ModelAdapter | RecordingAdapter,
        image: np.ndarray,
        cameras: list[tuple[str, str]],
        **kw: object,
    ) -> None:
        self.lock = threading.Lock()
        self.results: list[tuple[float, Result]] = []
        self.errors: list[BaseException] = []
        self.worker = ModelWorker(
            "nanodet",
            engine,
            adapter,  # type: ignore[arg-type]
            [self._sink],
            on_error=lambda _model, exc: self.errors.append(exc),
            **kw,  # type: ignore[arg-type]
        )
        self.image = image
        self.slots: dict[str, FrameSlot] = {}
        for name, kind in cameras:
            slot = EndlessSlot(self.worker.wake, name, image) if kind == "endless" else self.worker.new_slot()
            self.slots[name] = slot
            self.worker.add_camera(CameraRoute(name, slot, None, 0.35))
        self.worker.wake.set()

    def _sink(self, result: Result) -> None:
        with self.lock:
            self.results.append((time.monotonic(), result))

    def put(self, camera: str, frame_id: int, age_s: float = 0.0) -> None:
        frame = Frame(camera, frame_id, self.image, time.time() - age_s)
        frame.stamps["captured"] = time.monotonic() - age_s
        self.slots[camera].put(frame)

    def counts(self) -> Counter[str]:
        with self.lock:
            return Counter(r.frame.camera for _, r in self.results)

    def stop(self) -> None:
        assert self.worker.stop(timeout=10)
        assert self.worker.close_backends()


@pytest.fixture
def adapter(recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]]) -> ModelAdapter:
    return make_adapter("nanodet", recorded[0].input_spec, len(LABELS))


# -- fair batching ------------------------------------------------------------------------------------------
ORDERS = [
    "L.L.L",  # the case: live cameras separated by dead ones
    "..LLL",
    "LLL..",
    "L..LL.",
    ".L.L.L..",
]


@pytest.mark.parametrize("order", ORDERS)
def test_fair_shares_with_dead_cameras_step_by_step(
    order: str, recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    """Batches of 2 over 3 live cameras among dead ones: after 30 batches each live camera had 20 frames."""
    cams = [(f"cam{i}", "endless" if c == "L" else "dead") for i, c in enumerate(order)]
    rig = Rig(_engine(recorded, latency_ms=1.0), adapter, clip[0], cams, max_batch=2)
    for _ in range(30):
        assert rig.worker.run_once(timeout=1) == 2
    live = [name for name, kind in cams if kind == "endless"]
    assert rig.counts() == dict.fromkeys(live, 20)


def test_fair_shares_running_with_a_slow_engine(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    """The pipelined worker, 3 live and 3 dead cameras, batches of 2, an engine slower than the cameras:
    the live cameras' shares differ by at most one frame (the batches still in flight at the end)."""
    cams = [
        ("a", "endless"),
        ("d1", "dead"),
        ("b", "endless"),
        ("d2", "dead"),
        ("d3", "dead"),
        ("c", "endless"),
    ]
    rig = Rig(_engine(recorded, latency_ms=5.0), adapter, clip[0], cams, max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 60, 30)
    rig.stop()
    counts = rig.counts()
    assert set(counts) == {"a", "b", "c"}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert not rig.errors


def test_partly_filled_batch_waits_only_for_live_cameras(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]],
    adapter: ModelAdapter,
    clip: list,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dead cameras do not count as 'others may join': a lone live camera's batch is not held back for
    them; with two live cameras, a batch holding one waits once for the other."""
    cams = [("a", "fed"), ("b", "fed"), ("dead1", "dead"), ("dead2", "dead")]
    rig = Rig(_engine(recorded), adapter, clip[0], cams, max_batch=4, batch_wait_s=0.01)
    collects: list[int] = []
    real = Routes.take

    def counting(self: Routes, limit: int, exclude: frozenset[str] = frozenset()) -> list:
        collects.append(limit)
        return real(self, limit, exclude)

    monkeypatch.setattr(Routes, "take", counting)
    rig.put("a", 0)
    assert rig.worker.run_once(timeout=1) == 1
    assert collects == [4]  # one live camera: nobody to wait for
    rig.put("b", 0)
    rig.put("a", 1)
    assert rig.worker.run_once(timeout=1) == 2
    rig.put("a", 2)  # b is live now (it put a frame within the last second)
    collects.clear()
    assert rig.worker.run_once(timeout=1) == 1
    assert collects == [4, 3]  # waited once for b


# -- pipelining ---------------------------------------------------------------------------------------------
def test_preprocessing_of_the_next_batch_overlaps_inference(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    """The engine's first batch does not finish until the next batch's preprocessing has begun: only a
    pipelined worker gets past it. Then each batch k+1 started preprocessing before batch k left the
    engine."""
    spy = RecordingAdapter(adapter)
    engine = _engine(recorded, latency_ms=100.0)
    engine.hold = spy.second_started
    rig = Rig(engine, spy, clip[0], [("a", "endless"), ("b", "endless")], max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 6, 30)
    rig.stop()
    assert spy.second_started.is_set()
    with engine.lock:
        infers = sorted(engine.intervals)
    pre = sorted(spy.preprocessed)
    first_end = infers[0][1]
    assert pre[1][0] < first_end  # batch 2 was being preprocessed while batch 1 was in the engine
    overlapped = sum(1 for k in range(1, 6) if pre[k + 1][0] < infers[k][1])
    assert overlapped == 5, (pre[:7], infers[:6])
    assert engine.most_active == 1  # one slot: never two batches in it at once


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_in_flight_batches_bounded_by_slots(
    slots: int, recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    engine = _engine(recorded, latency_ms=30.0, slots=slots)
    cams = [(f"c{i}", "endless") for i in range(4)]
    rig = Rig(engine, adapter, clip[0], cams, max_batch=1)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 8 * slots, 30)
    rig.stop()
    # Preprocessing 1 frame takes far less than 30 ms: every slot was kept busy, none overfilled.
    assert engine.most_active == slots
    assert not rig.errors


def test_results_in_capture_order_per_camera_when_slots_finish_out_of_order(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    class Shuffling(RecordingEngine):
        """Every third batch is slow, so the two batches behind it (on the other slots) overtake it."""

        def _infer_impl(self, batch: np.ndarray | DeviceTensor) -> dict[str, np.ndarray]:
            with self.lock:
                n = len(self.intervals) + self.active
            time.sleep(0.04 if n % 3 == 0 else 0.005)
            return super()._infer_impl(batch)

    engine = Shuffling(recorded, slots=3)
    engine.load()
    cams = [(f"c{i}", "endless") for i in range(3)]
    rig = Rig(engine, adapter, clip[0], cams, max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 60, 30)
    rig.stop()
    with engine.lock:
        intervals = list(engine.intervals)  # in order of finishing
    starts = [s for s, _, _ in intervals]
    assert starts != sorted(starts), "no batch overtook another: the test did not exercise reordering"
    with rig.lock:
        results = [r for _, r in rig.results]
    for cam in ("c0", "c1", "c2"):
        ids = [r.frame.frame_id for r in results if r.frame.camera == cam]
        assert len(ids) >= 20
        assert ids == sorted(ids) and len(set(ids)) == len(ids), f"{cam}: {ids}"


# -- stale frames -------------------------------------------------------------------------------------------
def test_frames_older_than_max_age_are_dropped_and_counted(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    rig = Rig(_engine(recorded), adapter, clip[0], [("old", "fed"), ("new", "fed")], max_age_ms=500)
    rig.put("old", 1, age_s=2.0)
    rig.put("new", 1)
    assert rig.worker.run_once(timeout=1) == 1
    assert [r.frame.camera for _, r in rig.results] == ["new"]
    assert (rig.worker.route("old").stale, rig.worker.route("new").stale, rig.worker.stale) == (1, 0, 1)
    rig.put("old", 2)  # a fresh frame of the same camera goes through
    assert rig.worker.run_once(timeout=1) == 1
    assert rig.worker.route("old").stale == 1

    keep_all = Rig(_engine(recorded), adapter, clip[0], [("old", "fed")], max_age_ms=0)
    keep_all.put("old", 1, age_s=60.0)
    assert keep_all.worker.run_once(timeout=1) == 1 and keep_all.worker.stale == 0


# -- cameras come and go ------------------------------------------------------------------------------------
def test_no_result_of_a_removed_camera_after_remove_returns(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    cams = [("a", "endless"), ("b", "endless"), ("c", "endless")]
    rig = Rig(_engine(recorded, latency_ms=10.0, slots=2), adapter, clip[0], cams, max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.counts()["b"] >= 5, 30)
    rig.worker.remove_camera("b")
    removed_at = time.monotonic()
    done = rig.worker.frames
    assert wait_until(lambda: rig.worker.frames >= done + 20, 30)
    rig.stop()
    with rig.lock:
        late = [t - removed_at for t, r in rig.results if r.frame.camera == "b" and t >= removed_at]
    assert late == []
    # The others are served on; a camera added later (same name, new route) only gets its own frames.
    assert rig.counts()["a"] > 5 and rig.counts()["c"] > 5


def test_camera_added_while_running_is_served(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    rig = Rig(_engine(recorded, latency_ms=5.0), adapter, clip[0], [("a", "endless")], max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 3, 30)
    rig.worker.add_camera(CameraRoute("late", EndlessSlot(rig.worker.wake, "late", clip[1]), None, 0.35))
    assert wait_until(lambda: rig.counts()["late"] >= 5, 30)
    rig.stop()


# -- hot swap with batches in flight ------------------------------------------------------------------------
@pytest.mark.slow
def test_swap_never_closes_a_backend_with_batches_in_flight(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    """Three slots, several batches in the engine at any time, a new engine swapped in every 20 ms for 3 s."""
    first = _engine(recorded, latency_ms=15.0, slots=3)
    engines = [first]
    cams = [(f"c{i}", "endless") for i in range(6)]
    rig = Rig(first, adapter, clip[0], cams, max_batch=2)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.batches >= 3, 30)
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:
        new = _engine(recorded, latency_ms=15.0, slots=3)
        engines.append(new)
        rig.worker.swap_backend(new)
        time.sleep(0.02)
    assert wait_until(lambda: rig.worker.backend is engines[-1], 10)
    assert wait_until(lambda: engines[-1].batches >= 10, 10)  # the newest serves, in flight again
    rig.stop()
    assert not rig.errors
    assert sum(e.closed_while_in_use for e in engines) == 0
    assert sum(e.infers_after_close for e in engines) == 0
    assert [e.close_calls for e in engines] == [1] * len(engines)
    assert rig.worker.swaps >= 5
    assert sum(e.batches for e in engines) == rig.worker.batches
    assert max(e.most_active for e in engines) == 3  # batches really were in flight together


# -- errors, stop -------------------------------------------------------------------------------------------
def test_a_failing_batch_is_reported_and_the_pipeline_goes_on(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    class FailsOnce(RecordingEngine):
        failed = False

        def _infer_impl(self, batch: np.ndarray | DeviceTensor) -> dict[str, np.ndarray]:
            if not self.failed:
                self.failed = True
                raise BackendError("replay: device lost (once)")
            return super()._infer_impl(batch)

    engine = FailsOnce(recorded)
    engine.load()
    rig = Rig(engine, adapter, clip[0], [("a", "endless")], max_batch=1)
    rig.worker.start()
    assert wait_until(lambda: rig.worker.frames >= 5, 30)
    rig.stop()
    assert [str(e) for e in rig.errors] == ["replay: device lost (once)"]


def test_stop_delivers_the_batches_already_handed_over(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]], adapter: ModelAdapter, clip: list
) -> None:
    engine = _engine(recorded, slots=2)
    hold = threading.Event()
    engine.hold = hold
    rig = Rig(engine, adapter, clip[0], [("a", "endless"), ("b", "endless")], max_batch=1)
    rig.worker.start()
    assert wait_until(lambda: engine.active == 2, 10)  # two batches stuck in the engine
    assert rig.worker.stop(timeout=0.2) is False  # still running: those batches hold the backend
    assert rig.worker.close_backends() is False and engine.close_calls == 0
    hold.set()
    assert wait_until(lambda: not rig.worker.running, 10)
    assert rig.worker.frames >= 2 and len(rig.results) == rig.worker.frames
    assert rig.worker.close_backends() and engine.close_calls == 1


# -- GPU preprocessing routing (the GPU itself: tests/test_preprocess_gpu.py) --------------------------------
class fake_gpu_letterbox:
    """Stands in for GpuLetterbox where no GPU exists: the 'device' tensor is the CPU tensor."""

    class _Ready:
        raw = None

        def synchronize(self) -> None:
            pass

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.batches = 0
        self.released = 0
        self.closed = False
        self.keep: list[np.ndarray] = []

    def preprocess(self, images: list[np.ndarray], norm: Normalisation) -> tuple:
        tensor, boxes = self.adapter.preprocess(images)
        self.batches += 1
        self.keep.append(tensor)
        ptr = tensor.ctypes.data
        return DeviceTensor(ptr, tensor.shape, tensor.dtype, self._Ready()), boxes, self._release

    def _release(self) -> None:
        self.released += 1

    def close(self) -> None:
        self.closed = True


def test_gpu_preprocessing_only_for_backends_that_take_device_input(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]],
    adapter: ModelAdapter,
    clip: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = fake_gpu_letterbox(adapter)
    ort = OrtBackend(ASSETS / "nanodet-m-416.onnx", intra_threads=1)
    ort.load()
    rig = Rig(ort, adapter, clip[0], [("a", "fed")], gpu_preprocess=gpu)
    rig.put("a", 0)
    with caplog.at_level(logging.WARNING):
        assert rig.worker.run_once(timeout=1) == 1
    assert gpu.batches == 0 and "GPU preprocessing needs a backend that takes device input" in caplog.text
    rig.worker.swap_backend(_engine(recorded))  # the simulated engine reads device tensors
    rig.put("a", 1)
    assert rig.worker.run_once(timeout=1) == 1
    assert (gpu.batches, gpu.released) == (1, 1)  # buffers handed back once the batch was inferred
    rig.worker.stop()
    rig.worker.close_backends()
    assert gpu.closed


def test_host_only_backend_refuses_a_device_tensor(recorded: tuple[OrtBackend, list]) -> None:
    ort = recorded[0]
    with OrtBackend(ASSETS / "nanodet-m-416.onnx") as b:
        ready = fake_gpu_letterbox._Ready()
        with pytest.raises(BackendError, match="takes host arrays only"):
            b.infer(DeviceTensor(0, (1, *ort.input_spec.shape[1:]), np.dtype(np.float32), ready))  # type: ignore[arg-type]


# -- the simulated engine itself ----------------------------------------------------------------------------
def test_replay_engine_cycles_recorded_outputs_read_only(
    recorded: tuple[OrtBackend, list[dict[str, np.ndarray]]],
) -> None:
    ort, outputs = recorded
    engine = ReplayBackend(ort.input_spec, outputs, latency_ms=1.0, slots=2)
    engine.load()
    batch = np.zeros((3, *ort.input_spec.shape[1:]), np.float32)
    seen = [engine.infer(batch) for _ in range(4)]  # 12 frames over 8 recorded: the third batch wraps
    name = next(iter(outputs[0]))
    for k, out in enumerate(seen):
        expected = np.concatenate([outputs[(3 * k + i) % len(outputs)][name] for i in range(3)])
        np.testing.assert_array_equal(out[name], expected)
        assert not out[name].flags.writeable  # shared: an adapter writing into it would corrupt later batches
    assert engine.slots == 2 and engine.batches == 4 and engine.last_gpu_ms == pytest.approx(1.0)


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    assert wait_until(
        lambda: not [t for t in set(threading.enumerate()) - before if t.name.startswith("model-")]
    )
