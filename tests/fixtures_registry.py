"""A real OCI registry (CNCF Distribution, `docker-registry` from apt) per test, and a slow TCP proxy.

    with running_registry(tmp_path) as reg:                       # plain HTTP on 127.0.0.1:free port
        reg.url("site/engines")                                   # "oci://127.0.0.1:PORT/site/engines"
        reg.stop(); reg.start()                                   # down and back on the same port
        reg.blob_file("sha256:...")                               # the blob's file in the storage folder
    with running_registry(tmp_path, pki=make_pki(...), users={"u": "p"}) as reg:  # TLS + htpasswd
    with slow_proxy(reg.port, delay_s=30) as port:                # answers only after delay_s
    with slow_proxy(reg.port, delay_s=0.05, piece=512) as port:   # drips: 512 bytes every 50 ms
    with running_token_server(tmp, {"u": "p"}) as ts, running_registry(tmp, token=ts) as reg:  # Bearer

htpasswd: Distribution accepts bcrypt hashes only; they are made with the `bcrypt` package (a test
dependency: apache2-utils' htpasswd is not needed). Every process is stopped in `finally`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID
from fixtures_http import Pki
from fixtures_mqtt import free_port, port_open

DOCKER_REGISTRY = shutil.which("docker-registry") or next(
    (p for p in ("/usr/bin/docker-registry",) if Path(p).exists()), None
)


class DockerRegistry:
    """docker-registry serving `workdir/storage` on 127.0.0.1:port; start/stop/kill/start on the same port."""

    def __init__(
        self, workdir: Path, *, pki: Pki | None = None, users: dict[str, str] | None = None,
        token: TokenServer | None = None,
    ) -> None:
        if DOCKER_REGISTRY is None:
            raise RuntimeError("docker-registry is not installed (apt-get install docker-registry)")
        self.workdir = workdir
        self.port = free_port()
        self.storage = workdir / "storage"
        self.log = workdir / "registry.log"
        self.conf = workdir / "registry.yml"
        self.tls = pki is not None
        lines = [
            "version: 0.1",
            "log: {level: warn, accesslog: {disabled: true}}",
            f"storage: {{filesystem: {{rootdirectory: '{self.storage}'}}, delete: {{enabled: true}},",
            "  maintenance: {uploadpurging: {enabled: false}}}",
            f"http: {{addr: '127.0.0.1:{self.port}', secret: edge-agent-test"
            + ("" if pki is None else f", tls: {{certificate: '{pki.server_cert}', key: '{pki.server_key}'}}")
            + "}",
        ]
        if users:
            import bcrypt  # a test extra, needed only here

            htpasswd = workdir / "htpasswd"
            htpasswd.write_text(
                "".join(f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(4)).decode()}\n"
                        for u, p in users.items())
            )
            lines.append(f"auth: {{htpasswd: {{realm: edge-agent-test, path: '{htpasswd}'}}}}")
        if token is not None:
            lines.append(
                f"auth: {{token: {{realm: '{token.realm}', service: {TOKEN_SERVICE}, issuer: {TOKEN_ISSUER},"
                f" rootcertbundle: '{token.cert_file}'}}}}"
            )
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, repository: str = "site/engines", query: str = "") -> str:
        return f"oci://127.0.0.1:{self.port}/{repository}{query}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} already accepts connections before the registry started")
        assert DOCKER_REGISTRY is not None
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen([DOCKER_REGISTRY, "serve", str(self.conf)], stdout=logf, stderr=logf)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}: {self.log_tail()}")
            if port_open(self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(
            f"docker-registry did not listen on {self.port} within {timeout} s: {self.log_tail()}"
        )

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps blob `digest` (the registry serves it without re-checking)."""
        hexa = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexa[:2] / hexa / "data"

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def running_registry(
    workdir: Path, *, pki: Pki | None = None, users: dict[str, str] | None = None,
    token: TokenServer | None = None,
) -> Iterator[DockerRegistry]:
    workdir.mkdir(parents=True, exist_ok=True)
    reg = DockerRegistry(workdir, pki=pki, users=users, token=token)
    try:
        reg.start()
        yield reg
    finally:
        reg.kill()


