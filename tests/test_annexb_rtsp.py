"""Packets mode of the capture (pipelines/sources/capture.py) and the bitstream helpers against the
pure-Python RTSP server (tools/annexb_rtsp_server.py).

CPU only, no GStreamer: every test that needs a server starts tools/annexb_rtsp_server.py as a subprocess on
a free port (it prints the port first) and kills it in ``finally``. The served file is the bundled clip
converted to Annex-B by the server's own ``--from-mp4`` (OpenCV packet mode, about 0.5 MB, made per session).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
from fixtures_rtsp import CLIP

from pipelines.frames import Frame
from pipelines.sources import CameraReader, FrameSlot, SourceSpec
from pipelines.sources.bitstream import find_sps, is_irap, nal_types, nal_units
from pipelines.sources.capture import Capture, OpenError
from pipelines.sources.spec import resolve
from pipelines.sources.sps import SpsInfo, colour_of, parse_sps, unescape_rbsp
from pipelines.urls import mask_url
from tools.annexb_rtsp_server import access_units, fragment, split_nals
from tools.h264_pcm import _EMULATION, _Bits, _nal, sps

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tools" / "annexb_rtsp_server.py"
MEASURED: dict[str, float] = {}  # printed with -s; tests assert loose bounds only
PARAMETER_SETS = {7, 8}  # H.264 SPS, PPS


# --- helpers --------------------------------------------------------------------------------------------
class Packet:
    """One packet as a test looks at it: the capture's unit plus its NAL unit types."""

    def __init__(self, data: np.ndarray, flag_key: bool) -> None:
        self.data, self.flag_key = data, flag_key
        self.nal_types = tuple(nal_types(data, "h264"))
        self.irap = is_irap(self.nal_types, "h264")
        self.keyframe = flag_key or self.irap


def packet_capture(url: str, open_timeout_s: float = 10.0, read_timeout_s: float = 3.0) -> Capture:
    spec = SourceSpec("t", url=url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s)
    return Capture(spec, resolve(spec), packets=True, scrub=mask_url)


def read_packets(capture: Capture, limit: int = 10_000) -> list[Packet]:
    packets = []
    while len(packets) < limit and (unit := capture.read()) is not None:
        assert unit.data is not None
        packets.append(Packet(unit.data, unit.keyframe))
    return packets


