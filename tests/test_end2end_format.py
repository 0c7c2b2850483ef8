"""Issue 35 item 14, serving: exports that end in their own NMS decode through the `end2end` format. Real ONNX
graphs (NonMaxSuppression + Gather to [N, 6] with N decided by the data; a padded [B, K, 6]; EfficientNMS's
four outputs) run on ONNX Runtime through the project's backend and the adapter, detections compared in
frame pixels; the TensorRT side through fake_tensorrt's data-dependent output (TensorRT cannot run here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fake_tensorrt
import numpy as np
import onnx
import pytest
from engine_fixtures import gpu_fp, store_engine
from fake_cudart import FakeCudart
from onnx import TensorProto, helper, numpy_helper

from engines.runtimes.ort import OrtBackend
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi
from pipelines.frames import Detections
from pipelines.models import ModelAdapter, check_outputs, formats, resolve_onnx
from pipelines.models.end2end import End2EndAdapter
from pipelines.models.graph import GraphBuilder

NET = 64
LABELS = ("cat", "dog")
WHITE = np.full((96, 128, 3), 255, np.uint8)  # letterboxed to 64x64: scale 0.5, 8 rows of padding on top
BLACK = np.zeros((NET, NET, 3), np.uint8)  # fills the input: no padding, every pixel 0
# Network-pixel boxes x1 y1 x2 y2 and class scores (2 classes x 4 boxes), as a detector's head would give.
BOXES = np.array([[4, 12, 20, 28], [5, 12, 21, 28], [30, 20, 60, 50], [40, 40, 50, 50]], np.float32)
SCORES = np.array([[0.9, 0.8, 0.0, 0.0], [0.0, 0.0, 0.7, 0.1]], np.float32)
# What survives: box 0 (box 1 suppressed by it, IoU 0.88), box 2; box 3's 0.1 is under the threshold 0.25.
# In frame pixels: (net - pad) / scale.
WANT_BOXES = np.array([[8, 8, 40, 40], [60, 24, 120, 84]], np.float32)
WANT_SCORES = np.array([0.9, 0.7], np.float32)
WANT_CLASSES = np.array([0, 1], np.int32)


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name + "_v"))


def _save(
    path: Path, nodes: list[onnx.NodeProto], batch: int | str, outputs: list[onnx.ValueInfoProto]
) -> Path:
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, NET, NET])
    model = helper.make_model(
        helper.make_graph(nodes, "end2end", [images], outputs),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _nms_onnx(path: Path) -> Path:
    """Head -> NonMaxSuppression -> Gather -> [N, 6]. The scores are SCORES x the image's brightest value,
    so the number of rows NMS keeps (its threshold 0.05) depends on the image: a real data-dependent N."""
    nodes = [
        helper.make_node("ReduceMax", ["images"], ["bright"], keepdims=0),
        _const("head_scores", SCORES[None]),
        helper.make_node("Mul", ["head_scores", "bright"], ["scores"]),  # (1, 2, 4)
        _const("boxes", BOXES[None]),
        _const("max_out", np.array([100], np.int64)),
        _const("iou", np.array([0.5], np.float32)),
        _const("min_score", np.array([0.05], np.float32)),
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "min_score"], ["sel"]),
        _const("one", np.array(1, np.int64)),
        _const("two", np.array(2, np.int64)),
        helper.make_node("Gather", ["sel", "one"], ["cls_idx"], axis=1),  # (N,)
        helper.make_node("Gather", ["sel", "two"], ["box_idx"], axis=1),
        _const("flat_boxes", BOXES),
        helper.make_node("Gather", ["flat_boxes", "box_idx"], ["det_xyxy"], axis=0),  # (N, 4)
        helper.make_node("GatherND", ["scores", "sel"], ["det_score"]),  # (N,)
        helper.make_node("Cast", ["cls_idx"], ["det_cls"], to=TensorProto.FLOAT),
        _const("axis1", np.array([1], np.int64)),
        helper.make_node("Unsqueeze", ["det_score", "axis1"], ["score_col"]),
        helper.make_node("Unsqueeze", ["det_cls", "axis1"], ["cls_col"]),
        helper.make_node("Concat", ["det_xyxy", "score_col", "cls_col"], ["detections"], axis=1),
    ]
    out = helper.make_tensor_value_info("detections", TensorProto.FLOAT, ["N", 6])
    return _save(path, nodes, 1, [out])


# The padded layout (YOLOv10 / Ultralytics `nms=True`): K = 5 rows per image, after NMS, zero rows as padding.
PADDED = np.array(
    [
        [4, 12, 20, 28, 0.9, 0],
        [30, 20, 60, 50, 0.7, 1],
        [40, 40, 50, 50, 0.1, 1],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ],
    np.float32,
)


def _padded_onnx(path: Path) -> Path:
    """[B, 5, 6]: PADDED with each image's scores x its brightest value (a black image: no detections)."""
    nodes = [
        helper.make_node("ReduceMax", ["images"], ["bright"], axes=[1, 2, 3], keepdims=1),  # (B, 1, 1, 1)
        _const("shape", np.array([-1, 1, 1], np.int64)),
        helper.make_node("Reshape", ["bright", "shape"], ["b"]),  # (B, 1, 1)
        _const("zero", np.float32(0)),
        helper.make_node("Mul", ["b", "zero"], ["nothing"]),
        _const("xyxy", PADDED[None, :, :4]),
        helper.make_node("Add", ["xyxy", "nothing"], ["xyxy_b"]),
        _const("score", PADDED[None, :, 4:5]),
        helper.make_node("Mul", ["score", "b"], ["score_b"]),
        _const("cls", PADDED[None, :, 5:6]),
        helper.make_node("Add", ["cls", "nothing"], ["cls_b"]),
        helper.make_node("Concat", ["xyxy_b", "score_b", "cls_b"], ["output0"], axis=2),
    ]
    out = helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 5, 6])
    return _save(path, nodes, "batch", [out])


