"""Decode + NMS grafted onto the ONNX graph (pipelines.models.graft): same detections as the CPU postprocess.

ONNX Runtime runs the grafted bundled NanoDet on frames across the bundled clip; its detections must equal
the host decode + NMS: same count, same classes, boxes within 1 px, scores within 1e-3. Both NMS tails: the
default "matrix" one (which TensorRT-RTX builds) and the NonMaxSuppression op ("onnx"). YOLO layouts and a
batch > 1 run on small constant-head models (as tests/test_yolo_decoders.py makes them).
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
from pipelines.models import GraftParams, resolve_onnx
from pipelines.models.graft import OUTPUTS, decode_grafted, graft_nanodet, graft_postprocess
from pipelines.models.nanodet import NanoDetAdapter
from pipelines.postprocess import load_labels

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
SCORE, IOU, K = 0.35, 0.5, 100


@pytest.fixture(scope="module", params=["matrix", "onnx"])
def grafted(request: pytest.FixtureRequest) -> onnx.ModelProto:
    return graft_nanodet(
        onnx.load(MODEL),
        NanoDetAdapter((416, 416), 80),
        score_threshold=SCORE,
        iou_threshold=IOU,
        max_det=K,
        nms=request.param,
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


def test_the_agent_takes_a_grafted_model(tmp_path: Path) -> None:
    """tools/graft_model.py's output passes the agent's preflight (one ONNX Runtime inference whose outputs
    the format must decode) and, resolved from its graft record, the adapter reads them as detections."""
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
    spec = resolve_onnx("m", out, "nanodet", load_labels(ASSETS / "coco.names"))
    assert spec.postprocess == "graph" and spec.graft == GraftParams(0.3, 0.5, 100)
    adapter = spec.adapter()
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


@pytest.mark.parametrize("nms", ["matrix", "onnx"])
@pytest.mark.parametrize("fmt", ["yolov8", "yolov8-transposed", "yolov5"])
def test_yolo_grafts_equal_the_host_postprocess(fmt: str, nms: str, tmp_path: Path) -> None:
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
        onnx.load(path), adapter, score_threshold=0.25, iou_threshold=0.5, max_det=300, nms=nms
    )
    session = ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"])
    got = decode_grafted(_run(session, x), lb)[0]
    assert len(want) > 20 and len(got) == len(want)
    w, g = _sorted(want), _sorted(got)
    np.testing.assert_array_equal(g.class_ids, w.class_ids)
    np.testing.assert_allclose(g.scores, w.scores, atol=1e-3)
    np.testing.assert_allclose(g.boxes, w.boxes, atol=1.0)


def _batched_model(path: Path, pred: np.ndarray, coef: np.ndarray) -> Path:
    """Dynamic-batch head: pred + mean(image) * coef, so each batch item (a different mean) differs."""
    from onnx import TensorProto, helper, numpy_helper
    from test_yolo_decoders import NET

    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, NET, NET])
    out = helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", *pred.shape[1:]])
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], axes=[1, 2, 3], keepdims=1),  # (B, 1, 1, 1)
        helper.make_node("Squeeze", ["mean", "ax"], ["m3"]),  # (B, 1, 1)
        helper.make_node("Mul", ["m3", "coef"], ["shift"]),
        helper.make_node("Add", ["pred", "shift"], ["output0"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([3], np.int64), "ax"),
        numpy_helper.from_array(pred, "pred"),
        numpy_helper.from_array(coef, "coef"),
    ]
    graph = helper.make_graph(nodes, "batched_head", [images], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("nms", ["matrix", "onnx"])
def test_batch_of_three_equals_the_host_postprocess_per_image(nms: str, tmp_path: Path) -> None:
    """A dynamic-batch YOLOv8 head, 3 different frames in one batch: each item equals its host decode."""
    from engines.runtimes.ort import OrtBackend
    from pipelines.models import make_adapter

    rng = np.random.default_rng(7)
    n, nc = 300, 3
    boxes = np.concatenate([rng.uniform(0, 320, (n, 2)), rng.uniform(10, 80, (n, 2))], 1)
    pred = np.concatenate([boxes, rng.uniform(0, 1, (n, nc))], 1).T[None].astype(np.float32)
    # Centres move with the image, sizes stay positive (a negative width means nothing to either side).
    shift, size, cls = rng.uniform(-60, 60, (2, n)), np.zeros((2, n)), rng.uniform(-0.004, 0.004, (nc, n))
    coef = np.concatenate([shift, size, cls])
    coef = coef[None]
    path = _batched_model(tmp_path / "b.onnx", np.ascontiguousarray(pred), coef.astype(np.float32))
    frames = [np.full((480, 640, 3), v, np.uint8) for v in (0, 90, 200)]
    with OrtBackend(path) as backend:
        adapter = make_adapter("yolov8", backend.input_spec, num_classes=nc)
        adapter.max_det = 200  # below what NMS keeps: both sides must cut to the same best 200
        x, lb = adapter.preprocess(frames)
        want = adapter.postprocess(backend.infer(x), lb, 0.25, 0.5)
    grafted = graft_postprocess(
        onnx.load(path), adapter, score_threshold=0.25, iou_threshold=0.5, max_det=200, nms=nms
    )
    session = ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = _run(session, x)
    assert outputs["det_boxes"].shape == (3, 200, 4) and outputs["det_count"].shape == (3,)
    got = decode_grafted(outputs, lb)
    assert len({len(w) for w in want}) > 1 or not np.allclose(want[0].boxes, want[1].boxes)  # items differ
    for w, g in zip(want, got, strict=True):
        assert len(w) > 20 and len(g) == len(w)  # (200 where NMS kept more)
        w, g = _sorted(w), _sorted(g)
        np.testing.assert_array_equal(g.class_ids, w.class_ids)
        np.testing.assert_allclose(g.scores, w.scores, atol=1e-3)
        np.testing.assert_allclose(g.boxes, w.boxes, atol=1.0)


def test_fewer_anchors_than_max_det_still_gives_fixed_shapes(tmp_path: Path) -> None:
    """N = 40 anchors, max_det = 100: the matrix tail pads its outputs to K = 100; a blank head gives 0."""
    from test_yolo_decoders import _const_output_model

    from engines.runtimes.ort import OrtBackend
    from pipelines.models import make_adapter

    pred = np.zeros((1, 7, 40), np.float32)  # every score 0: nothing over the threshold
    path = _const_output_model(tmp_path / "z.onnx", pred)
    with OrtBackend(path) as backend:
        adapter = make_adapter("yolov8", backend.input_spec, num_classes=3)
        x, lb = adapter.preprocess([np.zeros((480, 640, 3), np.uint8)])
    grafted = graft_postprocess(
        onnx.load(path), adapter, score_threshold=0.25, iou_threshold=0.5, max_det=100
    )
    out = _run(ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"]), x)
    assert out["det_boxes"].shape == (1, 100, 4) and out["det_classes"].dtype == np.int32
    assert out["det_count"].tolist() == [0] and not out["det_scores"].any()
    assert len(decode_grafted(out, lb)[0]) == 0


def test_nanodet_fixed_batch_of_one_keeps_working(grafted: onnx.ModelProto) -> None:
    """The bundled NanoDet's input is fixed at batch 1: the grafted graph keeps it and outputs B = 1."""
    dims = [d.dim_value for d in grafted.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 416, 416]
    session = ort.InferenceSession(grafted.SerializeToString(), providers=["CPUExecutionProvider"])
    out = _run(session, np.zeros((1, 3, 416, 416), np.float32))
    assert out["det_count"].shape == (1,) and out["det_scores"].shape == (1, K)


def test_tensorrt_rtx_builds_the_default_graft(tmp_path: Path) -> None:
    """The matrix-NMS tail exists because TensorRT-RTX has no builder runner for NonMaxSuppression: a real
    (CPU, ahead-of-time) build of the grafted NanoDet must succeed and bind the fixed det_* outputs."""
    pytest.importorskip("tensorrt_rtx")
    from engines.build.builder import build
    from engines.fingerprint import probe_fingerprint
    from engines.settings import BuildSettings
    from engines.store import EngineStore
    from engines.trt import import_trt

    grafted = graft_nanodet(
        onnx.load(MODEL), NanoDetAdapter((416, 416), 80), score_threshold=SCORE, iou_threshold=IOU, max_det=K
    )
    path = tmp_path / "grafted.onnx"
    onnx.save(grafted, str(path))
    api = import_trt("tensorrt_rtx")
    result = build(
        EngineStore(tmp_path / "engines"),
        "graft",
        BuildSettings(onnx=path, precision="fp32"),
        api=api,
        fingerprint=probe_fingerprint(api),
        agent_version="test",
    )
    assert result.built and result.manifest is not None
    assert result.plan_path.stat().st_size > 0
    assert result.manifest.build.layers["total"] > 0
