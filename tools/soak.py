#!/usr/bin/env python3
"""Soak test of the agent: run it for a while, sample its resources, fail on growth (a leak check).

Starts the agent (`python -m agent.cli run`) on a given config, or on a generated one with N looped file
cameras of the bundled clip (agent/assets/bikes.mp4, the bundled NanoDet on ONNX Runtime), optionally with
a mosquitto it starts itself on a free port. After a warm-up it samples every --interval seconds:

- the agent process's RSS, open file descriptors and threads (psutil);
- from its MQTT telemetry: the oldest camera's frame age and the end-to-end latency p95 (stage `total`).

It writes `soak.json` (schema edge-agent/soak/1) and `soak.png` (matplotlib; a message says so where it
is not installed) into --out, stops the agent with SIGTERM, and exits

    0  no growth beyond the tolerances between the first and the last third of the samples
    1  growth (RSS, fds or threads: a leak)
    2  error: the agent died or did not stop cleanly, too few samples, no telemetry with --require-telemetry

Tolerances (medians of the first and last thirds): RSS may grow by --rss-tolerance-mb plus
--rss-tolerance-pct of the first third's median; fds and threads by --fd-tolerance / --thread-tolerance.

    .venv/bin/python tools/soak.py --start-broker --duration 600 --out soak-out      # 10 minutes
    .venv/bin/python tools/soak.py --config /etc/edge-agent/agent.yaml --duration 3600
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
SCHEMA = "edge-agent/soak/1"
GROWTH_METRICS = ("rss_mb", "fds", "threads")


# ---- the leak check (pure: tests call it) ----------------------------------------------------------------
def thirds(values: list[float]) -> tuple[list[float], list[float]]:
    """The first and the last third of ``values`` (at least one value each)."""
    k = max(1, len(values) // 3)
    return values[:k], values[-k:]


def slope_per_min(ts: list[float], values: list[float]) -> float | None:
    """Least-squares slope of ``values`` over ``ts`` (seconds), per minute."""
    if len(ts) < 2:
        return None
    mt, mv = statistics.fmean(ts), statistics.fmean(values)
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in zip(ts, values, strict=True)) / den


def leak_check(samples: list[dict[str, Any]], tolerance: dict[str, float]) -> dict[str, Any]:
    """{passed, problems, metrics: {name: {first, last, growth, allowed, ok, min, max, slope_per_min}}}.

    ``tolerance``: rss_mb, rss_pct, fds, threads. Needs at least 3 samples (else passed is False).
    """
    out: dict[str, Any] = {"passed": True, "problems": [], "metrics": {}}
    if len(samples) < 3:
        out["passed"] = False
        out["problems"].append(f"too few samples for a leak check: {len(samples)} (need 3)")
        return out
    ts = [float(s["t_s"]) for s in samples]
    for name in GROWTH_METRICS:
        values = [float(s[name]) for s in samples]
        head, tail = thirds(values)
        first, last = statistics.median(head), statistics.median(tail)
        if name == "rss_mb":
            allowed = tolerance["rss_mb"] + first * tolerance["rss_pct"] / 100.0
        else:
            allowed = tolerance[name]
        growth = last - first
        ok = growth <= allowed
        slope = slope_per_min(ts, values)
        out["metrics"][name] = {
            "first": round(first, 2),
            "last": round(last, 2),
            "growth": round(growth, 2),
            "allowed": round(allowed, 2),
            "ok": ok,
            "min": min(values),
            "max": max(values),
            "slope_per_min": None if slope is None else round(slope, 3),
        }
        if not ok:
            out["passed"] = False
            out["problems"].append(
                f"{name} grew by {growth:.1f} (first third median {first:.1f}, last {last:.1f}; "
                f"allowed {allowed:.1f})"
            )
    return out


def spread(samples: list[dict[str, Any]], name: str) -> dict[str, float | None]:
    values = [float(s[name]) for s in samples if s.get(name) is not None]
    if not values:
        return {"p50": None, "max": None, "n": 0}
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2), "n": len(values)}


# ---- processes -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def start_broker(out: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None
    )
    if exe is None:
        raise RuntimeError("--start-broker: mosquitto is not installed (apt-get install mosquitto)")
    port = port or free_port()
    conf = out / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n")
    with (out / "mosquitto.log").open("ab") as log:
        proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while not port_open(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 2)
            raise RuntimeError(f"mosquitto did not start on port {port}: see {out / 'mosquitto.log'}")
        time.sleep(0.05)
    return proc, port


class BrokerControl:
    """The soak's own mosquitto, restartable on the same port (--chaos restarts it)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc, self.port = start_broker(out)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5.0)
            self.proc = None

    def start(self) -> None:
        self.proc, _ = start_broker(self.out, self.port)


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int | None, float]:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; (exit status, None if killed; seconds taken)."""
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            return None, time.monotonic() - t0
    return proc.returncode, time.monotonic() - t0


def generated_config(
    args: argparse.Namespace, out: Path, host: str, port: int, cams: dict[str, Any] | None = None
) -> dict[str, Any]:
    cams = cams or {
        f"cam{i + 1}": {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": args.fps, "loop": True}
        for i in range(args.cameras)
    }
    return {
        "device_id": "soak",
        "engine_dir": str(out / "engines"),
        "models": {
            "detector": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "onnxruntime",
                "precision": "fp32",
                "threads": {"intra": args.threads},
            }
        },
        "cameras": cams,
        "mqtt": {"host": host, "port": port},
        # Twice per sample, so each sample has telemetry of its own interval.
        "telemetry": {"interval_s": max(1.0, args.interval / 2)},
    }


class Telemetry:
    """Latest telemetry payload of the agent, read over MQTT (plain MQTT, optional username/password)."""

    def __init__(self, host: str, port: int, topic: str, username: str | None, password: str | None) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.topic = topic
        self.latest: dict[str, Any] | None = None
        self.latest_at: float | None = None
        self.received = 0
        self._lock = threading.Lock()
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = lambda c, *_: c.subscribe(topic, qos=0)
        self.client.on_message = self._on_message
        self.client.connect_async(host, port, keepalive=30)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        try:
            body = json.loads(msg.payload)
        except ValueError:
            return
        with self._lock:
            self.latest, self.latest_at = body, time.monotonic()
            self.received += 1

    def read(self) -> tuple[dict[str, Any] | None, float | None]:
        with self._lock:
            age = None if self.latest_at is None else time.monotonic() - self.latest_at
            return self.latest, age

    def close(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()


def telemetry_fields(body: dict[str, Any] | None) -> dict[str, float | None]:
    if body is None:
        return dict.fromkeys(("frame_age_ms", "latency_p95_ms", "infer_p95_ms", "fps_out", "dropped_offline"))
    cams = body.get("cameras") or {}
    ages = [c.get("frame_age_ms") for c in cams.values() if c.get("frame_age_ms") is not None]
    fps = [c.get("fps_out") for c in cams.values() if c.get("fps_out") is not None]
    stages = body.get("stages") or {}
    return {
        "frame_age_ms": max(ages) if ages else None,  # the stalest camera
        "latency_p95_ms": (stages.get("total") or {}).get("p95"),
        "infer_p95_ms": (stages.get("infer") or {}).get("p95"),
        "fps_out": round(sum(fps), 2) if fps else None,
        "dropped_offline": (body.get("mqtt") or {}).get("dropped_offline"),
    }


def sample(proc: Any, t_s: float, telemetry: Telemetry | None) -> dict[str, Any]:
    with proc.oneshot():
        row: dict[str, Any] = {
            "t_s": round(t_s, 2),
            "rss_mb": round(proc.memory_info().rss / 2**20, 2),
            "fds": proc.num_fds(),
            "threads": proc.num_threads(),
            "cpu_percent": round(proc.cpu_percent(None), 1),
        }
    body, age = telemetry.read() if telemetry is not None else (None, None)
    row.update(telemetry_fields(body))
    row["telemetry_age_s"] = None if age is None else round(age, 2)
    return row


def agent_log_errors(path: Path, keep: int = 20) -> dict[str, Any]:
    """Error lines and tracebacks in the agent's log (the first ``keep`` of them, for the report)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"count": None, "first": []}
    bad = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or ln.startswith("Traceback")]
    return {"count": len(bad), "first": bad[:keep]}


