"""tools/soak.py: its leak check on known series, and the 60-second soak of the real agent that CI runs
(README "Faults and recovery" documents the 10-minute one)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from fixtures_mqtt import MOSQUITTO

from faults.harness import REPO

SOAK = REPO / "tools" / "soak.py"
TOLERANCE = {"rss_mb": 20.0, "rss_pct": 5.0, "fds": 2.0, "threads": 2.0}
SAMPLE_KEYS = {
    "t_s",
    "rss_mb",
    "fds",
    "threads",
    "cpu_percent",
    "frame_age_ms",
    "latency_p95_ms",
    "infer_p95_ms",
    "fps_out",
    "dropped_offline",
    "telemetry_age_s",
}


def soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("edge_agent_soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def series(rss: list[float], fds: list[int] | None = None, threads: list[int] | None = None) -> list[dict]:
    n = len(rss)
    fds = fds or [12] * n
    threads = threads or [20] * n
    return [{"t_s": 10.0 * i, "rss_mb": rss[i], "fds": fds[i], "threads": threads[i]} for i in range(n)]


def test_leak_check_tells_growth_from_noise() -> None:
    soak = soak_module()
    flat = soak.leak_check(series([200, 215, 201, 199, 214, 200, 202, 201, 203]), TOLERANCE)
    assert flat["passed"], flat["problems"]
    assert flat["metrics"]["rss_mb"]["growth"] == pytest.approx(1.0)
    # 6 MB per sample: the thirds' medians 206 -> 242 MB, more than 20 MB + 5 % of 206 MB allowed.
    leak = soak.leak_check(series([200 + 6 * i for i in range(9)]), TOLERANCE)
    assert not leak["passed"] and "rss_mb grew by 36.0" in leak["problems"][0]
    assert leak["metrics"]["rss_mb"]["slope_per_min"] == pytest.approx(36.0)
    fds = soak.leak_check(series([200] * 9, fds=[12, 12, 12, 13, 14, 15, 15, 16, 16]), TOLERANCE)
    assert not fds["passed"] and fds["problems"][0].startswith("fds grew by 4.0")
    threads = soak.leak_check(series([200] * 9, threads=[20, 20, 20, 21, 21, 21, 22, 22, 22]), TOLERANCE)
    assert threads["passed"]  # +2 is within the tolerance
    assert not soak.leak_check(series([200, 200]), TOLERANCE)["passed"]  # too few samples to tell


@pytest.mark.slow
def test_soak_60s_no_growth(tmp_path: Path) -> None:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    out = tmp_path / "soak"
    cmd = [sys.executable, str(SOAK), "--start-broker", "--cameras", "2", "--fps", "4"]
    cmd += ["--duration", "60", "--interval", "5", "--warmup", "15", "--require-telemetry", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    report_path = out / "soak.json"
    assert report_path.is_file(), done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    log = (out / "agent.log").read_text() if (out / "agent.log").is_file() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nagent log:\n{log[-3000:]}"

    assert report["schema"] == "edge-agent/soak/1"
    assert report["result"] == "pass" and report["errors"] == []
    assert report["leak_check"] == {"passed": True, "problems": []}
    assert report["duration_s"] == 60 and report["interval_s"] == 5 and report["warmup_s"] == 15
    samples = report["samples"]
    assert len(samples) == 13, [s["t_s"] for s in samples]  # 0, 5, ..., 60
    for s in samples:
        assert set(s) == SAMPLE_KEYS, s
        assert s["rss_mb"] > 50 and s["fds"] > 0 and s["threads"] > 0
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    # Telemetry arrived for (almost) every sample: frame age and latency are there and sane.
    with_tele = [s for s in samples if s["latency_p95_ms"] is not None]
    assert len(with_tele) >= len(samples) - 1
    assert all(0 <= s["frame_age_ms"] < 5000 for s in with_tele), [s["frame_age_ms"] for s in with_tele]
    assert all(s["latency_p95_ms"] > 0 and s["fps_out"] > 0 for s in with_tele)
    for name in ("rss_mb", "fds", "threads"):
        m = report["summary"][name]
        assert m["ok"] and m["growth"] <= m["allowed"], (name, m)
    assert report["agent"]["exit_code"] == 0 and report["agent"]["stop_s"] < 5.0
    assert report["telemetry_received"] >= 10
    if importlib.util.find_spec("matplotlib") is not None:
        assert report["plot"] and Path(report["plot"]).stat().st_size > 10_000
    assert "Traceback" not in log
