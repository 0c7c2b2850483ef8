"""Telemetry windows, rates, payload and the Prometheus endpoint."""

from __future__ import annotations

import json
import types
import urllib.request

import numpy as np
import pytest

from agent.mqtt.topics import payload
from agent.telemetry import (
    Metrics,
    RateCounter,
    StageWindow,
    build_telemetry,
    gpu_stats,
    process_stats,
)
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
    assert nvml.info(0) == GpuInfo("NVIDIA Fake", "8.9", "580.65.06", None, "pynvml")
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
