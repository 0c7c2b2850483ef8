"""A real RTSP server for tests: tools/rtsp_server.py run by the system python (GStreamer + gi).

Tests that use it are skipped, with the reason, where /usr/bin/python3 cannot import gi and
gst-rtsp-server (dev machines without the system packages); CI installs them.
"""

from __future__ import annotations

import contextlib
import functools
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_SCRIPT = ROOT / "tools" / "rtsp_server.py"
CLIP = ROOT / "agent" / "assets" / "bikes.mp4"
SYSTEM_PYTHON = "/usr/bin/python3"


@functools.lru_cache(maxsize=1)
def gst_rtsp_missing() -> str | None:
    """Why the server cannot run here, or None when it can."""
    if not Path(SYSTEM_PYTHON).exists():
        return f"{SYSTEM_PYTHON} not found"
    probe = (
        "import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0'); "
        "from gi.repository import Gst, GstRtspServer"
    )
    try:
        done = subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{SYSTEM_PYTHON} cannot run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return (
            f"{SYSTEM_PYTHON} cannot import gi/GstRtspServer ({last}); "
            "install python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-{base,good,bad,ugly}"
        )
    return None


def free_port() -> int:
    # Bind to port 0 and give the port back: the kernel does not hand it out again right away.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RtspServer:
    """One tools/rtsp_server.py process serving ``clip`` (or a live pattern) on one or more mounts."""

    def __init__(
        self,
        clip: Path | None = CLIP,
        mounts: Sequence[str] = ("/cam",),
        port: int | None = None,
        pattern: bool = False,
        auth: tuple[str, str] | None = None,
    ) -> None:
        self.clip = clip
        self.auth = auth  # (user, password): Basic authentication required
        self.mounts = [m if m.startswith("/") else "/" + m for m in mounts]
        self.port = port if port is not None else free_port()
        self.pattern = pattern
        self.proc: subprocess.Popen[str] | None = None
        self.paused = False
        self.ready_s: float | None = None  # start -> READY, last start
        # The server's stderr, kept for error messages; lives as long as this object (closed in close()).
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        # The server's scratch dir (its Annex-B copy of the clip): ours to remove, since a SIGKILLed server
        # cannot clean up after itself.
        self._workdir = tempfile.TemporaryDirectory(prefix="rtsp_server_")

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> RtspServer:
        """Start the server and wait for its READY line; raise with its stderr if it does not come."""
        if self.running:
            raise RuntimeError("RTSP server already running")
        cmd = [SYSTEM_PYTHON, str(SERVER_SCRIPT), "--port", str(self.port)]
        cmd += ["--pattern"] if self.pattern else ["--file", str(self.clip), "--workdir", self._workdir.name]
        for mount in self.mounts:
            cmd += ["--mount", mount]
        if self.auth is not None:
            cmd += ["--user", self.auth[0], "--password", self.auth[1]]
        self._stderr.seek(0)
        self._stderr.truncate()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.paused = False
        assert self.proc.stdout is not None
        deadline = t0 + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    raise RuntimeError(f"RTSP server not READY in {timeout} s: {self.stderr_text()}")
                line = self.proc.stdout.readline()
                if not line:  # EOF: it exited (port taken, bad clip...)
                    self.proc.wait(5)
                    raise RuntimeError(
                        f"RTSP server exited with {self.proc.returncode}: {self.stderr_text()}"
                    )
                if line.startswith("READY"):
                    break
        self.ready_s = time.monotonic() - t0
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def url(self, mount: str | None = None) -> str:
        mount = self.mounts[0] if mount is None else (mount if mount.startswith("/") else "/" + mount)
        return f"rtsp://127.0.0.1:{self.port}{mount}"

    def _signal(self, sig: signal.Signals) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers: a hung camera."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL (a crash or power loss); resumes first if paused so the kill is not left pending."""
        if self.proc is None:
            return
        if self.running:
            if self.paused:
                self.resume()
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._close_pipe()

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in ``timeout``. Returns the exit status."""
        if self.proc is None:
            return None
        if self.running:
            if self.paused:
                self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_pipe()
        return self.proc.returncode

    def restart(self, timeout: float = 15.0, retry_s: float = 5.0) -> RtspServer:
        """Kill (if running) and start again on the same port and mounts.

        Retries while the port is still being released (the old listening socket can linger briefly).
        """
        self.kill()
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return self.start(timeout)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().strip()[-2000:] or "(no stderr)"

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def close(self) -> None:
        self.kill()
        self._stderr.close()
        self._workdir.cleanup()


def _require_gst() -> None:
    reason = gst_rtsp_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def make_rtsp_server() -> Iterator[Callable[..., RtspServer]]:
    """Factory: ``make_rtsp_server(mounts=("/a", "/b"), port=None, pattern=False)`` -> a started server.

    Every server made is killed at teardown, whatever the test did to it.
    """
    _require_gst()
    servers: list[RtspServer] = []

    def make(**kwargs: object) -> RtspServer:
        server = RtspServer(**kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def rtsp_server(make_rtsp_server: Callable[..., RtspServer]) -> RtspServer:
    """A started server looping the bundled clip on /cam and /cam2 (separate pipelines)."""
    return make_rtsp_server(mounts=("/cam", "/cam2"))


__all__ = ["CLIP", "RtspServer", "free_port", "gst_rtsp_missing", "make_rtsp_server", "rtsp_server"]
