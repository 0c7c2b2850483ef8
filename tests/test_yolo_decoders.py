"""YOLOv8 / YOLOv5 decoding end to end: tiny ONNX models with a known output, run through ORT."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.runtimes.base import TensorSpec
from engines.runtimes.ort import OrtBackend
from pipelines.frames import Detections
from pipelines.models import NanoDetAdapter, YoloV5Adapter, YoloV8Adapter, make_adapter
from pipelines.postprocess import filter_detections, load_labels, nms

NET = 320  # network input side
LABELS = ["cat", "car", "tree"]


def _const_output_model(path: Path, pred: np.ndarray) -> Path:
    """A model whose output is `pred` + 0 * mean(image): input-dependent, so ORT really runs a graph."""
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, NET, NET])
    out = helper.make_tensor_value_info("output0", TensorProto.FLOAT, list(pred.shape))
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.float32(0.0), "zero_v")),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
        helper.make_node("Constant", [], ["pred"], value=numpy_helper.from_array(pred, "pred_v")),
        helper.make_node("Add", ["pred", "nothing"], ["output0"]),
    ]
    graph = helper.make_graph(nodes, "const_head", [images], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# Network-space boxes (cx, cy, w, h) and their intended fate; class scores per row over LABELS.
#   A  cat  0.90  kept
#   B  cat  0.80  IoU 0.82 with A -> suppressed by A (same class)
#   C  car  0.70  same box as A -> kept (other class)
#   D  tree 0.20  below threshold -> dropped
#   E  tree 0.60  runs past the bottom-right of the content -> kept, clipped to the source image
BOXES = np.array(
    [
        [100, 100, 40, 40],
        [104, 100, 40, 40],
        [100, 100, 40, 40],
        [200, 150, 30, 30],
        [300, 260, 80, 40],
    ],
    np.float32,
)
CLASS_SCORES = np.array(
    [
        [0.90, 0.05, 0.01],
        [0.80, 0.30, 0.01],
        [0.10, 0.70, 0.01],
        [0.05, 0.02, 0.20],
        [0.01, 0.02, 0.60],
    ],
    np.float32,
)


@pytest.fixture()
def labels(tmp_path: Path) -> list[str]:
    path = tmp_path / "labels.txt"
    path.write_text("\n".join(LABELS) + "\n\n")  # trailing blank line is ignored
    return load_labels(path)


def _run(tmp_path: Path, adapter_fmt: str, pred: np.ndarray, images: list[np.ndarray]) -> list[Detections]:
    with OrtBackend(_const_output_model(tmp_path / f"{adapter_fmt}.onnx", pred)) as backend:
        adapter = make_adapter(adapter_fmt, backend.input_spec, num_classes=len(LABELS))
        batch, lbs = adapter.preprocess(images)
        assert batch.shape == (len(images), 3, NET, NET)
        return adapter.postprocess(backend.infer(batch), lbs, score_threshold=0.25, iou_threshold=0.5)


def test_yolov8_decode_nms_and_unletterbox(tmp_path: Path, labels: list[str]) -> None:
    # [1, 4 + nc, N]: channels first, as Ultralytics exports it.
    pred = np.concatenate([BOXES, CLASS_SCORES], axis=1).T[None].copy()
    assert pred.shape == (1, 7, 5)
    # Landscape 640x480 source: scale 0.5, content 320x240, 40 px bars top and bottom.
    landscape = np.zeros((480, 640, 3), np.uint8)
    # Portrait 480x640 source: scale 0.5, content 240x320, 40 px bars left and right.
    portrait = np.zeros((640, 480, 3), np.uint8)
    land, port = _run(tmp_path, "yolov8", pred, [landscape, portrait])

    assert [labels[c] for c in land.class_ids] == ["cat", "car", "tree"]
    np.testing.assert_allclose(land.scores, [0.9, 0.7, 0.6], rtol=1e-6)
    # net x1y1x2y2 -> source: x = (x - 0) / 0.5, y = (y - 40) / 0.5, clipped to 640x480.
    np.testing.assert_allclose(
        land.boxes,
        [[160, 80, 240, 160], [160, 80, 240, 160], [520, 400, 640, 480]],
        atol=1e-3,
    )
    assert land.boxes.dtype == np.float32 and land.class_ids.dtype == np.int32

    # Same network output, other letterbox: x = (x - 40) / 0.5, y = y / 0.5, clipped to 480x640.
    assert [labels[c] for c in port.class_ids] == ["cat", "car", "tree"]
    np.testing.assert_allclose(
        port.boxes,
        [[80, 160, 160, 240], [80, 160, 160, 240], [440, 480, 480, 560]],
        atol=1e-3,
    )


def test_yolov8_transposed_export_is_accepted(tmp_path: Path) -> None:
    pred = np.concatenate([BOXES, CLASS_SCORES], axis=1)[None].copy()  # [1, N, 4 + nc]
    (dets,) = _run(tmp_path, "yolo11", pred, [np.zeros((480, 640, 3), np.uint8)])
    np.testing.assert_array_equal(dets.class_ids, [0, 1, 2])


def test_yolov5_decode_uses_objectness_times_class(tmp_path: Path, labels: list[str]) -> None:
    objectness = np.array([0.9, 0.9, 1.0, 0.9, 0.8], np.float32)[:, None]
    cls = CLASS_SCORES.copy()
    cls[0] = [1.0, 0.0, 0.0]  # A: 0.9 * 1.0 = 0.9 cat
    cls[1] = [0.8, 0.1, 0.0]  # B: 0.72 cat, overlaps A -> suppressed
    cls[2] = [0.1, 0.7, 0.0]  # C: 0.7 car, same box as A -> kept
    cls[3] = [0.0, 0.0, 0.25]  # D: 0.9 * 0.25 = 0.225 < 0.25 although objectness is high -> dropped
    cls[4] = [0.0, 0.0, 0.75]  # E: 0.8 * 0.75 = 0.6 tree
    pred = np.concatenate([BOXES, objectness, cls], axis=1)[None].copy()
    assert pred.shape == (1, 5, 8)
    (dets,) = _run(tmp_path, "yolov5", pred, [np.zeros((480, 640, 3), np.uint8)])

    assert [labels[c] for c in dets.class_ids] == ["cat", "car", "tree"]
    np.testing.assert_allclose(dets.scores, [0.9, 0.7, 0.6], rtol=1e-6)
    np.testing.assert_allclose(
        dets.boxes,
        [[160, 80, 240, 160], [160, 80, 240, 160], [520, 400, 640, 480]],
        atol=1e-3,
    )


def test_nothing_above_threshold_gives_empty_detections(tmp_path: Path) -> None:
    pred = np.concatenate([BOXES, CLASS_SCORES * 0.1], axis=1).T[None].copy()
    (dets,) = _run(tmp_path, "yolov8", pred, [np.zeros((480, 640, 3), np.uint8)])
    assert len(dets) == 0 and dets.boxes.shape == (0, 4)


def test_yolo_preprocess_is_rgb_over_255() -> None:
    adapter = make_adapter("yolov8", TensorSpec("images", (1, 3, 64, 64), np.dtype(np.float32)), 3)
    image = np.zeros((64, 64, 3), np.uint8)
    image[..., 0] = 255  # blue in BGR
    batch, _ = adapter.preprocess([image])
    np.testing.assert_allclose(batch[0, :, 10, 10], [0.0, 0.0, 1.0])


def test_wrong_num_classes_is_a_clear_error(tmp_path: Path) -> None:
    pred = np.concatenate([BOXES, CLASS_SCORES], axis=1).T[None].copy()
    with OrtBackend(_const_output_model(tmp_path / "m.onnx", pred)) as backend:
        adapter = make_adapter("yolov8", backend.input_spec, num_classes=80)
        batch, lbs = adapter.preprocess([np.zeros((320, 320, 3), np.uint8)])
        with pytest.raises(ValueError, match=r"yolov8: no output has a dim of 84"):
            adapter.postprocess(backend.infer(batch), lbs, 0.25)


def test_make_adapter_formats_and_sizes() -> None:
    dynamic = TensorSpec("images", (None, 3, None, None), np.dtype(np.float32))
    assert make_adapter("yolov8", dynamic, 80).input_hw == (640, 640)
    assert isinstance(make_adapter("yolo11", dynamic, 80), YoloV8Adapter)
    assert isinstance(make_adapter("yolov5", dynamic, 80), YoloV5Adapter)
    fixed = TensorSpec("input_1:0", (1, 3, 416, 320), np.dtype(np.float32))
    nano = make_adapter("nanodet", fixed, 80)
    assert isinstance(nano, NanoDetAdapter) and nano.input_hw == (416, 320) and nano.num_classes == 80
    with pytest.raises(ValueError, match=r"'ssd'.*nanodet.*yolov5.*yolov8"):
        make_adapter("ssd", fixed, 80)


def test_nms_handles_empty_and_is_class_aware() -> None:
    empty = nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32), 0.5)
    assert empty.shape == (0,) and empty.dtype == np.int64
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [0, 0, 10, 10], [50, 50, 60, 60]], np.float32)
    scores = np.array([0.6, 0.9, 0.8, 0.1], np.float32)
    keep = nms(boxes, scores, np.array([0, 0, 1, 0], np.int32), iou_threshold=0.5)
    np.testing.assert_array_equal(keep, [1, 2, 3])  # box 0 loses to box 1 (same class, IoU 0.82)
    np.testing.assert_array_equal(nms(boxes, scores, np.zeros(4, np.int32), 0.5, max_det=1), [1])


def test_filter_detections_by_score_and_class() -> None:
    dets = Detections(
        np.arange(16, dtype=np.float32).reshape(4, 4),
        np.array([0.9, 0.4, 0.8, 0.7], np.float32),
        np.array([0, 1, 2, 7], np.int32),  # 7 is outside the 3-class mask
    )
    mask = np.array([True, True, False])
    kept = filter_detections(dets, mask, min_score=0.5)
    np.testing.assert_array_equal(kept.class_ids, [0])
    np.testing.assert_array_equal(kept.boxes, dets.boxes[:1])
    np.testing.assert_array_equal(filter_detections(dets, None, 0.75).class_ids, [0, 2])


def test_load_labels_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.names"):
        load_labels(tmp_path / "missing.names")
    blank = tmp_path / "blank.names"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"blank\.names"):
        load_labels(blank)


def test_nms_keeps_classes_apart_at_negative_coordinates_and_cuts_after_suppression() -> None:
    # Two classes, boxes poking out left of the input: OpenCV's batched NMS offsets classes by the max
    # coordinate, which let a class-1 box at negative x land on class-0 boxes (found against the grafted
    # graph's per-class NMS).
    boxes = np.array([[-30, 0, 10, 40], [300, 0, 340, 40], [-30, 0, 10, 40]], np.float32)
    keep = nms(boxes, np.array([0.9, 0.8, 0.7], np.float32), np.array([1, 0, 0], np.int32), 0.5)
    assert sorted(keep.tolist()) == [0, 1, 2]
    # 10 identical boxes (one survives) + 5 separate ones, max_det 3: NMS first, then the best 3.
    same = np.tile(np.array([[0, 0, 10, 10]], np.float32), (10, 1))
    apart = np.array([[100 * i, 100, 100 * i + 10, 110] for i in range(1, 6)], np.float32)
    scores = np.concatenate([np.linspace(0.99, 0.9, 10), np.linspace(0.8, 0.7, 5)]).astype(np.float32)
    keep = nms(np.concatenate([same, apart]), scores, np.zeros(15, np.int32), 0.5, max_det=3)
    assert keep.tolist() == [0, 10, 11]
