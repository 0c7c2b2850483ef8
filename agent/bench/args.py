"""The options of `edge-agent bench` (light: the CLI builds its parser without importing the bench).

See agent/bench/run.py for what each section measures.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.models.registry import formats

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # agent/assets
SECTIONS = ("stages", "overhead", "sweep")  # the default
KNOWN_SECTIONS = (*SECTIONS, "readers", "tracking", "decode", "deploy", "fleet-cache", "fleet-rollout")


@dataclass
class BenchOptions:
    out: Path = Path("bench-out")
    model: Path = ASSETS / "nanodet-m-416.onnx"
    labels: Path = ASSETS / "coco.names"
    format: str = "nanodet"
    clip: Path = ASSETS / "bikes.mp4"
    frames: int = 200  # clip frames for the stages section
    clip_frames: int = 48  # distinct frames the looped streams cycle through
    threads: int = 0
    sections: tuple[str, ...] = SECTIONS
    engine: str = "sim"
    engine_ms: float = 2.0
    slots: int = 1
    streams: list[int] = field(default_factory=lambda: [1, 4, 16])
    batch: list[int] = field(default_factory=lambda: [1, 4, 8])
    fps: float = 25.0
    resolution: tuple[int, int] | None = None  # (w, h)
    preprocess: str = "cpu"
    decode: bool = False
    decoder: str = "cpu"  # camera readers' decoder: cpu (FFmpeg) or nvdec (PyNvVideoCodec)
    postprocess: str = "host"  # host: raw heads decoded on the host; graph: decode + NMS in the model
    rtsp: str | None = None
    warmup_s: float = 2.0
    duration_s: float = 10.0
    iterations: int | None = None
    max_age_ms: float = 500.0
    window_s: float = 10.0
    flap: int = 0  # isolation: cameras whose source drops them every flap_every_s, beside the steady ones
    flap_every_s: float = 2.0
    repeat: int = 1  # runs of each point (with --flap: rounds of the three variants, compared by medians)
    shards: int = 1  # sweep and decode: the streams split over this many processes (agent/bench/shards.py)
    gpus: list[int] | None = None  # shard k on GPU gpus[k % len] (CUDA_VISIBLE_DEVICES)
    deploy_fps: float = 5.0  # deploy section: each of its two cameras' frame rate
    fleet_agents: int = 0  # fleet sections: agents (0: the target's, 8 for fleet-cache, 10 for fleet-rollout)
    fleet_precision: str = "fp32"  # fleet-cache: the precision of the model's TensorRT-RTX build
    soak_s: float = 10.0  # fleet-rollout: each wave's soak


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (the CLI's `bench` subcommand and `python -m agent.bench`), in --help's order."""
    _what_arguments(p)
    _stream_arguments(p)
    _window_arguments(p)


def _what_arguments(p: argparse.ArgumentParser) -> None:
    """What runs: sections, model, clip, engine."""
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"any of {', '.join(KNOWN_SECTIONS)} (default: {', '.join(SECTIONS)}); readers: camera readers"
        " alone, no model (per-camera rate, start-up time); tracking: tracker, zones, lines and events per"
        " frame at 1/20/100 objects, IDF1 and ID switches, MQTT messages on the clip",
    )
    p.add_argument("--model", type=Path, default=BenchOptions.model, help="ONNX model (default: bundled)")
    p.add_argument("--format", default="nanodet", choices=formats(), help="its output layout")
    p.add_argument("--labels", type=Path, default=BenchOptions.labels)
    p.add_argument("--clip", type=Path, default=BenchOptions.clip, help="video (default: bundled clip)")
    p.add_argument("--frames", type=int, default=200, help="clip frames for the stages section")
    p.add_argument("--clip-frames", type=int, default=48, help="distinct frames the looped streams replay")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = default)")
    p.add_argument("--engine", choices=["sim", "ort"], default=None, help="sweep engine (default: sim)")
    p.add_argument(
        "--engine-ms",
        type=float,
        default=None,
        help="simulated engine: ms per batch (default 2; implies sim)",
    )
    p.add_argument("--slots", type=int, default=1, help="simulated engine: batches in flight at once")


