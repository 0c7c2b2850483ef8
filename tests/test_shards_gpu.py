"""The sharded daemon on a GPU box: two shards of NVDEC cameras (ONNX Runtime serving); one shard SIGKILLed
(what a crash in a decoder does to its process) is restarted and its cameras stream again while the other
shard's cameras keep streaming; SIGTERM stops everything. Run on the device box (marked gpu; CI skips it):

    python3 -m pytest -m gpu tests/test_shards_gpu.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"


def _clip(tmp_path: Path) -> Path:
    """An H.264 elementary stream of the bundled clip at 1080p (NVDEC needs a codec it decodes)."""
    out = tmp_path / "bikes-1080p.h264"
    tool = REPO / "tools" / "make_clip.py"
    subprocess.run(
        [sys.executable, str(tool), "--size", "1920x1080", "--codec", "h264", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def _wait(path: Path, pattern: str, timeout: float, start: int = 0) -> re.Match[str] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(errors="replace")[start:], re.M)
        if m:
            return m
        time.sleep(0.2)
    return None


def test_two_nvdec_shards_survive_a_killed_shard(tmp_path: Path) -> None:
    pytest.importorskip("PyNvVideoCodec")
    given = os.environ.get("EDGE_AGENT_GPU_CLIP")
    clip = Path(given) if given else _clip(tmp_path)
    pipeline = {"shards": 2, "restart": {"min_s": 0.5, "max_s": 2}}
    log = tmp_path / "agent.log"
    proc = _run(_config(tmp_path, clip, pipeline, pinned=True), log)
    try:
        assert _wait(log, r"agent\.supervisor: ready: 8/8 cameras streaming", 120), log.read_text()[-4000:]
        m = _wait(log, r"shard 1: running \(pid (\d+)", 1)
        assert m is not None
        pid = int(m.group(1))
        mark = len(log.read_text(errors="replace"))
        os.kill(pid, signal.SIGKILL)
        assert _wait(log, r"shard 1: killed by SIGKILL; restarting", 20, mark)
        back = _wait(log, r"shard 1: running \(pid (\d+)", 60, mark)
        assert back is not None and int(back.group(1)) != pid
        assert _wait(log, r"shard1 pipelines\.sources: camera cam\d: streaming", 60, mark)
        assert proc.poll() is None  # the supervisor and shard 0 went on
        after = log.read_text(errors="replace")[mark:]
        assert not re.search(r"shard0 .*camera cam\d: (reconnecting|starting)", after), after[-3000:]
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        print(log.read_text(errors="replace")[-6000:])


def _config(
    tmp_path: Path,
    clip: Path,
    pipeline: dict,
    preprocess: str = "cpu",
    port: int | None = None,
    pinned: bool = False,
) -> Path:
    """8 NVDEC cameras of the clip, ONNX Runtime serving; `pinned`: cameras alternate between shards 0, 1."""
    cams = {f"cam{i}": {"url": str(clip), "model": "det", "decoder": "nvdec", "fps": 25} for i in range(8)}
    if pinned:
        for i, cam in enumerate(cams.values()):
            cam["shard"] = i % 2
    cfg = {
        "device_id": "shards-gpus",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "det": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "labels": str(ASSETS / "coco.names"),
                "format": "nanodet",
                "backend": "onnxruntime",
                "preprocess": preprocess,
            }
        },
        "cameras": cams,
        "mqtt": {"enabled": False},
        "telemetry": {"interval_s": 1, "prometheus_port": port},
        "pipeline": pipeline,
    }
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _metrics(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "-c", str(config), "--log-level", "info"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def _gpu_count() -> int:
    from engines.cuda.gpu_probe import NVML

    return NVML.count()


def test_shards_spread_over_every_gpu(tmp_path: Path) -> None:
    """Two GPUs and `shards: auto` without pipeline.gpus: shards on both, NVDEC sessions on each."""
    pytest.importorskip("PyNvVideoCodec")
    if _gpu_count() < 2:
        pytest.skip("needs two GPUs (the nvidia-h100-x2 kind)")
    given = os.environ.get("EDGE_AGENT_GPU_CLIP")
    clip = Path(given) if given else _clip(tmp_path)
    port = _free_port()
    log = tmp_path / "agent.log"
    proc = _run(_config(tmp_path, clip, {"shards": 2}, port=port), log)
    try:
        assert _wait(log, r"agent\.supervisor: ready: 8/8 cameras streaming", 120), log.read_text()[-4000:]
        time.sleep(2.5)  # a telemetry interval or two
        m = _metrics(port)
        assert m.get('edge_agent_gpu_nvdec_sessions{gpu="0"}') == 4, m
        assert m.get('edge_agent_gpu_nvdec_sessions{gpu="1"}') == 4, m
        assert m.get('edge_agent_shard_up{shard="0"}') == 1 and m.get('edge_agent_shard_up{shard="1"}') == 1
        assert m.get('edge_agent_shard_device_memory_bytes{shard="1"}', 0) > 0, m
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        print(log.read_text(errors="replace")[-4000:])


def test_a_gpu_that_fails_fails_only_its_shards(tmp_path: Path) -> None:
    """pipeline.gpus names a GPU that is not there: its shard fails to start (GPU preprocessing cannot
    run) and retries with backoff, with the reason on its cameras; the other shard's cameras stream."""
    pytest.importorskip("PyNvVideoCodec")
    given = os.environ.get("EDGE_AGENT_GPU_CLIP")
    clip = Path(given) if given else _clip(tmp_path)
    port = _free_port()
    log = tmp_path / "agent.log"
    pipeline = {"shards": 2, "gpus": [0, 9], "restart": {"min_s": 1, "max_s": 2}}
    proc = _run(_config(tmp_path, clip, pipeline, preprocess="gpu", port=port), log)
    try:
        assert _wait(log, r"some pipeline shards did not start .*shard 1: .*gpu is not available", 120), (
            log.read_text()[-4000:]
        )
        assert _wait(log, r"agent\.supervisor: ready: 4/8 cameras streaming", 60), log.read_text()[-4000:]
        assert _wait(log, r"shard 1: failed to start", 30)
        time.sleep(2.5)
        m = _metrics(port)
        assert (
            m.get('edge_agent_shard_up{shard="0"}') == 1 and m.get('edge_agent_shard_up{shard="1"}') == 0
        ), m
        assert m.get('edge_agent_shard_restarts_total{shard="1"}', 0) >= 1, m
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        print(log.read_text(errors="replace")[-4000:])
