#!/usr/bin/env python3
"""What the agent keeps across camera reconnects, broker restarts, reloads and junk commands.

Runs the real agent (`python -m agent.cli run`) with EDGE_AGENT_TRACEMALLOC (agent/memtrace.py) on N real
RTSP cameras (tools/rtsp_server.py under the system python) and its own mosquitto, then drives --cycles
cycles of: every camera's server killed and started again (the agent reconnects), the broker restarted,
a SIGHUP with every camera's zone moved, a burst of junk commands on cmd/#. After a warm-up and after each
cycle it asks the agent for a snapshot (gc first), and prints per cycle:

- RSS (psutil, from outside), tracemalloc's traced bytes and live thread count;
- the top growing allocation sites since the warm-up (tracemalloc compare_to, by traceback);
- the object types whose live count grew (gc census).

RSS growing while traced bytes stay flat is native memory (decoders, ONNX Runtime, malloc arenas), not
Python objects. Light on CPU by default: 2 cameras at 2 fps.

    .venv/bin/python tools/memtrace.py --cameras 2 --cycles 10 --out /tmp/memtrace
    .venv/bin/python tools/memtrace.py --cycles 20 --env MALLOC_ARENA_MAX=2   # the agent's environment
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
SYSTEM_PYTHON = "/usr/bin/python3"  # has gi (GStreamer) for tools/rtsp_server.py
ZONES = (
    [[0.1, 0.1], [0.6, 0.1], [0.6, 0.9], [0.1, 0.9]],
    [[0.4, 0.1], [0.9, 0.1], [0.9, 0.9], [0.4, 0.9]],
)
FAULTS = ("camera", "broker", "reload", "junk")
JUNK = (
    b"",
    b"{",
    b"[]",
    b"null",
    b'{"model": 5}',
    b"\xff\xfe" * 64,
    b"x" * 70000,
    b'{"request_id": "' + b"a" * 5000 + b'"}',
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes] | None, how: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(how)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class Camera:
    def __init__(self, name: str, out: Path) -> None:
        self.name, self.port, self.log = name, free_port(), out / f"rtsp-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> None:
        cmd = [SYSTEM_PYTHON, str(REPO / "tools" / "rtsp_server.py"), "--port", str(self.port)]
        cmd += ["--file", str(ASSETS / "bikes.mp4"), "--mount", "/cam"]
        for _ in range(60):
            with self.log.open("ab") as log:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
            assert proc.stdout is not None
            if proc.stdout.readline().startswith(b"READY"):
                self.proc = proc
                return
            stop(proc, signal.SIGKILL)
            time.sleep(0.5)  # the old socket lets go of the port
        raise RuntimeError(f"camera {self.name} did not start: see {self.log}")


class Broker:
    def __init__(self, out: Path) -> None:
        self.out, self.port = out, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = self.out / "mosquitto.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        with (self.out / "mosquitto.log").open("ab") as log:
            self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while not port_open(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError("mosquitto did not start")
            time.sleep(0.05)


def agent_config(out: Path, cams: list[Camera], port: int, fps: float, flip: int) -> dict[str, Any]:
    return {
        "device_id": "memtrace",
        "engine_dir": str(out / "engines"),
        "models": {
            "detector": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "onnxruntime",
                "precision": "fp32",
                "threads": {"intra": 1},
            }
        },
        "cameras": {
            c.name: {
                "url": c.url,
                "model": "detector",
                "fps": fps,
                "zones": {"area": {"polygon": ZONES[flip]}},
            }
            for c in cams
        },
        "mqtt": {"host": "127.0.0.1", "port": port},
        "telemetry": {"interval_s": 2.0},
    }


def write_config(path: Path, cfg: dict[str, Any]) -> None:
    import yaml

    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)


def request_snapshot(folder: Path, name: str, trim: bool, timeout_s: float = 120.0) -> dict[str, Any]:
    (folder / f"request-{name}").write_text("trim" if trim else "")
    done = folder / f"snap-{name}.json"
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent wrote no snapshot {name} (is EDGE_AGENT_TRACEMALLOC honoured?)")
        time.sleep(0.2)
    return dict(json.loads(done.read_text()))


def junk_burst(port: int, rng: random.Random, n: int = 40) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.connect("127.0.0.1", port)
    client.loop_start()
    actions = ("deploy", "rollback", "rebuild", "check", "snapshot", "reload", "nope", "", "%%")
    for i in range(n):
        scope = rng.choice(("edge-agent/memtrace", "edge-agent/_all"))
        body = rng.choice(JUNK) if i % 4 else json.dumps({"request_id": f"junk-{rng.random()}"}).encode()
        client.publish(f"{scope}/cmd/{rng.choice(actions)}", body, qos=rng.choice((0, 1)))
    time.sleep(0.5)
    client.disconnect()
    client.loop_stop()


def report(folder: Path, base: str, name: str, top: int) -> dict[str, Any]:
    """Growth from snapshot ``base`` to ``name``: top sites by traceback, and types that grew."""
    a = tracemalloc.Snapshot.load(str(folder / f"snap-{base}.tracemalloc"))
    b = tracemalloc.Snapshot.load(str(folder / f"snap-{name}.tracemalloc"))
    skip = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
    ]
    diff = b.filter_traces(skip).compare_to(a.filter_traces(skip), "traceback")
    sites = []
    for stat in [s for s in diff if s.size_diff > 0][:top]:
        frames = [f"{f.filename.replace(str(REPO) + '/', '')}:{f.lineno}" for f in stat.traceback]
        ours = [f for f in frames if "site-packages" not in f and "/lib/python" not in f]
        sites.append(
            {"kb": round(stat.size_diff / 1024, 1), "count": stat.count_diff, "at": (ours or frames)[-3:]}
        )
    ja = json.loads((folder / f"snap-{base}.json").read_text())
    jb = json.loads((folder / f"snap-{name}.json").read_text())
    types = {t: jb["types"][t] - ja["types"].get(t, 0) for t in jb["types"]}
    grown = dict(sorted(((t, d) for t, d in types.items() if d > 0), key=lambda x: -x[1])[:15])
    before = {m[0]: m[2] for m in ja.get("mappings", [])}
    maps = [m for m in jb.get("mappings", []) if m[2] - before.get(m[0], 0.0) >= 4.0]
    return {"sites": sites, "types": grown, "mappings_grown_mb": maps}


def cycle(
    args: argparse.Namespace,
    cams: list[Camera],
    broker: Broker,
    agent: subprocess.Popen[bytes],
    state: dict[str, Any],
) -> None:
    if "camera" in args.faults:  # every camera reboots: killed, back after a while on the same port
        for cam in cams:
            stop(cam.proc, signal.SIGKILL if state["i"] % 2 else signal.SIGTERM)
        time.sleep(args.down_s)
        for cam in cams:
            cam.start()
    if "broker" in args.faults:
        stop(broker.proc)
        time.sleep(2.0)
        broker.start()
    if "reload" in args.faults:
        state["flip"] ^= 1
        write_config(state["config"], agent_config(args.out, cams, broker.port, args.fps, state["flip"]))
        os.kill(agent.pid, signal.SIGHUP)
        time.sleep(3.0)
    if "junk" in args.faults:
        junk_burst(broker.port, state["rng"])
    time.sleep(args.settle_s)  # reconnects done, the pipeline streaming again


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cameras", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--down-s", type=float, default=6.0, help="how long the cameras stay down each cycle")
    ap.add_argument("--settle-s", type=float, default=15.0)
    ap.add_argument(
        "--faults",
        type=lambda v: set() if v == "none" else set(v.split(",")),
        default=set(FAULTS),
        help=f"which faults each cycle injects, comma-separated, or none: steady state, a snapshot every "
        f"--settle-s (default: {','.join(FAULTS)})",
    )
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument(
        "--trim", action="store_true", help="malloc_trim in the agent at each snapshot (RSS after it too)"
    )
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the agent's environment")
    ap.add_argument("--out", type=Path, default=Path("memtrace-out"))
    args = ap.parse_args(argv)
    if args.faults - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(args.faults - set(FAULTS))} (known: {', '.join(FAULTS)})")
    import psutil

    args.out.mkdir(parents=True, exist_ok=True)
    snaps = args.out / "snaps"
    shutil.rmtree(snaps, ignore_errors=True)
    cams = [Camera(f"cam{i + 1}", args.out) for i in range(args.cameras)]
    broker = Broker(args.out)
    broker.start()
    for cam in cams:
        cam.start()
    state: dict[str, Any] = {"i": 0, "flip": 0, "rng": random.Random(1), "config": args.out / "agent.yaml"}
    write_config(state["config"], agent_config(args.out, cams, broker.port, args.fps, 0))
    env = {**os.environ, "EDGE_AGENT_TRACEMALLOC": str(snaps), "PYTHONPATH": str(REPO)}
    env.update(kv.split("=", 1) for kv in args.env)
    with (args.out / "agent.log").open("ab") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "-c", str(state["config"])],
            env=env,
            stdout=log,
            stderr=log,
            cwd=REPO,
        )
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(args.warmup_s)
        proc = psutil.Process(agent.pid)

        def snap(name: str) -> dict[str, Any]:
            info = request_snapshot(snaps, name, args.trim)
            row = {
                "name": name,
                "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                "traced_mb": round(info["traced_bytes"] / 2**20, 2),
                "threads": len(info["threads"]),
                "rss_trimmed_mb": None
                if info.get("rss_trimmed_bytes") is None
                else round(info["rss_trimmed_bytes"] / 2**20, 1),
                "fds": proc.num_fds(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            return info

        snap("warm")
        for i in range(1, args.cycles + 1):
            state["i"] = i
            cycle(args, cams, broker, agent, state)
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({agent.returncode}): see {args.out / 'agent.log'}")
            snap(f"c{i:03d}")
            if i == 1 or i == args.cycles or i % 5 == 0:
                print(
                    json.dumps(report(snaps, "c001" if i > 1 else "warm", f"c{i:03d}", args.top), indent=1),
                    flush=True,
                )
    finally:
        stop(agent)
        for cam in cams:
            stop(cam.proc, signal.SIGKILL)
        stop(broker.proc)
        (args.out / "memtrace.json").write_text(json.dumps(rows, indent=1))
    first, last = rows[1] if len(rows) > 1 else rows[0], rows[-1]
    n = max(1, len(rows) - 2)
    print(
        f"per cycle after cycle 1: RSS {(last['rss_mb'] - first['rss_mb']) / n:+.2f} MB, "
        f"traced {(last['traced_mb'] - first['traced_mb']) / n:+.3f} MB, "
        f"threads {last['threads'] - first['threads']:+d}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
