"""The soak's figures: availability per camera, the agent's own share, recovery times, RSS drift."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import leak_check
from soak_chaos import StateLog, camera_report, streaming_seconds


def test_streaming_seconds_counts_only_streaming_within_the_window() -> None:
    series = [(0.0, "starting"), (2.0, "streaming"), (10.0, "reconnecting"), (14.0, "streaming")]
    assert streaming_seconds(series, 0.0, 20.0) == pytest.approx(8.0 + 6.0)
    assert streaming_seconds(series, 5.0, 12.0) == pytest.approx(5.0)
    assert streaming_seconds([], 0.0, 10.0) == 0.0


def test_camera_report_separates_injected_outages_from_recovery() -> None:
    # The server is down 10-20 s; the agent notices at 12 s and streams again at 23 s (3 s recovery).
    series = [(0.0, "streaming"), (12.0, "reconnecting"), (23.0, "streaming")]
    faults = [{"kind": "camera_kill", "camera": "cam1", "down_at": 10.0, "up_at": 20.0}]
    r = camera_report("cam1", series, faults, (0.0, 100.0))
    assert r["availability"] == pytest.approx((12.0 + 77.0) / 100.0)
    # Outside the outage: 0-10 and 20-100 = 90 s, streaming 10 + 77 = 87 s (the 2 s of not noticing inside
    # the outage are not credited).
    assert r["availability_outside_outages"] == pytest.approx(87.0 / 90.0, abs=1e-4)
    assert r["recovery_s"] == {"p50": 3.0, "max": 3.0, "not_recovered": 0}
    assert r["outages"] == 1


def test_camera_report_counts_a_camera_that_never_came_back() -> None:
    series = [(0.0, "streaming"), (12.0, "reconnecting")]
    faults = [{"kind": "camera_stop", "camera": "cam1", "down_at": 10.0, "up_at": 20.0}]
    r = camera_report("cam1", series, faults, (0.0, 60.0))
    assert r["recovery_s"]["not_recovered"] == 1
    assert r["availability_outside_outages"] == pytest.approx(10.0 / 50.0)


def test_state_log_ignores_junk_and_keeps_transitions_only() -> None:
    log = StateLog(t0=0.0)
    log.on_message("edge-agent/soak/cameras/cam1/state", b'{"state": "streaming"}')
    log.on_message("edge-agent/soak/cameras/cam1/state", b'{"state": "streaming"}')
    log.on_message("edge-agent/soak/cameras/cam1/state", b"not json")
    log.on_message("edge-agent/soak/cameras/cam1/state", b"[1, 2]")
    log.on_message("edge-agent/soak/status", b'{"state": "online"}')
    assert [s for _, s in log.states["cam1"]] == ["streaming"]
    assert [s for _, s in log.status] == ["online"]


def test_leak_check_reports_the_slope_used_for_drift_per_hour() -> None:
    samples = [{"t_s": 60.0 * i, "rss_mb": 200.0 + 0.5 * i, "fds": 10, "threads": 20} for i in range(30)]
    check = leak_check(samples, {"rss_mb": 100.0, "rss_pct": 0.0, "fds": 2.0, "threads": 2.0})
    assert check["metrics"]["rss_mb"]["slope_per_min"] * 60 == pytest.approx(30.0, rel=1e-3)
