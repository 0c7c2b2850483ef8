"""`bench --sections fleet-rollout`: `edge-agent fleet deploy` over N real agents (default 10, each with a
file camera on ONNX Runtime and deployments on) on one mosquitto, the artifacts on nginx, as an operator
runs it: canary 1 then batches of 3, --soak S (10), --max-failures 0, --wait.

Two rollouts in one run: a good new version (the bundled ONNX with a version tag in its metadata: new bytes,
the same weights: it passes the gate) that must end with every device serving it, then a broken one (its
labels shuffled: the gate refuses it) with --rollback-on-halt that must halt after the canary, leave the
other N-1 devices untouched (no state of that version, still serving the good one) and leave the canary
serving the good version. Reported for each: the CLI's exit code, seconds and output (the table as the
operator sees it), the retained rollout state (`_fleet/rollouts/{id}`), each device's deployment stages in
time from the command (the plot's timeline) and its final state.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.bench.args import BenchOptions
from agent.bench.deploy import tagged_onnx
from agent.bench.deploy_rig import REPO, mosquitto, nginx
from agent.bench.fleet_rig import FleetListener, start_agents, stop_agents

MODEL, PREFIX, KEY_ID = "detector", "rolloutbench", "bench"
CAMERA_FPS = 1.0  # per agent: N agents share the machine; the gate and shadow need only a few frames
GATE_FRAMES = 8
# The candidate's inference runs beside the serving model's on cores shared with N agents (on a GPU it
# does not): measured here at 2-9x under load, its latency ratio says how loaded the machine is, not
# what the version costs. The bench's broken version fails the gate, not this.
SHADOW_LATENCY_RATIO = 20.0
CLI_TIMEOUT_S = 900.0


def agent_config(work: Path, i: int, opts: BenchOptions, mqtt_port: int, public_key: Path) -> dict[str, Any]:
    device = f"site-{i:02d}"
    return {
        "device_id": device,
        "engine_dir": str(work / device / "engines"),
        "models": {
            MODEL: {"onnx": str(opts.model), "labels": str(opts.labels), "format": opts.format,
                    "backend": "onnxruntime", "precision": "fp32", "threads": {"intra": 1}}
        },
        "cameras": {"cam": {"url": str(opts.clip), "model": MODEL, "fps": CAMERA_FPS, "loop": True}},
        "mqtt": {"host": "127.0.0.1", "port": mqtt_port, "prefix": PREFIX, "groups": ["bench"]},
        "deploy": {
            "enabled": True,
            "trusted_keys": {KEY_ID: str(public_key)},
            "allow_http": True,
            "state_dir": str(work / device / "state"),
            "watch_s": 0,
            "gate": {"frames": GATE_FRAMES},
            "shadow": {"frames": GATE_FRAMES, "max_latency_ratio": SHADOW_LATENCY_RATIO},
        },
    }


def document(www: Path, port: int, version: str, opts: BenchOptions, key: Path, broken: bool) -> Path:
    """A signed document of `version` written to www/{version}.json; `broken`: its labels shuffled."""
    import hashlib

    from agent.deploy.signing import sign_document

    folder = www / version
    folder.mkdir()
    onnx_path = tagged_onnx(opts.model, folder / "model.onnx", version)
    names = opts.labels.read_text().splitlines()
    if broken:
        random.Random(0).shuffle(names)
    labels = folder / "labels.txt"
    labels.write_text("\n".join(names) + "\n")

    def art(path: Path) -> dict[str, Any]:
        data = path.read_bytes()
        url = f"http://127.0.0.1:{port}/{version}/{path.name}"
        return {"url": url, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    doc = {"model": MODEL, "version": version, "format": opts.format,
           "artifacts": {"onnx": art(onnx_path), "labels": art(labels)}}
    out = www / f"{version}.json"
    out.write_text(json.dumps(sign_document(doc, key, KEY_ID)))
    return out


def fleet_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> dict[str, Any]:
    """`python -m agent.cli fleet ARGS`: argv, exit code, seconds, stdout and stderr (not a terminal: the
    table as a log or a pipe gets it)."""
    argv = [sys.executable, "-m", "agent.cli", "fleet", *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, _text(exc.stdout), _text(exc.stderr) + f"\n(killed after {timeout:g} s)"
    argv_shown = ["edge-agent", "fleet", *args]
    return {"argv": argv_shown, "rc": rc, "seconds": round(time.monotonic() - t0, 2), "stdout": out,
            "stderr": err}


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _rollouts(listener: FleetListener, since: float) -> dict[str, Any]:
    """The last retained payload of each `_fleet/rollouts/{id}` received since `since`."""
    out: dict[str, Any] = {}
    for t, topic, payload in listener.fleet:
        if t >= since and "/_fleet/rollouts/" in topic and payload:
            try:
                out[topic.rsplit("/", 1)[-1]] = json.loads(payload)
            except ValueError:
                out[topic.rsplit("/", 1)[-1]] = payload.decode(errors="replace")
    return out


def timeline(listener: FleetListener, devices: list[str], t0: float) -> dict[str, list[list[Any]]]:
    """Per device: [seconds from t0, stage, version] of each change of stage received since t0 (progress
    updates within a stage left out)."""
    out: dict[str, list[list[Any]]] = {}
    for d in devices:
        rows = out[d] = []
        for t, s in listener.deployment_states(d):
            if t >= t0 and (not rows or rows[-1][1:] != [s.get("stage"), s.get("version")]):
                rows.append([round(t - t0, 2), s.get("stage"), s.get("version")])
    return out


def serving_version(listener: FleetListener, device: str) -> str | None:
    """The version the device serves now by its states: the last `serving`, unless rolled back since."""
    version = None
    for _, s in listener.deployment_states(device):
        if s.get("stage") == "serving":
            version = s.get("version")
        elif s.get("stage") == "rolled_back":
            version = s.get("to") or s.get("previous") or version
    return version


def one_rollout(listener: FleetListener, devices: list[str], doc: Path, port: int, opts: BenchOptions,
                *extra: str) -> dict[str, Any]:
    version = json.loads(doc.read_text())["version"]
    load_start = [round(x, 2) for x in os.getloadavg()]  # a machine shared with other work says so here
    t0 = time.monotonic()
    cli = fleet_cli("deploy", str(doc), "--devices", ",".join(devices), "--canary", "1", "--batch", "3",
                    "--max-failures", "0", "--soak", f"{opts.soak_s:g}", "--wait", "--mqtt-host", "127.0.0.1",
                    "--mqtt-port", str(port), "--prefix", PREFIX, *extra)
    time.sleep(1.0)  # the last retained states on their way
    tl = timeline(listener, devices, t0)
    touched = [d for d in devices if any(v == version for _, _, v in tl[d])]
    retained = _rollouts(listener, t0)
    last = next(iter(retained.values()), {}) if len(retained) == 1 else {}
    return {
        "version": version,
        "cli": cli,
        "status": last.get("status") if isinstance(last, dict) else None,
        "halted_reason": last.get("halted_reason") if isinstance(last, dict) else None,
        "rollouts": retained,
        "timeline": tl,
        "touched": touched,
        "untouched": [d for d in devices if d not in touched],
        "serving": {d: serving_version(listener, d) for d in devices},
        "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
    }


def fleet_rollout_section(opts: BenchOptions) -> dict[str, Any]:
    import yaml

    from agent.deploy.signing import generate_keys

    n = opts.fleet_agents or 10
    with tempfile.TemporaryDirectory(prefix="bench-fleet-rollout-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        www = work / "www"
        www.mkdir()
        key, pub = generate_keys(work / "keys", KEY_ID)
        broker = mosquitto(work)
        stack.callback(broker.stop)  # everything started is stopped, whatever fails (in reverse order)
        store = nginx(work, www)
        stack.callback(store.stop)
        listener = FleetListener(broker.port, PREFIX)
        stack.callback(listener.close)
        configs = [work / f"site-{i:02d}.yaml" for i in range(1, n + 1)]
        for i, path in enumerate(configs, 1):
            path.write_text(yaml.safe_dump(agent_config(work, i, opts, broker.port, pub)))
        devices = [c.stem for c in configs]
        agents = start_agents(configs, work / "logs")
        stack.callback(stop_agents, agents)
        listener.wait(lambda: all(listener.online(d) for d in devices), 300, f"{n} agents online", agents)
        time.sleep(max(opts.warmup_s, GATE_FRAMES / CAMERA_FPS + 2))  # frames for the canary's gate
        good = document(www, store.port, "v2", opts, key, broken=False)
        bad = document(www, store.port, "v3-broken", opts, key, broken=True)
        runs = [one_rollout(listener, devices, good, broker.port, opts)]
        runs.append(one_rollout(listener, devices, bad, broker.port, opts, "--rollback-on-halt"))
        shown = fleet_cli("rollouts", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(broker.port),
                          "--prefix", PREFIX, timeout=60)
    return {"agents": n, "canary": 1, "batch": 3, "soak_s": opts.soak_s, "camera_fps": CAMERA_FPS,
            "gate_frames": GATE_FRAMES, "shadow_max_latency_ratio": SHADOW_LATENCY_RATIO,
            "good": runs[0], "broken": runs[1], "rollouts_listing": shown}


def fleet_rollout_summary(section: dict[str, Any]) -> str:
    good, bad = section["good"], section["broken"]
    n = section["agents"]
    on_good = sum(v == good["version"] for v in good["serving"].values())
    kept = sum(v == good["version"] for v in bad["serving"].values())

    def run(r: dict[str, Any]) -> str:
        return (f"{r['version']} {r['status']} (exit {r['cli']['rc']}) in {r['cli']['seconds']:.0f} s, load "
                f"average {r['load_avg']['start'][0]:g}")

    return (
        f"fleet rollout, {n} agents, canary 1 then batches of 3, soak {section['soak_s']:g} s: {run(good)}, "
        f"{on_good}/{n} serving it; broken {run(bad)}, touched {len(bad['touched'])} "
        f"({', '.join(bad['touched'])}), {len(bad['untouched'])} untouched, {kept}/{n} serving "
        f"{good['version']} after"
    )
