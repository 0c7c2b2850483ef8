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
