"""Chaos for tools/soak.py: real RTSP cameras that fail, a broker that restarts, reloads and junk commands.

Each camera is its own tools/rtsp_server.py process (run by the system python, which has GStreamer), so one
camera can die while the others stream. On a seeded schedule (one fault every ~--chaos-every seconds) the
soak injects:

- camera_kill / camera_stop: SIGKILL or SIGTERM one camera's server, start it again on the same port
  after 5-20 s (an RTSP camera rebooting);
- broker_restart: stop mosquitto, start it again on the same port after 2-8 s;
- reload: rewrite the config with every camera's zone moved, then SIGHUP (a zone change by reload);
- junk: a burst of 40 malformed commands on the device's and the fleet's cmd topics.

Availability per camera comes from the agent's retained camera state (`.../cameras/<cam>/state`):
the time it said `streaming` over the time observed. Two figures: all downtime counted, and the agent's
own share (outside the injected outages, so the time to notice and reconnect - the recovery - counts
against it). Recovery time: from the camera's server being back to the agent's state `streaming`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RTSP_SERVER = REPO / "tools" / "rtsp_server.py"
CLIP = REPO / "agent" / "assets" / "bikes.mp4"
SYSTEM_PYTHON = "/usr/bin/python3"  # a venv cannot import gi (GStreamer)
FAULTS = ("camera_kill", "camera_stop", "broker_restart", "reload", "junk")
WEIGHTS = (3, 2, 2, 2, 2)
ZONES = (
    [[0.1, 0.1], [0.6, 0.1], [0.6, 0.9], [0.1, 0.9]],
    [[0.4, 0.1], [0.9, 0.1], [0.9, 0.9], [0.4, 0.9]],
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CameraServer:
    """One RTSP camera: tools/rtsp_server.py serving the bundled clip on its own port at /cam."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.port, self.log = name, free_port(), out / f"rtsp-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self, timeout_s: float = 30.0) -> None:
        # The same port after a kill: retry while the old socket lets go.
        deadline = time.monotonic() + timeout_s
        while True:
            with self.log.open("ab") as log:
                proc = subprocess.Popen(
                    [
                        SYSTEM_PYTHON,
                        str(RTSP_SERVER),
                        "--port",
                        str(self.port),
                        "--file",
                        str(CLIP),
                        "--mount",
                        "/cam",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            assert proc.stdout is not None
            line = proc.stdout.readline().decode(errors="replace")
            if line.startswith("READY"):
                self.proc = proc
                return
            proc.kill()
            proc.wait(5)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"RTSP camera {self.name} did not start on port {self.port}: see {self.log}"
                )
            time.sleep(0.5)

    def down(self, how: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(how)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.down(signal.SIGKILL)


@dataclass
class StateLog:
    """Camera states and the agent's status over MQTT, with monotonic times (thread-safe)."""

    t0: float
    states: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    status: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_message(self, topic: str, payload: bytes) -> None:
        now = time.monotonic() - self.t0
        try:
            body = json.loads(payload) if payload else {}
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        parts = topic.split("/")
        with self.lock:
            if len(parts) >= 2 and parts[-1] == "state" and parts[-3] == "cameras":
                series = self.states.setdefault(parts[-2], [])
                state = str(body.get("state", "gone"))
                if not series or series[-1][1] != state:
                    series.append((now, state))
            elif parts[-1] == "status":
                state = str(body.get("state", "?"))
                if not self.status or self.status[-1][1] != state:
                    self.status.append((now, state))


class Chaos:
    """Runs the fault schedule in a thread; the soak reads the results at the end."""

    def __init__(self, *, out: Path, cameras: int, every_s: float, seed: int) -> None:
        self.out, self.every_s = out, every_s
        self.rng = random.Random(seed)
        self.servers = [CameraServer(f"cam{i + 1}", out) for i in range(cameras)]
        self.faults: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.log = StateLog(self.t0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mqtt: Any = None
        # Set by the soak once everything runs.
        self.agent_pid: int | None = None
        self.config_path: Path | None = None
        self.config: dict[str, Any] | None = None
        self.broker: Any = None  # soak.BrokerControl
        self.prefix, self.device = "edge-agent", "soak"
        self._zone_flip = 0

    # ---- set-up ----
    def start_cameras(self) -> None:
        for server in self.servers:
            server.start()

    def camera_config(self, fps: float) -> dict[str, Any]:
        return {
            s.name: {
                "url": s.url,
                "model": "detector",
                "fps": fps,
                "zones": {"area": {"polygon": ZONES[0]}},
            }
            for s in self.servers
        }

    def watch(self, host: str, port: int) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        client = paho.Client(CallbackAPIVersion.VERSION2)
        base = f"{self.prefix}/{self.device}"
        client.on_connect = lambda c, *_: c.subscribe([(f"{base}/cameras/+/state", 1), (f"{base}/status", 1)])
        client.on_message = lambda _c, _u, m: self.log.on_message(m.topic, m.payload)
        client.reconnect_delay_set(0.2, 1.0)  # the broker restarts: come back fast to see the states
        client.connect_async(host, port, keepalive=10)
        client.loop_start()
        self._mqtt = client

    def run(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="chaos", daemon=True)
        self._thread.start()

    # ---- the schedule ----
    def _loop(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.5, 1.5) * self.every_s):
            kind = self.rng.choices(FAULTS, WEIGHTS)[0]
            started = time.monotonic() - self.t0
            try:
                detail = getattr(self, f"_{kind}")()
                self.faults.append({"t_s": round(started, 2), "kind": kind, **detail})
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.faults.append({"t_s": round(started, 2), "kind": kind, "error": repr(exc)})

    def _camera_down(self, how: int) -> dict[str, Any]:
        server = self.rng.choice(self.servers)
        down_s = self.rng.uniform(5.0, 20.0)
        server.down(how)
        t_down = time.monotonic() - self.t0
        self._stop.wait(down_s)
        server.start()
        t_up = time.monotonic() - self.t0
        return {"camera": server.name, "down_at": round(t_down, 2), "up_at": round(t_up, 2)}

    def _camera_kill(self) -> dict[str, Any]:
        return self._camera_down(signal.SIGKILL)

    def _camera_stop(self) -> dict[str, Any]:
        return self._camera_down(signal.SIGTERM)

    def _broker_restart(self) -> dict[str, Any]:
        down_s = self.rng.uniform(2.0, 8.0)
        self.broker.stop()
        t_down = time.monotonic() - self.t0
        self._stop.wait(down_s)
        self.broker.start()
        return {"down_at": round(t_down, 2), "up_at": round(time.monotonic() - self.t0, 2)}

    def _reload(self) -> dict[str, Any]:
        import yaml

        assert self.config is not None and self.config_path is not None and self.agent_pid is not None
        self._zone_flip ^= 1
        for cam in self.config["cameras"].values():
            cam["zones"]["area"]["polygon"] = ZONES[self._zone_flip]
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.config, sort_keys=False))
        os.replace(tmp, self.config_path)
        os.kill(self.agent_pid, signal.SIGHUP)
        return {"zone": self._zone_flip}

    def _junk(self) -> dict[str, Any]:
        if self._mqtt is None:
            return {"sent": 0}
        actions = ("deploy", "rollback", "rebuild", "check", "snapshot", "reload", "nope", "", "%%")
        bodies = (
            b"",
            b"{",
            b"[]",
            b"null",
            b'{"model": 5}',
            b"\xff\xfe" * 64,
            b"x" * 70000,
            b'{"request_id": "' + b"a" * 5000 + b'"}',
            b'{"model": "detector", "to": "../../etc"}',
        )
        sent = 0
        for _ in range(40):
            scope = self.rng.choice((f"{self.prefix}/{self.device}", f"{self.prefix}/_all"))
            action = self.rng.choice(actions)
            self._mqtt.publish(f"{scope}/cmd/{action}", self.rng.choice(bodies), qos=0)
            sent += 1
        return {"sent": sent}

    # ---- results ----
    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        if self._mqtt is not None:
            self._mqtt.disconnect()
            self._mqtt.loop_stop()
        for server in self.servers:
            server.close()

    def report(self, window: tuple[float, float]) -> dict[str, Any]:
        """Availability and recovery per camera over ``window`` (seconds since the chaos' start)."""
        with self.log.lock:
            states = {k: list(v) for k, v in self.log.states.items()}
        cams = {
            s.name: camera_report(s.name, states.get(s.name, []), self.faults, window) for s in self.servers
        }
        broker = [f for f in self.faults if f["kind"] == "broker_restart" and "up_at" in f]
        return {
            "window_s": [round(window[0], 1), round(window[1], 1)],
            "faults": self.faults,
            "fault_counts": {k: sum(f["kind"] == k for f in self.faults) for k in FAULTS},
            "cameras": cams,
            "broker_restarts": len(broker),
            "status_changes": len(self.log.status),
        }


