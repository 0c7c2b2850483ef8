"""The GPU video path end to end on a real GPU: NVDEC -> GPU preprocessing -> engine -> detections.

Marked gpu (CI has no GPU). On the GPU box, with PyNvVideoCodec and onnx2torch installed:
    PYTHONPATH=.:tests python3 -m pytest --noconftest -o addopts= -m gpu tests/test_gpu_path_gpu.py

The engine is `fake_torch_engine` (tests/fake_torch_trt.py): the bundled NanoDet run by PyTorch behind
the agent's real execution slots, because TensorRT cannot be installed there. The reference is the CPU
path the agent runs without a GPU: FFmpeg decode, CPU letterbox, ONNX Runtime, CPU postprocess.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
CLIP = ASSETS / "bikes.mp4"


@pytest.fixture(scope="module")
def torch_engine():  # type: ignore[no-untyped-def]
    pytest.importorskip("onnx2torch")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from fake_torch_trt import fake_torch_engine

    return fake_torch_engine(str(MODEL), max_batch=16, contexts=2)


def _frames(count: int) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(CLIP))
    out = []
    while len(out) < count:
        ok, frame = cap.read()
        if not ok:
            break
        out.append(frame)
    cap.release()
    return out


def test_fake_engine_matches_onnx_runtime_through_the_execution_slots(torch_engine) -> None:  # type: ignore[no-untyped-def]
    from fake_torch_trt import fake_trt_backend

    from engines.runtimes.ort import OrtBackend
    from pipelines.models.nanodet import NanoDetAdapter

    adapter = NanoDetAdapter((416, 416), 80)
    batch, _ = adapter.preprocess(_frames(4))
    ort = OrtBackend(str(MODEL))
    ort.load()
    backend = fake_trt_backend(torch_engine, contexts=2)
    backend.load()
    try:
        want, got = ort.infer(batch), backend.infer(batch)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-3, rtol=1e-3)
    finally:
        backend.close()
        ort.close()


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=2)
    area_a = (a[:, 2:] - a[:, :2]).prod(axis=1)
    area_b = (b[:, 2:] - b[:, :2]).prod(axis=1)
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def _matched(ref, got) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(reference boxes, of them matched by a box of the same class at IoU >= 0.5)."""
    if len(ref) == 0:
        return 0, 0
    if len(got) == 0:
        return len(ref), 0
    iou = _iou(ref.boxes, got.boxes)
    same = ref.class_ids[:, None] == got.class_ids[None, :]
    return len(ref), int(((iou >= 0.5) & same).any(axis=1).sum())


SCORE = 0.35


@pytest.fixture(scope="module")
def cpu_reference():  # type: ignore[no-untyped-def]
    """The CPU path on every frame of the clip: FFmpeg decode, CPU letterbox, ONNX Runtime, postprocess."""
    from engines.runtimes.ort import OrtBackend
    from pipelines.models.nanodet import NanoDetAdapter

    adapter = NanoDetAdapter((416, 416), 80)
    ort = OrtBackend(str(MODEL))
    ort.load()
    out = []
    for frame in _frames(250):
        batch, boxes = adapter.preprocess([frame])
        out += adapter.postprocess(ort.infer(batch), boxes, SCORE)
    ort.close()
    return out


