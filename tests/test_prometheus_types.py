"""Prometheus metric types (issue 29): what only grows is a counter (`_total`), latencies are histograms with
fixed buckets, the standard process/python collectors are served, and README's table lists every metric.

Everything is read the way Prometheus reads it: over HTTP from a real ``Metrics`` server (and once from
the real agent), parsed with prometheus_client's own text parser.
"""

from __future__ import annotations

import json
import pickle
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, wait_until
from fixtures_mqtt import free_port
from prometheus_client.parser import text_string_to_metric_families

from agent.mqtt.topics import payload
from agent.telemetry import (
    LATENCY_BUCKETS_MS,
    LATENCY_BUCKETS_S,
    Metrics,
    StageWindow,
    build_telemetry,
)

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
Scrape = Callable[[], str]


@pytest.fixture
def served() -> Iterator[tuple[Metrics, Scrape]]:
    """A Metrics with its /metrics on a free port, and a function that scrapes it."""
    m = Metrics()
    port = m.start_http(0, addr="127.0.0.1")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    try:
        yield m, scrape
    finally:
        m.stop_http()


def types(text: str) -> dict[str, str]:
    """{name on the TYPE line: type}, as Prometheus reads them."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def fields(
    window: StageWindow,
    *,
    dropped: int = 0,
    stale: int = 0,
    reconnects: int = 0,
    decode_errors: int = 0,
    loops: int = 0,
    mqtt: dict[str, Any] | None = None,
    shards: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Telemetry fields the way the daemon builds them (build_telemetry over StageWindow.summary())."""
    cam = {
        "fps_in": 25.0,
        "fps_out": 24.0,
        "dropped": dropped,
        "dropped_stale": stale,
        "reconnects": reconnects,
        "loops": loops,
        "decode_errors": decode_errors,
        "frame_age_ms": 40.0,
    }
    out = build_telemetry(
        cameras={"gate": cam},
        stages=window.summary(),
        backend={"detector": "onnxruntime"},
        batch_fill=0.5,
        process={"cpu_percent": 10.0, "rss_mb": 100.0},
        gpu={"0": {"util_percent": 50.0, "nvdec_sessions": 2, "decoder_util_percent": 30.0}},
        mqtt=mqtt or {},
    )
    if shards is not None:
        out["shards"] = shards
    return out


COUNTERS = [
    ("edge_agent_camera_dropped_frames_total", {"camera": "gate"}),
    ("edge_agent_camera_stale_frames_total", {"camera": "gate"}),
    ("edge_agent_camera_reconnects_total", {"camera": "gate"}),
    ("edge_agent_camera_decode_errors_total", {"camera": "gate"}),
    ("edge_agent_camera_loops_total", {"camera": "gate"}),
    ("edge_agent_mqtt_dropped_offline_total", {}),
    ("edge_agent_mqtt_refused_total", {}),
    ("edge_agent_mqtt_reconnects_total", {}),
    ("edge_agent_mqtt_commands_total", {"result": "accepted"}),
    ("edge_agent_shard_restarts_total", {"shard": "1"}),
]


def test_cumulative_values_are_counters_that_only_grow(served: tuple[Metrics, Scrape]) -> None:
    m, scrape = served
    w = StageWindow()

    def report(k: int) -> dict[str, Any]:
        return fields(
            w,
            dropped=10 * k,
            stale=3 * k,
            reconnects=k,
            decode_errors=2 * k,
            loops=k,
            mqtt={"dropped_offline": 5 * k, "refused": k, "reconnects": k, "commands": {"accepted": 4 * k}},
            shards=[{"shard": 1, "state": "running", "restarts": k, "device_memory_mb": 300.0}],
        )

    m.update(report(1))
    first = scrape()
    kinds = types(first)
    for name, _ in COUNTERS:
        assert kinds.get(name) == "counter", (name, kinds.get(name))
    m.update(report(3))
    second = scrape()
    for name, labels in COUNTERS:
        assert value(second, name, **labels) == 3 * value(first, name, **labels) > 0, name
    # Names kept where the type stayed: the gauges, and the shard metrics sharded.py feeds.
    for name in (
        "edge_agent_camera_fps",
        "edge_agent_camera_frame_age_seconds",
        "edge_agent_mqtt_queued",
        "edge_agent_shard_up",
        "edge_agent_shard_device_memory_bytes",
        "edge_agent_gpu_nvdec_sessions",
        "edge_agent_gpu_decoder_utilization_percent",
    ):
        assert kinds[name] == "gauge", name
    assert value(second, "edge_agent_gpu_nvdec_sessions", gpu="0") == 2
    assert value(second, "edge_agent_shard_device_memory_bytes", shard="1") == 300 * 2**20
    # The gauges that became counters are gone under their old names.
    for old in ("camera_dropped_frames", "camera_stale_frames", "mqtt_dropped_offline", "mqtt_refused"):
        assert f"edge_agent_{old}" not in kinds


