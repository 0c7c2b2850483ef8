"""`edge-agent bench --sections deploy` end to end, kept short (one run, 2 s windows): it starts mosquitto,
nginx and the agent itself, deploys a second version of the bundled NanoDet over cmd/deploy and reports
command to serving, the seconds of each stage and the frames processed meanwhile (agent/bench/deploy.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_deploy_section_reports_command_to_serving(tmp_path: Path) -> None:
    for binary in ("mosquitto", "nginx"):
        if shutil.which(binary) is None and not Path(f"/usr/sbin/{binary}").exists():
            pytest.skip(f"needs {binary}")
    out = tmp_path / "out"
    args = ["--sections", "deploy", "--duration", "2", "--warmup", "0", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "agent.bench", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads((out / "bench.json").read_text())["deploy"]
    assert section["cameras"] == 2
    (run,) = section["runs"]
    assert run["stage"] == "serving", run["reason"]
    assert set(run["stage_s"]) == {"accepted", "downloading", "verifying", "building", "gating", "shadow"}
    assert run["command_to_serving_s"] > 0
    assert abs(sum(run["stage_share"].values()) - 1.0) < 0.01
    assert run["frames_before_per_s"] > 0 and run["frames_during_per_s"] > 0
    assert set(run["frames_by_camera_during"]) == {"cam1", "cam2"}
    assert run["state"]["checks"]["gate"]["agreement"] == 1.0  # the same weights, a new file
    assert "deploy bench-1: serving in" in done.stdout
