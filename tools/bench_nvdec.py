"""Decode throughput: the agent's NVDEC path against PyNvVideoCodec's own decode loop, N streams at once.

    python tools/bench_nvdec.py --clip bikes-1080p.h264 --streams 1,16 --seconds 10 --out nvdec.json

Each stream is a thread decoding the clip in a loop as fast as it can, for `--seconds`:
- `pynvvideocodec`: NVIDIA's demuxer (CreateDemuxer over the file) + decoder, the pictures left where the
  decoder put them: the ceiling.
- `agent`: what a camera with `decoder: nvdec` does: OpenCV's FFmpeg packet demux + pipelines.sources.nvdec's
  NvdecDecoder (its own stream, each picture copied into frame-owned memory, an event recorded).
- `cpu` (with --cpu): OpenCV's FFmpeg decode to BGR, as CPU cameras do.
Reported per variant and stream count: pictures/s over all streams and process CPU ms per picture.
Needs a GPU with NVDEC, PyNvVideoCodec and cuda-python (the `[nvdec]` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import psutil

# --latency: the decoders' DisplayDecodeLatencyType in every variant; None: each its own default
# (PyNvVideoCodec's NATIVE in its loop, the cameras' LOW in the agent's path).
LATENCY: list[str | None] = [None]


def _pnv_stream(clip: str, stop: threading.Event, counts: list[int], i: int) -> None:
    import PyNvVideoCodec as nvc

    latency = getattr(nvc.DisplayDecodeLatencyType, LATENCY[0] or "NATIVE")
    while not stop.is_set():
        demux = nvc.CreateDemuxer(filename=clip)
        dec = nvc.CreateDecoder(gpuid=0, codec=demux.GetNvCodecId(), usedevicememory=True, latency=latency)
        for packet in demux:
            counts[i] += len(dec.Decode(packet))
            if stop.is_set():
                return


def _agent_stream(clip: str, stop: threading.Event, counts: list[int], i: int) -> None:
    from pipelines.sources.bitstream import fourcc_text
    from pipelines.sources.nvdec import NvdecDecoder

    while not stop.is_set():
        cap = cv2.VideoCapture(clip, cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
        dec = NvdecDecoder(fourcc_text(cap.get(cv2.CAP_PROP_FOURCC)), latency=LATENCY[0] or "LOW")
        try:
            while not stop.is_set():
                ok, packet = cap.read()
                if not ok:
                    break
                pictures = dec.decode(packet, bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME)))
                counts[i] += len(pictures)
                del pictures  # the frame-owned copies go back to the pool, as a consumed frame's would
        finally:
            cap.release()
            dec.close()


def _read_loop(clip: str, params: list[int], stop: threading.Event, counts: list[int], i: int) -> None:
    """Read the clip with OpenCV again and again, counting what read() returns."""
    while not stop.is_set():
        cap = cv2.VideoCapture(clip, cv2.CAP_FFMPEG, params)
        while not stop.is_set():
            ok, _ = cap.read()
            if not ok:
                break
            counts[i] += 1
        cap.release()


def _demux_stream(clip: str, stop: threading.Event, counts: list[int], i: int) -> None:
    """Attribution: OpenCV's packet demux alone (what the agent adds in front of the decoder)."""
    _read_loop(clip, [cv2.CAP_PROP_FORMAT, -1], stop, counts, i)