def test_a_total_that_goes_down_counts_from_its_new_base(served: tuple[Metrics, Scrape]) -> None:
    """A camera restarted (a reload, a shard restart): its total starts again from 0. The counter never goes
    down; the new total is what happened since the restart, so it is added; later increases follow it."""
    m, scrape = served
    w = StageWindow()
    m.update(fields(w, dropped=100, reconnects=4))
    assert value(scrape(), "edge_agent_camera_dropped_frames_total", camera="gate") == 100
    m.update(fields(w, dropped=5, reconnects=0))  # restarted: 5 drops since
    after = scrape()
    assert value(after, "edge_agent_camera_dropped_frames_total", camera="gate") == 105
    assert value(after, "edge_agent_camera_reconnects_total", camera="gate") == 4
    m.update(fields(w, dropped=8, reconnects=1))
    after = scrape()
    assert value(after, "edge_agent_camera_dropped_frames_total", camera="gate") == 108
    assert value(after, "edge_agent_camera_reconnects_total", camera="gate") == 5
    m.update(fields(w, dropped=8, reconnects=1))  # the same totals again: nothing added
    assert value(scrape(), "edge_agent_camera_dropped_frames_total", camera="gate") == 108


def test_stage_latencies_are_histograms_with_the_documented_buckets(served: tuple[Metrics, Scrape]) -> None:
    m, scrape = served
    w = StageWindow(capacity=16)  # far fewer than the samples: the histogram still counts every one
    rng = np.random.default_rng(0)
    first_batch = rng.gamma(2.0, 6.0, 500)
    for ms in first_batch:
        w.add_many({"infer": float(ms), "queue": 0.3, "wait": None})
    m.update(fields(w))
    text = scrape()
    assert types(text)["edge_agent_stage_latency_seconds"] == "histogram"
    assert types(text)["edge_agent_stage_latency_window_seconds"] == "gauge"  # the window's exact quantiles
    s = samples(text)
    bounds = [f"{b}" for b in LATENCY_BUCKETS_S] + ["+Inf"]
    infer = [value(text, "edge_agent_stage_latency_seconds_bucket", le=le, stage="infer") for le in bounds]
    expected = [int(np.sum(first_batch <= b)) for b in LATENCY_BUCKETS_MS] + [500]
    assert infer == expected  # cumulative, exact per bucket, every sample (not only the ring's 16)
    assert value(text, "edge_agent_stage_latency_seconds_count", stage="infer") == 500
    assert value(text, "edge_agent_stage_latency_seconds_sum", stage="infer") == pytest.approx(
        first_batch.sum() / 1000.0
    )
    assert value(text, "edge_agent_stage_latency_seconds_bucket", le="0.0005", stage="queue") == 500
    assert ("edge_agent_stage_latency_seconds_count", (("stage", "wait"),)) not in s  # no sample, no series
    # The next window adds to it.
    for _ in range(20):
        w.add("infer", 3000.0)
    m.update(fields(w))
    later = scrape()
    assert value(later, "edge_agent_stage_latency_seconds_count", stage="infer") == 520
    assert value(later, "edge_agent_stage_latency_seconds_bucket", le="2.0", stage="infer") == expected[-1]
    assert value(later, "edge_agent_stage_latency_seconds_bucket", le="5.0", stage="infer") == 520
    m.update(fields(w))  # no new samples: nothing added
    assert value(scrape(), "edge_agent_stage_latency_seconds_count", stage="infer") == 520