def _efficient_nms_onnx(path: Path) -> Path:
    """EfficientNMS_TRT's outputs with fixed K = 4: num_dets [1, 1] = 2, then two padding rows that a
    decoder reading past num_dets would take (score 0.95)."""
    boxes = np.array([[4, 12, 20, 28], [30, 20, 60, 50], [1, 1, 9, 9], [2, 2, 9, 9]], np.float32)[None]
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        _const("zero", np.float32(0)),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
        _const("boxes", boxes),
        helper.make_node("Add", ["boxes", "nothing"], ["det_boxes"]),
        _const("scores", np.array([[0.9, 0.7, 0.95, 0.95]], np.float32)),
        helper.make_node("Add", ["scores", "nothing"], ["det_scores"]),
        _const("det_classes", np.array([[0, 1, 0, 1]], np.int32)),
        _const("num_dets", np.array([[2]], np.int32)),
    ]
    outs = [
        helper.make_tensor_value_info("num_dets", TensorProto.INT32, [1, 1]),
        helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, [1, 4, 4]),
        helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, [1, 4]),
        helper.make_tensor_value_info("det_classes", TensorProto.INT32, [1, 4]),
    ]
    return _save(path, nodes, 1, outs)


def _serve(path: Path, frames: list[np.ndarray]) -> tuple[dict[str, np.ndarray], list[Detections]]:
    """Resolve as the agent does, check the outputs as the daemon does, then one batch through the adapter."""
    adapter = resolve_onnx("m", path, "end2end", LABELS).adapter()
    assert isinstance(adapter, End2EndAdapter) and not adapter.grafted
    with OrtBackend(path) as backend:
        check_outputs("end2end", adapter, backend.infer(adapter.preprocess([BLACK])[0]))
        batch, letterboxes = adapter.preprocess(frames)
        outputs = backend.infer(batch)
    return outputs, adapter.postprocess(outputs, letterboxes, score_threshold=0.25, iou_threshold=0.5)


def _assert_dets(dets: Detections, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray) -> None:
    order = np.argsort(-dets.scores, kind="stable")
    np.testing.assert_allclose(dets.boxes[order], boxes, atol=1e-4)
    np.testing.assert_allclose(dets.scores[order], scores, atol=1e-6)
    np.testing.assert_array_equal(dets.class_ids[order], classes)
    assert dets.boxes.dtype == np.float32 and dets.class_ids.dtype == np.int32


def test_end2end_is_a_registered_format() -> None:
    assert "end2end" in formats()


