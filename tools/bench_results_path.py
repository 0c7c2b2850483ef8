"""How detections of a shard reach MQTT: each shard's own client, or a pipe to the supervisor's publisher.

    python tools/bench_results_path.py --messages 20000 --size 700

Starts mosquitto on a free port, then per path publishes `--messages` detections-sized messages (QoS 0) and
reports messages/s and host CPU microseconds per message, summed over the processes involved:
- `own_client`: a shard process publishes with its own agent.mqtt.MqttClient (what pipeline shards do);
- `via_supervisor`: a shard process sends (topic, body) over a multiprocessing pipe; the supervisor process
  receives and publishes with its client (one more hop, one more copy, and every shard's messages through
  one interpreter).
Each message is received back by a subscriber, so both paths are measured to the broker and out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client(port: int, shard: int | None) -> Any:
    from agent.config import MqttConfig
    from agent.mqtt import MqttClient
    from agent.mqtt.topics import Topics

    cfg = MqttConfig(host="127.0.0.1", port=port, offline_queue=10**6)
    c = MqttClient(cfg, Topics("bench", "dev"), shard=shard)
    c.start()
    if not c.wait_connected(10):
        raise RuntimeError("no broker")
    return c


def _own_client(port: int, n: int, size: int, out: Any) -> None:
    c = _client(port, 0)
    body = b"x" * size
    cpu0 = psutil.Process().cpu_times()
    for i in range(n):
        c.publish(f"bench/dev/cameras/cam{i % 16}/detections", body, kind="event")
    cpu1 = psutil.Process().cpu_times()
    time.sleep(0.5)
    c.close()
    out.put((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system))


def _sender(conn: Any, n: int, size: int, out: Any) -> None:
    body = b"x" * size
    cpu0 = psutil.Process().cpu_times()
    for i in range(n):
        conn.send((f"bench/dev/cameras/cam{i % 16}/detections", body))
    conn.send(None)
    cpu1 = psutil.Process().cpu_times()
    out.put((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system))


def _count(port: int, n: int) -> tuple[Any, Any]:
    import threading

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    done = threading.Event()
    seen = [0]

    def on_message(*_: Any) -> None:
        seen[0] += 1
        if seen[0] >= n:
            done.set()

    sub = paho.Client(CallbackAPIVersion.VERSION2)
    sub.on_message = on_message
    sub.connect("127.0.0.1", port)
    sub.subscribe("bench/#")
    sub.loop_start()
    time.sleep(0.5)
    return sub, done


def run(path: str, port: int, n: int, size: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sub, done = _count(port, n)
    me = psutil.Process()
    t0 = time.monotonic()
    cpu0 = me.cpu_times()
    if path == "own_client":
        p = ctx.Process(target=_own_client, args=(port, n, size, out))
        p.start()
        child_cpu = out.get(timeout=600)
    else:
        client = _client(port, None)
        a, b = ctx.Pipe()
        p = ctx.Process(target=_sender, args=(b, n, size, out))
        p.start()
        while True:
            msg = a.recv()
            if msg is None:
                break
            client.publish(msg[0], msg[1], kind="event")
        child_cpu = out.get(timeout=600)
    done.wait(120)
    elapsed = time.monotonic() - t0
    cpu1 = me.cpu_times()
    p.join(30)
    if path != "own_client":
        client.close()
    sub.loop_stop()
    # The parent's CPU counts only where it works (via_supervisor); the subscriber thread is common to both.
    parent = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    total = child_cpu + parent
    return {
        "path": path,
        "messages": n,
        "bytes": size,
        "seconds": round(elapsed, 3),
        "messages_per_s": round(n / elapsed, 1),
        "cpu_us_per_message_shard": round(child_cpu * 1e6 / n, 2),
        "cpu_us_per_message_all": round(total * 1e6 / n, 2),
        "all_received": done.is_set(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--size", type=int, default=700, help="payload bytes (a detections message: 0.5-1 kB)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    if args.messages < 1 or args.size < 1 or args.repeat < 1:
        p.error("--messages, --size and --repeat must be >= 1")
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "m.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n")
        broker = subprocess.Popen(
            [mosquitto, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            time.sleep(0.5)
            results = [
                run(path, port, args.messages, args.size)
                for _ in range(args.repeat)
                for path in ("own_client", "via_supervisor")
            ]
        finally:
            broker.kill()
            broker.wait(5)
    for r in results:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
