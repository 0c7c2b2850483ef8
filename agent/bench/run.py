"""`edge-agent bench`: the whole pipeline under load, like trtexec for an engine.

    edge-agent bench                                              # stages, overhead, sweep (simulated engine)
    edge-agent bench --sections sweep --streams 16 --batch 8 --duration 300   # the long no-growth run
    edge-agent bench --engine ort --streams 4 --batch 1,4         # ONNX Runtime vs its bare loop
    edge-agent bench --resolution 1920x1080 --preprocess gpu --streams 16 --batch 8   # a GPU box
    edge-agent bench --rtsp 'rtsp://127.0.0.1:8554/cam{i}' --streams 4   # tools/rtsp_server.py --mounts 4
    edge-agent bench --sections sweep --decode --streams 6 --batch 8 --flap 1   # isolation: a flapping camera
    edge-agent bench --sections fleet-cache,fleet-rollout      # engine cache (8 agents), rollouts (10 agents)

Sections (`--sections`, all by default):
- stages: each stage of one frame at a time on the bundled clip with ONNX Runtime (decode, preprocess,
  infer, postprocess, publish) and the sequential frame rate;
- overhead: the agent's own cost per frame (scheduler, preprocess, postprocess, payload) with inference
  replayed from recorded outputs, one frame at a time, at the clip's size and at 1920x1080;
- sweep: N streams (N looped copies of the clip at --fps each, decoded once into memory; or real camera
  readers with --decode / --rtsp) into the pipelined worker, for every --streams x --batch, after a
  warm-up: offered and processed frames/s, frame age p50/p95/p99 at delivery, per-stage times, engine
  busy time (device time), process CPU per frame, a timeline (throughput, age p95, RSS) for growth.
  The engine is the simulated one (--engine sim: NanoDet outputs recorded with ONNX Runtime, replayed
  with a fixed --engine-ms per batch that releases the GIL, --slots batches at once) or ONNX Runtime
  itself (--engine ort, with its bare infer loop at the same batch as the baseline). With camera readers
  each run also has `startup` (seconds from start to each camera streaming) and `camera_fps` (each
  camera's own delivered rate); with --flap K each point runs twice, without and with K cameras whose
  RTSP source drops them every --flap-every s, and `isolation` compares the steady cameras' share;
- tracking (not in the default set): host CPU per frame of the tracker, of tracker + zones + lines, and
  of the whole per-camera events hook at 1, 20 and 100 objects; IDF1 / ID switches on synthetic scenes,
  also of the library trackers where installed; MQTT messages on the clip per configuration with
  `publish.detections: off` (agent/bench/tracking.py);
- fleet-cache, fleet-rollout (not in the default set): real agents on mosquitto; 8 of one device kind
  building a TensorRT-RTX engine with an empty shared cache (docker-registry) against 8 independent builds,
  and `fleet deploy` of a good then a broken version over 10 (agent/bench/fleet_cache.py, fleet_rollout.py).

Writes bench.json and bench.png (throughput vs streams, latency vs batch; needs matplotlib) in --out and
prints a one-paragraph summary. `python -m agent.bench` runs it where the CLI's dependencies are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.bench.args import BenchOptions, add_arguments, options_from_args
from agent.bench.engine import engine_description
from agent.bench.isolation import isolation
from agent.bench.plot import plot
from agent.bench.sequential import OVERHEAD_TARGET_MS, overhead_report, stages
from agent.bench.streams import read_clip
from agent.bench.summary import summary
from agent.bench.sweep import against_decode, decode_section, readers_section, sweep
from agent.bench.workload import Workload
from engines.runtimes.ort import OrtBackend
from pipelines.models import ModelSpec, resolve_onnx
from pipelines.postprocess import load_labels

RECORDED_FRAMES = 16  # outputs recorded with ONNX Runtime for the simulated engine to replay


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    spec = resolve_onnx(opts.model.stem, opts.model, opts.format, load_labels(opts.labels))
    if opts.postprocess == "graph":
        spec = _grafted(opts, spec)
        opts = replace(opts, model=spec.onnx)
    labels = list(spec.labels)
    ort = OrtBackend(str(opts.model), intra_threads=opts.threads)
    ort.load()
    input_spec = ort.input_spec
    adapter = spec.adapter()
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "load_avg": list(os.getloadavg()),
        },
        "model": opts.model.name,
        "clip": opts.clip.name,
        "options": _jsonable(opts),
    }
    try:
        if "stages" in opts.sections:
            report.update(stages(opts, ort, adapter, labels))
        if "readers" in opts.sections:
            report["readers"] = readers_section(opts)
        if "tracking" in opts.sections:
            from agent.bench.tracking import tracking_report  # needs the config's pydantic: only when asked

            report["tracking"] = tracking_report(str(opts.clip), ort, adapter, labels)
        if "overhead" in opts.sections or "sweep" in opts.sections:
            images = read_clip(opts.clip, max(opts.clip_frames, RECORDED_FRAMES), opts.resolution)
            recorded = [ort.infer(adapter.preprocess([im])[0]) for im in images[:RECORDED_FRAMES]]
            work = Workload(input_spec, recorded, adapter, labels, images)
            report["resolution"] = f"{images[0].shape[1]}x{images[0].shape[0]}"
        if not (opts.engine == "ort" and "sweep" in opts.sections):
            ort.close()  # its idle thread pool would only compete with (and be counted as) the agent
        if "overhead" in opts.sections:
            report["overhead_ms"] = overhead_report(opts, work)
            report["overhead_target_ms"] = OVERHEAD_TARGET_MS
        if "decode" in opts.sections:
            report["decode_alone"] = decode_section(opts)
        if "sweep" in opts.sections:
            report["engine"] = engine_description(opts)
            bare = ort if opts.engine == "ort" else None
            report["runs"] = sweep(opts, work, bare)
            against_decode(report)
            if opts.flap:
                report["isolation"] = isolation(report["runs"], opts)
        if "deploy" in opts.sections:
            report["deploy"] = _deploy(opts, ort)
        report.update(_fleet(opts, ort))
    finally:
        ort.close()
    report["summary"] = _summary(report)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    report["plot"] = plot(report, opts.out / "bench.png")
    return report


def _deploy(opts: BenchOptions, ort: OrtBackend) -> dict[str, Any]:
    """The deploy section: it starts mosquitto, nginx and the agent (its sessions are measured, not ours)."""
    from agent.bench.deploy import deploy_section

    ort.close()
    return deploy_section(opts)


def _fleet(opts: BenchOptions, ort: OrtBackend) -> dict[str, Any]:
    """The fleet sections: they start mosquitto, docker-registry, nginx and N agents (agent/bench/fleet_*)."""
    out: dict[str, Any] = {}
    if "fleet-cache" in opts.sections:
        from agent.bench.fleet_cache import fleet_cache_section

        ort.close()
        out["fleet_cache"] = fleet_cache_section(opts)
    if "fleet-rollout" in opts.sections:
        from agent.bench.fleet_rollout import fleet_rollout_section

        ort.close()
        out["fleet_rollout"] = fleet_rollout_section(opts)
    return out


def _summary(report: dict[str, Any]) -> str:
    lines = [summary(report)]
    if "deploy" in report:
        from agent.bench.deploy import deploy_summary

        lines.append(deploy_summary(report["deploy"]))
    if "fleet_cache" in report:
        from agent.bench.fleet_cache import fleet_cache_summary

        lines.append(fleet_cache_summary(report["fleet_cache"]))
    if "fleet_rollout" in report:
        from agent.bench.fleet_rollout import fleet_rollout_summary

        lines.append(fleet_rollout_summary(report["fleet_rollout"]))
    return "\n".join(x for x in lines if x).strip()


def _grafted(opts: BenchOptions, spec: ModelSpec) -> ModelSpec:
    """The model with decode + NMS grafted on (what `tools/graft_model.py` writes), in --out."""
    import onnx

    from agent.config import ModelConfig  # the config's pydantic: only for --postprocess graph
    from pipelines.models import GraftParams
    from pipelines.models.graft import graft_spec

    # The daemon's default threshold (models.M.graph_score_threshold), read from the config schema; the
    # routes' min_score (0.4) is above it, as the daemon requires of a model's cameras. 100 boxes a frame.
    params = GraftParams(ModelConfig.model_fields["graph_score_threshold"].default, max_det=100)
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"{opts.model.stem}-grafted.onnx"
    onnx.save(graft_spec(spec, params), str(path))
    return spec.grafted_as(path, params)


def _jsonable(opts: BenchOptions) -> dict[str, Any]:
    out = {}
    for k, v in vars(opts).items():
        out[k] = str(v) if isinstance(v, Path) else (list(v) if isinstance(v, tuple) else v)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m agent.bench`: `edge-agent bench` where the CLI's dependencies are missing."""
    import logging

    p = argparse.ArgumentParser(prog="python -m agent.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"edge-agent bench: {exc}", file=sys.stderr)
        return 2
    report = run_bench(opts)
    print(report["summary"])
    print(f"report: {opts.out / 'bench.json'}" + (f", plot: {report['plot']}" if report["plot"] else ""))
    return 0
