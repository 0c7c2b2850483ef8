"""Per-layer profiling and engine inspection, on real components: ONNX Runtime's profiler on the bundled
NanoDet (FP32 and an INT8 Q/DQ copy made here), `edge-agent profile` end to end, the layer-precision
summary of real TensorRT-RTX builds (DETAILED profiling verbosity, CPU-only ahead-of-time) in the manifest
and in `check --json`. TensorRT execution (IProfiler, the inspector of a deserialised engine) cannot run
here: its logic runs with the real tensorrt_rtx IProfiler class and a stand-in backend."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from agent.cli import main
from engines.build.layer_info import (
    EngineLayer,
    check_summary,
    layers_from_build_log,
    layers_from_inspector,
    precision_of,
    summarize,
)
from engines.build.quantize import make_qdq_onnx
from engines.errors import ManifestError
from engines.manifest import manifest_from_dict
from engines.runtimes.base import TensorSpec
from engines.runtimes.profiling import SCHEMA, ProfileError, compare, parse_ort_trace, profile_onnx
from engines.settings import onnx_input_shapes
from pipelines.models import make_adapter

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
ITERATIONS = 3  # a 2-core machine: enough for a p50, no timing claims beyond "positive"

# ---- helpers and fixtures -------------------------------------------------------------------------


def clip_batches(n: int) -> list[np.ndarray]:
    """`n` preprocessed frames spread over the bundled clip."""
    name, dims = next(iter(onnx_input_shapes(MODEL).items()))
    adapter = make_adapter("nanodet", TensorSpec(name, dims, np.dtype(np.float32)), 80)
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    frames = []
    try:
        for i in range(n * 10):
            ok, img = cap.read()
            if not ok:
                break
            if i % 10 == 0:
                frames.append(adapter.preprocess([img])[0])
    finally:
        cap.release()
    assert len(frames) == n
    return frames


@pytest.fixture(scope="module")
def frame() -> np.ndarray:
    return clip_batches(1)[0]


@pytest.fixture(scope="module")
def fp32_run(frame):
    return profile_onnx(MODEL, frame, ITERATIONS)


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory, frame):
    qdq = tmp_path_factory.mktemp("qdq") / "int8.onnx"
    make_qdq_onnx(MODEL, qdq, iter(clip_batches(8)), "minmax")
    return profile_onnx(qdq, frame, ITERATIONS, precision="int8", source_onnx=MODEL)


def executed_graph(path: Path) -> onnx.ModelProto:
    """The graph ONNX Runtime runs after its default optimisations, saved independently of the profiler."""
    with tempfile.TemporaryDirectory() as work:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.optimized_model_filepath = str(Path(work) / "opt.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def write_config(tmp_path: Path, backend: str = "onnxruntime", precision: str = "fp32") -> Path:
    data = {
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "det": {
                "onnx": str(MODEL),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": backend,
                "precision": precision,
                "streams": 1,
                "calibration": {"samples": 16, "method": "minmax"},
            }
        },
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "det"}},
        "mqtt": {"enabled": False},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ---- ONNX Runtime profiles ------------------------------------------------------------------------


def test_ort_profile_lists_every_executed_node_with_positive_times(fp32_run) -> None:
    executed = executed_graph(MODEL)
    names = {layer.name for layer in fp32_run.layers}
    assert names == {n.name for n in executed.graph.node}
    assert fp32_run.graph["executed_nodes"] == len(executed.graph.node) and not fp32_run.graph["not_profiled"]
    assert all(layer.p50_ms > 0 and layer.samples == ITERATIONS for layer in fp32_run.layers)
    assert fp32_run.run_ms_p50 is not None and fp32_run.run_ms_p50 > 0
    assert sum(layer.share for layer in fp32_run.layers) == pytest.approx(1.0, abs=0.01)
    times = [layer.p50_ms for layer in fp32_run.layers]
    assert times == sorted(times, reverse=True)
    # Every convolution of the source graph is named, though ORT fused and renamed them all (NCHWc).
    convs = {n.name for n in onnx.load(str(MODEL)).graph.node if n.op_type == "Conv"}
    assert convs <= {layer.source for layer in fp32_run.layers}
    assert {r["op_type"] for r in fp32_run.op_types()} >= {"Conv", "Concat", "Sigmoid"}


def test_int8_profile_shows_quantised_convolutions(fp32_run, int8_run) -> None:
    source_convs = {n.name for n in onnx.load(str(MODEL)).graph.node if n.op_type == "Conv"}
    qconvs = [layer for layer in int8_run.layers if layer.op_type == "QLinearConv"]
    assert len(qconvs) >= 10 and all(layer.p50_ms > 0 for layer in qconvs)
    assert {layer.source for layer in qconvs} <= source_convs  # mapped back to the FP32 node names
    assert not int8_run.graph["not_profiled"]
    c = compare(fp32_run, int8_run)
    assert (c["reference"], c["candidate"]) == ("fp32", "int8")
    rows = {r["node"]: r for r in c["nodes"]}
    quantised = [
        r for r in rows.values() if r["reference_ops"] == "Conv" and r["candidate_ops"] == "QLinearConv"
    ]
    assert len(quantised) >= 10 and all(r["reference_ms"] > 0 and r["candidate_ms"] > 0 for r in quantised)
    # Q/DQ the quantiser added have no FP32 counterpart: summed per op type.
    added = rows["[added] QuantizeLinear"]
    assert added["reference_ms"] is None and added["candidate_ms"] > 0 and added["speedup"] is None
    assert c["reference_total_ms"] == pytest.approx(fp32_run.total_ms, abs=1e-3)
    by_op = {r["op_type"]: r for r in c["op_types"]}
    assert by_op["QLinearConv"]["reference_ms"] is None and by_op["Conv"]["reference_ms"] > 0


def test_fp16_profile_names_the_source_convolutions(tmp_path: Path, frame) -> None:
    """ORT runs an FP16 graph on the CPU through casts it inserts, renaming nodes and constants
    ("InsertedPrecisionFreeCast_...", "FusedBack_..."): the convolutions are still found."""
    pytest.importorskip("onnxconverter_common")
    from engines.precision import convert_fp16

    fp16 = tmp_path / "fp16.onnx"
    fp16.write_bytes(convert_fp16(MODEL))
    run = profile_onnx(fp16, frame, 1, precision="fp16", source_onnx=MODEL)
    convs = {n.name for n in onnx.load(str(MODEL)).graph.node if n.op_type == "Conv"}
    assert any(layer.name.startswith("InsertedPrecisionFreeCast_") for layer in run.layers)
    assert convs <= {layer.source for layer in run.layers} and not run.graph["not_profiled"]


def test_parse_ort_trace_drops_warmup_and_sums_per_run() -> None:
    def run(ts: int, dur: int) -> dict[str, Any]:
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(name: str, ts: int, dur: int, op: str = "Conv") -> dict[str, Any]:
        return {"cat": "Node", "name": name, "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [
        run(0, 100), node("a_kernel_time", 10, 90),  # warm-up: dropped
        run(200, 100), node("a_kernel_time", 210, 40), node("a_fence_before", 205, 5),
        run(400, 100), node("a_kernel_time", 410, 20), node("a_kernel_time", 440, 20),  # loop body: summed
        node("b_kernel_time", 460, 30, "Add"),
    ]  # fmt: skip
    samples, ops, runs = parse_ort_trace(events)
    assert samples == {"a": [0.04, 0.04], "b": [0.03]}
    assert ops == {"a": "Conv", "b": "Add"} and runs == [0.1, 0.1]


def test_profile_onnx_bad_input_names_the_file(tmp_path: Path, frame) -> None:
    missing = tmp_path / "missing.onnx"
    with pytest.raises(ProfileError, match=re.escape(f"ONNX model {missing} does not exist")):
        profile_onnx(missing, frame, 1)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ProfileError, match=re.escape(f"cannot read ONNX model {garbage}")):
        profile_onnx(garbage, frame, 1)
    with pytest.raises(ProfileError, match=re.escape(f"onnxruntime cannot profile {MODEL}")):
        profile_onnx(MODEL, np.zeros((1, 3, 8, 8), np.float32), 1)  # wrong input shape
    with pytest.raises(ProfileError, match="iterations must be >= 1"):
        profile_onnx(MODEL, frame, 0)


# ---- the command ----------------------------------------------------------------------------------

REPORT_KEYS = {
    "schema",
    "model",
    "created_at",
    "iterations",
    "input",
    "runs",
    "comparison",
    "engine",
    "notes",
}
RUN_KEYS = {
    "runtime",
    "precision",
    "model",
    "iterations",
    "run_ms_p50",
    "total_ms",
    "graph",
    "timing",
    "layers",
    "op_types",
}
LAYER_KEYS = {"name", "op_type", "p50_ms", "share", "samples", "source", "precision", "tactic"}
COMPARISON_KEYS = {
    "reference", "candidate", "reference_total_ms", "candidate_total_ms", "speedup", "nodes", "op_types"
}  # fmt: skip
ROW_KEYS = {"node", "reference_ops", "candidate_ops", "reference_ms", "candidate_ms", "speedup"}


def test_cli_profile_int8_report_schema_and_chart(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = ["profile", "-c", str(write_config(tmp_path)), "--precision", "int8", "--iterations", "2"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / "det.json").read_text())
    assert set(report) == REPORT_KEYS and report["schema"] == SCHEMA == "edge-agent/profile/1"
    assert report["model"] == "det" and report["iterations"] == 2 and report["engine"] is None
    assert report["input"].startswith("held-out frame ")  # the calibration set captured for INT8
    assert [r["precision"] for r in report["runs"]] == ["fp32", "int8"]
    for run in report["runs"]:
        assert set(run) == RUN_KEYS and run["runtime"] == "onnxruntime"
        assert all(set(layer) == LAYER_KEYS for layer in run["layers"])
        assert set(run["op_types"][0]) == {"op_type", "nodes", "p50_ms", "share"}
    assert set(report["comparison"]) == COMPARISON_KEYS
    assert all(set(row) == ROW_KEYS for row in report["comparison"]["nodes"])
    assert (out / "det.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for prec in ("fp32", "int8"):
        trace = json.loads((out / f"det-ort-{prec}.trace.json").read_text())
        assert any(e.get("cat") == "Node" for e in trace)
    # The table: both runs, then the comparison naming a quantised convolution.
    assert main([*args, "--out", str(out), "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "onnxruntime" in text and "fp32 vs int8, per source node" in text
    assert "Conv -> QLinearConv" in text and f"report: {out / 'det.json'}, chart: {out / 'det.png'}" in text


def test_cli_profile_without_matplotlib_still_writes_the_report(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "out"
    assert main(["profile", "-c", str(write_config(tmp_path)), "--iterations", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"no chart {out / 'det.png'}: matplotlib is not installed" in captured.err
    assert not (out / "det.png").exists()
    report = json.loads((out / "det.json").read_text())
    assert report["comparison"] is None and report["input"] == "zeros (no calibration set)"
    assert f"report: {out / 'det.json'}\n" in captured.out


def test_cli_profile_errors_name_the_problem(tmp_path: Path, capsys) -> None:
    cfg = str(write_config(tmp_path))
    assert main(["profile", "-c", cfg, "--model", "nope"]) == 2
    assert "--model 'nope': not in the config (known: det)" in capsys.readouterr().err
    assert main(["profile", "-c", cfg, "--iterations", "0"]) == 2
    assert "--iterations and --top must be >= 1" in capsys.readouterr().err


# ---- layer information (pure) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "precision"),
    [
        ("Float", "FP32"),
        ("Row major linear FP32", "FP32"),
        ("Half", "FP16"),
        ("Channel major FP16 format where channel % 8 == 0", "FP16"),
        ("Int8", "INT8"),
        ("Four wide channel vectorized row major Int8 format", "INT8"),
        ("BFloat16", "BF16"),
        ("UInt8", "other"),
        ("Int64", "other"),
        (None, "none"),
    ],
)
def test_precision_of(text: str | None, precision: str) -> None:
    assert precision_of(text) == precision


def test_layers_from_inspector_json() -> None:
    """The inspector's JSON as TensorRT documents it (DETAILED): precision of the first input, tactic."""
    text = json.dumps(
        {
            "Layers": [
                {
                    "Name": "conv1 + relu1",
                    "LayerType": "CaskConvolution",
                    "Inputs": [{"Name": "x", "Format/Datatype": "Four wide channel vectorized Int8 format"}],
                    "Outputs": [{"Name": "y", "Format/Datatype": "Row major linear FP32"}],
                    "TacticValue": "0x0000000000000fb3",
                    "Metadata": "[ONNX Layer: conv1][ONNX Layer: relu1]",
                },
                {"Name": "w", "LayerType": "Constant", "Inputs": [], "Outputs": [{"Name": "w"}]},
                {"Name": "head", "LayerType": "kgen", "Inputs": [{"Name": "y", "Datatype": "Half"}]},
            ],
            "Bindings": ["x", "y"],
        }
    )
    layers = layers_from_inspector(text)
    assert layers == [
        EngineLayer("conv1 + relu1", "CaskConvolution", "INT8", "0x0000000000000fb3", ("conv1", "relu1")),
        EngineLayer("w", "Constant", "none"),
        EngineLayer("head", "kgen", "FP16"),
    ]
    # LAYER_NAMES_ONLY: names, nothing else.
    names_only = layers_from_inspector('{"Layers": ["a", "b"]}')
    assert names_only == [EngineLayer("a", "", "unknown"), EngineLayer("b", "", "unknown")]
    with pytest.raises(ValueError, match="no 'Layers' list"):
        layers_from_inspector("{}")