def test_an_nms_terminated_onnx_with_data_dependent_rows_serves_on_onnx_runtime(tmp_path: Path) -> None:
    path = _nms_onnx(tmp_path / "nms.onnx")
    with OrtBackend(path) as backend:
        assert [s.shape for s in backend.output_specs] == [(None, 6)]
    outputs, (dets,) = _serve(path, [WHITE])
    assert outputs["detections"].shape == (3, 6)  # NMS kept boxes 0, 2 and 3
    _assert_dets(dets, WANT_BOXES, WANT_SCORES, WANT_CLASSES)
    # A darker image: the model keeps fewer rows (box 3 falls under its own threshold), scaled scores.
    dim = np.full((NET, NET, 3), 100, np.uint8)
    outputs, (dets,) = _serve(path, [dim])
    assert outputs["detections"].shape == (2, 6)
    assert len(dets) == 2 and np.allclose(np.sort(dets.scores), np.array([0.7, 0.9]) * 100 / 255, atol=1e-5)
    # A black image: NMS keeps nothing, an empty [0, 6] output.
    outputs, (dets,) = _serve(path, [BLACK])
    assert outputs["detections"].shape == (0, 6) and len(dets) == 0


def test_an_n_by_6_output_refuses_a_batch_it_cannot_split(tmp_path: Path) -> None:
    adapter = resolve_onnx("m", _nms_onnx(tmp_path / "nms.onnx"), "end2end", LABELS).adapter()
    rows = np.array([[4, 12, 20, 28, 0.9, 0]], np.float32)
    _, letterboxes = adapter.preprocess([WHITE, WHITE])
    with pytest.raises(ValueError, match=r"output 'detections' \[1, 6\] holds one image's .* batch max 1"):
        adapter.postprocess({"detections": rows}, letterboxes, 0.25)


def test_a_padded_batch_output_serves_each_image_its_own_rows(tmp_path: Path) -> None:
    outputs, (white, black) = _serve(_padded_onnx(tmp_path / "padded.onnx"), [WHITE, BLACK])
    assert outputs["output0"].shape == (2, 5, 6)
    _assert_dets(white, WANT_BOXES, WANT_SCORES, WANT_CLASSES)
    assert len(black) == 0  # its rows scored 0: below the threshold, like the padding rows


def test_efficient_nms_outputs_serve_and_rows_past_num_dets_are_padding(tmp_path: Path) -> None:
    outputs, (dets,) = _serve(_efficient_nms_onnx(tmp_path / "enms.onnx"), [WHITE])
    assert sorted(outputs) == ["det_boxes", "det_classes", "det_scores", "num_dets"]
    _assert_dets(dets, WANT_BOXES, WANT_SCORES, WANT_CLASSES)


def _adapter() -> ModelAdapter:
    return End2EndAdapter((NET, NET), len(LABELS))


@pytest.mark.parametrize(
    ("outputs", "refusal"),
    [
        # A YOLOv8 export (2 classes: [1, 4 + 2, 8400]) declared end2end.
        ({"output0": np.zeros((1, 6, 8400), np.float32)}, r"output 'output0' has shape \[1, 6, 8400\]"),
        ({"dets": np.zeros((300, 7), np.float32)}, r"output 'dets' has shape \[300, 7\]; expected \[B, N, 6"),
        ({"a": np.zeros((1, 300, 6)), "b": np.zeros((1, 300))}, r"outputs .* are neither one \[B, N, 6\]"),
        (
            {
                "num_dets": np.zeros((1, 1), np.int32),
                "det_boxes": np.zeros((1, 100, 5), np.float32),
                "det_scores": np.zeros((1, 100), np.float32),
                "det_classes": np.zeros((1, 100), np.int32),
            },
            r"output 'det_boxes' has shape \[1, 100, 5\]; expected \[B, K, 4\]",
        ),
        (
            {
                "num_dets": np.zeros((1, 1), np.int32),
                "det_boxes": np.zeros((1, 100, 4), np.float32),
                "det_scores": np.zeros((1, 100), np.float32),
                "det_classes": np.zeros((1, 50), np.int32),
            },
            r"output 'det_classes' has shape \[1, 50\]; expected \[1, 100\]",
        ),
        (
            {
                "num_dets": np.zeros((2, 2), np.int32),
                "det_boxes": np.zeros((1, 100, 4), np.float32),
                "det_scores": np.zeros((1, 100), np.float32),
                "det_classes": np.zeros((1, 100), np.int32),
            },
            r"output 'num_dets' has shape \[2, 2\]; expected \[1, 1\]",
        ),
    ],
)
def test_wrong_layouts_are_refused_naming_the_output(outputs: dict[str, np.ndarray], refusal: str) -> None:
    with pytest.raises(ValueError, match=r"are not end2end outputs: end2end: " + refusal):
        check_outputs("end2end", _adapter(), outputs)


