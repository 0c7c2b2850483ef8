"""Camera states over MQTT, from the real agent (a subprocess) on real sources (issue 23): a looping file is a
healthy camera, a file that does not loop ends, a server that closes every 2 s reconnects each time, and a
frozen camera is never shown "streaming" while it sends nothing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import pytest
from fixtures_agent import AgentProcess, decoded, wait
from fixtures_mqtt import Broker, Subscriber
from test_annexb_rtsp import serve

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"

pytestmark = pytest.mark.slow


def annexb_head(path: Path, packets: int) -> Path:
    """The bundled clip's first `packets` access units as a raw H.264 file (30: up to its second IDR)."""
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    with path.open("wb") as f:
        for _ in range(packets):
            ok, packet = cap.read()
            assert ok
            f.write(packet.tobytes())
    cap.release()
    return path


def states_of(msgs: list, camera: str) -> list[dict]:
    return decoded(msgs, f"/cameras/{camera}/state")


def test_camera_states_over_mqtt(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    short = annexb_head(tmp_path / "short.h264", 30)  # 1.2 s a pass at 25 fps; raw H.264 cannot seek
    served = annexb_head(tmp_path / "served.h264", 250)
    with (
        serve(served, fps=25, close_after=2.0) as (flap_url, _),
        serve(served, fps=25) as (frozen_url, frozen),
    ):
        cams = {
            "looped": f"{{url: {short}, loop: true}}",
            "once": f"{{url: {short}, loop: false}}",
            "flap": f"{{url: '{flap_url}'}}",
            "frozen": f"{{url: '{frozen_url}'}}",
        }
        lines = "\n".join(
            f"  {n}: {c[:-1]}, model: detector, fps: 5, read_timeout_s: 1, open_timeout_s: 3}}"
            for n, c in cams.items()
        )
        config = tmp_path / "agent.yaml"
        config.write_text(
            f"""
device_id: states
engine_dir: {tmp_path / "engines"}
models:
  detector: {{onnx: {ASSETS / "nanodet-m-416.onnx"}, format: nanodet, labels: {ASSETS / "coco.names"},
              backend: onnxruntime, precision: fp32}}
cameras:
{lines}
mqtt: {{host: 127.0.0.1, port: {mqtt_broker.port}, keepalive: 5}}
telemetry: {{interval_s: 1}}
"""
        )
        sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/states/#")
        agent = start_agent(config)

        # A file that does not loop plays once and ends: a clear state, not an error.
        msgs = wait(
            sub, lambda m: any(s["state"] == "ended" for s in states_of(m, "once")), 40, agent, "ended"
        )
        ended = [s for s in states_of(msgs, "once") if s["state"] == "ended"][-1]
        assert ended["last_error"] is None and ended["reconnects"] == 0

        # A server that closes every 2 s: reconnecting ("stream ended") and streaming again, each time.
        msgs = wait(
            sub,
            lambda m: any(s["reconnects"] >= 2 and s["state"] == "streaming" for s in states_of(m, "flap")),
            40,
            agent,
            "flap reconnected twice",
        )
        flap = states_of(msgs, "flap")
        assert any(s["state"] == "reconnecting" and "stream ended" in (s["last_error"] or "") for s in flap)

        # The looping file: passes counted, never a reconnect, never another state.
        msgs = wait(
            sub, lambda m: any(s["loops"] >= 3 for s in states_of(m, "looped")), 30, agent, "looped passes"
        )
        looped = states_of(msgs, "looped")
        assert {s["state"] for s in looped} <= {"starting", "streaming"}
        assert all(s["reconnects"] == 0 and s["last_error"] is None for s in looped)
        tele = decoded(msgs, "/telemetry")[-1]["cameras"]
        assert tele["looped"]["loops"] >= 3 and tele["looped"]["reconnects"] == 0

        # A frozen camera (SIGSTOP keeps the connection, sends nothing): reconnecting within the read
        # timeout, and no "streaming" state while it stays frozen.
        wait(
            sub,
            lambda m: any(s["state"] == "streaming" for s in states_of(m, "frozen")),
            30,
            agent,
            "frozen up",
        )
        os.kill(frozen.pid, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            msgs = wait(
                sub,
                lambda m: any(
                    s["state"] == "reconnecting" and s["ts"] > frozen_at for s in states_of(m, "frozen")
                ),
                15,
                agent,
                "frozen camera reconnecting",
            )
            time.sleep(3.0)  # telemetry republishes the states every second meanwhile
            msgs = sub.snapshot()
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        later = [s for s in states_of(msgs, "frozen") if s["ts"] > frozen_at + 1.5]
        assert later and all(s["state"] != "streaming" for s in later), later
        reported = [s for s in later if s["state"] == "reconnecting"]
        assert any("no frame for 1 s" in (s["last_error"] or "") for s in reported), reported
    rc, _ = agent.terminate(15)
    assert rc == 0
