"""Artifact servers for the deploy download tests: a real nginx (HTTPS with a test CA, and plain HTTP) serving
a folder, and a small threaded Python server for the faults nginx cannot produce (drip, truncation, wrong
length, drops, redirects off https, a server that ignores Range, a certificate for another name).

Everything listens on 127.0.0.1 on free ports and is stopped in `finally` by the fixtures.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fixtures_mqtt import free_port, port_open

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


# -- a test CA -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path  # for 127.0.0.1 and localhost, signed by the CA
    server_key: Path
    other_cert: Path  # for other.invalid only, signed by the same CA (the name mismatch)
    other_key: Path

    def server_context(self, other_name: bool = False) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if other_name:
            ctx.load_cert_chain(self.other_cert, self.other_key)
        else:
            ctx.load_cert_chain(self.server_cert, self.server_key)
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, names: list[x509.GeneralName],
          key_path: Path, cert_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("edge-agent test server"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(key, key_path)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and one for another name, all signed by the CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("edge-agent test CA"))
        .issuer_name(_name("edge-agent test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key",
              directory / "other.pem", directory / "other.key")
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    local = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    _leaf(ca_key, ca_cert, local, pki.server_key, pki.server_cert)
    _leaf(ca_key, ca_cert, [x509.DNSName("other.invalid")], pki.other_key, pki.other_cert)
    return pki


# -- nginx ---------------------------------------------------------------------------------------------
class Nginx:
    """nginx in the foreground serving `root` over HTTP and HTTPS; /private/ needs Basic auth (user:pass
    from `users`). The access log line per request: `STATUS "REQUEST" range="..." user="..."`."""

    def __init__(self, workdir: Path, root: Path, pki: Pki, users: dict[str, str]) -> None:
        if NGINX is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        self.workdir, self.root = workdir, root
        self.http_port, self.https_port = free_port(), free_port()
        self.access_log, self.error_log = workdir / "access.log", workdir / "error.log"
        (workdir / "htpasswd").write_text("".join(f"{u}:{{PLAIN}}{p}\n" for u, p in users.items()))
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (workdir / sub).mkdir(exist_ok=True)
        private = f'location /private/ {{ auth_basic "artifacts"; auth_basic_user_file {workdir}/htpasswd; }}'
        # As root the workers would run as nobody and could not read the test's 0700 tmp folder.
        user = "user root;\n" if os.geteuid() == 0 else ""
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(
            f"{user}worker_processes 1;\npid {workdir}/nginx.pid;\nerror_log {self.error_log} warn;\n"
            "events { worker_connections 64; }\n"
            "http {\n"
            "  log_format t '$status \"$request\" range=\"$http_range\" user=\"$remote_user\"';\n"
            f"  access_log {self.access_log} t;\n"
            f"  client_body_temp_path {workdir}/body; proxy_temp_path {workdir}/proxy;\n"
            f"  fastcgi_temp_path {workdir}/fastcgi; uwsgi_temp_path {workdir}/uwsgi;\n"
            f"  scgi_temp_path {workdir}/scgi;\n"
            "  default_type application/octet-stream;\n"
            f"  server {{ listen 127.0.0.1:{self.http_port}; root {root}; {private} }}\n"
            f"  server {{ listen 127.0.0.1:{self.https_port} ssl; root {root}; {private}\n"
            f"    ssl_certificate {pki.server_cert}; ssl_certificate_key {pki.server_key}; }}\n"
            "}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self._marks = 0

    def start(self, timeout: float = 10.0) -> None:
        cmd = [NGINX, "-p", str(self.workdir), "-e", str(self.error_log), "-c", str(self.conf),
               "-g", "daemon off;"]
        with (self.workdir / "stderr.log").open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self.log_tail()}")
            if port_open(self.http_port) and port_open(self.https_port):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nginx did not listen within {timeout} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown of master and workers
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def log_tail(self) -> str:
        parts = [p.read_text(errors="replace")[-2000:] for p in (self.error_log, self.workdir / "stderr.log")
                 if p.exists()]
        return " | ".join(parts)

    def requests(self, timeout: float = 5.0) -> list[str]:
        """The access log lines so far. nginx logs a request after answering it: a marker request, waited for
        in the log, makes sure every earlier line is there (one worker: in order)."""
        self._marks += 1
        mark = f"/__mark_{self._marks}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.http_port), 2) as s:
            s.sendall(f"GET {mark} HTTP/1.0\r\n\r\n".encode())
            s.recv(1024)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.access_log.read_text().splitlines() if self.access_log.exists() else []
            if any(mark in line for line in lines):
                return [line for line in lines if "/__mark_" not in line]
            time.sleep(0.01)
        raise RuntimeError(f"nginx did not log {mark} within {timeout} s")

    def url(self, name: str, tls: bool = True, auth: str = "", query: str = "") -> str:
        scheme, port = ("https", self.https_port) if tls else ("http", self.http_port)
        return f"{scheme}://{auth}127.0.0.1:{port}/{name}{query}"


# -- the fault server ----------------------------------------------------------------------------------
@dataclass
class Seen:
    path: str
    headers: dict[str, str]


@dataclass
class FaultState:
    payload: bytes
    drip_s: float = 1.0
    drip_for_s: float = 5.0  # then the drip closes (a client without a stall rule fails, not hangs)
    fail_times: int = 2  # /flaky answers 500 this many times, then serves
    slow_bps: int = 1 << 20  # /slow serves the payload (from the Range start) at about this rate
    seen: list[Seen] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    server: _FaultServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(5)
            with contextlib.suppress(OSError):
                self.request.do_handshake()
        super().setup()

    def _count(self, mode: str) -> int:
        st = self.server.state
        with st.lock:
            st.counts[mode] = st.counts.get(mode, 0) + 1
            return st.counts[mode]

    def _range_start(self) -> int:
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        return int(m.group(1)) if m else 0

    def _head(self, status: int, length: int | None, start: int = 0, total: int | None = None,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if length is not None:
            self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{start + (length or 1) - 1}/{total}")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _serve(self, cut: int | None = None, honour_range: bool = True, announce: int | None = None,
               start_shift: int = 0) -> None:
        """The payload (from the Range start when honoured); `cut`: close after that many body bytes."""
        data = self.server.state.payload
        start = self._range_start() if honour_range else 0
        body = data[start:]
        status = 206 if start else 200
        length = announce if announce is not None else len(body)
        self._head(status, length, start + start_shift, len(data))
        with contextlib.suppress(OSError):
            self.wfile.write(body if cut is None else body[:cut])
            self.wfile.flush()
        self.close_connection = True

    def do_GET(self) -> None:
        st = self.server.state
        mode = self.path.split("?", 1)[0].strip("/").split("/", 1)[0]
        with st.lock:
            st.seen.append(Seen(self.path, dict(self.headers.items())))
        n = self._count(mode)
        size = len(st.payload)
        other = f"https://localhost:{self.server.server_port}/ok"
        plain = f"http://127.0.0.1:{self.server.server_port}/ok"
        if mode == "ok":
            self._serve()
        elif mode == "missing":
            self._head(404, 0)
        elif mode == "flaky":  # 500 the first fail_times requests, then the file
            self._head(500, 0) if n <= st.fail_times else self._serve()
        elif mode == "truncate":  # every answer: the right Content-Length, half the body, then close
            self._serve(cut=(size - self._range_start()) // 2)
        elif mode == "drop-once":  # the first answer stops after a third of the body; later ones serve
            self._serve(cut=size // 3 if n == 1 else None)
        elif mode == "long-length":  # announces more than the file has, sends the file, closes
            self._serve(announce=size + 1000)
        elif mode == "short-length":
            self._serve(announce=size - 1000)
        elif mode == "no-length-long":  # no Content-Length, more bytes than the file, ended by close
            self._head(200, None)
            with contextlib.suppress(OSError):
                self.wfile.write(st.payload + b"x" * 5000)
            self.close_connection = True
        elif mode == "ignore-range":  # 200 with the whole file always; the first answer drops halfway
            self._serve(cut=size // 2 if n == 1 else None, honour_range=False)
        elif mode == "wrong-start":  # first answer drops; the 206 after it starts 10 bytes early
            self._serve(cut=size // 2) if n == 1 else self._serve(start_shift=-10 if n == 2 else 0)
        elif mode == "slow":  # the whole payload, Range honoured, at slow_bps: a download to interrupt
            self._slow()
        elif mode == "drip":
            self._drip()
        elif mode == "drip-headers":  # a status line, then one header byte at a time
            self._drip(head=True)
        elif mode == "hang":  # accepts, reads the request, never answers
            st.stopping.wait(30)
        elif mode in ("to-http", "to-other-host", "to-same", "loop"):
            target = {"to-http": plain, "to-other-host": other, "to-same": "/ok", "loop": "/loop"}[mode]
            self._head(302, 0, extra={"Location": target})
        else:
            self._head(400, 0)

    def _slow(self) -> None:
        st = self.server.state
        start = self._range_start()
        body = st.payload[start:]
        self._head(206 if start else 200, len(body), start, len(st.payload))
        step = max(st.slow_bps // 20, 1)  # 20 writes a second
        for i in range(0, len(body), step):
            if st.stopping.wait(0.05):
                return
            try:
                self.wfile.write(body[i : i + step])
                self.wfile.flush()
            except OSError:  # the client went away (killed, cancelled)
                return
        self.close_connection = True

    def _drip(self, head: bool = False) -> None:
        st = self.server.state
        if head:
            self.wfile.write(b"HTTP/1.0 200 OK\r\n")
            data = b"X-Slow: " + b"a" * 1000
        else:
            self._head(200, len(st.payload))
            data = st.payload
        for i in range(min(len(data), int(st.drip_for_s / st.drip_s))):
            if st.stopping.wait(st.drip_s):
                return
            try:
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
            except OSError:
                return


class _FaultServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: FaultState, tls: ssl.SSLContext | None) -> None:
        self.state, self.tls = state, tls
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that refused our certificate or hung up: the test sees it from the client side

    def get_request(self) -> tuple[socket.socket, object]:
        sock, addr = self.socket.accept()
        if self.tls is None:
            return sock, addr
        # The handshake runs in the handler's thread: a client that stalls it cannot block accept().
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class FaultServer:
    """The fault server on a free port (TLS when given a context); `url(mode)` and what it saw."""

    def __init__(self, state: FaultState, tls: ssl.SSLContext | None = None) -> None:
        self.state = state
        self.httpd = _FaultServer(state, tls)
        self.port = self.httpd.server_port
        self.scheme = "https" if tls else "http"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.state.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def url(self, mode: str, auth: str = "", query: str = "") -> str:
        return f"{self.scheme}://{auth}127.0.0.1:{self.port}/{mode}/artifact.bin{query}"


# -- running servers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def running_nginx(workdir: Path, root: Path, pki: Pki, users: dict[str, str]) -> Iterator[Nginx]:
    server = Nginx(workdir, root, pki, users)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_faults(state: FaultState, tls: ssl.SSLContext | None = None) -> Iterator[FaultServer]:
    server = FaultServer(state, tls)
    try:
        server.start()
        yield server
    finally:
        server.stop()
