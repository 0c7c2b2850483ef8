"""Telemetry windows, rates, payload and the Prometheus endpoint."""

from __future__ import annotations

import json
import re
import types
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fixtures_agent import ASSETS, AgentProcess, bundled_model, wait_until
from fixtures_mqtt import Broker, Subscriber, free_port
from prometheus_client.parser import text_string_to_metric_families

from agent.mqtt.topics import payload
from agent.telemetry import (
    FIELDS,
    Field,
    Kind,
    Metrics,
    RateCounter,
    Shards,
    StageWindow,
    build_telemetry,
    gpu_stats,
    process_stats,
    readme_table,
    sharded_telemetry,
    walk,
)
from agent.telemetry.spec import exposed_name, metric_specs
from engines.cuda.gpu_probe import GpuInfo, Nvml


def test_percentiles_of_known_samples() -> None:
    w = StageWindow()
    for ms in range(1, 101):
        w.add("infer", float(ms))
    w.add_many({"queue": 2.0, "preprocess": None})
    s = w.summary()
    assert s["infer"]["n"] == 100
    expected = np.percentile(np.arange(1, 101), [50, 95, 99])
    assert [s["infer"][k] for k in ("p50", "p95", "p99")] == pytest.approx(expected, abs=1e-3)
    assert 50 <= s["infer"]["p50"] <= 51 and 94 <= s["infer"]["p95"] <= 96 and 98 <= s["infer"]["p99"] <= 100
    assert s["queue"] == {"p50": 2.0, "p95": 2.0, "p99": 2.0, "n": 1}
    assert "preprocess" not in s


def test_summary_resets_the_window() -> None:
    w = StageWindow()
    w.add("infer", 10.0)
    assert w.summary()["infer"]["n"] == 1
    empty = w.summary()
    assert empty["infer"] == {"p50": None, "p95": None, "p99": None, "n": 0}
    w.add("infer", 3.0)
    assert w.summary(reset=False)["infer"]["p50"] == 3.0
    assert w.summary()["infer"]["n"] == 1  # reset=False kept it


def test_ring_buffer_wraps_and_keeps_the_newest() -> None:
    w = StageWindow(capacity=10)
    for ms in range(1, 26):
        w.add("total", float(ms))
    s = w.summary()["total"]
    assert s["n"] == 25
    assert s["p50"] == pytest.approx(np.percentile(np.arange(16, 26), 50))  # 16..25 survive
    assert s["p99"] <= 25.0


def test_rate_counter_over_a_sliding_window() -> None:
    now = [1000.0]
    r = RateCounter(window_s=10, clock=lambda: now[0])
    for _ in range(100):  # 10 fps for 10 s
        now[0] += 0.1
        r.tick()
    assert r.rate() == pytest.approx(10.0, rel=0.15)
    assert r.rate() == pytest.approx(r.rate())  # reading does not reset
    now[0] += 30  # silence longer than the window
    assert r.rate() == 0.0
    assert r.total == 100


def test_process_and_gpu_stats() -> None:
    p = process_stats()
    assert p["rss_mb"] > 1 and p["cpu_percent"] >= 0
    assert isinstance(gpu_stats(), dict)  # {} without NVML


class _NvmlError(Exception):
    pass


def fake_pynvml(devices: int = 2, init_fails: int = 0) -> types.SimpleNamespace:
    """The slice of pynvml that engines.gpu_probe.Nvml reads, with call counts."""
    calls = {"init": 0}

    def init() -> None:
        calls["init"] += 1
        if calls["init"] <= init_fails:
            raise _NvmlError("Driver Not Loaded")

    def handle(i: int) -> int:
        if i >= devices:
            raise _NvmlError("Invalid Argument")
        return i

    return types.SimpleNamespace(
        calls=calls,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: devices,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: b"NVIDIA Fake" if h == 0 else "NVIDIA Other",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=512 * 2**20, total=8192 * 2**20),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37, memory=5),
        nvmlDeviceGetTemperature=lambda h, sensor: 61,
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 9),
        nvmlSystemGetDriverVersion=lambda: b"580.65.06",
    )


