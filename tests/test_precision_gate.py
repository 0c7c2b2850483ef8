"""Calibration set, INT8 Q/DQ, FP16 and the accuracy gate on the bundled NanoDet + clip, real ONNX Runtime.

One calibration set (64 calibration + 40 held-out frames of bikes.mp4) and one gate run per
precision/method are made once per session; the CLI tests reuse the cached candidate models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml

from agent.config import load_config
from agent.lifecycle.calibration import (
    CalibrationError,
    calibration_batches,
    load_calibration_set,
    model_adapter,
)
from agent.lifecycle.capture import capture_calibration_set
from agent.lifecycle.gate import run_gate
from agent.lifecycle.gate_report import GateReport, write_report
from agent.lifecycle.model import ModelContext
from engines.build.qdq_nodes import QuantizationError, resolve_exclusions, sensitive_nodes
from engines.build.quantize import make_qdq_onnx

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
CLIP = ASSETS / "bikes.mp4"
SAMPLES, HELD_OUT = 64, 40
METHODS = ("entropy", "minmax", "percentile")


def write_config(
    path: Path, engine_dir: Path, min_agreement: float = 0.9, method: str = "percentile"
) -> Path:
    data = {
        "engine_dir": str(engine_dir),
        "models": {
            "nanodet": {
                "onnx": str(MODEL),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "onnxruntime",
                "precision": "best",
                "calibration": {"samples": SAMPLES, "method": method},
                "accuracy_gate": {"min_agreement": min_agreement},
            }
        },
        "cameras": {"street": {"url": str(CLIP), "model": "nanodet", "min_score": 0.4}},
        "mqtt": {"enabled": False},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("precision")
    config = write_config(root / "config.yaml", root / "engines")
    cfg = load_config(config)
    cset = capture_calibration_set(cfg, "nanodet", samples=SAMPLES, held_out=HELD_OUT, progress=False)
    ctx = ModelContext.from_config(cfg, "nanodet")
    return {"root": root, "config": config, "cfg": cfg, "ctx": ctx, "cset": cset}


def gate(ctx: ModelContext, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """run_gate's report as a plain dict (entries too), as it is stored."""
    return GateReport.to_json(run_gate(ctx, *args, **kwargs))


