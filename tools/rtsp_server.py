#!/usr/bin/python3
"""A small RTSP server for tests and demos: loops an mp4 clip (no re-encoding) or serves a live test pattern.

Run it with the system python that has PyGObject and gst-rtsp-server (a venv usually cannot import gi):

    /usr/bin/python3 tools/rtsp_server.py --port 8554 --file agent/assets/bikes.mp4 --mount /cam --mount /cam2

It listens on 127.0.0.1 only, prints one line ``READY rtsp://127.0.0.1:PORT/MOUNT`` per mount on stdout
(flushed) once the socket is bound, and exits with status 0 on SIGTERM or SIGINT. ``--port 0`` picks a
free port (the READY lines name it).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402  (gi.require_version must come first)

HOST = "127.0.0.1"


def fail(message: str) -> None:
    print(f"rtsp_server: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def mp4_to_annexb(mp4: Path, out: Path, timeout_s: float = 60.0) -> tuple[int, int]:
    """Remux the H.264 track of an mp4 into a raw Annex-B file; return its framerate as (num, den).

    Byte-stream with SPS/PPS before every IDR (config-interval=-1) so that the file can be played from
    its start again and again by multifilesrc loop=true, and a client joining late gets the parameters.
    """
    pipeline = Gst.parse_launch(
        f"filesrc location={_quote(mp4)} ! qtdemux name=demux demux.video_0 ! queue ! "
        "h264parse config-interval=-1 ! video/x-h264,stream-format=byte-stream,alignment=au ! "
        f"filesink name=sink location={_quote(out)}"
    )
    pipeline.set_state(Gst.State.PLAYING)
    bus = pipeline.get_bus()
    msg = bus.timed_pop_filtered(int(timeout_s * Gst.SECOND), Gst.MessageType.EOS | Gst.MessageType.ERROR)
    caps = pipeline.get_by_name("sink").get_static_pad("sink").get_current_caps()
    pipeline.set_state(Gst.State.NULL)
    if msg is None:
        fail(f"converting {mp4} timed out")
    if msg.type == Gst.MessageType.ERROR:
        err, debug = msg.parse_error()
        fail(f"cannot read H.264 from {mp4}: {err.message} ({debug})")
    if out.stat().st_size == 0:
        fail(f"no H.264 video in {mp4}")
    ok, num, den = (False, 0, 1) if caps is None else caps.get_structure(0).get_fraction("framerate")
    if not ok or num <= 0:
        # Variable-rate or unknown: h264parse needs a rate to timestamp the raw stream.
        num, den = 25, 1
    return num, den


def _quote(path: Path) -> str:
    # gst-launch syntax: a double-quoted value survives spaces in temp or asset paths.
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


def file_launch(h264: Path, num: int, den: int) -> str:
    return (
        f"( multifilesrc location={_quote(h264)} loop=true "
        f"caps=video/x-h264,stream-format=byte-stream,alignment=au,framerate={num}/{den} "
        "! h264parse ! rtph264pay name=pay0 pt=96 config-interval=1 )"
    )


def pattern_launch(width: int, height: int, fps: int) -> str:
    return (
        "( videotestsrc is-live=true pattern=ball "
        f"! video/x-raw,width={width},height={height},framerate={fps}/1 "
        f"! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={fps} "
        "! rtph264pay name=pay0 pt=96 config-interval=1 )"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8554, help="TCP port on 127.0.0.1 (0: pick a free one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=Path, help="mp4 with an H.264 track, looped forever")
    src.add_argument("--pattern", action="store_true", help="live videotestsrc encoded with x264enc")
    p.add_argument("--mount", action="append", help="mount path (repeatable); default /cam")
    p.add_argument("--mounts", type=int, default=0, help="also serve /cam1 ... /camN")
    p.add_argument(
        "--workdir",
        type=Path,
        help="where to write the Annex-B copy of --file (kept); default a temp dir removed on exit "
        "(a SIGKILL leaves it behind, so test fixtures pass their own)",
    )
    p.add_argument("--user", help="require Basic authentication with this user (with --password)")
    p.add_argument("--password", help="password of --user")
    p.add_argument("--size", default="640x360", help="pattern size WxH")
    p.add_argument("--fps", type=int, default=25, help="pattern frame rate")
    args = p.parse_args(argv)
    mounts = list(args.mount or [])
    mounts += [f"/cam{i}" for i in range(1, args.mounts + 1)]
    args.mounts_list = [m if m.startswith("/") else "/" + m for m in (mounts or ["/cam"])]
    if len(set(args.mounts_list)) != len(args.mounts_list):
        p.error("duplicate mount")
    return args


def basic_auth(user: str, password: str) -> GstRtspServer.RTSPAuth:
    """Basic authentication for one user (role "user"); a wrong or missing password gets 401."""
    auth = GstRtspServer.RTSPAuth()
    token = GstRtspServer.RTSPToken()
    token.set_string(GstRtspServer.RTSP_TOKEN_MEDIA_FACTORY_ROLE, "user")
    auth.add_basic(GstRtspServer.RTSPAuth.make_basic(user, password), token)
    return auth


def role_perms(factory: GstRtspServer.RTSPMediaFactory, role: str) -> None:
    factory.add_role_from_structure(
        Gst.Structure.new_from_string(
            f"{role}, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Gst.init(None)
    own_tmp = args.workdir is None
    tmp = Path(tempfile.mkdtemp(prefix="rtsp_server_")) if own_tmp else args.workdir
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        if args.pattern:
            w, h = (int(v) for v in args.size.lower().split("x"))
            launch = pattern_launch(w, h, args.fps)
        else:
            if not args.file.is_file():
                fail(f"no such file: {args.file}")
            h264 = tmp / "clip.h264"
            num, den = mp4_to_annexb(args.file.resolve(), h264)
            launch = file_launch(h264, num, den)

        server = GstRtspServer.RTSPServer()
        server.set_address(HOST)
        server.set_service(str(args.port))
        mounts = server.get_mount_points()
        if args.user:
            server.set_auth(basic_auth(args.user, args.password or ""))
        for mount in args.mounts_list:
            factory = GstRtspServer.RTSPMediaFactory()
            factory.set_launch(launch)
            if args.user:  # only this user may see and play the media
                role_perms(factory, "user")
            # One pipeline per mount, shared by all its clients: a camera does not restart per viewer.
            factory.set_shared(True)
            mounts.add_factory(mount, factory)

        loop = GLib.MainLoop()
        try:
            # attach() binds and listens; it fails (GLib.Error or 0) when the port is taken.
            source_id = server.attach(None)
        except GLib.Error as exc:
            fail(f"cannot listen on {HOST}:{args.port}: {exc.message}")
        if not source_id:
            fail(f"cannot listen on {HOST}:{args.port}")
        port = server.get_bound_port()

        def quit_loop() -> bool:
            loop.quit()
            return GLib.SOURCE_REMOVE

        for sig in (signal.SIGTERM, signal.SIGINT):
            GLib.unix_signal_add(GLib.PRIORITY_HIGH, sig, quit_loop)

        for mount in args.mounts_list:
            print(f"READY rtsp://{HOST}:{port}{mount}", flush=True)
        loop.run()
        return 0
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