def test_gpu_stats_through_the_one_nvml_reader() -> None:
    lib = fake_pynvml()
    nvml = Nvml(lambda: lib)
    stats = gpu_stats(nvml)
    assert stats == {
        "0": {
            "name": "NVIDIA Fake",
            "util_percent": 37.0,
            "mem_used_mb": 512.0,
            "mem_total_mb": 8192.0,
            "temp_c": 61.0,
        },
        "1": {
            "name": "NVIDIA Other",
            "util_percent": 37.0,
            "mem_used_mb": 512.0,
            "mem_total_mb": 8192.0,
            "temp_c": 61.0,
        },
    }
    assert nvml.info(0) == GpuInfo("NVIDIA Fake", "8.9", "580.65.06", None, "pynvml", memory_mib=8192)
    assert nvml.info(5) is None  # no such device: None, not an exception
    gpu_stats(nvml)
    assert lib.calls["init"] == 1  # initialised once, not per read
    fields = build_telemetry(cameras={}, stages={}, backend="onnxruntime", batch_fill=None, gpu=stats)
    assert fields["gpu"]["0"] == stats["0"]


def test_gpu_stats_degrade_without_nvml() -> None:
    def missing() -> None:
        raise ImportError("No module named 'pynvml'")

    assert gpu_stats(Nvml(missing)) == {}
    assert Nvml(missing).info(0) is None
    lib = fake_pynvml(init_fails=1)  # no driver yet: {} now, retried on the next read
    nvml = Nvml(lambda: lib)
    assert gpu_stats(nvml) == {}
    assert set(gpu_stats(nvml)) == {"0", "1"} and lib.calls["init"] == 2
    broken = fake_pynvml()
    broken.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(_NvmlError("GPU is lost"))
    assert gpu_stats(Nvml(lambda: broken)) == {}


def _fields() -> dict:
    w = StageWindow()
    for ms in range(1, 101):
        w.add("infer", float(ms))
    return build_telemetry(
        cameras={
            "gate": {"fps_in": 25.0, "fps_out": 9.9, "dropped": 3, "frame_age_ms": 41.0},
            "yard": {"fps_in": 25.0, "fps_out": 20.0, "dropped": 1, "dropped_stale": 4, "frame_age_ms": 60.0},
        },
        stages=w.summary(),
        backend={"detector": "onnxruntime"},
        batch_fill=0.75,
        mqtt={
            "connected": False,
            "dropped_offline": 7,
            "queued": 5,
            "published": 1,
            "refused": 3,
            "last_refused": "publish to x/y: Not authorized (0x87)",
            "duplicates": ["0a1b2c3d"],
            "commands": {"rejected": 2},
        },
        gpu={},
    )


def test_telemetry_payload_has_the_design_fields() -> None:
    d = json.loads(payload("telemetry", **_fields()))
    assert d["schema"] == "edge-agent/telemetry/1" and isinstance(d["ts"], float)
    assert set(d) >= {"cameras", "stages", "backend", "batch_fill", "process", "gpu", "mqtt"}
    assert d["cameras"]["gate"] == {
        "fps_in": 25.0,
        "fps_out": 9.9,
        "dropped": 3,
        "dropped_stale": 0,  # filled in when the caller has no count
        "frame_age_ms": 41.0,
    }
    assert set(d["stages"]["infer"]) >= {"p50", "p95", "p99"}
    assert set(d["process"]) == {"cpu_percent", "rss_mb"}
    assert d["mqtt"] == {
        "dropped_offline": 7,
        "queued": 5,
        "reconnects": 0,
        "refused": 3,
        "last_refused": "publish to x/y: Not authorized (0x87)",
        "duplicates": ["0a1b2c3d"],
        "commands": {"rejected": 2},
    }


