"""The FP32 island of the grafted NanoDet in the network TensorRT's parser really makes (issue 35, items 3
and 4). fake_tensorrt replays the TensorRT-RTX 1.7 parse recorded in tests/data/nanodet_grafted_layers.json
(tools/record_parsed_layers.py; test_recording_matches_the_parser re-parses where tensorrt_rtx is
installed), so the pinning and the INT8 layer selection run on the parser's own layer names: the Loop's
unnamed Recurrence/TripLimit/LoopOutput layers, ONNXTRT_Broadcast_*/ONNXTRT_ShapeShuffle_*, the island's
constants named after their initializers. Weakly typed TensorRT (<= 10) itself cannot run here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import fake_tensorrt
import numpy as np
import onnx
import pytest
from test_trt_review import fp_for

from engines.build import islands
from engines.build.builder import build
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import LayerInfo, TrtApi
from pipelines.models import GraftParams, ModelSpec
from pipelines.models.graft import graft_spec

ROOT = Path(__file__).resolve().parents[1]
NANODET = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"
RECORDED = fake_tensorrt.recorded_parse()
# The three head convolutions (NanoDet-m: one per stride, class scores and box distribution together).
HEAD_CONVS = {"Conv__176", "Conv__178", "Conv__180"}


@functools.lru_cache(maxsize=1)
def _grafted() -> bytes:
    from engines.runtimes.ort import OrtBackend

    backend = OrtBackend(str(NANODET))
    backend.load()
    input_spec = backend.input_spec
    backend.close()
    labels = tuple(f"class{i}" for i in range(80))
    spec = ModelSpec(NANODET.stem, "nanodet", labels, input_spec, NANODET, NANODET)
    return graft_spec(spec, GraftParams(0.35, 0.5, 100)).SerializeToString()


@pytest.fixture
def grafted(tmp_path: Path) -> Path:
    path = tmp_path / "grafted.onnx"
    path.write_bytes(_grafted())
    return path


def recorded_layers() -> list[LayerInfo]:
    return [
        LayerInfo(i, name, kind, tuple(ins), tuple(outs), tuple(dtypes))
        for i, (name, kind, ins, outs, dtypes, _) in enumerate(RECORDED["layers"])
    ]


def parser_island() -> set[str]:
    """The island as the parser sees it: the grafted parse's layers that the island-free parse lacks."""
    return {x[0] for x in RECORDED["layers"] if not x[5]}


def test_island_found_by_reachability_matches_the_parser(grafted: Path) -> None:
    rest_out = islands.rest_outputs(onnx.load(str(grafted)))
    assert rest_out == RECORDED["island_free_outputs"]  # TensorRT keeps the ONNX tensor names
    layers = recorded_layers()
    found = {layers[i].name for i in islands.island_layers(layers, rest_out)}
    assert found == parser_island()
    # What pinning by name missed (before): the parser's own layers, and the island's constants.
    by_name = {x.name for x in layers if islands.marked(x.name)}
    missed = found - by_name
    for name in (
        "(Unnamed Layer* 288) [Recurrence]",
        "(Unnamed Layer* 300) [LoopOutput]",
        "(Unnamed Layer* 281) [TripLimit]",
        "ONNXTRT_ShapeShuffle_45",
        "ONNXTRT_Broadcast_110",
        "graft/eps_69",
    ):
        assert name in missed
    # Without an island in the ONNX: by name only (nothing, for a plain detector).
    assert islands.island_layers(layers[:146], None) == set()


def test_weakly_typed_fp16_pins_every_island_layer_the_parser_made(grafted: Path, tmp_path: Path) -> None:
    mod = fake_tensorrt.make("10.3.0", parsed=RECORDED)
    api = TrtApi(mod)
    settings = BuildSettings(onnx=grafted, precision="fp16")
    build(EngineStore(tmp_path / "e"), "det", settings, api=api, fingerprint=fp_for(api), force=True)
    net = mod.last_network.layers
    pinned = {x.name for x in net if x.precision == mod.DataType.FLOAT}
    floats = {
        x.name
        for x in net
        if any(t is not None and t.dtype.name == "FLOAT" for t in [*x._inputs, *x._outputs])
    }
    assert pinned == parser_island() & floats
    eps = next(x for x in net if x.name == "ONNXTRT_Broadcast_110")  # 1e-9: 0 in FP16
    assert eps.precision == mod.DataType.FLOAT and eps.output_types == {0: mod.DataType.FLOAT}
    assert not [x.name for x in net if x.precision is not None and x.name not in parser_island()]


def test_int8_keeps_the_head_convolutions_and_never_constrains_the_island(
    grafted: Path, tmp_path: Path
) -> None:
    mod = fake_tensorrt.make("10.3.0", int8=True, parsed=RECORDED)
    api = TrtApi(mod)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, 3, 416, 416)).astype(np.float32) for _ in range(2)]
    settings = BuildSettings(
        onnx=grafted, precision="int8", calibration={"method": "entropy", "samples": 2}
    )
    result = build(
        EngineStore(tmp_path / "e"),
        "det",
        settings,
        api=api,
        fingerprint=fp_for(api),
        force=True,
        calibration_batches=data,
        device_allocator=fake_tensorrt.FakeAllocator(),
    )
    assert result.manifest.build.int8["calibrated_graph"] == "without_fp32_island"
    net = mod.last_network.layers
    kept = {x.name for x in net if x.precision == mod.DataType.HALF}
    assert kept >= HEAD_CONVS  # @head reached the head convolutions (before: it stopped in the graft)
    assert not kept & parser_island()  # before: two graft layers constrained to FP16 inside the island
    island_precisions = {x.precision for x in net if x.name in parser_island() and x.precision is not None}
    assert island_precisions == {mod.DataType.FLOAT}
    assert result.manifest.build.int8["kept_layers"] == len(kept)


def test_fake_parse_of_the_island_free_graph_is_the_recorded_one(grafted: Path) -> None:
    """The INT8 pre-pass parses the graph without its island: the fake gives the island-free parse,
    its outputs the tensors the island reads, two layers under the names that parse gave them."""
    mod = fake_tensorrt.make("10.3.0", parsed=RECORDED)
    parts = islands.split(onnx.load(str(grafted)))
    assert parts is not None
    net = mod.Builder(None).create_network(0)
    assert mod.OnnxParser(net, None).parse(parts[0].SerializeToString())
    assert [t.name for t in net.outputs] == RECORDED["island_free_outputs"]
    assert len(net.layers) == sum(x[5] for x in RECORDED["layers"])
    assert set(RECORDED["island_free_renames"].values()) <= {x.name for x in net.layers}


def test_recording_matches_the_parser() -> None:
    """The recorded data is what the installed TensorRT-RTX parser makes of the graft today."""
    pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from record_parsed_layers import record
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert record() == RECORDED
