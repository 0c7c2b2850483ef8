"""`models.M.postprocess: graph` in the agent: the grafted graph becomes the model for every route. Real
ONNX Runtime serving over mosquitto, and a real TensorRT-RTX FP16 build behind the accuracy gate (the
grafted tail kept FP32 by engines.islands through the FP16 conversion)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from fixtures_agent import ASSETS, AgentProcess, bundled_model, decoded, run_cli, wait
from fixtures_mqtt import Broker, Subscriber

from agent.config import ConfigError, parse_config
from engines.build.islands import marked
from pipelines.models.graft import OUTPUTS

pytestmark = pytest.mark.slow


def config(tmp_path: Path, **model: object) -> Path:
    text = {
        "device_id": "grafted",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model(postprocess="graph", **model)},
        "cameras": {
            "street": {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 8, "min_score": 0.4}
        },
        "mqtt": {"host": "127.0.0.1", "port": 1},
        "telemetry": {"interval_s": 5},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(json.dumps(text))
    return path


def test_daemon_serves_the_grafted_graph(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = config(tmp_path)
    data = json.loads(path.read_text())
    data["mqtt"]["port"] = mqtt_broker.port
    path.write_text(json.dumps(data))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/grafted/#")
    agent = start_agent(path)
    msgs = wait(
        sub,
        lambda m: any(d["detections"] for d in decoded(m, "/detections")),
        90,
        agent,
        "grafted detections",
    )
    dets = [x for d in decoded(msgs, "/detections") for x in d["detections"]]
    assert all(x["score"] >= 0.4 and len(x["box"]) == 4 and x["label"] for x in dets)
    made = list((tmp_path / "engines" / "detector" / "graft").glob("*.onnx"))
    assert len(made) == 1 and made[0].name.endswith("-s0.25-i0.5-k300.onnx"), made
    assert [o.name for o in onnx.load(str(made[0])).graph.output] == list(OUTPUTS)
    assert "decode + NMS grafted onto" in agent.text() and "Traceback" not in agent.text()


def test_rtx_fp16_build_of_the_grafted_graph_passes_the_gate(tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
    path = config(
        tmp_path,
        backend="tensorrt_rtx",
        precision="fp16",
        calibration={"samples": 30, "method": "minmax", "interval_s": 0.25},
        accuracy_gate={"min_agreement": 0.9},
    )
    built = run_cli("rebuild", "-c", str(path), timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    after = run_cli("check", "-c", str(path), "--json")
    assert after.returncode == 0, after.stdout + after.stderr
    entry = json.loads(after.stdout)["models"]["detector"]
    assert entry["validation"]["precision"] == "fp16" and entry["validation"]["passed"] is True
    # The FP16 graph the engine was built from: converted around the grafted tail, which stayed FP32.
    fp16 = onnx.load(str(tmp_path / "engines" / "detector" / "calibration" / "models" / "fp16.onnx"))
    tail = [n for n in fp16.graph.node if marked(n.name)]
    assert tail and not any(
        n.op_type == "Cast"
        and n.name.startswith("keep_fp32/")
        and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)
        for n in tail
    )
    assert [o.name for o in fp16.graph.output] == list(OUTPUTS)
    halves = [i for i in fp16.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
    assert halves, "the rest of the model was not converted"
    assert all(not i.name.startswith("graft/") for i in halves)


def test_min_score_below_the_graph_threshold_is_refused() -> None:
    base = {
        "models": {"m": {"onnx": "m.onnx", "postprocess": "graph", "graph_score_threshold": 0.3}},
        "cameras": {"c": {"url": "rtsp://x/y", "model": "m", "min_score": 0.2}},
    }
    with pytest.raises(
        ConfigError, match=r"a.yaml: cameras.c.min_score: 0.2 is below models.m.graph_score_thr"
    ):
        parse_config(base, "a.yaml")
    base["cameras"]["c"]["min_score"] = 0.3  # type: ignore[index]
    assert parse_config(base, "a.yaml").models["m"].postprocess == "graph"
