"""`edge-agent bench --sections fleet-cache,fleet-rollout` end to end, kept small (2 agents each, soak 1 s):
it starts mosquitto, docker-registry, nginx and the agents itself (agent/bench/fleet_cache.py,
fleet_rollout.py) and reports builds and pulls, bytes, the rollouts' exit codes, states and timelines."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_bench_fleet_sections_report_builds_pulls_and_rollouts(tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
    for binary in ("mosquitto", "nginx", "docker-registry"):
        if shutil.which(binary) is None and not Path(f"/usr/sbin/{binary}").exists():
            pytest.skip(f"needs {binary}")
    out = tmp_path / "out"
    args = ["--sections", "fleet-cache,fleet-rollout", "--fleet-agents", "2", "--soak", "1"]
    args += ["--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "agent.bench", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())

    cache = report["fleet_cache"]
    assert (cache["agents"], cache["builds"], cache["pulls"]) == (2, 1, 1), cache["cached"]["origins"]
    assert cache["independent"]["origins"] == {"built": 2}
    assert cache["cached"]["plans"] == 1  # every device serves the one plan built
    reg = cache["cached"]["registry"]
    assert reg["manifests_pushed"] == 1 and min(reg["bytes_pulled"], reg["bytes_stored"]) > 1_000_000
    assert cache["cached"]["agents_counted"]["hits"] == 1
    assert "1 build(s) + 1 pull(s)" in done.stdout

    rollout = report["fleet_rollout"]
    good, bad = rollout["good"], rollout["broken"]
    assert (good["cli"]["rc"], good["status"]) == (0, "done"), good["cli"]
    assert set(good["serving"].values()) == {"v2"} and not good["untouched"]
    assert "WAVE" in good["cli"]["stdout"]  # the table the operator sees
    assert bad["cli"]["rc"] == 1 and bad["touched"] == ["site-01"], bad["cli"]
    assert bad["untouched"] == ["site-02"] and set(bad["serving"].values()) == {"v2"}
    assert [stage for _, stage, _ in bad["timeline"]["site-01"]][-1] == "rejected"
    assert (out / "bench.png").exists() or "matplotlib" in done.stderr
