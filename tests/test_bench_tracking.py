"""`edge-agent bench --sections tracking` (agent.bench.tracking): the report's shape on a short run."""

from __future__ import annotations

from agent.bench.args import KNOWN_SECTIONS
from agent.bench.tracking import OBJECTS, summary, tracking_report


def test_tracking_section_reports_cost_quality_and_target() -> None:
    assert "tracking" in KNOWN_SECTIONS
    report = tracking_report(frames=60, repeats=1, seeds=1)
    assert set(report["cost_ms"]) == {str(n) for n in OBJECTS}
    for row in report["cost_ms"].values():
        for part in ("tracker", "analytics", "events"):
            assert row[part]["cpu_ms_mean"] > 0 and row[part]["wall_ms_p99"] >= row[part]["wall_ms_p50"]
    assert report["cost_ms"]["100"]["objects_in_view"] > report["cost_ms"]["20"]["objects_in_view"] > 10
    assert isinstance(report["meets_target"], bool) and report["target_ms"] == 0.1
    ours = report["quality"]["ours (greedy)"]
    assert ours["available"] and ours["crossing"]["id_switches"] == 0 and ours["crowd"]["idf1"] > 0.9
    for name, row in report["quality"].items():
        assert row["available"] or row["why"], name  # library trackers: there or said why not
    assert report["kernels"] == "compiled" and "Tracking (compiled), CPU per frame" in summary(report)
    for row in report["cost_ms"].values():
        assert row["analytics_numpy"]["cpu_ms_mean"] > 0  # the reference beside the kernels
