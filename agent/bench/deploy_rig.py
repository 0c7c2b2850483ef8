"""The real components a deployment runs among, for `bench --sections deploy` (and tests that want the same):
mosquitto and nginx (plain HTTP, the artifact store) on free ports of 127.0.0.1, the agent as a subprocess
(`python -m agent.cli run`), and an MQTT listener that counts each camera's detections messages (one per
processed frame: `publish.detections: every_frame`) and keeps the `deployments/{model}` states.

Needs the mosquitto and nginx binaries (apt: mosquitto, nginx-light) and a repository checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def _binary(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}",) if Path(p).exists()), None)
    if found is None:
        package = "nginx-light" if name == "nginx" else name
        raise RuntimeError(f"{name} is not installed (apt-get install {package})")
    return found


class Service:
    """A server process listening on `port`, started in the foreground, stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out)
        deadline = time.monotonic() + 10
        while not _listening(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start: {log.read_text(errors='replace')[-1000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def mosquitto(workdir: Path) -> Service:
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n")
    return Service("mosquitto", [_binary("mosquitto"), "-c", str(conf)], port, workdir / "mosquitto.log")


def nginx(workdir: Path, root: Path) -> Service:
    """nginx serving `root` over plain HTTP (the deployment's `deploy.allow_http`; sha256 still checked)."""
    port = free_port()
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / sub).mkdir(exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""  # as root its workers could not read a 0700 tmp folder
    conf = workdir / "nginx.conf"
    conf.write_text(
        f"{user}worker_processes 1;\npid {workdir}/nginx.pid;\nerror_log {workdir}/error.log warn;\n"
        "events { worker_connections 64; }\nhttp {\n  access_log off;\n"
        f"  client_body_temp_path {workdir}/body; proxy_temp_path {workdir}/proxy;\n"
        f"  fastcgi_temp_path {workdir}/fastcgi; uwsgi_temp_path {workdir}/uwsgi;\n"
        f"  scgi_temp_path {workdir}/scgi;\n"
        "  default_type application/octet-stream;\n"
        f"  server {{ listen 127.0.0.1:{port}; root {root}; }}\n}}\n"
    )
    cmd = [_binary("nginx"), "-p", str(workdir), "-e", str(workdir / "error.log"), "-c", str(conf),
           "-g", "daemon off;"]
    return Service("nginx", cmd, port, workdir / "nginx.log")


class Agent:
    """`python -m agent.cli run -c CONFIG` from the repository, its output in `log`."""

    def __init__(self, config: Path, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "-c", str(config), "--log-level", "info"],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Listener:
    """Subscribed to `{prefix}/{device}/#`: the receive times of each camera's detections messages, the
    `deployments/{model}` states in order (with their receive time) and command results."""

    def __init__(self, port: int, prefix: str, device: str) -> None:
        import paho.mqtt.client as mqtt

        self.base = f"{prefix}/{device}"
        self.frames: dict[str, list[float]] = {}
        self.states: list[tuple[float, dict[str, Any]]] = []
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"{self.base}/#", qos=1)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.monotonic()
        parts = msg.topic[len(self.base) + 1 :].split("/")
        with self._lock:
            if len(parts) == 3 and parts[0] == "cameras" and parts[2] == "detections":
                self.frames.setdefault(parts[1], []).append(now)
            elif len(parts) == 2 and parts[0] == "deployments" and msg.payload:
                self.states.append((now, json.loads(msg.payload)))
            elif parts[0] == "cmd" and parts[-1] == "result":
                self.results.append(json.loads(msg.payload))

    def publish(self, topic: str, payload: bytes) -> float:
        """Publish under the device's base topic; the monotonic time it was handed to the broker."""
        info = self.client.publish(f"{self.base}/{topic}", payload, qos=1)
        info.wait_for_publish(10)
        return time.monotonic()

    def count(self, t0: float, t1: float) -> dict[str, int]:
        """Detections messages received per camera in [t0, t1)."""
        with self._lock:
            return {cam: sum(t0 <= t < t1 for t in ts) for cam, ts in self.frames.items()}

    def wait(self, cond: Callable[[], bool], timeout: float, what: str, agent: Agent | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline or (agent is not None and agent.proc.poll() is not None):
                tail = f"\nagent log:\n{agent.tail()}" if agent is not None else ""
                raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}{tail}")
            time.sleep(0.05)

    def last_state(self, model: str) -> dict[str, Any] | None:
        with self._lock:
            mine = [s for _, s in self.states if s.get("model") == model]
        return mine[-1] if mine else None

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