@pytest.fixture(scope="session")
def measured(env: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One gate run per candidate, threshold 0 so every run reports its own agreement."""
    ctx: ModelContext = env["ctx"]
    out = {m: gate(ctx, "int8", method=m, min_agreement=0.0) for m in METHODS}
    out["fp16"] = gate(ctx, "fp16", min_agreement=0.0)
    return out


def best_method(measured: dict[str, dict[str, Any]]) -> str:
    return max(METHODS, key=lambda m: measured[m]["value"])


# ---- calibration set -----------------------------------------------------------------------------


def test_calibration_set_layout(env: dict[str, Any]) -> None:
    cset = env["cset"]
    m = json.loads((cset.directory / "calibration.json").read_text())
    assert cset.directory == env["root"] / "engines" / "nanodet" / "calibration"
    assert m["schema"] == "edge-agent/calibration-set/1"
    assert m["source"] == "cameras" and m["cameras"] == ["street"]
    assert (m["samples"], m["held_out_count"]) == (SAMPLES, HELD_OUT)
    assert len(m["frames"]) == SAMPLES and len(m["held_out"]) == HELD_OUT
    calib = {f["file"] for f in m["frames"]}
    held = {f["file"] for f in m["held_out"]}
    assert not calib & held, "held-out frames must never be calibration frames"
    assert all((cset.directory / f).is_file() for f in calib | held)
    # Spread over the whole clip (250 frames), held-out ones too.
    held_idx = sorted(int(f["origin"].rsplit("#", 1)[1]) for f in m["held_out"])
    assert held_idx[0] < 10 and held_idx[-1] > 240
    assert "created_at" in m


def test_calibration_batches_skip_held_out(env: dict[str, Any]) -> None:
    adapter = model_adapter(env["ctx"])
    batches = list(calibration_batches(env["cset"], adapter, batch_size=8))
    assert sum(b.shape[0] for b in batches) == SAMPLES
    assert batches[0].dtype == np.float32 and batches[0].shape[1:] == (3, 416, 416)
    held = list(calibration_batches(env["cset"], adapter, batch_size=8, split="held_out"))
    assert sum(b.shape[0] for b in held) == HELD_OUT


# ---- quantiser -----------------------------------------------------------------------------------


def test_sensitive_nodes_of_nanodet() -> None:
    found = sensitive_nodes(onnx.load(str(MODEL)))
    # stem: the first two convs; heads: the three convs feeding Split/Sigmoid/Reshape -> outputs
    assert set(found) == {"Conv__145", "Conv__146", "Conv__176", "Conv__178", "Conv__180"}


def test_exclusion_patterns() -> None:
    model = onnx.load(str(MODEL))
    assert resolve_exclusions(model, ["Conv__17[0-2]"], ["Conv"], "m") == [
        "Conv__170",
        "Conv__171",
        "Conv__172",
    ]
    with pytest.raises(QuantizationError, match="matches no Conv node"):
        resolve_exclusions(model, ["backbone.*"], ["Conv"], "m.onnx")


def test_qdq_graph_is_tensorrt_style(env: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    path = Path(measured["minmax"]["tried"][0]["onnx"])
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    inits = {i.name: i for i in model.graph.initializer}
    zero_points = [
        onnx.numpy_helper.to_array(inits[n.input[2]])
        for n in model.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2
    ]
    assert zero_points and all(not zp.any() for zp in zero_points), "symmetric: zero points are 0"
    assert {zp.dtype for zp in zero_points} == {np.dtype(np.int8)}
    assert not [i for i in inits.values() if i.data_type == onnx.TensorProto.INT32], "bias stays float"
    producers = {o: n for n in model.graph.node for o in n.output}
    convs = {n.name: n for n in model.graph.node if n.op_type == "Conv"}
    for name in ("Conv__145", "Conv__176"):  # excluded: data input not from a DequantizeLinear
        src = producers.get(convs[name].input[0])
        assert src is None or src.op_type != "DequantizeLinear"
    assert producers[convs["Conv__150"].input[0]].op_type == "DequantizeLinear"
    # Per-channel weights: a weight DQ scale with one value per output channel.
    w_dq = producers[convs["Conv__150"].input[1]]
    assert onnx.numpy_helper.to_array(inits[w_dq.input[1]]).ndim == 1
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name], "no temp files left"


def test_make_qdq_onnx_errors(tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="method"):
        make_qdq_onnx(MODEL, tmp_path / "x.onnx", [], "kl")  # type: ignore[arg-type]
    with pytest.raises(QuantizationError, match="no calibration samples"):
        make_qdq_onnx(MODEL, tmp_path / "x.onnx", [], "minmax")
    assert not (tmp_path / "x.onnx").exists()


def test_qdq_parses_with_tensorrt_rtx(measured: dict[str, dict[str, Any]]) -> None:
    trt = pytest.importorskip("tensorrt_rtx")
    path = Path(measured[best_method(measured)]["tried"][0]["onnx"])
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse(path.read_bytes())
    errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
    assert ok, errors
    layer_types = {network.get_layer(i).type for i in range(network.num_layers)}
    assert trt.LayerType.QUANTIZE in layer_types and trt.LayerType.DEQUANTIZE in layer_types


# ---- agreement and the gate -----------------------------------------------------------------------


def test_fp16_agrees_with_fp32(measured: dict[str, dict[str, Any]]) -> None:
    r = measured["fp16"]
    assert r["precision"] == "fp16" and r["frames"] == HELD_OUT
    assert r["value"] >= 0.99 and r["mean_iou"] >= 0.99


def test_int8_methods_measured_and_best_reaches_0_9(measured: dict[str, dict[str, Any]]) -> None:
    for m in METHODS:
        r = measured[m]
        assert r["precision"] == "int8" and r["method"] == m
        assert 0.0 <= r["value"] <= 1.0 and r["mean_iou"] > 0.8, (m, r)
    best = best_method(measured)
    summary = {m: (measured[m]["value"], measured[m]["mean_iou"]) for m in METHODS}
    assert measured[best]["value"] >= 0.9, summary


def test_gate_decision_follows_threshold(env: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    best = best_method(measured)
    value = measured[best]["value"]
    ok = gate(env["ctx"], "int8", method=best, min_agreement=value)
    assert ok["passed"] and ok["precision"] == "int8" and ok["value"] == value
    bad = gate(env["ctx"], "int8", method=best, min_agreement=min(1.0, value + 0.005))
    if value < 1.0:
        assert not bad["passed"] and "< min_agreement" in bad["tried"][0]["reason"]
    validation = run_gate(env["ctx"], "int8", method=best, min_agreement=value).validation()
    assert {"reference", "metric", "value", "threshold", "passed", "frames"} <= set(validation)
    assert validation["passed"] is True and validation["runtime"] == "onnxruntime"


def test_best_prefers_int8_when_it_passes(env: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    best = best_method(measured)
    r = gate(env["ctx"], "best", method=best, min_agreement=measured[best]["value"] - 0.01)
    assert r["precision"] == "int8" and r["passed"] and len(r["tried"]) == 1


def test_best_falls_back_to_fp16(env: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    best = best_method(measured)
    value = measured[best]["value"]
    threshold = value + (1.0 - value) / 2  # above INT8, below FP16's 1.0
    report = run_gate(env["ctx"], "best", method=best, min_agreement=threshold)
    r = report.to_json()
    assert r["precision"] == "fp16" and r["passed"] and r["requested"] == "best"
    assert [t["precision"] for t in r["tried"]] == ["int8", "fp16"]
    why = r["tried"][0]["reason"]
    assert f"map50 {value:.3f} < min_agreement" in why
    path = write_report(env["cset"], report)
    assert path == env["cset"].directory / "validation-best.json"
    assert json.loads(path.read_text())["precision"] == "fp16"


# ---- command line ---------------------------------------------------------------------------------


def test_validate_cli_json_and_exit_codes(env: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    best = best_method(measured)
    value = measured[best]["value"]
    root: Path = env["root"]
    engines = root / "engines"  # same engine_dir: the cached Q/DQ model is reused
    passing = write_config(root / "pass.yaml", engines, min_agreement=round(value - 0.01, 4), method=best)
    p = cli("validate", "-c", str(passing), "--precision", "int8", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("reference", "metric", "value", "threshold", "passed", "frames", "model", "precision"):
        assert key in out, key
    assert out["model"] == "nanodet" and out["precision"] == "int8" and out["passed"] is True
    assert out["value"] == pytest.approx(value) and out["frames"] == HELD_OUT and out["reference"] == "fp32"

    failing = write_config(root / "fail.yaml", engines, min_agreement=min(1.0, value + 0.005), method=best)
    p = cli("validate", "-c", str(failing), "--precision", "int8", "--json")
    assert p.returncode == (1 if value < 1.0 else 0), p.stderr
    assert json.loads(p.stdout)["passed"] is (p.returncode == 0)

    p = cli("validate", "-c", str(failing), "--precision", "fp16")
    assert p.returncode == 0, p.stderr
    assert "PASS precision fp16" in p.stdout


def test_validate_without_calibration_set(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", tmp_path / "engines")
    p = cli("validate", "-c", str(config), "--json")
    assert p.returncode == 2
    assert "run edge-agent calibrate" in p.stderr and str(tmp_path / "engines") in p.stderr
    with pytest.raises(CalibrationError, match="calibrate"):
        load_calibration_set(ModelContext.from_config(load_config(config), "nanodet"))


def test_calibrate_cli_from_folder(tmp_path: Path) -> None:
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "street.mp4").symlink_to(CLIP)
    (folder / "dog.jpg").write_bytes((REPO / "tests" / "data" / "dog.jpg").read_bytes())
    config = write_config(tmp_path / "c.yaml", tmp_path / "engines")
    p = cli("calibrate", "-c", str(config), "--from", str(folder), "--samples", "30", "--held-out", "20")
    assert p.returncode == 0, p.stderr
    assert "30 calibration + 20 held-out" in p.stdout
    m = json.loads((tmp_path / "engines" / "nanodet" / "calibration" / "calibration.json").read_text())
    assert m["source"] == "folder" and m["folder"] == str(folder)
    origins = [f["origin"] for f in m["frames"] + m["held_out"]]
    assert "dog.jpg" in origins
    video = sorted(int(o.split("#")[1]) for o in origins if o.startswith("street.mp4#"))
    assert len(video) == 49 and video[0] == 0 and video[-1] == 249  # uniform over the clip's length


def test_calibrate_cli_errors_name_the_folder(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", tmp_path / "engines")
    missing = tmp_path / "nope"
    p = cli("calibrate", "-c", str(config), "--from", str(missing))
    assert p.returncode == 2 and str(missing) in p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    p = cli("calibrate", "-c", str(config), "--from", str(empty))
    assert p.returncode == 2 and f"{empty} holds no images" in p.stderr
    assert not (tmp_path / "engines" / "nanodet" / "calibration").exists()