def test_layers_from_build_log_oneline() -> None:
    """TensorRT-RTX's builder log (DETAILED): nested brackets in the inputs, constants before the outputs."""
    text = (
        "Layers:\n"
        "Name: [trainStation1], LayerType: TrainStation, Inputs: [], Outputs: [], TacticValue: 0x0, "
        "StreamId: 0, Metadata: \n"
        "Name: __myl_Conv_1, LayerType: runtime_fusion, Inputs: [ { Name: a, Dimensions: [1,3,8,8], "
        "Datatype: Int8, Format: (Linear) Row major }], Constants: [ { Name: w, Datatype: Float }], "
        "Outputs: [ { Name: b, Datatype: Half }], TacticName: , StreamId: 0, "
        "Metadata: [ONNX Layer: Conv__145][ONNX Layer: Relu_1]\n"
        "Name: shape, LayerType: kgen, Inputs: [ { Name: s, Dimensions: [3], Datatype: Int64 }], "
        "Outputs: [], TacticName: __myl_Move_0x1, StreamId: 0, Metadata: \n"
        "not a layer line\n"
    )
    assert layers_from_build_log(text) == [
        EngineLayer("[trainStation1]", "TrainStation", "none", "0x0"),
        EngineLayer("__myl_Conv_1", "runtime_fusion", "INT8", None, ("Conv__145", "Relu_1")),
        EngineLayer("shape", "kgen", "other", "__myl_Move_0x1"),
    ]


