"""Decode + NMS grafted onto the ONNX graph (pipelines.models.graft): same detections as the CPU postprocess.

ONNX Runtime runs the grafted bundled NanoDet on frames across the bundled clip; its detections must equal
the host decode + NMS: same count, same classes, boxes within 1 px, scores within 1e-3. (TensorRT-RTX parses
the grafted graph but its builder has no NonMaxSuppression implementation here: see README.)
"""

from __future__ import annotations

import time
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipelines.frames import Detections
from pipelines.models.graft import OUTPUTS, decode_grafted, graft_nanodet, graft_postprocess
from pipelines.models.nanodet import NanoDetAdapter

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
SCORE, IOU, K = 0.35, 0.5, 100


@pytest.fixture(scope="module")
def grafted() -> onnx.ModelProto:
    return graft_nanodet(
        onnx.load(MODEL), NanoDetAdapter((416, 416), 80), score_threshold=SCORE, iou_threshold=IOU, max_det=K
    )


def _run(session: ort.InferenceSession, x: np.ndarray) -> dict[str, np.ndarray]:
    return dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {session.get_inputs()[0].name: x}),
            strict=True,
        )
    )


def _sorted(d: Detections) -> Detections:
    return d.select(np.lexsort((d.boxes[:, 1], d.boxes[:, 0], d.class_ids, -np.round(d.scores, 3))))


def test_grafted_detections_equal_the_host_postprocess(grafted: onnx.ModelProto) -> None:
    adapter = NanoDetAdapter((416, 416), 80)
    host = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    graph = ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"])
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    frames = []
    for i in range(250):
        ok, frame = cap.read()
        if ok and i % 10 == 0:
            frames.append(frame)
    cap.release()
    frames.append(np.zeros((272, 640, 3), np.uint8))  # nothing to detect
    boxes_seen = 0
    t_host = t_graph = 0.0
    for frame in frames:
        x, lb = adapter.preprocess([frame])
        t0 = time.perf_counter()
        want = adapter.postprocess(_run(host, x), lb, SCORE, IOU)[0]
        t1 = time.perf_counter()
        outputs = _run(graph, x)
        got = decode_grafted(outputs, lb)[0]
        t2 = time.perf_counter()
        t_host, t_graph = t_host + t1 - t0, t_graph + t2 - t1
        assert set(outputs) == set(OUTPUTS)
        assert len(got) == len(want)
        if len(want):
            w, g = _sorted(want), _sorted(got)
            np.testing.assert_array_equal(g.class_ids, w.class_ids)
            np.testing.assert_allclose(g.scores, w.scores, atol=1e-3)
            np.testing.assert_allclose(g.boxes, w.boxes, atol=1.0)
        boxes_seen += len(want)
    assert boxes_seen > 20
    assert len(got) == 0 and outputs["det_count"][0] == 0  # the last frame was blank
    raw = sum(int(np.prod(v.shape)) * 4 for v in _run(host, x).values())
    small = sum(v.nbytes for v in outputs.values())
    print(
        f"\ngrafted NanoDet: {boxes_seen} boxes on {len(frames)} frames equal; ONNX Runtime + postprocess "
        f"{1000 * t_host / len(frames):.2f} ms vs grafted {1000 * t_graph / len(frames):.2f} ms per frame; "
        f"{raw} bytes of heads vs {small} bytes of detections per frame"
    )
    assert small < raw / 100


def test_grafted_graph_is_valid_and_fixed_shape(grafted: onnx.ModelProto) -> None:
    onnx.checker.check_model(grafted)
    outs = {
        o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim]
        for o in grafted.graph.output
    }
    assert outs == {
        "det_boxes": ["batch", K, 4],
        "det_scores": ["batch", K],
        "det_classes": ["batch", K],
        "det_count": ["batch"],
    }


def test_the_agent_takes_a_grafted_model(grafted: onnx.ModelProto, tmp_path: Path) -> None:
    """tools/graft_model.py's output passes the agent's preflight (one ONNX Runtime inference whose outputs
    the format must decode) and the adapter's postprocess reads grafted outputs as detections."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "grafted.onnx"
    subprocess.run(
        [
            sys.executable,
            str(repo / "tools" / "graft_model.py"),
            str(MODEL),
            "--score",
            "0.3",
            "--out",
            str(out),
        ],
        check=True,
        cwd=repo,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"models:\n  m: {{onnx: {out}, format: nanodet, labels: {ASSETS / 'coco.names'}, "
        "backend: onnxruntime}\n"
        f"cameras:\n  c: {{url: {ASSETS / 'bikes.mp4'}, model: m}}\nmqtt: {{enabled: false}}\n"
    )
    check = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(config), "--check-config"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    adapter = NanoDetAdapter((416, 416), 80)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    _, frame = cap.read()
    cap.release()
    x, lb = adapter.preprocess([frame])
    outputs = _run(session, x)
    via_adapter = adapter.postprocess(outputs, lb, 0.3)[0]
    direct = decode_grafted(outputs, lb)[0]
    assert len(via_adapter) == len(direct) > 0
    np.testing.assert_array_equal(via_adapter.boxes, direct.boxes)


@pytest.mark.parametrize("fmt", ["yolov8", "yolov8-transposed", "yolov5"])
def test_yolo_grafts_equal_the_host_postprocess(fmt: str, tmp_path: Path) -> None:
    """400 random overlapping boxes over 3 classes (plenty for NMS to suppress), through each YOLO layout."""
    from test_yolo_decoders import _const_output_model

    from engines.runtimes.ort import OrtBackend
    from pipelines.models import make_adapter

    rng = np.random.default_rng(5)
    n, nc = 400, 3
    boxes = np.concatenate([rng.uniform(0, 320, (n, 2)), rng.uniform(10, 80, (n, 2))], 1).astype(np.float32)
    cls = rng.uniform(0, 1, (n, nc)).astype(np.float32)
    if fmt == "yolov5":
        pred = np.concatenate([boxes, rng.uniform(0.3, 1, (n, 1)).astype(np.float32), cls], 1)[None]
    elif fmt == "yolov8":
        pred = np.concatenate([boxes, cls], 1).T[None]
    else:
        pred = np.concatenate([boxes, cls], 1)[None]
    path = _const_output_model(tmp_path / "m.onnx", np.ascontiguousarray(pred))
    with OrtBackend(path) as backend:
        adapter = make_adapter(fmt.split("-")[0], backend.input_spec, num_classes=nc)
        x, lb = adapter.preprocess([np.zeros((480, 640, 3), np.uint8)])
        want = adapter.postprocess(backend.infer(x), lb, 0.25, 0.5)[0]
    grafted = graft_postprocess(
        onnx.load(path), adapter, score_threshold=0.25, iou_threshold=0.5, max_det=300
    )
    session = ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"])
    got = decode_grafted(_run(session, x), lb)[0]
    assert len(want) > 20 and len(got) == len(want)
    w, g = _sorted(want), _sorted(got)
    np.testing.assert_array_equal(g.class_ids, w.class_ids)
    np.testing.assert_allclose(g.scores, w.scores, atol=1e-3)
    np.testing.assert_allclose(g.boxes, w.boxes, atol=1.0)
