"""`bench --sections deploy`: one MQTT command to serving, for the bundled NanoDet on ONNX Runtime, measured
on the real agent with two cameras (the bundled clip, looped, at --deploy-fps each), mosquitto and nginx.

Each run: the cameras' processed frames counted for --duration s (detections messages, one per processed
frame), then a signed document of a new version (the bundled ONNX with a version tag in its metadata: new
bytes, same weights) published on `cmd/deploy`; from the command to the `serving` state: the total, the
seconds of each stage from the state's `stage_s` (the time of the promotion is inside `shadow`'s: the
state moves on once the swap is done) and the frames processed meanwhile as % of the rate before. The watch
is left out (`watch_s: 0`): it is time the version already serves. --repeat runs follow one another on the
same agent (versions bench-1, bench-2, ...).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.bench.args import BenchOptions
from agent.bench.deploy_rig import Agent, Listener, mosquitto, nginx

MODEL, DEVICE, PREFIX = "nanodet", "bench-deploy", "edge-agent"
CAMERAS = ("cam1", "cam2")
ENDINGS = ("serving", "rejected", "failed", "rolled_back")
STAGES = ("accepted", "downloading", "verifying", "building", "gating", "shadow")


def tagged_onnx(src: Path, dst: Path, tag: str) -> Path:
    """`src` with `tag` in its metadata: a new file (sha256) with the same graph and weights."""
    import onnx

    model = onnx.load(str(src))
    model.metadata_props.append(onnx.StringStringEntryProto(key="edge-agent.variant", value=tag))
    onnx.save(model, str(dst))
    return dst


def agent_config(work: Path, opts: BenchOptions, mqtt_port: int, public_key: Path) -> dict[str, Any]:
    cams = {
        cam: {"url": str(opts.clip), "model": MODEL, "fps": opts.deploy_fps, "loop": True, "min_score": 0.4}
        for cam in CAMERAS
    }
    return {
        "device_id": DEVICE,
        "engine_dir": str(work / "engines"),
        "models": {
            MODEL: {
                "onnx": str(opts.model),
                "labels": str(opts.labels),
                "format": opts.format,
                "backend": "onnxruntime",
                "precision": "fp32",
                "threads": {"intra": 1},
            }
        },
        "cameras": cams,
        "mqtt": {"host": "127.0.0.1", "port": mqtt_port, "prefix": PREFIX},
        "deploy": {
            "enabled": True,
            "trusted_keys": {"bench": str(public_key)},
            "allow_http": True,
            "state_dir": str(work / "state"),
            "watch_s": 0,
        },
    }


def _document(www: Path, port: int, version: str, opts: BenchOptions, key: Path) -> bytes:
    import hashlib

    from agent.deploy.signing import sign_document

    folder = www / version
    folder.mkdir()
    onnx_path = tagged_onnx(opts.model, folder / "model.onnx", version)
    labels = folder / "labels.txt"
    labels.write_bytes(opts.labels.read_bytes())

    def art(path: Path) -> dict[str, Any]:
        data = path.read_bytes()
        url = f"http://127.0.0.1:{port}/{version}/{path.name}"
        return {"url": url, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    doc = {
        "model": MODEL,
        "version": version,
        "format": opts.format,
        "artifacts": {"onnx": art(onnx_path), "labels": art(labels)},
        "request_id": version,
    }
    return json.dumps(sign_document(doc, key, "bench")).encode()


def _one(listener: Listener, agent: Agent, doc: bytes, version: str, opts: BenchOptions) -> dict[str, Any]:
    load_before = [round(x, 2) for x in os.getloadavg()]  # a machine shared with other work says so here
    t0 = time.monotonic()
    time.sleep(opts.duration_s)
    before = listener.count(t0, time.monotonic())
    rate_before = sum(before.values()) / opts.duration_s
    t_cmd = listener.publish("cmd/deploy", doc)

    def ended() -> dict[str, Any] | None:
        for t, s in list(listener.states):
            if t >= t_cmd and s.get("version") == version and s.get("stage") in ENDINGS:
                return {"t": t, **s}
        return None

    listener.wait(lambda: ended() is not None, 900, f"deployment {version} to end", agent)
    end = ended()
    assert end is not None
    total_s = end["t"] - t_cmd
    during = listener.count(t_cmd, end["t"])
    rate_during = sum(during.values()) / max(total_s, 1e-6)
    stage_s = {k: v for k, v in (end.get("stage_s") or {}).items() if k in STAGES}
    staged = sum(stage_s.values())
    return {
        "version": version,
        "stage": end["stage"],
        "reason": end.get("reason"),
        "command_to_serving_s": round(total_s, 2),
        "stage_s": stage_s,
        "stage_share": {k: round(v / staged, 3) for k, v in stage_s.items()} if staged else {},
        "untracked_s": round(total_s - staged, 2),  # MQTT in/out and the state's publication
        "frames_before_per_s": round(rate_before, 2),
        "frames_during_per_s": round(rate_during, 2),
        "frames_during_pct_of_before": round(100.0 * rate_during / max(rate_before, 1e-6), 1),
        "load_avg_before": load_before,
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "frames_by_camera_before": before,
        "frames_by_camera_during": during,
        "state": {k: v for k, v in end.items() if k != "t"},  # the retained deployments/{model} payload
    }


def deploy_section(opts: BenchOptions) -> dict[str, Any]:
    import yaml

    from agent.deploy.signing import generate_keys

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as tmp:
        work = Path(tmp)
        www = work / "www"
        www.mkdir()
        key, pub = generate_keys(work / "keys", "bench")
        broker = mosquitto(work)
        store = nginx(work, www)
        agent: Agent | None = None
        listener: Listener | None = None
        try:
            listener = Listener(broker.port, PREFIX, DEVICE)
            config = work / "agent.yaml"
            config.write_text(yaml.safe_dump(agent_config(work, opts, broker.port, pub)))
            agent = Agent(config, work / "agent.log")
            lst = listener
            lst.wait(lambda: all(lst.frames.get(c) for c in CAMERAS), 180, "both cameras' detections", agent)
            time.sleep(max(opts.warmup_s, 5.0))
            for i in range(1, max(1, opts.repeat) + 1):
                version = f"bench-{i}"
                doc = _document(www, store.port, version, opts, key)
                runs.append(_one(listener, agent, doc, version, opts))
        finally:
            if listener is not None:
                listener.close()
            if agent is not None:
                agent.stop()
            store.stop()
            broker.stop()
    return {
        "model": opts.model.name,
        "runtime": "onnxruntime (1 intra-op thread)",
        "cameras": len(CAMERAS),
        "camera_fps": opts.deploy_fps,
        "window_s": opts.duration_s,
        "runs": runs,
    }


def deploy_summary(section: dict[str, Any]) -> str:
    lines = []
    for r in section["runs"]:
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["stage_share"].items())
        lines.append(
            f"deploy {r['version']}: {r['stage']} in {r['command_to_serving_s']:.1f} s ({shares}); frames "
            f"during {r['frames_during_pct_of_before']:.1f}% of before ({r['frames_during_per_s']:.1f} vs "
            f"{r['frames_before_per_s']:.1f}/s; load average {r['load_avg_before'][0]:g} before)"
        )
    return "\n".join(lines)