def test_summary_and_its_check() -> None:
    layers = [EngineLayer("a", "t", "INT8"), EngineLayer("b", "t", "FP32"), EngineLayer("c", "t", "none")]
    s = summarize(layers, "inspector")
    assert s == {
        "total": 3,
        "precisions": {"FP32": 1, "FP16": 0, "INT8": 1, "none": 1},
        "source": "inspector",
    }
    assert check_summary(s) is None
    assert check_summary({**s, "total": 4}) == "'precisions' add up to 3, not 'total' 4"
    assert check_summary({"total": True, "precisions": {}}) == "'total' must be a non-negative integer"
    with pytest.raises(ValueError, match="source must be one of"):
        summarize(layers, "guess")


def test_manifest_layer_fields_are_optional_and_checked() -> None:
    base = {
        "schema": "edge-agent/engine-manifest/1",
        "fingerprint": {
            "trt_flavor": "tensorrt_rtx", "trt_version": "1.7.1.116", "gpu_name": None,
            "compute_capability": "8.6", "cuda_driver": None, "cuda_runtime": None, "l4t": None,
            "dla_core": None, "platform": "linux-x86_64",
        },
        "build": {
            "onnx_sha256": "0" * 64, "precision": "fp32", "profiles": [], "workspace_bytes": 1,
            "optimization_level": 3, "calibration": None, "timing_cache": None,
            "built_at": "2026-01-01T00:00:00+00:00", "build_s": 0.4, "agent_version": "0.1.0",
            "plan_sha256": "0" * 64,
        },
        "validation": None,
    }  # fmt: skip
    old = manifest_from_dict(base)  # written before the profiling fields existed
    assert "layers" not in old.build.to_dict()
    layers = {"total": 2, "precisions": {"FP32": 1, "FP16": 0, "INT8": 1}, "source": "build_log"}
    new = {**base, "build": {**base["build"], "profiling_verbosity": "detailed", "layers": layers}}
    assert manifest_from_dict(new).build.layers == layers
    bad = {**base, "build": {**base["build"], "layers": {**layers, "total": 5}}}
    with pytest.raises(
        ManifestError, match=r"manifest m.json: field 'build.layers' 'precisions' add up to 2"
    ):
        manifest_from_dict(bad, "m.json")
    with pytest.raises(ManifestError, match=r"field 'build\.profiling_verbosity' must be str"):
        manifest_from_dict({**base, "build": {**base["build"], "profiling_verbosity": 2}}, "m.json")