def _nocopy_stream(clip: str, stop: threading.Event, counts: list[int], i: int) -> None:
    """Attribution: OpenCV demux + PyNvVideoCodec decode, pictures left in the decoder (no copy, no event)."""
    import numpy as np
    import PyNvVideoCodec as nvc

    from pipelines.sources.bitstream import codec_name, fourcc_text
    from pipelines.sources.nvdec import NVDEC_CODECS

    while not stop.is_set():
        cap = cv2.VideoCapture(clip, cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
        name = NVDEC_CODECS[codec_name(fourcc_text(cap.get(cv2.CAP_PROP_FOURCC)))]
        codec = getattr(nvc.cudaVideoCodec, name)
        latency = getattr(nvc.DisplayDecodeLatencyType, LATENCY[0] or "LOW")
        dec = nvc.CreateDecoder(gpuid=0, codec=codec, usedevicememory=True, latency=latency)
        while not stop.is_set():
            ok, packet = cap.read()
            if not ok:
                break
            data = np.ascontiguousarray(packet.reshape(-1))
            pkt = nvc.PacketData()
            pkt.bsl_data, pkt.bsl = data.ctypes.data, data.size
            counts[i] += len(dec.Decode(pkt))
        cap.release()


def _cpu_stream(clip: str, stop: threading.Event, counts: list[int], i: int) -> None:
    _read_loop(clip, [], stop, counts, i)  # FFmpeg decoding to BGR, as CPU cameras do


VARIANTS = {
    "pynvvideocodec": _pnv_stream,
    "agent": _agent_stream,
    "cpu": _cpu_stream,
    "opencv-demux": _demux_stream,
    "agent-nocopy": _nocopy_stream,
}


def run(variant: str, clip: str, streams: int, seconds: float, warmup: float = 2.0) -> dict[str, Any]:
    stop = threading.Event()
    counts = [0] * streams
    threads = [
        threading.Thread(target=VARIANTS[variant], args=(clip, stop, counts, i), daemon=True)
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    time.sleep(warmup)
    proc = psutil.Process()
    c0, n0, t0 = proc.cpu_times(), sum(counts), time.monotonic()
    time.sleep(seconds)
    c1, n1, t1 = proc.cpu_times(), sum(counts), time.monotonic()
    stop.set()
    for t in threads:
        t.join(30)
    frames = n1 - n0
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return {
        "variant": variant,
        "streams": streams,
        "fps": round(frames / (t1 - t0), 1),
        "cpu_ms_per_frame": round(1000 * cpu / frames, 3) if frames else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clip", required=True)
    p.add_argument("--streams", default="1,16")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--cpu", action="store_true", help="also FFmpeg CPU decoding")
    p.add_argument(
        "--attribute", action="store_true", help="also OpenCV demux alone; demux + decode without the copy"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the variants in turn this many times; report medians (the baseline itself varies ~10%%"
        " run to run on the H100)",
    )
    p.add_argument(
        "--latency",
        choices=["NATIVE", "LOW"],
        help="one decoder output latency for every variant: NATIVE (pictures up to 4 packets later) or LOW"
        " (each with its packet); default: PyNvVideoCodec's loop NATIVE, the agent's path LOW (as cameras)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    LATENCY[0] = args.latency
    variants = ["pynvvideocodec", "agent"] + (["cpu"] if args.cpu else [])
    variants += ["opencv-demux", "agent-nocopy"] if args.attribute else []
    results = []
    for n in (int(s) for s in args.streams.split(",")):
        for rep in range(max(1, args.repeat)):
            for v in variants:  # in turn, so slow drifts of the machine hit every variant alike
                r = {**run(v, args.clip, n, args.seconds), "repeat": rep}
                print(json.dumps(r), flush=True)
                results.append(r)
    report: dict[str, Any] = {
        "clip": args.clip,
        "seconds": args.seconds,
        "latency": args.latency,
        "results": results,
    }
    for n in sorted({r["streams"] for r in results}):
        ref = [r for r in results if r["streams"] == n and r["variant"] == "pynvvideocodec"]
        ours = [r for r in results if r["streams"] == n and r["variant"] == "agent"]
        ratios = [o["fps"] / b["fps"] for o, b in zip(ours, ref, strict=True) if b["fps"]]
        report[f"agent_vs_pynvvideocodec_{n}"] = round(statistics.median(ratios), 3) if ratios else None
        report[f"agent_vs_pynvvideocodec_{n}_each"] = [round(x, 3) for x in ratios]
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k.startswith("agent_vs")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