def test_prometheus_endpoint_exposes_the_stage_metrics() -> None:
    m, other = Metrics(), Metrics()  # own registries: several instances may coexist
    m.update(_fields())
    port = m.start_http(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        m.stop_http()
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("edge_agent_stage_latency_window_seconds{")
        and 'stage="infer"' in x
        and 'quantile="0.5"' in x
    )
    assert float(line.split()[-1]) == pytest.approx(0.0505, abs=1e-4)
    assert 'edge_agent_camera_fps{camera="gate",direction="in"} 25.0' in text
    assert "edge_agent_mqtt_dropped_offline_total 7.0" in text
    assert "edge_agent_mqtt_refused_total 3.0" in text
    assert "edge_agent_mqtt_duplicate_device_agents 1.0" in text
    assert 'edge_agent_camera_stale_frames_total{camera="yard"} 4.0' in text
    assert 'edge_agent_stage_latency_seconds_count{stage="infer"} 100.0' in text  # the histogram
    assert other.registry is not m.registry


# ---- every field declared once (agent.telemetry.fields) ----------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def test_readme_table_is_made_from_the_declarations() -> None:
    text = (REPO / "README.md").read_text()
    section = re.split(r"\n##+ ", text.split("\n### Telemetry fields\n", 1)[1], maxsplit=1)[0]
    table = "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))
    behind = "README is behind agent/telemetry/fields.py: python -m agent.telemetry prints the table"
    assert table == readme_table(FIELDS), behind


def test_a_metric_fed_by_fields_that_disagree_is_refused() -> None:
    fps = next(f for f in FIELDS if f.path.endswith(".fps_in"))
    other = replace(fps, path="cameras.{camera}.fps_x", help="Something else")
    with pytest.raises(ValueError, match=r"fps_in and cameras\.\{camera\}\.fps_x feed camera_fps unlike"):
        metric_specs([fps, other])
    with pytest.raises(ValueError, match="a metric exactly when it is not payload-only"):
        Field("x.y", Kind.GAUGE, "", Shards.SUM, "X")


# Raw values of the fields whose metric value is made from something else than a number.
_RAW = {"mqtt.duplicates": ["0a1b2c3d", "4e5f6a7b"], "shards.{shard}.state": "running"}
_KEYS = {"camera": "cam{k}", "model": "model{k}", "gpu": "0"}  # other wildcards: "x"


def _put(tree: dict[str, Any], path: str, value: Any, k: int) -> None:
    """``value`` at ``path`` in ``tree``, each wildcard given its key (``_KEYS``, shard ``k``), unless the
    tree has a value there already."""
    segments = path.split(".")
    *parents, last = (_KEYS.get(s[1:-1], "x").format(k=k) if s.startswith("{") else s for s in segments)
    for p in parents:
        tree = tree.setdefault(p, {})
    tree.setdefault(last, value)


def _every_field() -> dict[str, Any]:
    """A sharded supervisor's payload fields (agent.telemetry.sharded_telemetry) from inputs with a value at
    every declared path: two shard reports (a camera, a model each), the supervisor's MQTT stats, NVML
    reading and shard rows; the stages from a real window."""
    reports: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    mqtt: dict[str, Any] = {}
    gpu: dict[str, Any] = {}
    rows = [{"shard": k, "state": "running", "gpu": 0, "cameras": [f"cam{k}"]} for k in (0, 1)]
    for i, f in enumerate(FIELDS):
        section, _, rest = f.path.partition(".")
        text = f.kind in (Kind.PAYLOAD, Kind.INFO)
        raw = _RAW.get(f.path, f"{f.path} {i}" if text else float(i + 1))
        if f.shards is Shards.OWNER or f.shards in (Shards.SUM, Shards.MEAN):
            for k, report in reports.items():
                _put(report, f.path, raw, k)
        elif section == "mqtt":
            _put(mqtt, rest, raw, 0)
        elif section == "gpu" and not rest.endswith(("shards", "nvdec_sessions")):  # the supervisor adds them
            _put(gpu, rest, raw, 0)
        elif section == "shards":
            for k, row in enumerate(rows):
                _put({"row": row}, "row" + f.path.split("}", 1)[1], raw, k)
    reports[0]["cameras"]["cam0"]["decoder"] = "nvdec"  # counted in gpu.0.nvdec_sessions
    window = StageWindow()
    for ms in (1.0, 2.0, 30.0):
        window.add_many({"infer": ms, "total": ms + 1.0})
    return sharded_telemetry(rows, reports, window.summary(), mqtt, gpu=gpu)