def streaming_seconds(series: list[tuple[float, str]], a: float, b: float) -> float:
    """Seconds within [a, b] during which the last state said before was `streaming`."""
    total = 0.0
    for i, (t, state) in enumerate(series):
        end = series[i + 1][0] if i + 1 < len(series) else b
        lo, hi = max(t, a), min(end, b)
        if state == "streaming" and hi > lo:
            total += hi - lo
    return total


def camera_report(
    name: str, series: list[tuple[float, str]], faults: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    a, b = window
    outages = [(f["down_at"], f["up_at"]) for f in faults if f.get("camera") == name and "up_at" in f]
    injected = sum(max(0.0, min(u, b) - max(d, a)) for d, u in outages)
    streaming = streaming_seconds(series, a, b)
    # Before the agent notices an outage it still says `streaming`: that time is not the agent's credit.
    outside = streaming - sum(streaming_seconds(series, max(d, a), min(u, b)) for d, u in outages if u > a)
    recoveries = []
    for _down, u in outages:
        # The first `streaming` after the server came back (None: never, within the soak).
        back = next((t for t, s in series if t >= u and s == "streaming"), None)
        recoveries.append(None if back is None else round(back - u, 2))
    done = [r for r in recoveries if r is not None]
    observed = b - a
    return {
        "availability": round(streaming / observed, 4) if observed > 0 else None,
        # The agent's own share: outside the injected outages the camera should stream; recovery counts.
        "availability_outside_outages": round(outside / (observed - injected), 4)
        if observed - injected > 0
        else None,
        "outages": len(outages),
        "injected_down_s": round(injected, 1),
        "recovery_s": {
            "p50": round(statistics.median(done), 2) if done else None,
            "max": max(done) if done else None,
            "not_recovered": len(recoveries) - len(done),
        },
        "state_changes": len(series),
    }
