"""`edge-agent demo`: bundled model + clip on ONNX Runtime, console lines, MQTT only when a broker answers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_mqtt import Broker, Subscriber, free_port

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"^\d\d:\d\d:\d\d street\s+(\d+\.\d) fps\s+infer\s+[\d.]+ ms\s+total\s+[\d.]+ ms\s+\[onnxruntime/fp32"
)

pytestmark = pytest.mark.slow


def run_demo(port: int, seconds: float) -> tuple[int, str, str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--mqtt-port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(seconds)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        return proc.returncode, out, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def console_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if LINE.match(line)]


def test_demo_without_broker_prints_detections_quietly() -> None:
    rc, out, err, took = run_demo(free_port(), seconds=8)
    assert rc == 0, err
    assert took < 5
    lines = console_lines(out)
    assert len(lines) >= 3, out
    assert any(re.search(r"\b(car|person) x\d", line) for line in lines), out
    # The clip is paced to its own 25 fps; the model keeps up or drops frames, never lags behind.
    assert all(float(LINE.match(line).group(1)) > 5 for line in lines[1:]), out  # type: ignore[union-attr]
    # No broker: retried quietly, no warnings or tracebacks on stderr.
    assert "Traceback" not in err and "WARNING" not in err and "ERROR" not in err, err


def test_demo_publishes_when_a_broker_answers(
    mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/+/cameras/street/detections")
    rc, out, err, _ = run_demo(mqtt_broker.port, seconds=8)
    assert rc == 0, err
    assert console_lines(out), out
    payloads = [json.loads(p) for _, p, _ in sub.snapshot()]
    assert len(payloads) >= 20
    labels = {d["label"] for p in payloads for d in p["detections"]}
    assert labels & {"car", "person"}


@pytest.mark.parametrize("what", ["missing", "directory", "not a video", "unreadable"])
def test_demo_with_a_clip_it_cannot_play_exits_2_naming_it(tmp_path: Path, what: str) -> None:
    """Issue 36 (12): before, the camera retried such a clip forever and the demo never ended (the timeout
    below fired); now exit 2 at once, the path and the reason on stderr."""
    import os

    clip = tmp_path / "clip.mp4"
    reason = {
        "missing": "no such file",
        "directory": "is a directory, not a file",
        "not a video": "not a video FFmpeg can decode (no first frame)",
        "unreadable": "cannot read (Permission denied)",
    }[what]
    if what == "directory":
        clip.mkdir()
    elif what != "missing":
        clip.write_bytes(b"\x00\x00\x00\x18ftypmp42 and then nothing a decoder wants")
        if what == "unreadable":
            clip.chmod(0)
            if os.access(clip, os.R_OK):
                pytest.skip("root reads a file without permissions")
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--clip", str(clip), "--mqtt-port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"edge-agent demo: --clip {clip}: {reason}"
