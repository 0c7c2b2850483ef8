"""A camera's last_error tells why it cannot be opened: refused, no answer, 401, 404 (real RTSP server,
real reader), and never shows the password."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
from fixtures_agent import wait_until
from fixtures_mqtt import free_port
from fixtures_rtsp import RtspServer

from pipelines.rtsp_probe import diagnose
from pipelines.sources import CameraReader, SourceSpec

SECRET = "pw-9Xq-secret"


def read_error(url: str, timeout_s: float = 1.0) -> str:
    reader = CameraReader(SourceSpec(camera="cam", url=url, open_timeout_s=timeout_s, read_timeout_s=1.0))
    reader.start()
    try:
        assert wait_until(lambda: reader.last_error is not None, 20), "no error reported"
        return str(reader.last_error)
    finally:
        reader.stop()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections (kernel backlog) and never answers: a hung camera."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_refused_and_silent_cameras(silent_port: int) -> None:
    port = free_port()
    assert "connection refused by 127.0.0.1:" in read_error(f"rtsp://127.0.0.1:{port}/cam")
    err = read_error(f"rtsp://127.0.0.1:{silent_port}/cam")
    assert "no answer from 127.0.0.1" in err, err


def test_a_silent_camera_is_named_with_one_timeout(silent_port: int) -> None:
    err = read_error(f"rtsp://127.0.0.1:{silent_port}/cam", timeout_s=3.5)
    assert "open timed out after 3.5 s" in err, err
    assert f"no answer from 127.0.0.1:{silent_port} within 3.5 s" in err, err


def test_auth_and_not_found_from_a_real_rtsp_server(make_rtsp_server: Callable[..., RtspServer]) -> None:
    server = make_rtsp_server(auth=("viewer", SECRET))
    port = server.port
    assert "authentication required (401)" in read_error(f"rtsp://127.0.0.1:{port}/cam")
    wrong = read_error(f"rtsp://viewer:wrong-{SECRET}@127.0.0.1:{port}/cam")
    assert "authentication failed (401)" in wrong and SECRET not in wrong
    missing = read_error(f"rtsp://viewer:{SECRET}@127.0.0.1:{port}/nothing-here")
    assert "not found (404)" in missing and SECRET not in missing
    # The right password: the probe gets through (what FFmpeg does is then its business).
    assert "authentication" not in diagnose(f"rtsp://viewer:{SECRET}@127.0.0.1:{port}/cam")

    ok = CameraReader(
        SourceSpec(camera="cam", url=f"rtsp://viewer:{SECRET}@127.0.0.1:{port}/cam", open_timeout_s=10)
    )
    ok.start()
    try:
        assert wait_until(lambda: ok.state == "streaming", 30), ok.last_error
    finally:
        ok.stop()


def test_probe_answers_for_things_that_are_not_rtsp() -> None:
    http = socket.socket()
    http.bind(("127.0.0.1", 0))
    http.listen(1)
    port = http.getsockname()[1]

    import threading

    def answer() -> None:
        conn, _ = http.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert "not an RTSP server" in diagnose(f"rtsp://127.0.0.1:{port}/x", timeout=2)
    finally:
        http.close()
    assert diagnose("rtsp:///nohost") == "no host in the URL"