def test_every_declared_field_reaches_the_payload_and_prometheus() -> None:
    fields = _every_field()
    body = json.loads(payload("telemetry", **fields))
    assert body["gpu"]["0"]["nvdec_sessions"] == 1 and body["process"]["processes"] == 3
    missing = [f.path for f in FIELDS if f.kind is not Kind.HISTOGRAM and not list(walk(f.path, body))]
    assert not missing, missing
    m = Metrics()
    m.update(fields)
    port = m.start_http(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        m.stop_http()
    exposed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    checked = set()
    for f in FIELDS:
        if not f.metric:
            continue
        name = exposed_name(f, "edge_agent")
        assert kinds[name] == f.kind.prometheus, name
        if f.kind is Kind.HISTOGRAM:
            for stage, (counts, _) in fields["stages"].histograms.items():
                assert exposed[(f"{name}_count", (("stage", stage),))] == sum(counts)
                checked.add(f.path)
            continue
        for keys, raw in walk(f.path, body):
            values = (*keys, *(v for _, v in f.const), *((str(raw),) if f.info else ()))
            labels = tuple(sorted(zip(f.labels, values, strict=True)))
            expected = 1.0 if f.info else f.sample(raw)
            assert exposed.get((name, labels)) == pytest.approx(expected), (f.path, name, labels)
            checked.add(f.path)
    assert checked == {f.path for f in FIELDS if f.metric}


@pytest.mark.slow
def test_the_running_sharded_agent_publishes_every_declared_field(
    tmp_path: Path, mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    """Every declared field is in the real agent's telemetry (two shards, a zone and a line), and each value
    there that Prometheus shows has its series on /metrics. Not here: NVML (no GPU on this machine, unless
    there is one) and a shard's ``failure`` (only while it is down)."""
    prom = free_port()
    cams = {n: {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 4} for n in ("street", "yard")}
    right = {"polygon": [[0.5, 0], [1, 0], [1, 1], [0.5, 1]], "labels": ["person", "car"]}  # counted by label
    cams["street"]["zones"] = {"right": right}
    cams["street"]["lines"] = {"mid": {"points": [[0.5, 0], [0.5, 1]]}}
    cfg = {
        "device_id": "fields",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": cams,
        "mqtt": {"host": "127.0.0.1", "port": mqtt_broker.port, "keepalive": 5},
        "telemetry": {"interval_s": 1, "prometheus_port": prom},
        "pipeline": {"shards": 2},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/fields/telemetry")
    agent = AgentProcess(path, tmp_path / "agent.log")
    try:

        def both_streaming(msgs: list[Any]) -> bool:
            t = json.loads(msgs[-1][1]) if msgs else {}
            rows = t.get("shards") or []
            return len(t.get("cameras", {})) == 2 and len(rows) == 2 and all("process" in r for r in rows)

        assert wait_until(lambda: both_streaming(sub.snapshot()), 120), agent.text()[-3000:]
        body = json.loads(sub.snapshot()[-1][1])
        with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        agent.terminate(30)
        agent.kill()
    absent_here = ("shards.{shard}.failure",) + (("gpu.",) if not gpu_stats() else ())
    wanted = [f for f in FIELDS if f.kind is not Kind.HISTOGRAM and not f.path.startswith(absent_here)]
    missing = [f.path for f in wanted if not list(walk(f.path, body))]
    assert not missing, (missing, body)
    series = {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for f in FIELDS:
        if not f.metric or f.kind is Kind.HISTOGRAM:
            continue
        for keys, raw in walk(f.path, body):
            value = f.sample(raw)
            if value is None or (f.kind.prometheus == "counter" and value <= 0):  # no increase, no series
                continue
            values = (*keys, *(v for _, v in f.const), *((str(raw),) if f.info else ()))
            labels = tuple(sorted(zip(f.labels, values, strict=True)))
            assert (exposed_name(f, "edge_agent"), labels) in series, (f.path, labels)