def _stream_arguments(p: argparse.ArgumentParser) -> None:
    """The streams and the pipeline they go through."""
    p.add_argument("--streams", default="1,4,16", help="stream counts to sweep, e.g. 1,4,16")
    p.add_argument("--batch", default="1,4,8", help="max batch sizes to sweep, e.g. 1,4,8")
    p.add_argument(
        "--fps",
        type=float,
        default=25.0,
        help="frames per second per stream; 0 with camera readers: unpaced (files as fast as they decode),"
        " the saturation point",
    )
    p.add_argument("--resolution", help="resize the clip's frames to WxH first, e.g. 1920x1080")
    p.add_argument("--preprocess", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--decode", action="store_true", help="streams decode the clip (camera readers)")
    p.add_argument(
        "--decoder",
        choices=["cpu", "nvdec"],
        default="cpu",
        help="camera readers decode with FFmpeg on the CPU or with NVDEC (implies --decode)",
    )
    p.add_argument(
        "--postprocess",
        choices=["host", "graph"],
        default="host",
        help="graph: decode + NMS grafted onto the model (pipelines.models.graft), so the engine's outputs"
        " are detections (a few KB per frame) instead of raw heads",
    )
    p.add_argument(
        "--rtsp", help="streams read this RTSP URL ('{i}' becomes 1..N), e.g. from tools/rtsp_server.py"
    )


def _window_arguments(p: argparse.ArgumentParser) -> None:
    """The measured windows, isolation and shards."""
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured window")
    p.add_argument("--duration", type=float, default=10.0, help="seconds each measured window lasts")
    p.add_argument("--iterations", type=int, help="end each window after this many frames instead")
    p.add_argument("--max-age-ms", type=float, default=500.0, help="drop frames older than this (0: never)")
    p.add_argument("--window", type=float, default=10.0, help="timeline granularity, seconds")
    p.add_argument(
        "--flap",
        type=int,
        default=0,
        help="isolation: also run each point with K more cameras whose RTSP source (tools/annexb_rtsp_server"
        ".py --close-after) drops them every --flap-every s, and report the steady cameras with and without"
        " them (needs --decode or --rtsp)",
    )
    p.add_argument("--flap-every", type=float, default=2.0, help="seconds between drops")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each point N times (with --flap: N rounds of alone/control/flapping; isolation compares"
        " medians, which a machine shared with other work needs)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="sweep and decode: split the streams over N processes, each a whole pipeline (as the daemon's"
        " pipeline.shards); the run sums them, CPU per frame over every process",
    )
    p.add_argument("--gpus", help="with --shards: GPU indices, shard k on the k-th modulo their count: 0,1")
    p.add_argument(
        "--deploy-fps",
        type=float,
        default=5.0,
        help="deploy section: frames per second of each of its two cameras (agent/bench/deploy.py)",
    )
    p.add_argument(
        "--fleet-agents",
        type=int,
        default=0,
        help="fleet-cache / fleet-rollout: agents started (default 8 / 10; agent/bench/fleet_*.py)",
    )
    p.add_argument("--fleet-precision", choices=["fp32", "fp16"], default="fp32", help="fleet-cache's build")
    p.add_argument("--soak", type=float, default=10.0, help="fleet-rollout: seconds each wave holds serving")
    p.add_argument("--log-level", default="warning")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(KNOWN_SECTIONS))
    if unknown:
        raise ValueError(f"--sections: unknown {unknown} (known: {', '.join(KNOWN_SECTIONS)})")
    engine = args.engine or "sim"
    _check(args, sections, engine)
    gpus = _ints(args.gpus, "--gpus", zero=True) if args.gpus else None
    if args.flap and not _readers(args):
        raise ValueError("--flap compares camera readers: give --decode (file readers) or --rtsp")
    resolution = None
    if args.resolution:
        w, _, h = args.resolution.lower().partition("x")
        resolution = (int(w), int(h))
    return BenchOptions(
        out=Path(args.out),
        model=args.model,
        labels=args.labels,
        format=args.format,
        clip=args.clip,
        frames=args.frames,
        clip_frames=args.clip_frames,
        threads=args.threads,
        sections=sections,
        engine=engine,
        engine_ms=2.0 if args.engine_ms is None else args.engine_ms,
        slots=args.slots,
        streams=_ints(args.streams, "--streams"),
        batch=_ints(args.batch, "--batch"),
        fps=args.fps,
        resolution=resolution,
        preprocess=args.preprocess,
        decode=args.decode or args.decoder != "cpu",
        decoder=args.decoder,
        postprocess=args.postprocess,
        rtsp=args.rtsp,
        warmup_s=args.warmup,
        duration_s=args.duration,
        iterations=args.iterations,
        max_age_ms=args.max_age_ms,
        window_s=args.window,
        flap=args.flap,
        flap_every_s=args.flap_every,
        repeat=args.repeat,
        shards=args.shards,
        gpus=gpus,
        deploy_fps=args.deploy_fps,
        fleet_agents=args.fleet_agents,
        fleet_precision=args.fleet_precision,
        soak_s=args.soak,
    )


def _check(args: argparse.Namespace, sections: tuple[str, ...], engine: str) -> None:
    """The options that cannot go together or are out of range (ValueError: a usage error)."""
    if args.engine_ms is not None and engine != "sim":
        raise ValueError("--engine-ms is for the simulated engine (--engine sim)")
    if args.preprocess == "gpu" and engine != "sim":
        raise ValueError("--preprocess gpu needs an engine that takes device input: the simulated one")
    if args.flap < 0 or args.flap_every <= 0 or args.repeat < 1:
        raise ValueError("--flap must be >= 0, --flap-every > 0 and --repeat >= 1")
    for flag, value in (("--warmup", args.warmup), ("--duration", args.duration), ("--fps", args.fps)):
        if not value >= 0 or (flag == "--duration" and not value > 0):  # NaN fails both
            low = "> 0" if flag == "--duration" else ">= 0"
            raise ValueError(f"{flag}: expected a number {low}, got {value}")
    if args.fps == 0 and not _readers(args):
        raise ValueError("--fps 0 (unpaced, saturation) needs camera readers: --decode, --decoder or --rtsp")
    if not args.deploy_fps > 0:
        raise ValueError(f"--deploy-fps: expected a number > 0, got {args.deploy_fps}")
    if args.fleet_agents < 0 or not args.soak >= 0:
        raise ValueError("--fleet-agents must be >= 0 and --soak >= 0")
    if args.shards < 1:
        raise ValueError(f"--shards: expected an integer >= 1, got {args.shards}")
    if args.shards > 1 and args.flap:
        raise ValueError("--flap compares cameras inside one process: leave --shards at 1")
    if "decode" in sections and not _readers(args):
        raise ValueError("--sections decode measures camera readers: give --decode, --decoder or --rtsp")


def _readers(args: argparse.Namespace) -> bool:
    """The streams are camera readers (--decode, --decoder or --rtsp), not the clip looped in memory."""
    return bool(args.decode or args.rtsp or args.decoder != "cpu")


def _ints(text: str, flag: str, zero: bool = False) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < (0 if zero else 1):
        raise ValueError(f"{flag}: expected {'integers >= 0' if zero else 'positive integers'}, got {text!r}")
    return values