# ---- TensorRT-RTX: real builds, and the execution-side logic ---------------------------------------


@pytest.fixture(scope="module")
def rtx():
    pytest.importorskip("tensorrt_rtx")
    from engines.trt import import_trt

    return import_trt("tensorrt_rtx")


@pytest.mark.slow
def test_rtx_build_records_detailed_verbosity_and_layer_precisions(rtx, tmp_path: Path, capsys) -> None:
    from agent.config import load_config
    from agent.lifecycle.model import ModelContext
    from engines.build.builder import build
    from engines.fingerprint import probe_fingerprint
    from engines.store import EngineStore

    cfg_path = write_config(tmp_path, backend="tensorrt_rtx")
    ctx = ModelContext.from_config(load_config(cfg_path), "det")
    store, fp = EngineStore(ctx.engine_dir), probe_fingerprint(rtx)
    summaries = {}
    for precision in ("fp16", "fp32"):  # fp32 last: the configured precision, for `check`
        result = build(store, "det", ctx.build_settings(precision), api=rtx, fingerprint=fp, force=True)
        b = json.loads(store.manifest_path("det", result.key).read_text())["build"]
        assert b["profiling_verbosity"] == "detailed"
        summaries[precision] = b["layers"]
    for s in summaries.values():
        assert s["source"] == "build_log" and s["total"] > 20 and check_summary(s) is None
    assert summaries["fp32"]["precisions"]["FP32"] > 20 and summaries["fp32"]["precisions"]["FP16"] == 0
    fp16 = summaries["fp16"]["precisions"]
    assert fp16["FP16"] > 20 and fp16["FP16"] > fp16["FP32"]  # IO stays FP32 (keep_io_types)

    assert main(["check", "-c", str(cfg_path), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["models"]["det"]
    assert checked["status"] == "ok" and checked["layers"] == summaries["fp32"]
    # profile: the engine cannot execute here, so ONNX Runtime profiles the graph and says why.
    out = tmp_path / "out"
    assert main(["profile", "-c", str(cfg_path), "--iterations", "1", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"]["status"] == "ok" and report["engine"]["layers"] == summaries["fp32"]
    assert any("cannot execute here (no CUDA GPU)" in n for n in report["notes"])
    assert report["runs"][0]["runtime"] == "onnxruntime"


@pytest.mark.slow
def test_rtx_engine_inspector_needs_a_gpu(rtx, tmp_path: Path) -> None:
    """What runs here: TensorRT-RTX refuses to deserialise a plan without a CUDA driver, so no inspector
    can be made on this machine; the summary then comes from the builder's log or is absent, and the
    attempt never fails (a build would keep its engine)."""
    from engines.build.builder import build
    from engines.fingerprint import probe_fingerprint
    from engines.runtimes.trt_layers import build_layer_summary
    from engines.settings import BuildSettings
    from engines.store import EngineStore

    store = EngineStore(tmp_path)
    result = build(store, "det", BuildSettings(onnx=MODEL), api=rtx, fingerprint=probe_fingerprint(rtx))
    plan = result.plan_path.read_bytes()
    logger = rtx.logger()
    assert rtx.deserialize(plan, logger)[1] is None and "cudaError 35" in " ".join(logger.errors)
    assert build_layer_summary(rtx, plan, rtx.logger(), has_gpu=True) is None
    with_log = rtx.logger()
    with_log.layers_log = (
        "Layers:\nName: a, LayerType: kgen, Inputs: [ { Name: x, Datatype: Half }], Outputs: []"
    )
    assert build_layer_summary(rtx, plan, with_log, has_gpu=True) == {
        "total": 1,
        "precisions": {"FP32": 0, "FP16": 1, "INT8": 0},
        "source": "build_log",
    }


def test_rtx_profiler_subclass_collects_layer_times(rtx) -> None:
    import tensorrt_rtx

    profiler = rtx.layer_profiler()
    assert isinstance(profiler, tensorrt_rtx.IProfiler)
    profiler.report_layer_time("conv", 0.5)
    profiler.report_layer_time("conv", 0.25)
    profiler.report_layer_time("head", 1)
    assert profiler.times == {"conv": [0.5, 0.25], "head": [1.0]}


class StandInBackend:
    """What profile_engine uses of TensorRTBackend; each execution reports its layers like TensorRT."""

    precision = "int8"
    plan_path = "/engines/det/abc.plan"

    def __init__(self, api: Any, inspector_json: str) -> None:
        self.trt_api, self._json = api, inspector_json
        self.profiler: Any = None
        self.executions = 0

    def set_profiler(self, profiler: Any) -> None:
        self.profiler = profiler

    def infer(self, batch: np.ndarray) -> None:
        self.executions += 1
        if self.profiler is None:  # the timed run without the profiler (trtexec --separateProfileRun)
            self.unprofiled = self.executions
            return
        self.profiler.report_layer_time("conv", 0.5 if self.executions > 6 else 50.0)  # warm-up is slow
        self.profiler.report_layer_time("head", 0.25)

    def layer_information(self) -> str:
        return self._json


def test_profile_engine_joins_profiler_times_with_the_inspector(rtx) -> None:
    from engines.runtimes.trt_layers import profile_engine

    inspector = {
        "Layers": [
            {"Name": "conv", "LayerType": "CaskConvolution", "Inputs": [{"Format/Datatype": "Int8"}],
             "TacticValue": "0x1", "Metadata": "[ONNX Layer: Conv__145]"},
            {"Name": "head", "LayerType": "Reformat", "Inputs": [{"Format/Datatype": "Half"}]},
            {"Name": "never", "LayerType": "Shuffle", "Inputs": []},
        ]
    }  # fmt: skip
    backend = StandInBackend(rtx, json.dumps(inspector))
    run = profile_engine(backend, np.zeros((1, 3, 8, 8), np.float32), 4)  # type: ignore[arg-type]
    # Timed without the profiler first (1 warm-up + 4), then a separate profiled run (the same).
    assert backend.unprofiled == 5 and backend.executions == 10
    assert run.timing["method"] == "separate_profile_run"
    assert run.runtime == "tensorrt_rtx" and run.precision == "int8" and run.model == backend.plan_path
    conv, head = run.layers
    assert (conv.name, conv.op_type, conv.precision, conv.tactic, conv.source) == (
        "conv", "CaskConvolution", "INT8", "0x1", "Conv__145"
    )  # fmt: skip
    assert conv.p50_ms == 0.5 and conv.samples == 4 and conv.share == pytest.approx(2 / 3, abs=1e-3)
    assert (head.precision, head.p50_ms) == ("FP16", 0.25)
    assert run.graph["engine_layers"] == 3 and run.graph["not_profiled"] == ["never"]
    with pytest.raises(ProfileError, match="iterations must be >= 1"):
        profile_engine(backend, np.zeros((1, 3, 8, 8), np.float32), 0)  # type: ignore[arg-type]


def test_no_stray_profile_files_in_the_working_directory(tmp_path: Path, frame, monkeypatch) -> None:
    """ORT writes its trace where profile_file_prefix says: into a temp folder, never the cwd."""
    monkeypatch.chdir(tmp_path)
    profile_onnx(MODEL, frame, 1, trace_out=tmp_path / "kept.json")
    assert os.listdir(tmp_path) == ["kept.json"]
