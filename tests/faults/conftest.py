"""Recovery times measured by the fault suite: each test records what it measured next to the bound it
asserted; the records go to a JSON file (under pytest's base temp dir, or $EDGE_AGENT_FAULT_REPORT) and to
the terminal summary, so a run of the suite yields the README table's numbers."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_RECORDS: list[dict[str, Any]] = []
_REPORT: list[Path] = []  # where the records were written (set on the first record)


def _report_path(factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("EDGE_AGENT_FAULT_REPORT")
    return Path(env) if env else factory.getbasetemp() / "fault-recovery.json"


@pytest.fixture
def record_recovery(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., None]:
    """``record_recovery(fault, measured_s, bound_s, what)``: keep one measured recovery time."""

    def record(fault: str, measured_s: float, bound_s: float, what: str) -> None:
        _RECORDS.append(
            {
                "test": request.node.nodeid,
                "fault": fault,
                "what": what,
                "measured_s": round(measured_s, 3),
                "bound_s": round(bound_s, 3),
                "at": round(time.time(), 3),
            }
        )
        path = _report_path(tmp_path_factory)
        if not _REPORT:
            _REPORT.append(path)
        doc = {
            "schema": "edge-agent/fault-recovery/1",
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "records": _RECORDS,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))

    return record


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _RECORDS:
        return
    tr = terminalreporter
    tr.section("fault recovery times (measured / asserted bound)")
    for r in _RECORDS:
        tr.write_line(f"{r['measured_s']:8.2f} s  (<= {r['bound_s']:.1f} s)  {r['fault']}: {r['what']}")
    if _REPORT:
        tr.write_line(f"written to {_REPORT[0]}")