@pytest.fixture(scope="module")
def annexb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("annexb") / "bikes.h264"
    done = subprocess.run(
        [sys.executable, str(SERVER), "--from-mp4", str(CLIP), "--write-annexb", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def clip_packets() -> list[Packet]:
    """The mp4's packets through the capture in packets mode: the reference access units."""
    capture = packet_capture(str(CLIP))
    try:
        capture.open()
        packets = read_packets(capture)
    finally:
        capture.release()
    assert capture.ended and "end of file" in capture.error
    return packets


@pytest.fixture(scope="module")
def clip_frame_hashes() -> list[str]:
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG)
    hashes = []
    while True:
        ok, image = cap.read()
        if not ok:
            break
        hashes.append(hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest())
    cap.release()
    return hashes


@contextlib.contextmanager
def serve(
    path: Path, *, fps: float = 25.0, loop: bool = True, close_after: float = 0.0
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Run the server on a free port; yield (url, process); always kill it (resuming it first if stopped).
    ``close_after``: the server drops each client after that many seconds (a flapping camera)."""
    cmd = [sys.executable, str(SERVER), str(path), "--port", "0", "--fps", str(fps)]
    cmd.append("--loop" if loop else "--no-loop")
    cmd += ["--close-after", str(close_after)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(20):
                raise RuntimeError("server printed no port in 20 s")
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {proc.communicate(timeout=5)[1]}")
        yield f"rtsp://127.0.0.1:{int(line)}/stream", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=10)


def read_all(url: str, read_timeout_s: float = 3.0, limit: int = 10_000) -> tuple[list[Packet], Capture]:
    capture = packet_capture(url, read_timeout_s=read_timeout_s)
    try:
        t0 = time.monotonic()
        capture.open()
        MEASURED["rtsp_open_s"] = time.monotonic() - t0
        packets = read_packets(capture, limit)
    finally:
        capture.release()
    return packets, capture


def without_parameter_sets(packet: Packet) -> list[bytes]:
    return [n for n in nal_units(packet.data) if n[0] & 0x1F not in PARAMETER_SETS]


def assert_same_access_units(got: list[Packet], want: list[Packet]) -> None:
    """What is compared: per packet, in order, the NAL units (header + payload, start codes excluded,
    byte-exact) other than SPS/PPS must be equal; every SPS/PPS a received packet holds must be
    byte-equal to the file's (FFmpeg may repeat parameter sets before IDRs); key flags must agree."""
    assert len(got) == len(want)
    file_params = {n for p in want for n in nal_units(p.data) if n[0] & 0x1F in PARAMETER_SETS}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert without_parameter_sets(g) == without_parameter_sets(w), f"packet {i} differs"
        assert {n for n in nal_units(g.data) if n[0] & 0x1F in PARAMETER_SETS} <= file_params, i
        assert g.keyframe == w.keyframe, i
    MEASURED["strictly_equal_packets"] = sum(
        g.data.tobytes() == w.data.tobytes() for g, w in zip(got, want, strict=True)
    )


# --- the Annex-B file and the server's access units -------------------------------------------------------
def test_annexb_file_access_units_match_mp4_samples(annexb: Path, clip_packets: list[Packet]) -> None:
    data = annexb.read_bytes()
    assert len(data) < 1_000_000
    assert data == b"".join(p.data.tobytes() for p in clip_packets)  # the converter writes packets as is
    units = access_units(split_nals(data), hevc=False)
    assert [list(u) for u in units] == [nal_units(p.data) for p in clip_packets]


def test_fragmentation_round_trip_h264_and_h265() -> None:
    rng = np.random.default_rng(0)
    body = rng.integers(1, 256, 5000, dtype=np.uint8).tobytes()
    nal = bytes([0x65]) + body  # IDR, nal_ref_idc 3
    frags = fragment(nal, hevc=False, max_payload=1400)
    assert len(frags) == 4 and all(len(f) <= 1400 for f in frags)
    assert all(f[0] == (0x60 | 28) for f in frags)  # FU indicator: NRI of the NAL, type 28
    assert [f[1] & 0xC0 for f in frags] == [0x80, 0, 0, 0x40]  # S on the first, E on the last
    assert all(f[1] & 0x1F == 5 for f in frags)
    assert bytes([(frags[0][0] & 0xE0) | (frags[0][1] & 0x1F)]) + b"".join(f[2:] for f in frags) == nal
    assert fragment(nal[:1400], hevc=False, max_payload=1400) == [nal[:1400]]  # single NAL unit packet

    hnal = bytes([19 << 1, 0x01]) + body  # IDR_W_RADL, TID 1
    frags = fragment(hnal, hevc=True, max_payload=1400)
    assert all(len(f) <= 1400 for f in frags)
    assert all((f[0] >> 1) & 0x3F == 49 and f[1] == 0x01 for f in frags)  # PayloadHdr type 49
    assert [f[2] & 0xC0 for f in frags] == [0x80] + [0] * (len(frags) - 2) + [0x40]
    assert all(f[2] & 0x3F == 19 for f in frags)
    assert hnal[:2] + b"".join(f[3:] for f in frags) == hnal


def test_h265_access_unit_rule() -> None:
    def n(kind: int, first: bool = True) -> bytes:
        return bytes([kind << 1, 1, 0x80 if first else 0x00, 0xAA])

    nals = [n(32), n(33), n(34), n(19), n(19, first=False), n(1), n(39), n(1), n(1, first=False)]
    units = access_units(nals, hevc=True)
    assert [len(u) for u in units] == [5, 1, 3]


# --- over RTSP ----------------------------------------------------------------------------------------------
def test_packets_over_rtsp_equal_the_files_access_units(annexb: Path, clip_packets: list[Packet]) -> None:
    with serve(annexb, fps=100, loop=False) as (url, _):
        t0 = time.monotonic()
        packets, capture = read_all(url)
        took = time.monotonic() - t0
    assert capture.info is not None and capture.info.codec == "h264"
    assert (capture.info.width, capture.info.height) == (640, 272)
    assert "stream ended" in capture.error and not capture.ended  # a live source does not "end" like a file
    assert_same_access_units(packets, clip_packets)
    assert [i for i, p in enumerate(packets) if p.keyframe] == [0, 30, 76, 137, 187, 242]
    sps = find_sps(packets[0].data, "h264")
    assert sps is not None and (parse_sps(sps, "h264").width, parse_sps(sps, "h264").height) == (640, 272)
    MEASURED["rtsp_packets_per_s"] = len(packets) / took


class _ListSlot(FrameSlot):
    """Keeps a hash of every frame (FrameSlot drops unread ones: here the order and count matter)."""

    def __init__(self) -> None:
        super().__init__()
        self.hashes: list[str] = []

    def put(self, frame: Frame) -> None:
        self.hashes.append(hashlib.sha1(np.ascontiguousarray(frame.image).tobytes()).hexdigest())
        super().put(frame)


def test_camera_reader_decodes_the_same_frames_over_rtsp(annexb: Path, clip_frame_hashes: list[str]) -> None:
    assert len(clip_frame_hashes) == 250
    with serve(annexb, fps=100, loop=False) as (url, _):
        slot = _ListSlot()
        reader = CameraReader(SourceSpec("c", url=url, open_timeout_s=10, read_timeout_s=3), slot)
        reader.start()
        try:
            deadline = time.monotonic() + 30
            while len(slot.hashes) < len(clip_frame_hashes) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            reader.stop(timeout=10)
    # Each client is served from the file's first access unit (an IDR), so frame i over RTSP is frame i of
    # the file: exact pixels, same order, none missing.
    assert slot.hashes[: len(clip_frame_hashes)] == clip_frame_hashes


def _raw_play(port: int) -> socket.socket:
    """A minimal RTSP client up to PLAY (TCP interleaved); returns the socket with RTP flowing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    url = f"rtsp://127.0.0.1:{port}/any/mount"
    for cseq, (method, extra) in enumerate(
        [
            ("OPTIONS", ""),
            ("DESCRIBE", "Accept: application/sdp\r\n"),
            ("SETUP", "Transport: RTP/AVP/TCP;unicast;interleaved=0-1\r\n"),
            ("PLAY", "Session: x\r\n"),
        ],
        start=1,
    ):
        s.sendall(f"{method} {url} RTSP/1.0\r\nCSeq: {cseq}\r\n{extra}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
        text = head.decode()
        assert text.startswith("RTSP/1.0 200"), text
        length = next(
            (
                int(line.split(":")[1])
                for line in text.split("\r\n")
                if line.startswith("Content-") and "Length" in line
            ),
            0,
        )
        body = b""
        while len(body) < length:
            body += s.recv(length - len(body))
        if method == "DESCRIBE":
            sdp = body.decode()
            assert "a=rtpmap:96 H264/90000" in sdp
            assert "packetization-mode=1" in sdp and "sprop-parameter-sets=" in sdp
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def test_rtsp_protocol_and_rtp_framing(annexb: Path, clip_packets: list[Packet]) -> None:
    with serve(annexb, fps=200, loop=False) as (url, _):
        port = int(url.split(":")[2].split("/")[0])
        # UDP transport is refused with 461 (FFmpeg with rtsp_transport tcp never asks for it).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            udp = "Transport: RTP/AVP;unicast;client_port=5000-5001"
            s.sendall(f"SETUP {url} RTSP/1.0\r\nCSeq: 7\r\n{udp}\r\n\r\n".encode())
            assert s.recv(1000).startswith(b"RTSP/1.0 461")
        s = _raw_play(port)
        try:
            nals: list[list[bytes]] = []
            current: list[bytes] = []
            fu = b""
            ts_of_au: int | None = None
            seq: int | None = None
            while len(nals) < 40:
                magic, channel, size = struct.unpack("!cBH", _recv_exact(s, 4))
                assert magic == b"$" and channel == 0
                rtp = _recv_exact(s, size)
                v, mpt, sq, ts = struct.unpack("!BBHI", rtp[:8])
                assert v == 0x80 and mpt & 0x7F == 96
                assert seq is None or sq == (seq + 1) & 0xFFFF
                seq = sq
                assert ts_of_au is None or ts == ts_of_au  # one timestamp per access unit
                ts_of_au = ts
                payload = rtp[12:]
                if payload[0] & 0x1F == 28:  # FU-A: reassemble
                    if payload[1] & 0x80:
                        fu = bytes([(payload[0] & 0xE0) | (payload[1] & 0x1F)])
                    fu += payload[2:]
                    if payload[1] & 0x40:
                        current.append(fu)
                else:
                    current.append(payload)
                if mpt & 0x80:  # marker: last packet of the access unit
                    nals.append(current)
                    current, ts_of_au = [], None
        finally:
            s.close()
    assert nals == [nal_units(p.data) for p in clip_packets[:40]]


def test_two_clients_and_a_stalled_one(annexb: Path, clip_packets: list[Packet]) -> None:
    results: dict[int, list[Packet]] = {}
    with serve(annexb, fps=100, loop=False) as (url, _):
        port = int(url.split(":")[2].split("/")[0])
        stalled = _raw_play(port)  # plays, never reads: must not hold anyone else up
        try:
            threads = [
                threading.Thread(target=lambda i=i: results.__setitem__(i, read_all(url)[0]))
                for i in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            stalled.close()
    assert sorted(results) == [0, 1]
    for packets in results.values():
        assert_same_access_units(packets, clip_packets)


def test_sigstop_looks_like_a_frozen_camera(annexb: Path) -> None:
    """SIGSTOP keeps the TCP connection open and sends nothing: the reader reports the stall within the read
    timeout (whatever FFmpeg drains from its buffers after its interrupt), and comes back after SIGCONT."""
    read_timeout = 1.0
    states: list[tuple[float, str, str | None]] = []
    with serve(annexb, fps=25, loop=True) as (url, proc):
        spec = SourceSpec("r", url=url, read_timeout_s=read_timeout, backoff_initial_s=0.2, backoff_max_s=0.5)
        reader = CameraReader(spec, on_state=lambda c, s, r: states.append((time.monotonic(), s, r)))
        reader.start()
        try:
            assert reader.slot.get(timeout=20) is not None
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            deadline = t0 + 10
            while time.monotonic() < deadline and reader.state == "streaming":
                time.sleep(0.02)
            took = time.monotonic() - t0
            assert reader.state == "reconnecting", reader.stats()
            assert reader.last_error is not None and "no frame for 1 s" in reader.last_error
            os.kill(proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and reader.state != "streaming":
                time.sleep(0.05)
            assert reader.state == "streaming", reader.stats()
        finally:
            reader.stop(timeout=10)
    MEASURED["sigstop_to_reconnecting_s"] = took
    assert took < read_timeout + 3.0


def test_open_failure_is_masked_and_clean() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    capture = packet_capture(f"rtsp://admin:s3cret@127.0.0.1:{port}/stream", open_timeout_s=2)
    with pytest.raises(OpenError) as err:
        capture.open()
    assert "s3cret" not in str(err.value) and "admin:***@" in str(err.value)
    with pytest.raises(OpenError, match="no such file"):
        packet_capture("/nonexistent/clip.mp4").open()
    with pytest.raises(ValueError, match="FFmpeg"):
        packet_capture("/dev/video0")


def test_file_packets_and_rewind(clip_packets: list[Packet], annexb: Path) -> None:
    assert len(clip_packets) == 250
    first = clip_packets[0]
    assert first.data.ndim == 1 and first.data.dtype == np.uint8
    assert first.nal_types == (6, 7, 8, 5) and first.flag_key and first.irap and first.keyframe
    assert clip_packets[1].nal_types == (1,) and not clip_packets[1].keyframe
    assert [i for i, p in enumerate(clip_packets) if p.flag_key] == [
        i for i, p in enumerate(clip_packets) if p.irap
    ]
    capture = packet_capture(str(CLIP))
    try:
        info = capture.open()
        assert (info.codec, info.width, info.height, info.fps, info.pixel_format) == (
            "h264",
            640,
            272,
            25.0,
            "I420",
        )
        for _ in range(5):
            capture.read()
        assert capture.rewind()
        again = capture.read()
        assert again is not None and again.data is not None and again.data.tobytes() == first.data.tobytes()
    finally:
        capture.release()
    # A raw Annex-B file: FFmpeg's seek says yes and then nothing can be read; the capture reopens instead.
    raw = packet_capture(str(annexb))
    try:
        raw.open()
        assert len(read_packets(raw)) == 250 and raw.ended
        for _ in range(3):  # the first rewind finds out (reopen), later ones reopen at once
            assert raw.rewind()
            assert len(read_packets(raw)) == 250
        assert raw._seek_works is False
    finally:
        raw.release()


# --- bitstream helpers and the SPS parser -----------------------------------------------------------------
def test_corrupt_and_truncated_data_never_raise(clip_packets: list[Packet]) -> None:
    rng = np.random.default_rng(1)
    for data in (b"", b"\x00\x00\x01", b"\x00\x00\x00\x01", rng.integers(0, 256, 10_000, np.uint8).tobytes()):
        nal_types(data, "h264")
        nal_types(data, "hevc")
        assert colour_of(data, "h264") == ("bt601", False)
    key = clip_packets[0].data.tobytes()
    for cut in (1, 5, 40, 700, 800, len(key) - 1):
        nal_types(key[:cut], "h264")
        assert colour_of(key[:cut], "h264") == ("bt601", False)
    sps_nal = find_sps(key, "h264")
    assert sps_nal is not None
    for cut in range(1, len(sps_nal)):
        try:
            info = parse_sps(sps_nal[:cut], "h264")
        except ValueError:
            continue
        assert info.width == 640  # parsed past the size: only the VUI may be missing
    with pytest.raises(ValueError):
        parse_sps(b"\x68\x00", "h264")  # a PPS


def test_nal_split_handles_three_and_four_byte_start_codes() -> None:
    data = b"\x00\x00\x00\x01\x67\xaa\x00\x00\x01\x68\xbb\x00\x00\x00\x00\x01\x65\xcc\xdd"
    assert nal_units(data) == [b"\x67\xaa", b"\x68\xbb", b"\x65\xcc\xdd"]
    assert nal_types(np.frombuffer(data, np.uint8), "h264") == [7, 8, 5]
    assert unescape_rbsp(b"\x00\x00\x03\x00\x00\x03\x01") == b"\x00\x00\x00\x00\x01"


def test_sps_of_the_bundled_clip(clip_packets: list[Packet]) -> None:
    nal = find_sps(clip_packets[0].data, "h264")
    assert nal is not None
    info = parse_sps(nal, "h264")
    assert (info.codec, info.profile, info.profile_idc, info.level_idc) == ("h264", "High", 100, 21)
    assert (info.chroma_format, info.bit_depth_luma, info.bit_depth_chroma) == ("420", 8, 8)
    assert (info.width, info.height) == (640, 272)  # 17 macroblock rows, cropped by 8
    # x264 wrote a VUI without video_signal_type: the documented fallback applies.
    assert info.video_full_range_flag is None and info.matrix_coefficients is None and info.vui_error is None
    assert (info.matrix, info.full_range, info.colour_from_stream) == ("bt601", False, False)


@pytest.mark.parametrize(
    ("full_range", "matrix", "want"),
    [
        (True, 1, ("bt709", True)),
        (False, 1, ("bt709", False)),
        (False, 6, ("bt601", False)),
        (True, 9, ("bt2020", True)),
        (True, None, ("bt601", True)),
        (None, None, ("bt601", False)),
    ],
)
def test_sps_colour_from_hand_made_h264(full_range: bool | None, matrix: int | None, want: tuple) -> None:
    # tools/h264_pcm.py writes baseline SPSs with a VUI, timing info included: num_units_in_tick 1000 is
    # 00 00 03 E8 on the wire, so emulation-prevention removal is exercised too.
    nal = sps(1920, 1080, fps=25, full_range=full_range, matrix=matrix)[4:]
    info = parse_sps(nal, "h264")
    assert (info.profile, info.width, info.height, info.chroma_format) == ("Baseline", 1920, 1080, "420")
    assert (info.matrix, info.full_range) == want
    assert info.video_full_range_flag == full_range
    assert info.matrix_coefficients == matrix
    assert colour_of(b"\x00\x00\x00\x01" + nal, "h264") == want


def test_sps_high_444_10bit_with_scaling_lists() -> None:
    b = _Bits()
    b.u(8, 244)  # High 4:4:4 Predictive
    b.u(8, 0)
    b.u(8, 40)
    b.ue(0)
    b.ue(3)  # chroma_format_idc 4:4:4
    b.u(1, 0)  # separate_colour_plane_flag
    b.ue(2)  # bit_depth_luma_minus8 -> 10
    b.ue(2)
    b.u(1, 0)  # qpprime_y_zero_transform_bypass_flag
    b.u(1, 1)  # seq_scaling_matrix_present_flag: 12 lists for 4:4:4
    for i in range(12):
        b.u(1, int(i in (0, 7)))
        if i in (0, 7):
            for _ in range(16 if i < 6 else 64):
                b.se(1)
    b.ue(0)  # log2_max_frame_num_minus4
    b.ue(1)  # pic_order_cnt_type 1
    b.u(1, 0)
    b.se(-2)
    b.se(3)
    b.ue(2)
    b.se(1)
    b.se(-1)
    b.ue(4)  # max_num_ref_frames
    b.u(1, 0)
    b.ue(1280 // 16 - 1)
    b.ue(736 // 32 - 1)  # field coding: map units are pairs of macroblock rows
    b.u(1, 0)  # frame_mbs_only_flag 0
    b.u(1, 0)  # mb_adaptive_frame_field_flag
    b.u(1, 1)
    b.u(1, 1)  # cropping: 4:4:4 crop unit 1 x (1 * 2)
    for v in (0, 0, 0, 8):
        b.ue(v)
    b.u(1, 1)  # VUI
    b.u(1, 1)
    b.u(8, 255)  # Extended_SAR
    b.u(16, 4)
    b.u(16, 3)
    b.u(1, 1)
    b.u(1, 0)  # overscan
    b.u(1, 1)
    b.u(3, 5)
    b.u(1, 1)  # full range
    b.u(1, 1)
    for v in (1, 1, 1):
        b.u(8, v)
    info = parse_sps(_nal(0x67, b.trailing())[4:], "h264")
    assert (info.profile, info.chroma_format, info.bit_depth_luma, info.bit_depth_chroma) == (
        "High 4:4:4 Predictive",
        "444",
        10,
        10,
    )
    assert (info.width, info.height) == (1280, 720)
    assert (info.matrix, info.full_range, info.colour_from_stream) == ("bt709", True, True)


def _h265_sps(
    *, vui: bool, full_range: bool, matrix: int, sub_layers: int = 1, inter_rps: bool = True
) -> bytes:
    """An H.265 SPS (Main 10, 1920x1080 with a conformance window) written field by field (7.3.2.2)."""
    b = _Bits()
    b.u(4, 0)
    b.u(3, sub_layers - 1)
    b.u(1, 1)
    # profile_tier_level
    b.u(2, 0)
    b.u(1, 0)
    b.u(5, 2)  # Main 10
    b.u(32, 0x20000000)
    b.u(48, 0x900000000000)
    b.u(8, 120)
    for _ in range(sub_layers - 1):
        b.u(1, 1)
        b.u(1, 1)
    if sub_layers > 1:
        b.u(2 * (8 - (sub_layers - 1)), 0)
        for _ in range(sub_layers - 1):
            b.u(88, 0)
            b.u(8, 90)
    b.ue(0)  # sps_seq_parameter_set_id
    b.ue(1)  # 4:2:0
    b.ue(1920)
    b.ue(1088)
    b.u(1, 1)
    for v in (0, 0, 0, 4):
        b.ue(v)  # bottom 4 chroma rows = 8 luma rows
    b.ue(2)
    b.ue(2)  # 10-bit
    b.ue(4)  # log2_max_pic_order_cnt_lsb_minus4 -> 8 bits
    b.u(1, 1)
    for _ in range(sub_layers):
        b.ue(4)
        b.ue(2)
        b.ue(0)
    for v in (0, 3, 0, 3, 1, 1):
        b.ue(v)
    b.u(1, 1)  # scaling_list_enabled_flag
    b.u(1, 1)  # sps_scaling_list_data_present_flag
    for size_id in range(4):
        for matrix_id in range(0, 6, 3 if size_id == 3 else 1):
            explicit = matrix_id == 0
            b.u(1, int(explicit))
            if not explicit:
                b.ue(0)
                continue
            if size_id > 1:
                b.se(8)
            for _ in range(min(64, 1 << (4 + (size_id << 1)))):
                b.se(0)
    b.u(1, 0)
    b.u(1, 1)
    b.u(1, 1)  # pcm_enabled_flag
    b.u(4, 7)
    b.u(4, 7)
    b.ue(0)
    b.ue(1)
    b.u(1, 0)
    b.ue(3 if inter_rps else 1)  # num_short_term_ref_pic_sets
    b.ue(2)  # set 0: 2 negative, 1 positive
    b.ue(1)
    for _ in range(3):
        b.ue(0)
        b.u(1, 1)
    if inter_rps:
        for _ in range(2):  # sets 1 and 2 predicted from the previous one
            b.u(1, 1)  # inter_ref_pic_set_prediction_flag
            b.u(1, 0)
            b.ue(0)
            # NumDeltaPics(prev) + 1 entries: used, not used + use_delta, not used + not use_delta, used
            b.u(1, 1)
            b.u(1, 0)
            b.u(1, 1)
            b.u(1, 0)
            b.u(1, 0)
            b.u(1, 1)
    b.u(1, 1)  # long_term_ref_pics_present_flag
    b.ue(2)
    for _ in range(2):
        b.u(8, 3)
        b.u(1, 1)
    b.u(1, 1)
    b.u(1, 1)
    b.u(1, int(vui))
    if vui:
        b.u(1, 0)
        b.u(1, 0)
        b.u(1, 1)
        b.u(3, 5)
        b.u(1, int(full_range))
        b.u(1, 1)
        for _ in range(3):
            b.u(8, matrix)
        b.u(1, 0)  # the rest of the VUI is not read
    rbsp = b.trailing()
    return bytes([33 << 1, 1]) + _EMULATION.sub(b"\x00\x00\x03", rbsp)


@pytest.mark.parametrize("sub_layers", [1, 3])
def test_h265_sps(sub_layers: int) -> None:
    info = parse_sps(_h265_sps(vui=True, full_range=True, matrix=9, sub_layers=sub_layers), "hevc")
    assert isinstance(info, SpsInfo) and info.vui_error is None
    assert (info.codec, info.profile, info.level_idc, info.chroma_format) == ("hevc", "Main 10", 120, "420")
    assert (info.bit_depth_luma, info.width, info.height) == (10, 1920, 1080)
    assert (info.matrix, info.full_range, info.colour_primaries) == ("bt2020", True, 9)
    plain = parse_sps(_h265_sps(vui=False, full_range=False, matrix=1, inter_rps=False), "hevc")
    assert (plain.matrix, plain.full_range, plain.colour_from_stream, plain.width) == (
        "bt601",
        False,
        False,
        1920,
    )


def test_print_measured() -> None:
    """Not a check: shows the numbers the other tests recorded (run with -s)."""
    print({k: round(v, 3) for k, v in MEASURED.items()})
