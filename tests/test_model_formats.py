"""A new model format is one adapter and one registry line: a toy format registered here goes through the
same resolution as the real ones (config -> ModelSpec -> adapter -> decode), host and grafted, with nothing
else changed. Also: the grafted ONNX's record of its postprocess; the config's and the CLI's choices are the
registry's, and the docs point to it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.config import ConfigError, ModelConfig
from agent.lifecycle.model import resolve_spec
from engines.runtimes.ort import OrtBackend
from pipelines.frames import Detections
from pipelines.models import FORMATS, GraftParams, ModelAdapter, formats, resolve_onnx
from pipelines.models.base import Candidates
from pipelines.models.graph import GraphBuilder, GraphHeads

NET = 64
LABELS = ("cat", "dog")
# Toy layout: one output (1, N, 4 + C), boxes x1 y1 x2 y2 in network pixels, then class scores.
PRED = np.array(
    [
        [
            [4, 4, 20, 20, 0.9, 0.1],
            [5, 4, 21, 20, 0.8, 0.2],
            [4, 4, 20, 20, 0.3, 0.7],
            [30, 30, 60, 50, 0.1, 0.6],
        ],
    ],
    np.float32,
)


class ToyAdapter(ModelAdapter):
    """The whole of a format: normalisation, host decoding, and the same decoding written into a graph."""

    scale = 1.0 / 255.0
    swap_rb = True

    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        (pred,) = outputs.values()
        best = pred[:, :, 4:].max(axis=2)
        b, a = np.nonzero(best >= score_threshold)
        rows = pred[b, a]
        ids = rows[:, 4:].argmax(axis=1).astype(np.int32)
        return self._split_by_image(b, rows[:, :4].copy(), best[b, a], ids, batch)

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        ((name, shape),) = shapes.items()

        def cols(lo: int, hi: int) -> str:
            ends = [g.const(np.array([v], np.int64), "c") for v in (lo, hi, 2)]
            return g.op("Slice", [name, *ends])

        return GraphHeads(cols(0, 4), cols(4, 4 + self.num_classes), shape[1])


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FORMATS, "toy", ToyAdapter)  # the one registry line


def _toy_onnx(path: Path) -> Path:
    """PRED + 0 * mean(image): input-dependent, so ONNX Runtime really runs the graph."""
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, NET, NET])
    out = helper.make_tensor_value_info("toy_out", TensorProto.FLOAT, list(PRED.shape))
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.float32(0.0), "z")),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
        helper.make_node("Constant", [], ["pred"], value=numpy_helper.from_array(PRED, "p")),
        helper.make_node("Add", ["pred", "nothing"], ["toy_out"]),
    ]
    graph = helper.make_graph(nodes, "toy", [images], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _config(tmp_path: Path, **fields: object) -> ModelConfig:
    labels = tmp_path / "toy.names"
    labels.write_text("\n".join(LABELS) + "\n")
    # model_construct: the schema's `format` choices were fixed when agent.config was imported, before
    # this test registered its format; everything after the schema is what this test is about.
    return ModelConfig.model_construct(
        onnx=_toy_onnx(tmp_path / "toy.onnx"), format="toy", labels=labels, **fields
    )


def _detect(onnx_path: Path, adapter: ModelAdapter) -> Detections:
    with OrtBackend(str(onnx_path)) as backend:
        batch, boxes = adapter.preprocess([np.zeros((NET, NET, 3), np.uint8)])
        return adapter.postprocess(backend.infer(batch), boxes, score_threshold=0.25, iou_threshold=0.5)[0]


def test_a_registered_format_is_resolved_and_decoded_on_the_host(toy: None, tmp_path: Path) -> None:
    assert "toy" in formats()
    spec = resolve_spec("m", _config(tmp_path))
    assert (spec.format, spec.labels, spec.postprocess, spec.graft) == ("toy", LABELS, "host", None)
    assert spec.input.shape == (1, 3, NET, NET) and spec.onnx == spec.source_onnx
    adapter = spec.adapter()
    assert isinstance(adapter, ToyAdapter) and not adapter.grafted
    dets = _detect(spec.onnx, adapter)
    # Row 1 is suppressed by row 0 (same class, IoU 0.8); row 2 is another class on the same box.
    np.testing.assert_array_equal(dets.class_ids, [0, 1, 1])
    np.testing.assert_allclose(dets.scores, [0.9, 0.7, 0.6])
    np.testing.assert_allclose(dets.boxes[0], [4, 4, 20, 20])


def test_a_registered_format_is_grafted_and_its_graph_decodes_the_same(toy: None, tmp_path: Path) -> None:
    mcfg = _config(tmp_path, postprocess="graph")
    host = resolve_spec("m", mcfg.model_copy(update={"postprocess": "host"}))
    spec = resolve_spec("m", mcfg, tmp_path / "engines")
    assert spec.postprocess == "graph" and spec.graft == GraftParams(0.25, 0.5, 300)
    assert spec.onnx.parent == tmp_path / "engines" / "m" / "graft" and spec.source_onnx == host.onnx
    adapter = spec.adapter()
    assert isinstance(adapter, ToyAdapter) and adapter.grafted
    want, got = _detect(host.onnx, host.adapter()), _detect(spec.onnx, adapter)
    np.testing.assert_array_equal(got.class_ids, want.class_ids)
    np.testing.assert_allclose(got.scores, want.scores)
    np.testing.assert_allclose(got.boxes, want.boxes)
    # The grafted ONNX says how it was made: read back with no config, it resolves to the same model.
    assert resolve_onnx("m", spec.onnx, "toy", LABELS) == spec
    # Served as the model (what the precision job's child reads): the same spec, nothing grafted twice.
    assert resolve_spec("m", mcfg.model_copy(update={"onnx": spec.onnx})) == spec


def test_a_grafted_onnx_that_disagrees_with_the_config_is_refused(toy: None, tmp_path: Path) -> None:
    mcfg = _config(tmp_path, postprocess="graph")
    grafted = resolve_spec("m", mcfg, tmp_path / "engines").onnx
    other = mcfg.model_copy(update={"onnx": grafted, "graph_score_threshold": 0.5})
    with pytest.raises(ConfigError, match=r"models.m.postprocess: graph: .* grafted with s0.25-i0.5-k300"):
        resolve_spec("m", other)
    (tmp_path / "three.names").write_text("a\nb\nc\n")
    more = mcfg.model_copy(update={"onnx": grafted, "labels": tmp_path / "three.names"})
    with pytest.raises(ConfigError, match=r"models.m.labels: 3 labels, but .* grafted for 2 classes"):
        resolve_spec("m", more)
    with pytest.raises(ConfigError, match=r"models.m.format: yolov8: .* grafted for toy outputs"):
        resolve_spec("m", mcfg.model_copy(update={"onnx": grafted, "format": "yolov8"}))


def test_the_config_choices_are_the_registry() -> None:
    assert set(get_args(ModelConfig.model_fields["format"].annotation)) == set(formats())


def test_a_registered_format_is_a_choice_of_every_format_flag(toy: None, tmp_path: Path) -> None:
    """`edge-agent build --format` and `bench --format` take the registry's names, read when the parser
    is built, and `build --calib` of images without --format names them."""
    import argparse

    from agent.bench.args import add_arguments
    from agent.cli.parser import build_parser
    from agent.lifecycle.standalone import UsageError, calibration_data

    args = build_parser().parse_args(["build", "--onnx", "m.onnx", "--format", "toy"])
    assert args.format == "toy"
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    assert bench.parse_args(["--format", "toy"]).format == "toy"
    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "a.jpg").write_bytes(b"not read before --format is checked")
    with pytest.raises(UsageError, match=rf"give --format \({re.escape(', '.join(formats()))}\)"):
        calibration_data(tmp_path / "calib", None, tmp_path / "m.onnx")


def test_the_docs_name_the_registry_instead_of_copying_its_list() -> None:
    """A new format is its adapter and its registry line: README, DESIGN and the example config point to the
    registry (and `edge-agent build --help`, whose choices are the registry's) rather than list names that
    would drift."""
    repo = Path(__file__).resolve().parent.parent
    names = "|".join(re.escape(f) for f in formats())
    copy = re.compile(rf"\b({names})\b`?\s*[|,]\s*`?\b({names})\b")
    for doc in ("README.md", "docs/DESIGN.md", "examples/agent.yaml"):
        text = (repo / doc).read_text()
        assert "format registry" in text, doc
        for n, line in enumerate(text.splitlines(), 1):
            assert not copy.search(line), f"{doc}:{n} restates the format registry: {line.strip()}"
