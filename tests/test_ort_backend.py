"""OrtBackend against real ONNX Runtime: loading errors, specs, fixed- and dynamic-batch inference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engines.runtimes.base import BackendError
from engines.runtimes.ort import OrtBackend

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
NANODET = ASSETS / "nanodet-m-416.onnx"


@pytest.fixture(scope="module")
def nanodet() -> Iterator[OrtBackend]:
    backend = OrtBackend(NANODET)
    backend.load()
    yield backend
    backend.close()


def _double_model(path: Path, batch: int | str = "batch") -> Path:
    """y = 2 * x, symbolic batch dim by default: a model small enough to build inline."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3, 4, 4])
    two = helper.make_node(
        "Constant", [], ["two"], value=helper.make_tensor("t", TensorProto.FLOAT, [], [2.0])
    )
    mul = helper.make_node("Mul", ["x", "two"], ["y"])
    graph = helper.make_graph([two, mul], "double", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.onnx"
    backend = OrtBackend(path)
    with pytest.raises(BackendError, match=r"nope\.onnx.*no such file"):
        backend.load()
    assert not backend.loaded


def test_truncated_file_names_path_and_reason(tmp_path: Path) -> None:
    path = tmp_path / "truncated.onnx"
    path.write_bytes(NANODET.read_bytes()[:4096])
    with pytest.raises(BackendError) as info:
        OrtBackend(path).load()
    msg = str(info.value)
    assert str(path) in msg
    # The ORT reason travels with it (protobuf parse failure), not just "failed".
    assert "protobuf" in msg.lower() or "parse" in msg.lower(), msg


def test_unavailable_provider_is_an_error() -> None:
    with pytest.raises(BackendError, match="NoSuchExecutionProvider"):
        OrtBackend(NANODET, providers=["NoSuchExecutionProvider"]).load()


def test_infer_before_load() -> None:
    backend = OrtBackend(NANODET)
    with pytest.raises(BackendError, match="before load"):
        backend.infer(np.zeros((1, 3, 416, 416), np.float32))
    with pytest.raises(BackendError, match="load"):
        _ = backend.input_spec


def test_nanodet_specs(nanodet: OrtBackend) -> None:
    spec = nanodet.input_spec
    assert spec.name == "input_1:0"
    assert spec.shape == (1, 3, 416, 416)
    assert spec.dtype == np.float32
    shapes = {o.name: o.shape for o in nanodet.output_specs}
    assert shapes["Identity:0"] == (1, 2704, 80)
    assert shapes["Identity_3:0"] == (1, 2704, 44)
    assert shapes["Identity_2:0"] == (1, 169, 80)
    assert len(shapes) == 6
    assert nanodet.max_batch >= 8  # fixed batch 1 is still batchable (chunked)


def test_fixed_batch_model_takes_batch_of_three(nanodet: OrtBackend) -> None:
    rng = np.random.default_rng(1)
    batch = rng.normal(size=(3, 3, 416, 416)).astype(np.float32)
    out = nanodet.infer(batch)
    assert set(out) == {o.name for o in nanodet.output_specs}
    for name, value in out.items():
        assert value.shape[0] == 3, name
    # Each item equals its own single run, and the items really differ (not one result repeated).
    for i in range(3):
        single = nanodet.infer(batch[i : i + 1])
        for name, value in single.items():
            np.testing.assert_allclose(out[name][i : i + 1], value, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out["Identity:0"][0], out["Identity:0"][1])


def test_wrong_input_shape_names_tensor(nanodet: OrtBackend) -> None:
    with pytest.raises(BackendError, match=r"input_1:0"):
        nanodet.infer(np.zeros((1, 3, 320, 320), np.float32))


def test_dynamic_batch_model(tmp_path: Path) -> None:
    with OrtBackend(_double_model(tmp_path / "double.onnx"), intra_threads=1, inter_threads=1) as backend:
        assert backend.input_spec.shape == (None, 3, 4, 4)
        assert backend.output_specs[0].shape == (None, 3, 4, 4)
        x = np.arange(5 * 3 * 4 * 4, dtype=np.float32).reshape(5, 3, 4, 4)
        out = backend.infer(x)
        assert list(out) == ["y"]
        np.testing.assert_array_equal(out["y"], 2 * x)
        # float64 input is converted to the model's float32, not rejected by ORT.
        np.testing.assert_array_equal(backend.infer(x.astype(np.float64))["y"], 2 * x)
    assert not backend.loaded


def test_fixed_batch_two_model_pads_last_chunk(tmp_path: Path) -> None:
    with OrtBackend(_double_model(tmp_path / "double2.onnx", batch=2)) as backend:
        assert backend.input_spec.shape == (2, 3, 4, 4)
        x = np.arange(5 * 3 * 4 * 4, dtype=np.float32).reshape(5, 3, 4, 4)
        out = backend.infer(x)  # chunks of 2, 2 and 1 (+1 zero item, trimmed)
        assert out["y"].shape == (5, 3, 4, 4)
        np.testing.assert_array_equal(out["y"], 2 * x)


def test_fp16_precision_rejected() -> None:
    with pytest.raises(BackendError, match="precision"):
        OrtBackend(NANODET, precision="fp16")
