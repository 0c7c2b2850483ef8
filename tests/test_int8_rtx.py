"""The agent's Q/DQ model of the folded graph builds an INT8 engine with TensorRT-RTX, for real (the
unfolded one hits an internal TensorRT-RTX error: tests/test_precision_build.py asserts the message)."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from engines.build.builder import build
from engines.build.quantize import make_qdq_onnx
from engines.fingerprint import probe_fingerprint
from engines.runtimes.ort import OrtBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import import_trt
from pipelines.models import make_adapter
from pipelines.postprocess import load_labels

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"


def clip_batches(n: int) -> list[np.ndarray]:
    backend = OrtBackend(str(MODEL))
    backend.load()
    adapter = make_adapter("nanodet", backend.input_spec, len(load_labels(ASSETS / "coco.names")))
    backend.close()
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    frames = []
    try:
        for i in range(n * 10):
            ok, img = cap.read()
            if not ok:
                break
            if i % 10 == 0:  # spread over the clip's scenes
                frames.append(adapter.preprocess([img])[0])
    finally:
        cap.release()
    return frames


def test_qdq_model_builds_int8_engine_with_rtx(tmp_path: Path) -> None:
    qdq = tmp_path / "int8.onnx"
    info = make_qdq_onnx(MODEL, qdq, iter(clip_batches(16)), "minmax", fold=True)
    assert info["samples"] == 16 and info["folded"] is True
    record = {"method": "minmax", "samples": 16, "data_id": "test"}
    settings = BuildSettings(onnx=MODEL, precision="int8", qdq_onnx=qdq, calibration=record)
    api = import_trt("tensorrt_rtx")
    store = EngineStore(tmp_path / "engines")
    result = build(store, "det", settings, fingerprint=probe_fingerprint(api), api=api)
    assert result.built
    manifest = json.loads(store.manifest_path("det", result.key).read_text())
    assert manifest["build"]["precision"] == "int8"
    assert manifest["build"]["calibration"]["method"] == "minmax"
    assert manifest["build"]["calibration"]["cache_sha256"] == info["sha256"]
    # INT8 weights: the plan is about half the 18 MB FP32 plan.
    assert result.plan_path.stat().st_size < 12_000_000
