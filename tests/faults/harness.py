"""Helpers of the fault suite: agent configs, a subscriber that survives broker restarts, payload access.

Everything here drives real processes; nothing is faked. The fixtures themselves (mosquitto, RTSP server,
the agent subprocess) come from tests/fixtures_*.py through tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import yaml
from fixtures_agent import AgentProcess
from fixtures_mqtt import Message
from fixtures_rtsp import SERVER_SCRIPT, SYSTEM_PYTHON, gst_rtsp_missing
from paho.mqtt.enums import CallbackAPIVersion

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "agent" / "assets"
CLIP = ASSETS / "bikes.mp4"
MODEL = ASSETS / "nanodet-m-416.onnx"
LABELS = ASSETS / "coco.names"

# What the graceful offline status and the last will both carry (docs/DESIGN.md, status topic).
OFFLINE_FIELDS = {
    *("schema", "ts", "state", "reason", "version", "started_at", "cameras_up", "cameras_total"),
    "instance",  # the process (agent.mqtt): tells a second agent with the same device id apart
    "groups",  # mqtt.groups: `fleet deploy --group` finds a group's devices by it, offline ones too
}

TimedMessage = tuple[float, str, bytes, bool]  # monotonic arrival time, topic, payload, retain


def config_dict(
    tmp_path: Path,
    port: int,
    cameras: Mapping[str, Mapping[str, Any]],
    *,
    device: str = "faults",
    keepalive: int = 5,
    telemetry_s: float = 2.0,
    mqtt: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The bundled NanoDet on ONNX Runtime (one intra-op thread: the CI box is small) and ``cameras``
    (each a camera section; ``model`` and ``fps`` default to ``detector`` and 4)."""
    return {
        "device_id": device,
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "detector": {
                "onnx": str(MODEL),
                "format": "nanodet",
                "labels": str(LABELS),
                "backend": "onnxruntime",
                "precision": "fp32",
                "threads": {"intra": 1},
            }
        },
        "cameras": {name: {"model": "detector", "fps": 4, **cam} for name, cam in cameras.items()},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": keepalive, **(mqtt or {})},
        "telemetry": {"interval_s": telemetry_s},
    }


def write_config(tmp_path: Path, data: Mapping[str, Any], name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False))
    return path


class LiveSubscriber:
    """Collects every message of ``topic_filter`` with its arrival time; subscribes again after each
    (re)connect, so it keeps collecting across broker restarts (clean session, as a dashboard would).

    ``snapshot()`` gives (topic, payload, retain) tuples, so ``fixtures_agent.wait`` works with it.
    """

    def __init__(self, port: int, topic_filter: str, qos: int = 1, timeout: float = 5.0) -> None:
        self.topic_filter, self.qos = topic_filter, qos
        self._lock = threading.Lock()
        self._messages: list[TimedMessage] = []
        self._subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        self.client.reconnect_delay_set(min_delay=0.1, max_delay=0.2)  # type: ignore[arg-type]
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *_: self._subscribed.clear()
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port, keepalive=5)
        self.client.loop_start()
        if not self.wait_subscribed(timeout):
            self.close()
            raise RuntimeError(f"no SUBACK for {topic_filter} on port {port}")

    def _on_connect(
        self, client: paho.Client, userdata: object, flags: object, reason: Any, props: object
    ) -> None:
        if not reason.is_failure:
            client.subscribe(self.topic_filter, qos=self.qos)

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        with self._lock:
            self._messages.append((time.monotonic(), msg.topic, bytes(msg.payload), bool(msg.retain)))

    def wait_subscribed(self, timeout: float) -> bool:
        return self._subscribed.wait(timeout)

    def timed(self) -> list[TimedMessage]:
        with self._lock:
            return list(self._messages)

    def snapshot(self) -> list[Message]:
        return [(t, p, r) for _, t, p, r in self.timed()]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


def retained_now(port: int, topic_filter: str, settle_s: float = 1.0) -> dict[str, bytes]:
    """What the broker holds retained under ``topic_filter`` now, as a new subscriber sees it."""
    sub = LiveSubscriber(port, topic_filter)
    try:
        time.sleep(settle_s)
        return {t: p for _, t, p, r in sub.timed() if r}
    finally:
        sub.close()


def bodies(msgs: list[Message], suffix: str) -> list[dict[str, Any]]:
    """The JSON payloads of topics ending in ``suffix`` (empty payloads, i.e. deletions, skipped)."""
    return [json.loads(p) for t, p, _ in msgs if t.endswith(suffix) and p]


def camera_states(msgs: list[Message], camera: str) -> list[dict[str, Any]]:
    return bodies(msgs, f"/cameras/{camera}/state")


def last_state(msgs: list[Message], camera: str) -> str | None:
    states = camera_states(msgs, camera)
    return states[-1]["state"] if states else None


def detections(msgs: list[Message], camera: str) -> list[dict[str, Any]]:
    return bodies(msgs, f"/cameras/{camera}/detections")


def first_time(
    timed: list[TimedMessage], cond: Callable[[str, bytes], bool], after: float = float("-inf")
) -> float | None:
    """Arrival time of the first message after ``after`` for which ``cond(topic, payload)`` holds."""
    return next((t for t, topic, p, _ in timed if t > after and cond(topic, p)), None)


def is_state(camera: str, state: str) -> Callable[[str, bytes], bool]:
    def cond(topic: str, body: bytes) -> bool:
        return (
            topic.endswith(f"/cameras/{camera}/state") and bool(body) and json.loads(body)["state"] == state
        )

    return cond


def assert_clean_log(agent: AgentProcess) -> None:
    """No traceback anywhere in the agent's output (a fault must be handled, not crash a thread)."""
    text = agent.text()
    assert "Traceback" not in text, text[-6000:]


@contextlib.contextmanager
def auth_rtsp_server(workdir: Path, user: str, password: str, timeout: float = 20.0) -> Iterator[str]:
    """tools/rtsp_server.py requiring Basic authentication (its ``--user``/``--password``), serving the
    bundled clip on /cam; yields ``rtsp://127.0.0.1:PORT/cam`` (no credentials), kills it at exit."""
    reason = gst_rtsp_missing()
    if reason:
        import pytest

        pytest.skip(reason)
    cmd = [SYSTEM_PYTHON, str(SERVER_SCRIPT), "--port", "0", "--file", str(CLIP), "--workdir", str(workdir)]
    cmd += ["--mount", "/cam", "--user", user, "--password", password]
    log = workdir / "rtsp-auth-server.log"
    with log.open("w") as err_file:  # a file, not a pipe nobody reads while it runs
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not line.startswith("READY"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"authenticating RTSP server not READY in {timeout} s")
                line = proc.stdout.readline()
                if not line:
                    proc.wait(5)
                    err = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"authenticating RTSP server exited with {proc.returncode}: {err}")
        yield line.split()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