@pytest.mark.parametrize("post", ["host", "graph"])
def test_nvdec_gpu_preprocess_engine_agree_with_the_cpu_path(
    torch_engine, cpu_reference, post, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Decode (NVDEC) -> NV12 letterbox kernel -> engine reading the device batch -> detections, on every
    frame of the clip in batches of 4: the same boxes as the CPU path (>= 0.95 matched, same class)."""
    pytest.importorskip("PyNvVideoCodec")
    from fake_torch_trt import fake_trt_backend

    from pipelines.models.nanodet import NanoDetAdapter
    from pipelines.preprocess_gpu import GpuLetterbox
    from pipelines.sources.nvdec import NvdecDecoder

    adapter = NanoDetAdapter((416, 416), 80)
    engine = torch_engine
    if post == "graph":  # decode + NMS grafted onto the graph: the engine's outputs are detections
        import onnx
        from fake_torch_trt import fake_torch_engine

        from pipelines.models.graft import decode_grafted, graft_nanodet

        # The NonMaxSuppression tail (TensorRT >= 8.5: INMSLayer): onnx2torch has no converter for the Loop of
        # the default matrix tail (TensorRT-RTX's). Both equal the host postprocess on ONNX Runtime in CI.
        grafted = tmp_path / "grafted.onnx"
        model = graft_nanodet(onnx.load(MODEL), adapter, score_threshold=SCORE, max_det=100, nms="onnx")
        onnx.save(model, grafted)
        engine = fake_torch_engine(str(grafted), max_batch=16, contexts=2)
    backend = fake_trt_backend(engine, contexts=2)
    backend.load()
    gpu = GpuLetterbox()
    dec = NvdecDecoder("h264")
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    pictures, got, host_bytes = [], [], []
    try:
        while True:
            ok, packet = cap.read()
            if ok:
                pictures += dec.decode(packet, bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME)))
            else:
                pictures += dec.flush()
            while len(pictures) >= 4 or (not ok and pictures):
                batch, pictures = pictures[:4], pictures[4:]
                tensor, boxes, release = gpu.preprocess(batch, adapter.normalisation)
                outputs = backend.infer(tensor)
                release()
                host_bytes.append(sum(v.nbytes for v in outputs.values()) / len(batch))
                if post == "graph":
                    got += decode_grafted(outputs, boxes)
                else:
                    got += adapter.postprocess(outputs, boxes, SCORE)
            if not ok:
                break
    finally:
        cap.release()
        dec.close()
        gpu.close()
        backend.close()
    assert len(got) == len(cpu_reference)
    totals = np.array([_matched(r, g) for r, g in zip(cpu_reference, got, strict=True)])
    ref_boxes, matched = totals.sum(axis=0)
    extra = sum(len(g) for g in got) - sum(len(r) for r in cpu_reference)
    print(
        f"NVDEC+GPU path ({post} postprocess) vs CPU path: {matched}/{ref_boxes} boxes matched, box count "
        f"difference {extra}, {np.mean(host_bytes):.0f} bytes per frame copied to the host"
    )
    assert ref_boxes > 100
    assert matched / ref_boxes >= 0.95


def test_sixteen_rtsp_streams_nvdec_to_detections(torch_engine, cpu_reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """16 RTSP streams (the project's Annex-B server) -> NVDEC readers -> the pipelined worker with GPU
    preprocessing -> the engine -> a sink: every camera delivers, and its detections agree with the CPU
    path on the same clip frames (frame ids count pictures from the start of the served file)."""
    import threading
    import time

    pytest.importorskip("PyNvVideoCodec")
    from fake_torch_trt import fake_trt_backend
    from test_annexb_rtsp import serve

    from pipelines.models.nanodet import NanoDetAdapter
    from pipelines.preprocess_gpu import GpuLetterbox
    from pipelines.scheduler import CameraRoute, ModelWorker
    from pipelines.sources import CameraReader, SourceSpec
    from pipelines.sources.nvdec import DeviceNv12, NvdecStage

    path = tmp_path / "clip.h264"
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    data = bytearray()
    while True:
        ok, packet = cap.read()
        if not ok:
            break
        data += packet.tobytes()
    path.write_bytes(bytes(data))
    results: list = []
    lock = threading.Lock()
    on_device = []

    def sink(result) -> None:  # type: ignore[no-untyped-def]
        with lock:
            results.append((result.frame.camera, result.frame.frame_id, result.detections))
            on_device.append(isinstance(result.frame.image, DeviceNv12))

    adapter = NanoDetAdapter((416, 416), 80)
    backend = fake_trt_backend(torch_engine, contexts=2)
    backend.load()
    worker = ModelWorker("m", backend, adapter, [sink], max_batch=16, gpu_preprocess=GpuLetterbox())
    readers = []
    with serve(path, fps=25) as (url, _proc):
        for i in range(16):
            route = CameraRoute(f"cam{i:02d}", worker.new_slot(), None, SCORE)
            worker.add_camera(route)
            spec = SourceSpec(camera=route.name, url=url)
            readers.append(CameraReader(spec, route.slot, stage=NvdecStage(), mode="nvdec"))
        worker.start()
        for r in readers:
            r.start()
        time.sleep(12)
        for r in readers:
            r.request_stop()
        for r in readers:
            r.stop()
        worker.stop(timeout=10)
        worker.close_backends()
    cameras = {c for c, _, _ in results}
    assert cameras == {f"cam{i:02d}" for i in range(16)}
    assert all(on_device)
    same = [(cpu_reference[fid], dets) for _, fid, dets in results if fid < len(cpu_reference)]
    totals = np.array([_matched(r, g) for r, g in same])
    ref_boxes, matched = totals.sum(axis=0)
    per_cam = {c: sum(1 for cc, _, _ in results if cc == c) for c in sorted(cameras)}
    print(
        f"16 streams: {len(results)} results in 12 s, per camera {min(per_cam.values())}-"
        f"{max(per_cam.values())}; {matched}/{ref_boxes} boxes matched the CPU path"
    )
    assert matched / ref_boxes >= 0.95