@pytest.fixture
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerRegistry]:
    """A plain-HTTP registry on loopback (the engine cache's default transport there), in a folder of its
    own (the test's tmp_path stays the test's)."""
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


# -- a slow proxy -----------------------------------------------------------------------------------------
def _pipe(
    src: socket.socket, dst: socket.socket, delay_s: float, stopping: threading.Event,
    piece: int | None = None,
) -> None:
    """Forward src -> dst, each chunk (or each `piece` bytes of it) only after `delay_s`: a registry that
    answers, but too late (or drips)."""
    with contextlib.suppress(OSError):
        while not stopping.is_set():
            data = src.recv(65536)
            if not data:
                break
            step = piece or len(data)
            for i in range(0, len(data), step):
                if stopping.wait(delay_s):
                    return
                dst.sendall(data[i : i + step])
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def slow_proxy(upstream_port: int, delay_s: float, piece: int | None = None) -> Iterator[int]:
    """A TCP proxy on a free 127.0.0.1 port to `upstream_port` that holds every answer for `delay_s`;
    with `piece`, it drips answers: `piece` bytes every `delay_s`."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stopping = threading.Event()
    sockets: list[socket.socket] = []

    def accept() -> None:
        while not stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", upstream_port))
            sockets.extend((client, upstream))
            threading.Thread(target=_pipe, args=(client, upstream, 0.0, stopping), daemon=True).start()
            back = (upstream, client, delay_s, stopping, piece)
            threading.Thread(target=_pipe, args=back, daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stopping.set()
        thread.join(5)
        listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


# -- a token server (docker's token protocol, as Harbor or GitLab run one) -------------------------------
TOKEN_SERVICE = "edge-agent-test"
TOKEN_ISSUER = "edge-agent-test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class TokenServer:
    """Issues ES256 JWTs the registry (`auth: token`) trusts through `cert_file` (the signing key's own
    certificate, sent as x5c): users from `users` get pull and push on what they ask for; anonymous
    requests get pull only when `anonymous_pull`. `requests` records (user or None, scope)."""

    def __init__(self, workdir: Path, users: dict[str, str], anonymous_pull: bool = False) -> None:
        self.users, self.anonymous_pull = users, anonymous_pull
        self.requests: list[tuple[str | None, str]] = []
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge-agent test token signer")])
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(self.key, hashes.SHA256())
        )
        self.cert_file = workdir / "token-signer.pem"
        self.cert_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.realm = f"http://127.0.0.1:{self.httpd.server_port}/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def token(self, user: str | None, scope: str) -> str:
        actions = ["pull", "push"] if user else ["pull"]
        access = []
        if scope.count(":") == 2:
            kind, name, wanted = scope.split(":")
            access = [{"type": kind, "name": name, "actions": [a for a in wanted.split(",") if a in actions]}]
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256",
                  "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {"iss": TOKEN_ISSUER, "sub": user or "", "aud": TOKEN_SERVICE, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def _user(self, authorization: str) -> str | bool | None:
        """The user of a valid Basic header, None without one, False for a wrong one."""
        if not authorization.startswith("Basic "):
            return None
        user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
        return user if self.users.get(user) == password else False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                user = server._user(self.headers.get("Authorization", ""))
                server.requests.append((user or None, query.get("scope", "")))
                if user is False or (user is None and not server.anonymous_pull):
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": server.token(user or None, query.get("scope", "")),
                                   "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


@contextlib.contextmanager
def running_token_server(workdir: Path, users: dict[str, str], anonymous_pull: bool = False
                         ) -> Iterator[TokenServer]:
    workdir.mkdir(parents=True, exist_ok=True)
    server = TokenServer(workdir, users, anonymous_pull)
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(5)