def test_no_nms_on_top_of_the_models_own() -> None:
    """Two same-class boxes at IoU 0.6 that the model's NMS kept (its threshold 0.7) both stay, whatever the
    agent's iou_threshold."""
    adapter = _adapter()
    _, letterboxes = adapter.preprocess([BLACK])
    rows = np.array([[[0, 0, 40, 40, 0.9, 0], [0, 10, 40, 50, 0.8, 0]]], np.float32)  # IoU 1200 / 2000
    (dets,) = adapter.postprocess({"output0": rows}, letterboxes, 0.25, iou_threshold=0.5)
    np.testing.assert_allclose(dets.boxes, rows[0, :, :4])
    np.testing.assert_allclose(dets.scores, [0.9, 0.8])


def test_a_class_id_beyond_the_labels_is_refused_naming_the_output() -> None:
    adapter = _adapter()
    _, letterboxes = adapter.preprocess([WHITE])
    rows = np.array([[4, 12, 20, 28, 0.9, 7]], np.float32)
    with pytest.raises(ValueError, match=r"output 'out' has class id 7 .* outside the 2 labels"):
        adapter.postprocess({"out": rows}, letterboxes, 0.25)
    rows[0, 4] = 0.1  # under the threshold: not a detection, its class is not looked at
    assert len(adapter.postprocess({"out": rows}, letterboxes, 0.25)[0]) == 0


def test_an_end2end_model_is_not_grafted_again() -> None:
    with pytest.raises(ValueError, match=r"ends in its own NMS; serve it with postprocess: host"):
        _adapter().graph_heads(GraphBuilder(onnx.GraphProto()), {"output0": (1, 300, 6)})


# --- TensorRT: the [N, 6] output handed out through the IOutputAllocator, decoded by the adapter ----------
def test_an_nms_terminated_tensorrt_engine_serves_through_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: rt)
    mod: Any = fake_tensorrt.make("10.3.0")  # the fake engine's knobs are set below
    mod.ENGINE_IO = [mod.ENGINE_IO[0], ("detections", 2, (-1, 6), 0, None)]  # 416x416 input, [N, 6] out
    mod._ENGINE_DDS = {"detections": 3}  # the fake writes row i as 6i .. 6i + 5
    api = TrtApi(mod)
    fp = gpu_fp(api)
    store = EngineStore(tmp_path / "engines")
    onnx_path = Path(__file__).resolve().parent.parent / "agent" / "assets" / "nanodet-m-416.onnx"
    m = store_engine(store, "det", BuildSettings(onnx=onnx_path, contexts=1, precision="fp16"), fp)
    assert m.key is not None
    backend = TensorRTBackend(store, "det", m.key, api=api, fingerprint=fp, contexts=1)
    backend.load()
    try:
        assert [s.shape for s in backend.output_specs] == [(None, 6)]
        adapter = End2EndAdapter((416, 416), 30)  # class ids 5, 11, 17 of the fake's rows
        frame = np.zeros((832, 832, 3), np.uint8)  # scale 0.5, no padding: frame = 2 x network pixels
        batch, letterboxes = adapter.preprocess([frame])
        outputs = backend.infer(batch)
        check_outputs("end2end", adapter, outputs)
        # The fake's scores are 4, 10, 16: the threshold drops the first row.
        (dets,) = adapter.postprocess(outputs, letterboxes, score_threshold=5.0)
        np.testing.assert_allclose(dets.boxes, [[12, 14, 16, 18], [24, 26, 28, 30]])
        np.testing.assert_array_equal(dets.scores, [10, 16])
        np.testing.assert_array_equal(dets.class_ids, [11, 17])
        mod._ENGINE_DDS["detections"] = 0  # nothing detected: a [0, 6] output
        outputs = backend.infer(batch)
        assert outputs["detections"].shape == (0, 6)
        assert len(adapter.postprocess(outputs, letterboxes, score_threshold=0.25)[0]) == 0
        # Fewer labels than the engine's classes: told, naming the output.
        with pytest.raises(ValueError, match=r"output 'detections' has class id 11 .* outside the 10 labels"):
            mod._ENGINE_DDS["detections"] = 2
            End2EndAdapter((416, 416), 10).postprocess(backend.infer(batch), letterboxes, score_threshold=5.0)
    finally:
        backend.close()
    assert rt.live == 0
