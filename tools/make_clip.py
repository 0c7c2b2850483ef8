"""Make camera-like test clips (H.264 or H.265 Annex-B) at any size from the bundled clip, with PyAV.

The benchmarks need compressed 1080p streams (a lossless tools/h264_pcm.py stream is 3 MB a frame, far
more than a camera sends), and neither OpenCV's wheels nor the H100 box (NVDEC, no NVENC) can encode.
PyAV's wheels carry libx264 and libx265; it is a developer tool here, not a dependency of the agent:

    pip install av
    python tools/make_clip.py --size 1920x1080 --codec h264 --out bikes-1080p.h264
    python tools/make_clip.py --size 1920x1080 --codec hevc --out bikes-1080p.h265

Like most cameras: no B-frames, a key frame every `--gop` frames, SPS/PPS repeated before each, yuv420p.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"


def make_clip(
    out: Path,
    size: tuple[int, int],
    codec: str = "h264",
    frames: int = 250,
    fps: int = 25,
    gop: int = 50,
    crf: int = 23,
    source: Path = ASSETS / "bikes.mp4",
) -> int:
    """Write `frames` frames of `source` (looped, resized to `size`) as an Annex-B stream; returns count."""
    import av  # optional: only this tool needs it

    encoder = {"h264": "libx264", "hevc": "libx265"}[codec]
    muxer = {"h264": "h264", "hevc": "hevc"}[codec]
    cap = cv2.VideoCapture(str(source))
    with av.open(str(out), "w", format=muxer) as container:
        stream = container.add_stream(encoder, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.options = {"crf": str(crf), "g": str(gop), "bf": "0", "preset": "veryfast"}
        if codec == "hevc":
            stream.options["x265-params"] = (
                f"keyint={gop}:min-keyint={gop}:bframes=0:repeat-headers=1:log-level=error"
            )
        else:
            stream.options["x264-params"] = f"keyint={gop}:min-keyint={gop}:bframes=0:repeat-headers=1"
        written = 0
        while written < frames:
            ok, bgr = cap.read()
            if not ok:
                cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
                continue
            frame = av.VideoFrame.from_ndarray(cv2.resize(bgr, size), format="bgr24")
            for packet in stream.encode(frame):
                container.mux(packet)
            written += 1
        for packet in stream.encode():
            container.mux(packet)
    cap.release()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1920x1080")
    p.add_argument("--codec", choices=["h264", "hevc"], default="h264")
    p.add_argument("--frames", type=int, default=250)
    p.add_argument("--fps", type=int, default=25)
    p.add_argument("--gop", type=int, default=50)
    p.add_argument("--crf", type=int, default=23)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    w, _, h = args.size.lower().partition("x")
    n = make_clip(args.out, (int(w), int(h)), args.codec, args.frames, args.fps, args.gop, args.crf)
    print(f"{args.out}: {n} frames {w}x{h} {args.codec}, {args.out.stat().st_size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