# ---- output ----------------------------------------------------------------------------------------------
def plot(samples: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "soak: matplotlib is not installed: no plot (pip install matplotlib); the JSON has every sample"
        )
        return None
    t = [s["t_s"] / 60.0 for s in samples]

    def series(name: str) -> list[float]:
        return [math.nan if s.get(name) is None else float(s[name]) for s in samples]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0][0], [("rss_mb", "RSS")], "MB"),
        (axes[0][1], [("fds", "open fds"), ("threads", "threads")], "count"),
        (axes[1][0], [("frame_age_ms", "frame age (stalest camera)")], "ms"),
        (axes[1][1], [("latency_p95_ms", "total p95"), ("infer_p95_ms", "infer p95")], "ms"),
    ]
    for ax, lines, unit in panels:
        for key, label in lines:
            ax.plot(t, series(key), marker=".", label=label)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("minutes after warm-up")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", type=Path, help="run the agent on this config (its broker is read from it)")
    src.add_argument(
        "--cameras", type=int, default=2, help="generated config: looped file cameras (default 2)"
    )
    p.add_argument(
        "--fps", type=float, default=5.0, help="generated config: fps limit per camera (default 5)"
    )
    p.add_argument("--threads", type=int, default=1, help="generated config: ONNX Runtime intra-op threads")
    p.add_argument(
        "--start-broker", action="store_true", help="generated config: start mosquitto on a free port"
    )
    p.add_argument(
        "--broker", default="127.0.0.1:1883", help="generated config: HOST:PORT (no --start-broker)"
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of sampling after warm-up (600)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples (10)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds before the first sample (30)")
    p.add_argument("--out", type=Path, default=Path("soak-out"), help="folder for soak.json, soak.png, logs")
    p.add_argument("--rss-tolerance-mb", type=float, default=20.0, help="RSS growth allowed, MB (20)")
    p.add_argument("--rss-tolerance-pct", type=float, default=5.0, help="... plus this %% of the start (5)")
    p.add_argument("--fd-tolerance", type=int, default=2, help="open fds growth allowed (2)")
    p.add_argument("--thread-tolerance", type=int, default=2, help="threads growth allowed (2)")
    p.add_argument("--require-telemetry", action="store_true", help="exit 2 when no telemetry arrived")
    p.add_argument("--python", default=sys.executable, help="python that runs the agent (default: this one)")
    p.add_argument(
        "--max-rss-drift-mb-h", type=float, default=None,
        help="also fail when RSS grows faster than this after warm-up (least-squares slope, MB/h)",
    )
    p.add_argument(
        "--chaos", action="store_true",
        help="generated config with RTSP cameras (tools/rtsp_server.py) and faults: camera kills and "
        "stops, broker restarts, reloads with zone changes, junk commands (tools/soak_chaos.py); "
        "implies --start-broker",
    )
    p.add_argument(
        "--chaos-every", type=float, default=90.0, help="--chaos: mean seconds between faults (90)"
    )
    p.add_argument("--seed", type=int, default=1, help="--chaos: the fault schedule's seed (1)")
    args = p.parse_args(argv)
    if args.chaos and args.config is not None:
        p.error("--chaos generates its config: leave out --config")
    args.start_broker = args.start_broker or args.chaos
    if args.interval <= 0 or args.duration < 3 * args.interval:
        p.error("need --interval > 0 and --duration >= 3 x --interval (three samples at least)")
    if args.config is None and args.cameras < 1:
        p.error("--cameras must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import psutil
    import yaml

    sys.path.insert(0, str(REPO))
    from agent.config import ConfigError, load_config

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    broker: BrokerControl | None = None
    chaos: Any = None
    agent: subprocess.Popen[bytes] | None = None
    telemetry: Telemetry | None = None
    samples: list[dict[str, Any]] = []
    errors: list[str] = []
    chaos_report: dict[str, Any] | None = None
    exit_code: int | None = None
    stop_s: float | None = None
    config_path: Path | None = None
    try:
        if args.config is not None:
            config_path = args.config.resolve()
        else:
            if args.start_broker:
                broker = BrokerControl(out)
                host, port = "127.0.0.1", broker.port
            else:
                host, _, port_text = args.broker.rpartition(":")
                host, port = host or "127.0.0.1", int(port_text)
            cams = None
            if args.chaos:
                sys.path.insert(0, str(REPO / "tools"))
                from soak_chaos import Chaos

                chaos = Chaos(out=out, cameras=args.cameras, every_s=args.chaos_every, seed=args.seed)
                chaos.start_cameras()
                cams = chaos.camera_config(args.fps)
            generated = generated_config(args, out, host, port, cams)
            config_path = out / "agent.yaml"
            config_path.write_text(yaml.safe_dump(generated, sort_keys=False))
            if chaos is not None:
                chaos.config, chaos.config_path, chaos.broker = generated, config_path, broker
        try:
            cfg = load_config(config_path)
        except ConfigError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 2
        if cfg.mqtt.enabled and cfg.mqtt.tls is None:
            topic = f"{cfg.mqtt.prefix}/{cfg.device_id}/telemetry"
            telemetry = Telemetry(
                cfg.mqtt.host, cfg.mqtt.port, topic, cfg.mqtt.username, cfg.mqtt.read_password()
            )
        else:
            print("soak: MQTT disabled or TLS: frame age and latency are not read (resources only)")

        log_path = out / "agent.log"
        with log_path.open("wb") as log:
            agent = subprocess.Popen(
                [args.python, "-m", "agent.cli", "run", "-c", str(config_path)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        proc = psutil.Process(agent.pid)
        proc.cpu_percent(None)
        if chaos is not None:
            chaos.agent_pid, chaos.prefix, chaos.device = agent.pid, cfg.mqtt.prefix, cfg.device_id
            chaos.watch(cfg.mqtt.host, cfg.mqtt.port)
            chaos.run()
        print(
            f"soak: agent pid {agent.pid} on {config_path}; warm-up {args.warmup:g} s, then "
            f"{args.duration:g} s sampled every {args.interval:g} s; log {log_path}",
            flush=True,
        )
        deadline = time.monotonic() + args.warmup
        while time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.2)
        start = time.monotonic()
        count = int(args.duration / args.interval + 1e-9) + 1  # at 0, interval, ..., duration
        for i in range(count):
            while time.monotonic() < start + i * args.interval and agent.poll() is None:
                time.sleep(min(0.2, max(0.0, start + i * args.interval - time.monotonic())))
            if agent.poll() is not None:
                break
            row = sample(proc, time.monotonic() - start, telemetry)
            samples.append(row)
            print(
                f"soak: t={row['t_s']:7.1f}s rss={row['rss_mb']:7.1f}MB fds={row['fds']:4d} "
                f"threads={row['threads']:3d} cpu={row['cpu_percent']:5.1f}% "
                f"frame_age={row['frame_age_ms']}ms p95={row['latency_p95_ms']}ms",
                flush=True,
            )
        end = time.monotonic()
        if agent.poll() is not None:
            errors.append(f"the agent exited early with status {agent.returncode}: see {log_path}")
        if chaos is not None:
            chaos.stop()
            chaos_report = chaos.report((start - chaos.t0, end - chaos.t0))
        exit_code, stop_s = stop_process(agent, 10.0)
        if not errors and exit_code != 0:
            errors.append(f"the agent did not stop cleanly on SIGTERM (status {exit_code}, {stop_s:.1f} s)")
    except (OSError, RuntimeError, psutil.Error) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        if agent is not None and agent.poll() is None:
            stop_process(agent, 5.0)
        if chaos is not None:
            chaos.stop()
        if telemetry is not None:
            telemetry.close()
        if broker is not None:
            broker.stop()

    tolerance = {
        "rss_mb": args.rss_tolerance_mb,
        "rss_pct": args.rss_tolerance_pct,
        "fds": float(args.fd_tolerance),
        "threads": float(args.thread_tolerance),
    }
    check = leak_check(samples, tolerance)
    rss_slope = (check["metrics"].get("rss_mb") or {}).get("slope_per_min")
    drift_h = None if rss_slope is None else round(rss_slope * 60.0, 2)
    if args.max_rss_drift_mb_h is not None and drift_h is not None and drift_h > args.max_rss_drift_mb_h:
        check["passed"] = False
        check["problems"].append(
            f"RSS drifts {drift_h} MB/h after warm-up (allowed {args.max_rss_drift_mb_h})"
        )
    log_errors = agent_log_errors(out / "agent.log")
    received = telemetry.received if telemetry is not None else 0
    if args.require_telemetry and received == 0:
        errors.append("no telemetry received over MQTT")
    result = "error" if errors or len(samples) < 3 else ("pass" if check["passed"] else "leak")
    title = (
        f"edge-agent soak: {len(samples)} samples every {args.interval:g} s on {platform.node()} "
        f"({os.cpu_count()} CPUs) - {result}"
    )
    png = plot(samples, out / "soak.png", title) if samples else None
    report = {
        "schema": SCHEMA,
        "created_at": round(time.time(), 3),
        "host": {"name": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {
            "path": None if config_path is None else str(config_path),
            "generated": args.config is None,
            "cameras": None if args.config is not None else args.cameras,
            "fps": None if args.config is not None else args.fps,
            "own_broker": broker is not None,
        },
        "duration_s": args.duration,
        "interval_s": args.interval,
        "warmup_s": args.warmup,
        "tolerance": tolerance,
        "samples": samples,
        "telemetry_received": received,
        "summary": {
            **check["metrics"],
            "frame_age_ms": spread(samples, "frame_age_ms"),
            "latency_p95_ms": spread(samples, "latency_p95_ms"),
            "cpu_percent": spread(samples, "cpu_percent"),
        },
        "rss_drift_mb_per_h": drift_h,
        "agent_log_errors": log_errors,
        "chaos": chaos_report,
        "leak_check": {"passed": check["passed"], "problems": check["problems"]},
        "agent": {"exit_code": exit_code, "stop_s": None if stop_s is None else round(stop_s, 2)},
        "errors": errors,
        "plot": None if png is None else str(png),
        "result": result,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    for name, m in check["metrics"].items():
        print(
            f"soak: {name}: {m['first']} -> {m['last']} (growth {m['growth']}, allowed {m['allowed']}, "
            f"slope {m['slope_per_min']}/min) {'ok' if m['ok'] else 'GROWS'}"
        )
    print(f"soak: RSS drift after warm-up {drift_h} MB/h; agent log: {log_errors['count']} error lines")
    if chaos_report is not None:
        print(f"soak: faults {chaos_report['fault_counts']}")
        for cam, r in chaos_report["cameras"].items():
            print(
                f"soak: {cam}: availability {r['availability']} ({r['availability_outside_outages']} outside "
                f"{r['outages']} injected outages, {r['injected_down_s']} s), recovery {r['recovery_s']}"
            )
    for problem in check["problems"] + errors:
        print(f"soak: {problem}", file=sys.stderr)
    print(f"soak: {result}; report {out / 'soak.json'}" + (f", plot {png}" if png else ""))
    return {"pass": 0, "leak": 1}.get(result, 2)


if __name__ == "__main__":
    sys.exit(main())
