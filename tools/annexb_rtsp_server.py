#!/usr/bin/env python3
"""A small pure-Python RTSP server: serves an Annex-B H.264/H.265 elementary stream over RTSP/TCP interleaved.

For machines without GStreamer (the GPU box): standard library only. Every client gets the file from its
first access unit (so what a client decodes lines up exactly with the file), paced at ``--fps``, looped or
not, on any mount path; one thread per client, each socket write bounded by a timeout, so a client that
stalls or vanishes never holds up the others. A SIGSTOPped server looks like a frozen camera.

    python tools/annexb_rtsp_server.py clip.h264 --port 0 --fps 25     # first stdout line: the port
    ffplay -rtsp_transport tcp rtsp://127.0.0.1:PORT/stream
    python tools/annexb_rtsp_server.py --from-mp4 agent/assets/bikes.mp4 --write-annexb clip.h264
    python tools/annexb_rtsp_server.py clip.h264 --port 0 --close-after 2   # a camera that drops every 2 s

RTSP: OPTIONS, DESCRIBE (SDP with sprop-parameter-sets / sprop-vps,sps,pps from the file), SETUP
(``RTP/AVP/TCP;interleaved=a-b`` only; UDP gets 461 Unsupported Transport, which makes FFmpeg with
``rtsp_transport tcp`` proceed and a UDP-only client fail loudly), PLAY, TEARDOWN, GET/SET_PARAMETER
(keepalive). RTP: RFC 6184 (H.264: single NAL unit packets, FU-A above ``--max-payload`` bytes) and RFC 7798
(H.265: single NAL unit packets, FU type 49); one RTP timestamp per access unit, marker bit on its last
packet. Timestamps advance by 90000/fps per access unit in *decode* order: an elementary stream carries no
timestamps, and decoders reorder B-frames by picture order count, not by RTP time.

Access units (how NAL units are grouped, simple rule for camera-style streams): a new access unit starts
at an access unit delimiter, parameter set, SEI or other non-VCL prefix NAL (H.264 6-9, 14-18; H.265 32-39,
41-44, 48-55), or at a slice that begins a picture (H.264 first_mb_in_slice == 0; H.265
first_slice_segment_in_pic_flag) -- in each case only once the current access unit holds a slice. So
SPS/PPS/SEI are sent with the picture that follows them.

``--from-mp4`` converts with OpenCV's packet mode (FFmpeg's mp4-to-Annex-B conversion, SPS/PPS before
every IDR), so no ffmpeg binary is needed; that mode needs ``cv2``, serving does not.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import random
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START = b"\x00\x00\x01"
RTP_CLOCK = 90000
PAYLOAD_TYPE = 96
PUBLIC_METHODS = "OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN, GET_PARAMETER, SET_PARAMETER"
SEND_TIMEOUT_S = 5.0  # a client whose socket takes longer than this to accept one access unit is dropped


# --- elementary stream --------------------------------------------------------------------------------
def split_nals(data: bytes) -> list[bytes]:
    """NAL units of an Annex-B byte stream (start codes and trailing zero bytes removed), via bytes.find."""
    nals: list[bytes] = []
    pos = data.find(START)
    while pos >= 0:
        begin = pos + 3
        nxt = data.find(START, begin)
        end = len(data) if nxt < 0 else nxt
        while end > begin and data[end - 1] == 0:  # zeros before a start code are not NAL data
            end -= 1
        if end > begin:
            nals.append(data[begin:end])
        pos = nxt
    return nals


def nal_type(nal: bytes, hevc: bool) -> int:
    return (nal[0] >> 1) & 0x3F if hevc else nal[0] & 0x1F


def _is_vcl(kind: int, hevc: bool) -> bool:
    return kind <= 31 if hevc else 1 <= kind <= 5


def _starts_au_non_vcl(kind: int, hevc: bool) -> bool:
    if hevc:  # VPS, SPS, PPS, AUD, prefix SEI, reserved 36-39 -> 32..39; 41-44; 48-55 (7.4.2.4.4)
        return 32 <= kind <= 39 or 41 <= kind <= 44 or 48 <= kind <= 55
    return 6 <= kind <= 9 or 14 <= kind <= 18  # SEI, SPS, PPS, AUD, prefix/subset SPS... (7.4.1.2.3)


def _first_slice_of_picture(nal: bytes, hevc: bool) -> bool:
    # H.264: first_mb_in_slice is ue(v) right after the 1-byte header; value 0 is the single bit "1".
    # H.265: first_slice_segment_in_pic_flag is the first bit after the 2-byte header.
    idx = 2 if hevc else 1
    return len(nal) > idx and bool(nal[idx] & 0x80)


def access_units(nals: list[bytes], hevc: bool) -> list[list[bytes]]:
    """Group NAL units into access units (rule in the module docstring). Trailing non-VCL units without
    a slice after them form a last access unit of their own."""
    units: list[list[bytes]] = []
    current: list[bytes] = []
    has_vcl = False
    for nal in nals:
        kind = nal_type(nal, hevc)
        vcl = _is_vcl(kind, hevc)
        if has_vcl and (
            (vcl and _first_slice_of_picture(nal, hevc)) or (not vcl and _starts_au_non_vcl(kind, hevc))
        ):
            units.append(current)
            current, has_vcl = [], False
        current.append(nal)
        has_vcl = has_vcl or vcl
    if current:
        units.append(current)
    return units


def fragment(nal: bytes, hevc: bool, max_payload: int) -> list[bytes]:
    """RTP payloads for one NAL unit: itself, or FU-A (RFC 6184 5.8) / FU (RFC 7798 4.4.3) fragments."""
    if len(nal) <= max_payload:
        return [nal]
    if hevc:
        kind = nal_type(nal, True)
        # PayloadHdr: the NAL header with type 49 (F bit and LayerId/TID kept); FU header: S, E, type.
        head = bytes(((nal[0] & 0x81) | (49 << 1), nal[1]))
        body, fu_type, head_len = nal[2:], kind, 3
    else:
        head = bytes(((nal[0] & 0xE0) | 28,))  # FU indicator: F and NRI of the NAL, type 28
        body, fu_type, head_len = nal[1:], nal[0] & 0x1F, 2
    step = max_payload - head_len
    out: list[bytes] = []
    for off in range(0, len(body), step):
        fu = fu_type | (0x80 if off == 0 else 0) | (0x40 if off + step >= len(body) else 0)
        out.append(head + bytes((fu,)) + body[off : off + step])
    return out


@dataclass
class Stream:
    """An elementary stream ready to serve: access units already cut into RTP payloads (shared, read-only)."""

    codec: str  # "H264" | "H265"
    payloads: list[list[bytes]]  # per access unit, the RTP payloads in order
    parameter_sets: dict[str, bytes]  # "vps"/"sps"/"pps" -> first such NAL unit in the file
    nal_count: int

    @classmethod
    def load(cls, path: Path, codec: str | None = None, max_payload: int = 1400) -> Stream:
        data = path.read_bytes()
        nals = split_nals(data)
        if not nals:
            raise ValueError(f"{path}: no Annex-B start codes: not an H.264/H.265 elementary stream")
        hevc = (codec or _guess_codec(nals)).upper() in ("H265", "HEVC")
        names = {32: "vps", 33: "sps", 34: "pps"} if hevc else {7: "sps", 8: "pps"}
        params: dict[str, bytes] = {}
        for nal in nals:
            name = names.get(nal_type(nal, hevc))
            if name and name not in params:
                params[name] = nal
        missing = [n for n in names.values() if n not in params]
        if missing:
            raise ValueError(f"{path}: no {'/'.join(missing).upper()} in the stream")
        payloads = [
            [p for nal in au for p in fragment(nal, hevc, max_payload)] for au in access_units(nals, hevc)
        ]
        return cls("H265" if hevc else "H264", payloads, params, len(nals))

    def sdp(self, host: str, session_id: int) -> str:
        b64 = {k: base64.b64encode(v).decode("ascii") for k, v in self.parameter_sets.items()}
        if self.codec == "H264":
            sps = self.parameter_sets["sps"]
            fmtp = (
                f"packetization-mode=1;profile-level-id={sps[1:4].hex().upper()};"
                f"sprop-parameter-sets={b64['sps']},{b64['pps']}"
            )
        else:
            fmtp = f"sprop-vps={b64['vps']};sprop-sps={b64['sps']};sprop-pps={b64['pps']}"
        lines = [
            "v=0",
            f"o=- {session_id} 1 IN IP4 {host}",
            "s=annexb_rtsp_server",
            "c=IN IP4 0.0.0.0",
            "t=0 0",
            "a=range:npt=0-",
            f"m=video 0 RTP/AVP {PAYLOAD_TYPE}",
            f"a=rtpmap:{PAYLOAD_TYPE} {self.codec}/{RTP_CLOCK}",
            f"a=fmtp:{PAYLOAD_TYPE} {fmtp}",
            "a=control:trackID=0",
        ]
        return "\r\n".join(lines) + "\r\n"


def _guess_codec(nals: list[bytes]) -> str:
    # H.264 SPS header byte 0x67 (or 0x27/0x47: other nal_ref_idc); H.265 VPS header 0x40 0x01.
    for nal in nals:
        if len(nal) >= 2 and nal[0] == 0x40 and nal[1] == 0x01:
            return "H265"
        if nal[0] & 0x1F == 7 and not nal[0] & 0x80:
            return "H264"
    return "H264"


# --- RTSP -----------------------------------------------------------------------------------------------
class ClientGone(Exception):
    pass


class Session:
    """One client connection: request loop on the handler thread, RTP on a sender thread."""

    def __init__(self, sock: socket.socket, server: RtspServer) -> None:
        self.sock = sock
        self.server = server
        self.stream = server.stream
        self.lock = threading.Lock()  # responses and RTP share the socket
        self.stop = threading.Event()
        self.session_id = f"{random.getrandbits(48):012X}"
        self.channel = 0
        self.sender: threading.Thread | None = None
        self.ssrc = random.getrandbits(32)
        self.seq = random.getrandbits(16)
        self.ts0 = random.getrandbits(32)

    # -- io --------------------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        with self.lock:
            try:
                self.sock.sendall(data)  # bounded by the socket timeout: a stalled reader is dropped
            except OSError as exc:
                self.stop.set()
                raise ClientGone(str(exc)) from None

    def requests(self) -> Iterator[tuple[str, str, dict[str, str]]]:
        """(method, url, lower-cased headers) of each request, until the client goes or stop is set."""
        buf = b""
        while not self.stop.is_set():
            # Interleaved data from the client (RTCP receiver reports on channel 1): skip it.
            while buf[:1] == b"$":
                if len(buf) < 4:
                    break
                size = struct.unpack("!H", buf[2:4])[0]
                if len(buf) < 4 + size:
                    break
                buf = buf[4 + size :]
            end = buf.find(b"\r\n\r\n")
            if end >= 0 and buf[:1] != b"$":
                head, rest = buf[:end].decode("latin-1"), buf[end + 4 :]
                lines = head.split("\r\n")
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0") or 0)
                if len(rest) >= length:
                    buf = rest[length:]
                    parts = lines[0].split()
                    if len(parts) >= 2:
                        yield parts[0].upper(), parts[1], headers
                    continue
            if len(buf) > 65536:
                return  # not RTSP
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue  # the timeout is there for sends; an idle client is fine
            except OSError:
                return
            if not chunk:
                return
            buf += chunk

    def reply(
        self, cseq: str, status: str = "200 OK", headers: dict[str, str] | None = None, body: str = ""
    ) -> None:
        lines = [f"RTSP/1.0 {status}", f"CSeq: {cseq}", "Server: annexb_rtsp_server"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body:
            lines.append(f"Content-Length: {len(body.encode())}")
        self.send(("\r\n".join(lines) + "\r\n\r\n" + body).encode())

    # -- protocol ----------------------------------------------------------------------------------------
    def serve(self) -> None:
        try:
            for method, url, headers in self.requests():
                cseq = headers.get("cseq", "0")
                if method == "OPTIONS":
                    self.reply(cseq, headers={"Public": PUBLIC_METHODS})
                elif method == "DESCRIBE":
                    host = self.sock.getsockname()[0]
                    base = url if url.endswith("/") else url + "/"
                    sdp = self.stream.sdp(host, random.getrandbits(32))
                    kinds = {"Content-Base": base, "Content-Type": "application/sdp"}
                    self.reply(cseq, headers=kinds, body=sdp)
                elif method == "SETUP":
                    transport = headers.get("transport", "")
                    if "RTP/AVP/TCP" not in transport.upper():
                        self.reply(cseq, "461 Unsupported Transport")
                        continue
                    channels = f"{self.channel}-{self.channel + 1}"
                    for field in transport.split(";"):
                        if field.strip().startswith("interleaved="):
                            channels = field.strip().split("=", 1)[1]
                            self.channel = int(channels.split("-")[0])
                    self.reply(
                        cseq,
                        headers={
                            "Transport": f"RTP/AVP/TCP;unicast;interleaved={channels};ssrc={self.ssrc:08X}",
                            "Session": f"{self.session_id};timeout=60",
                        },
                    )
                elif method == "PLAY":
                    self.reply(
                        cseq,
                        headers={
                            "Session": self.session_id,
                            "Range": "npt=0.000-",
                            "RTP-Info": f"url={url};seq={self.seq};rtptime={self.ts0}",
                        },
                    )
                    if self.sender is None:
                        self.sender = threading.Thread(target=self.play, name="rtp-sender", daemon=True)
                        self.sender.start()
                elif method == "TEARDOWN":
                    self.reply(cseq, headers={"Session": self.session_id})
                    break
                elif method in ("GET_PARAMETER", "SET_PARAMETER"):
                    self.reply(cseq, headers={"Session": self.session_id})
                else:
                    self.reply(cseq, "501 Not Implemented")
        except ClientGone:
            pass
        finally:
            self.stop.set()
            if self.sender is not None and self.sender is not threading.current_thread():
                self.sender.join(SEND_TIMEOUT_S + 1)

    def play(self) -> None:
        """Send access units from the first one, paced at fps; loop or, at the end, close the connection
        (also after --close-after seconds of playing: a camera that keeps dropping its clients)."""
        period = 1.0 / self.server.fps
        close_at = time.monotonic() + self.server.close_after if self.server.close_after else None
        # Interleave header '$', channel, length; then RTP: V/P/X/CC, M/PT, seq, timestamp, SSRC.
        header = struct.Struct("!cBHBBHII")
        sent = 0
        start = time.monotonic()
        try:
            while not self.stop.is_set():
                for payloads in self.stream.payloads:
                    # Absolute schedule: no drift; a late client is not made to burst more than one period.
                    delay = start + sent * period - time.monotonic()
                    if delay > 0:
                        if self.stop.wait(delay):
                            return
                    elif delay < -period:
                        start -= delay + period
                    ts = (self.ts0 + round(sent * RTP_CLOCK * period)) & 0xFFFFFFFF
                    last = len(payloads) - 1
                    frames = []
                    for i, payload in enumerate(payloads):
                        frames.append(
                            header.pack(
                                b"$",
                                self.channel,
                                12 + len(payload),
                                0x80,
                                PAYLOAD_TYPE | (0x80 if i == last else 0),
                                self.seq,
                                ts,
                                self.ssrc,
                            )
                        )
                        frames.append(payload)
                        self.seq = (self.seq + 1) & 0xFFFF
                    self.send(b"".join(frames))
                    sent += 1
                    if close_at is not None and time.monotonic() >= close_at:
                        break
                if not self.server.loop or (close_at is not None and time.monotonic() >= close_at):
                    break
        except ClientGone:
            return
        # End of a non-looping stream: close, so the client reads end of stream (FFmpeg flushes its parser).
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)
        Session(sock, self.server).serve()  # type: ignore[arg-type]


class RtspServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a stuck client thread never keeps the process alive
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self, address: tuple[str, int], stream: Stream, fps: float, loop: bool, close_after: float = 0.0
    ) -> None:
        self.stream, self.fps, self.loop, self.close_after = stream, fps, loop, close_after
        super().__init__(address, _Handler)


# --- mp4 -> Annex-B -----------------------------------------------------------------------------------
def mp4_to_annexb(src: Path, out: Path) -> tuple[str, float, int]:
    """Write the video track of ``src`` as an Annex-B file; return (codec tag, fps, packets).

    OpenCV's FFmpeg backend in packet mode already converts to Annex-B with SPS/PPS before every IDR.
    """
    import cv2  # only this helper needs OpenCV

    cap = cv2.VideoCapture(str(src), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    if not cap.isOpened():
        raise ValueError(f"cannot open {src}")
    try:
        tag = int(cap.get(cv2.CAP_PROP_FOURCC)).to_bytes(4, "little").decode("latin-1").strip("\x00 ")
        if tag.lower() not in ("h264", "avc1", "hevc", "hev1", "hvc1", "h265"):
            raise ValueError(f"{src}: codec {tag!r} is not H.264/H.265")
        fps = cap.get(cv2.CAP_PROP_FPS)
        count = 0
        with out.open("wb") as f:
            while True:
                ok, packet = cap.read()
                if not ok or packet is None:
                    break
                data = packet.reshape(-1).tobytes()
                if not data.startswith(START) and not data.startswith(b"\x00" + START):
                    raise ValueError(f"{src}: packet {count} is not Annex-B")
                f.write(data)
                count += 1
    finally:
        cap.release()
    if not count:
        raise ValueError(f"{src}: no video packets")
    return tag, fps, count


# --- main -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", type=Path, help="Annex-B H.264/H.265 elementary stream to serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8554, help="0: any free port (printed first on stdout)")
    ap.add_argument("--fps", type=float, default=25.0)
    ap.add_argument("--loop", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--codec", choices=["h264", "h265"], help="default: guessed from the stream")
    ap.add_argument(
        "--close-after", type=float, default=0.0, help="close each client after this many seconds (0: never)"
    )
    ap.add_argument("--max-payload", type=int, default=1400, help="RTP payload bytes before FU fragmentation")
    ap.add_argument("--from-mp4", type=Path, help="convert this mp4 (with --write-annexb) and exit")
    ap.add_argument("--write-annexb", type=Path)
    args = ap.parse_args(argv)
    if args.from_mp4 or args.write_annexb:
        if not (args.from_mp4 and args.write_annexb):
            ap.error("--from-mp4 and --write-annexb go together")
        try:
            tag, fps, count = mp4_to_annexb(args.from_mp4, args.write_annexb)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{args.write_annexb}: {count} packets, {tag}, {fps:g} fps")
        return 0
    if args.file is None:
        ap.error("give the Annex-B file to serve")
    if not (0 < args.fps <= 1000) or args.max_payload < 100:
        ap.error("need 0 < --fps <= 1000 and --max-payload >= 100")
    try:
        stream = Stream.load(args.file, args.codec, args.max_payload)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    server = RtspServer((args.host, args.port), stream, args.fps, args.loop, args.close_after)
    port = server.server_address[1]
    print(port, flush=True)  # first line: the port, for scripts and tests
    print(
        f"serving {args.file} ({stream.codec}, {len(stream.payloads)} access units, "
        f"{stream.nal_count} NAL units) at rtsp://{args.host}:{port}/stream, {args.fps:g} fps, "
        f"{'looping' if args.loop else 'once'}"
        + (f", closing each client after {args.close_after:g} s" if args.close_after else ""),
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