def test_the_histogram_stays_out_of_the_mqtt_payload() -> None:
    w = StageWindow()
    for ms in (1.0, 2.0, 3.0):
        w.add("infer", ms)
    f = fields(w)
    counts, sum_ms = f["stages"].histograms["infer"]  # beside the rows, for Metrics
    assert counts[:5] == (0, 1, 1, 1, 0) and sum(counts) == 3 and sum_ms == 6.0  # le 1, 2 and 5 ms
    body = json.loads(payload("telemetry", **f))
    assert body["stages"] == {"infer": {"p50": 2.0, "p95": 2.9, "p99": 2.98, "n": 3}}


def test_sharded_latencies_reach_the_supervisors_histogram(served: tuple[Metrics, Scrape]) -> None:
    """Each shard drains its window over the pipe (pickled) after its own summary(), as agent.daemon does;
    the supervisor absorbs them and serves one histogram with every shard's samples."""
    m, scrape = served
    shards = [StageWindow(), StageWindow()]
    supervisor = StageWindow(capacity=2 * 2048)
    sent = 0
    for rnd in range(3):
        for k, shard in enumerate(shards):
            for i in range(3000):  # more than a shard's ring holds
                shard.add("total", 10.0 * (k + 1) + (i % 7))
                sent += 1
            shard.summary()  # the shard's own telemetry_fields() runs first
            drained = pickle.loads(pickle.dumps(shard.drain()))
            assert drained["total"][1] == 3000
            supervisor.absorb(drained)
        f = fields(supervisor)
        assert f["stages"]["total"]["n"] == 6000
        m.update(f)
        text = scrape()
        count = value(text, "edge_agent_stage_latency_seconds_count", stage="total")
        assert count == sent == 6000 * (rnd + 1)
    assert value(text, "edge_agent_stage_latency_seconds_bucket", le="0.005", stage="total") == 0
    # shard 0: 10..16 ms, shard 1: 20..26 ms (20 ms itself is in le=0.02)
    zero = [10.0 + (i % 7) for i in range(3000)]
    one = [20.0 + (i % 7) for i in range(3000)]
    le20 = 3 * (sum(x <= 20 for x in zero) + sum(x <= 20 for x in one))
    assert value(text, "edge_agent_stage_latency_seconds_bucket", le="0.02", stage="total") == le20
    assert value(text, "edge_agent_stage_latency_seconds_sum", stage="total") == pytest.approx(
        3 * (sum(zero) + sum(one)) / 1000.0
    )


def test_default_process_and_python_collectors_are_served(served: tuple[Metrics, Scrape]) -> None:
    _, scrape = served
    kinds = types(scrape())
    assert kinds["process_cpu_seconds_total"] == "counter"
    assert kinds["process_resident_memory_bytes"] == "gauge"
    assert kinds["process_open_fds"] == "gauge"
    assert kinds["python_gc_collections_total"] == "counter"
    assert kinds["python_info"] == "gauge"
    assert Metrics().registry is not Metrics().registry  # each instance has its own (tests run several)


def _readme_table() -> dict[str, str]:
    """{metric: type} of README's "Telemetry fields" table (field, unit, shards, metric, type, ...)."""
    text = (REPO / "README.md").read_text()
    section = re.split(r"\n##+ ", text.split("\n### Telemetry fields\n", 1)[1], maxsplit=1)[0]
    row = r"^\| `[^`]+` \| [^|]* \| [^|]* \| `(edge_agent_\w+)` \| (counter|gauge|histogram) \|"
    return dict(re.findall(row, section, re.M))


def test_readme_lists_every_metric_with_its_type(served: tuple[Metrics, Scrape]) -> None:
    m, scrape = served
    w = StageWindow()
    w.add("infer", 1.0)
    m.update(fields(w, mqtt={"commands": {"accepted": 1}}, shards=[{"shard": 0, "state": "running"}]))
    exposed = {
        name: kind
        for name, kind in types(scrape()).items()
        if name.startswith("edge_agent_") and not name.endswith("_created")
    }
    assert _readme_table() == exposed


