"""A deployed model checked before install (agent.deploy.verify): the bundled NanoDet passes; a garbage ONNX,
wrong outputs, wrong or broken labels are refused naming the artifact, never with a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import agent.deploy.verify as verify
from agent.deploy.errors import VerifyError
from agent.deploy.verify import verify_model

ASSETS = Path(__file__).resolve().parent.parent / "agent" / "assets"
NANODET, COCO = ASSETS / "nanodet-m-416.onnx", ASSETS / "coco.names"


def _labels(tmp_path: Path, n: int) -> Path:
    p = tmp_path / "labels.txt"
    p.write_text("".join(f"class{i}\n" for i in range(n)), encoding="utf-8")
    return p


def _const_model(tmp_path: Path, out_shape: tuple[int, ...], inputs: int = 1) -> Path:
    """An ONNX whose one output is a constant of `out_shape`, beside an image input [1, 3, 32, 32]."""
    value = numpy_helper.from_array(np.zeros(out_shape, np.float32), "value")
    node = helper.make_node("Identity", ["value"], ["out"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, 3, 32, 32]) for i in range(inputs)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(out_shape))],
        initializer=[value],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return path


def test_bundled_nanodet_passes() -> None:
    model = verify_model(NANODET, COCO, "nanodet", expect_classes=80)
    assert (model.format, model.input_hw, model.num_classes, model.postprocess) == (
        "nanodet",
        (416, 416),
        80,
        "host",
    )
    assert model.input_shape == (1, 3, 416, 416) and model.labels[0] == "person"
    assert len(model.outputs) == 6


def test_labels_with_the_wrong_count_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        VerifyError,
        match=r"has 79 labels, but nanodet-m-416\.onnx's outputs fit nanodet only with (\d+ or )?80 classes",
    ) as e:
        verify_model(NANODET, _labels(tmp_path, 79), "nanodet")
    assert e.value.field == "artifacts.labels"
    with pytest.raises(VerifyError, match="80 labels, 81 classes were expected") as e:
        verify_model(NANODET, COCO, "nanodet", expect_classes=81)
    assert e.value.field == "artifacts.labels"


def test_the_wrong_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match="are not yolov8 outputs"):  # field: labels or onnx, see verify
        verify_model(NANODET, COCO, "yolov8")
    with pytest.raises(VerifyError, match="unknown model format") as e:
        verify_model(NANODET, COCO, "detr")
    assert e.value.field == "format"


def test_wrong_outputs_are_refused(tmp_path: Path) -> None:
    path = _const_model(tmp_path, (1, 10))  # a classifier's logits, not detections
    with pytest.raises(VerifyError, match=r"onnx: .*model\.onnx: .*not nanodet outputs") as e:
        verify_model(path, _labels(tmp_path, 10), "nanodet")
    assert e.value.field == "artifacts.onnx"


def test_yolov8_outputs_with_other_class_count_blame_the_labels(tmp_path: Path) -> None:
    path = _const_model(tmp_path, (1, 4 + 3, 50))
    assert verify_model(path, _labels(tmp_path, 3), "yolov8").input_hw == (32, 32)
    with pytest.raises(
        VerifyError, match=r"has 2 labels, but model\.onnx's outputs fit yolov8 only with 3( or \d+)? classes"
    ) as e:
        verify_model(path, _labels(tmp_path, 2), "yolov8")
    assert e.value.field == "artifacts.labels"


def test_two_image_inputs_are_refused(tmp_path: Path) -> None:
    path = _const_model(tmp_path, (1, 7, 50), inputs=2)
    with pytest.raises(VerifyError, match="expected one image") as e:
        verify_model(path, _labels(tmp_path, 3), "yolov8")
    assert e.value.field == "artifacts.onnx"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 64,
        b"this is not a model at all\n" * 100,
        bytes(range(256)) * 64,
        # parses as a ModelProto, but no graph, no opset: onnx.checker refuses it
        onnx.ModelProto(producer_name="x").SerializeToString(),
    ],
    ids=["empty", "zeros", "text", "bytes", "no-graph"],
)
def test_garbage_onnx_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(VerifyError, match=r"onnx: .*model\.onnx is not a valid ONNX model") as e:
        verify_model(path, COCO, "nanodet")
    assert e.value.field == "artifacts.onnx" and "\n" not in e.value.reason


def test_a_huge_onnx_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    with open(path, "wb") as f:
        f.truncate(verify.MAX_ONNX_BYTES + 1)  # sparse: nothing is written, nothing must be read
    with pytest.raises(VerifyError, match="more than one ONNX file holds") as e:
        verify_model(path, COCO, "nanodet")
    assert e.value.field == "artifacts.onnx"


def test_external_weights_are_refused(tmp_path: Path) -> None:
    path = _const_model(tmp_path, (1, 7, 50))
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=0)
    with pytest.raises(VerifyError, match="external files"):
        verify_model(path, _labels(tmp_path, 3), "yolov8")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "has no labels"),
        (b"\n \n\t\n", "has no labels"),
        (b"person\n\x00\x01\x02car\n", r"line 2 holds a control character"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8|control character"),
        (b"caf\xe9\n", r"not UTF-8 text \(byte 3\)"),
        (b"person\n" * (1 << 18), "larger than 1048576 bytes"),
        (b"x" * 300 + b"\n", "label 1 is longer than 256"),
    ],
    ids=["empty", "blank", "binary", "png", "latin1", "huge", "long-label"],
)
def test_broken_labels_files_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "labels.txt"
    path.write_bytes(content)
    with pytest.raises(VerifyError, match=message) as e:
        verify_model(NANODET, path, "nanodet")
    assert e.value.field == "artifacts.labels" and "\n" not in e.value.reason


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match=r"labels: cannot read .*nope\.txt") as e:
        verify_model(NANODET, tmp_path / "nope.txt", "nanodet")
    assert e.value.field == "artifacts.labels"
    with pytest.raises(VerifyError, match=r"onnx: cannot read .*nope\.onnx") as e:
        verify_model(tmp_path / "nope.onnx", COCO, "nanodet")
    assert e.value.field == "artifacts.onnx"
