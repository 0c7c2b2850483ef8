"""The lifecycle's contracts on real components: the plan per TensorRT flavour, the child's JSON request,
read-only `check`, FP16 capturing held-out frames only, `--wait` on every precision.

TensorRT-RTX (strongly typed) is real here; weakly typed TensorRT (<= 10) is not installable, so its
capabilities are a `fake_` object with the two answers the plan asks for.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from fixtures_agent import run_cli

from agent.config import ConfigError, load_config
from agent.lifecycle.job import JobRequest
from agent.lifecycle.model import ModelContext
from engines.plan import Step, candidates, plan_steps
from engines.precision import parse_precision
from engines.store import EngineStore

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"


class fake_weakly_typed:
    strongly_typed = False

    def precisions(self) -> list[str]:
        return ["fp32", "fp16", "int8"]


def test_plan_per_flavour() -> None:
    trt = pytest.importorskip("tensorrt_rtx")
    del trt
    from engines.trt import import_trt

    rtx = import_trt("tensorrt_rtx")
    assert rtx.strongly_typed
    assert plan_steps("best", rtx) == [
        Step("int8"),
        Step("int8", folded=True, only_if_build_failed=True),
        Step("fp16"),
        Step("fp32"),
    ]
    assert plan_steps("fp16", rtx) == [Step("fp16"), Step("fp32")]
    assert plan_steps("fp32", rtx) == [Step("fp32")]
    weak = fake_weakly_typed()
    assert plan_steps("int8", weak) == [Step("int8", calibrator=True), Step("fp16"), Step("fp32")]
    assert candidates("best") == candidates("int8") == ("int8", "fp16", "fp32")
    with pytest.raises(ValueError, match="'fp8' is not one of fp32, fp16, int8, best"):
        parse_precision("fp8")


def write_config(tmp_path: Path, precision: str, samples: int = 40, min_agreement: float = 0.9) -> Path:
    data = {
        "device_id": "life",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "det": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "tensorrt_rtx",
                "precision": precision,
                "calibration": {"samples": samples, "method": "minmax"},
                "accuracy_gate": {"min_agreement": min_agreement},
            }
        },
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "det", "min_score": 0.35}},
        "mqtt": {"enabled": False},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_job_request_round_trip_and_bad_requests(tmp_path: Path) -> None:
    ctx = ModelContext.from_config(load_config(write_config(tmp_path, "best")), "det")
    assert ctx.score_threshold == 0.35 and ctx.cfg.onnx.is_absolute()
    req = JobRequest(ctx, "best", force=True, lock_wait_s=None)
    assert JobRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    bad = req.to_json()
    bad["precision"] = "fp8"
    with pytest.raises(ConfigError, match="job request: precision: 'fp8'"):
        JobRequest.from_json(bad)
    bad = req.to_json()
    bad["model"]["model"]["batch"] = {"min": 4, "opt": 1, "max": 1}
    with pytest.raises(ConfigError, match="job request: model context"):
        JobRequest.from_json(bad)
    # The child answers garbage on stdin with one failure result, exit 2.
    for stdin in (b"not json", b"[]", json.dumps({"precision": "fp16"}).encode()):
        p = subprocess.run(
            [sys.executable, "-m", "agent.lifecycle.job"],
            input=stdin,
            capture_output=True,
            cwd=REPO,
            timeout=60,
        )
        assert p.returncode == 2, p.stderr
        event = json.loads(p.stdout.splitlines()[-1])
        assert event["event"] == "result" and event["ok"] is False and "bad job request" in event["error"]


pytestmark_rtx = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import tensorrt_rtx"], capture_output=True).returncode != 0,
    reason="CI installs tensorrt-rtx (test extra)",
)


@pytestmark_rtx
@pytest.mark.slow
def test_fp16_captures_held_out_only_and_check_is_read_only(tmp_path: Path) -> None:
    config = write_config(tmp_path, "fp16", samples=90)
    cal = tmp_path / "engines" / "det" / "calibration"

    before = run_cli("check", "-c", str(config), "--json")
    assert before.returncode == 1 and not cal.exists(), "check must not capture anything"

    built = run_cli("rebuild", "-c", str(config))
    assert built.returncode == 0, built.stderr
    assert "fp16 -> fp16" in built.stdout and "gate fp16 passed" in built.stdout
    m = json.loads((cal / "calibration.json").read_text())
    # FP16 needs no calibration frames: only the gate's held-out ones (samples/9, at least 20).
    assert m["samples"] == 0 and m["held_out_count"] == 20 and m["frames"] == []
    assert run_cli("check", "-c", str(config)).returncode == 0

    # int8 asks for calibration frames: the held-out-only set is replaced by a full one.
    config = write_config(tmp_path, "int8", samples=30, min_agreement=0.5)  # INT8 passes at 0.5
    listing = sorted(p.name for p in cal.rglob("*"))
    check = run_cli("check", "-c", str(config), "--json")
    assert check.returncode == 1
    assert "not validated" in " ".join(json.loads(check.stdout)["models"]["det"]["reasons"])
    assert sorted(p.name for p in cal.rglob("*")) == listing, "check quantised or converted something"

    built = run_cli("rebuild", "-c", str(config))
    assert built.returncode == 0, built.stderr
    m = json.loads((cal / "calibration.json").read_text())
    assert m["samples"] == 30 and m["held_out_count"] == 20
    assert "gate int8/minmax passed" in built.stdout and "int8 -> int8" in built.stdout
    ok = run_cli("check", "-c", str(config), "--json")
    assert ok.returncode == 0, ok.stdout

    # A Q/DQ model deleted behind the agent's back: check says why, and still makes nothing.
    for qdq in (cal / "models").glob("int8-*.onnx"):
        qdq.unlink()
    listing = sorted(p.name for p in cal.rglob("*"))
    again = run_cli("check", "-c", str(config), "--json")
    entry = json.loads(again.stdout)["models"]["det"]
    assert again.returncode == 1 and "graph is missing" in entry["reasons"][0], entry
    assert sorted(p.name for p in cal.rglob("*")) == listing


@pytestmark_rtx
@pytest.mark.slow
def test_wait_is_honoured_for_gated_precisions(tmp_path: Path) -> None:
    config = write_config(tmp_path, "fp16")
    store = EngineStore(tmp_path / "engines")
    with store.lock("det", wait_s=0):
        busy = run_cli("rebuild", "-c", str(config), "--wait", "0")
    assert busy.returncode == 2 and "another build of model 'det' is running" in busy.stderr

    lock = store.lock("det", wait_s=0)
    lock.acquire()
    released = threading.Event()

    def release_later() -> None:
        time.sleep(3.0)
        lock.release()
        released.set()

    threading.Thread(target=release_later, daemon=True).start()
    waited = run_cli("rebuild", "-c", str(config), "--wait", "60")
    assert released.is_set()
    assert waited.returncode == 0, waited.stderr
    assert "fp16 -> fp16" in waited.stdout


def test_streams_build_one_profile_set_per_context(tmp_path: Path) -> None:
    from engines.settings import onnx_input_shapes, resolve_profiles

    cfg = load_config(write_config(tmp_path, "fp32"))
    ctx = ModelContext.from_config(cfg, "det")
    assert ctx.cfg.streams == 2 and ctx.build_settings().contexts == 2
    three = ModelContext("det", ctx.cfg.model_copy(update={"streams": 3}), ctx.engine_dir, 0.4)
    profiles = resolve_profiles(three.build_settings(), onnx_input_shapes(ctx.cfg.onnx))
    assert len(profiles) == 3 and profiles[0] == profiles[1] == profiles[2]
    bad = write_config(tmp_path, "fp32")
    data = yaml.safe_load(bad.read_text())
    data["models"]["det"]["streams"] = 0
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"models\.det\.streams"):
        load_config(bad)


def test_killed_parent_takes_its_child_along(tmp_path: Path) -> None:
    """SIGKILL of `edge-agent rebuild` or of the daemon must not leave its build child running with the
    model's lock: a child started by start_child dies with its parent (here one that would sleep 60 s)."""
    import os
    import signal

    import psutil

    pid_file = tmp_path / "child.pid"
    parent_code = f"""
import sys, time
from engines.buildproc import start_child
child = [sys.executable, "-c", "import os, time; from engines.buildproc import die_with_parent; "
         "die_with_parent(); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
start_child(child, {{}}, None)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        child = psutil.Process(int(pid_file.read_text()))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)

        def running(p: psutil.Process) -> bool:  # a zombie is dead, only not yet reaped by its new parent
            try:
                return p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        gone_by = time.monotonic() + 5.0
        while running(child) and time.monotonic() < gone_by:
            time.sleep(0.02)
        assert not running(child), f"child {child.pid} outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