# ---- the real agent ----------------------------------------------------------------------------------
def test_the_running_agent_serves_counters_and_growing_histograms(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    port = free_port()
    cfg = {
        "device_id": "prom-test",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 4}},
        "mqtt": {"enabled": False},
        "telemetry": {"interval_s": 0.5, "prometheus_port": port},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    agent = start_agent(path)
    seen: list[str] = []

    def count_at_least(n: float) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        seen.append(text)
        found = samples(text).get(("edge_agent_stage_latency_seconds_count", (("stage", "total"),)), 0.0)
        return found >= n

    assert wait_until(lambda: count_at_least(1), 60), agent.text()[-3000:]
    first = seen[-1]
    n1 = value(first, "edge_agent_stage_latency_seconds_count", stage="total")
    assert wait_until(lambda: count_at_least(n1 + 4), 30), agent.text()[-3000:]
    second = seen[-1]
    kinds = types(second)
    assert kinds["edge_agent_stage_latency_seconds"] == "histogram"
    assert kinds["edge_agent_camera_dropped_frames_total"] == "counter"
    assert kinds["edge_agent_camera_reconnects_total"] == "counter"
    assert kinds["process_cpu_seconds_total"] == "counter"
    for stage in ("queue", "preprocess", "infer", "postprocess", "total"):
        assert value(second, "edge_agent_stage_latency_seconds_count", stage=stage) >= n1 + 4, stage
    assert value(second, "edge_agent_stage_latency_seconds_sum", stage="total") > value(
        first, "edge_agent_stage_latency_seconds_sum", stage="total"
    )
    assert value(second, "edge_agent_stage_samples_total", stage="total") >= n1 + 4


# ---- cameras that go ----------------------------------------------------------------------------------
def _camera(dropped: int) -> dict[str, Any]:
    return {
        "fps_in": 4.0,
        "fps_out": 4.0,
        "dropped": dropped,
        "reconnects": 1,
        "frame_age_ms": 12.0,
        "tracking": {
            "tracks_active": 2,
            "tracks_started": 5,
            "events": {"new": 2},
            "zones": {"porch": {"person": 1}},
            "lines": {"gate": {"in": 1, "out": 0}},
        },
    }


def _cameras_in(text: str) -> set[str]:
    return {dict(labels).get("camera", "") for _name, labels in samples(text)} - {""}


def test_a_removed_camera_leaves_no_series(served: tuple[Metrics, Scrape]) -> None:
    """A camera removed or disabled by a reload loses every series (gauges would show its last values
    forever); one that comes back starts its counters at its reported totals."""
    m, scrape = served
    m.update({"cameras": {"street": _camera(3), "yard": _camera(7)}}, cameras=["street", "yard"])
    assert _cameras_in(scrape()) == {"street", "yard"}
    assert value(scrape(), "edge_agent_camera_dropped_frames_total", camera="yard") == 7
    # Gone from the config; its last payload row may still come in (a shard reporting late): not shown.
    m.update({"cameras": {"street": _camera(4), "yard": _camera(8)}}, cameras=["street"])
    text = scrape()
    assert _cameras_in(text) == {"street"}, text
    assert value(text, "edge_agent_camera_dropped_frames_total", camera="street") == 4
    # Back (re-enabled): a fresh series at the total it reports.
    m.update({"cameras": {"street": _camera(4), "yard": _camera(2)}}, cameras=["street", "yard"])
    text = scrape()
    assert value(text, "edge_agent_camera_dropped_frames_total", camera="yard") == 2
    assert value(text, "edge_agent_zone_objects", camera="yard", zone="porch", label="person") == 1
    # No camera list (a caller that does not know the config): nothing is removed.
    m.update({"cameras": {}})
    assert _cameras_in(scrape()) == {"street", "yard"}


def test_the_running_agent_drops_a_removed_camera_on_sighup(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    port = free_port()
    camera = {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 4}
    cfg = {
        "device_id": "prom-reload",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"street": camera, "yard": camera},
        "mqtt": {"enabled": False},
        "telemetry": {"interval_s": 0.5, "prometheus_port": port},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    agent = start_agent(path)
    last: list[str] = []

    def cameras_are(expected: set[str]) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                last.append(resp.read().decode())
        except OSError:
            return False
        return _cameras_in(last[-1]) == expected

    assert wait_until(lambda: cameras_are({"street", "yard"}), 90), agent.text()[-3000:]
    del cfg["cameras"]["yard"]
    path.write_text(yaml.safe_dump(cfg))
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: cameras_are({"street"}), 30), (last[-1:], agent.text()[-3000:])
