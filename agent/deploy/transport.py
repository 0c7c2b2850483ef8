"""One HTTP(S) GET under the deploy policy, for agent.deploy.download: URL parsing that keeps credentials out
of what is shown, the TLS context (system CAs + an optional private CA, hostname checked), connect and read
timeouts, and redirects (bounded; never to another scheme; to another host only if allowed, and then
without our credentials). Errors come from the caller's ``fail(what, retryable)`` so that they carry its
URL and field.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from agent.deploy.errors import DownloadError
from pipelines.urls import scrubber

REDIRECTS = frozenset({301, 302, 303, 307, 308})

Fail = Callable[..., DownloadError]  # fail(what: str, retryable: bool = False) -> DownloadError


@dataclass(frozen=True)
class Target:
    """A URL split for http.client."""

    url: str  # as given (credentials included): only to resolve a relative redirect against
    scheme: str
    host: str
    port: int | None
    path: str  # path + query, as sent in the request line
    auth: str | None  # the Authorization header made of the URL's user:password

    @property
    def shown(self) -> str:
        """The URL as reasons and logs show it: no userinfo, no query."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port is not None else ""
        return f"{self.scheme}://{host}{port}{self.path.split('?', 1)[0]}"


def parse_target(url: str) -> Target:
    """``url`` split; ValueError (whose text holds no part of the URL) when it has no host or a bad port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError("bad port") from None
    if not parts.hostname:
        raise ValueError("no host")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    auth = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Target(url, parts.scheme.lower(), parts.hostname, port, path, auth)


def _cut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    cut.set()
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


def tls_context(ca_file: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()  # system CAs, certificate required, hostname checked
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is not None:
        ctx.load_verify_locations(cafile=str(ca_file))  # a private CA, in addition to the system's
    return ctx


@dataclass(frozen=True)
class Opener:
    tls: ssl.SSLContext | None
    connect_timeout_s: float
    read_timeout_s: float
    max_redirects: int
    follow_other_hosts: bool

    def open(
        self, target: Target, headers: Mapping[str, str], fail: Fail
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """GET ``target`` following allowed redirects; the caller closes the connection."""
        for _ in range(self.max_redirects + 1):
            conn = self._connect(target, fail)
            resp = self._request(conn, target, headers, fail)
            if resp.status not in REDIRECTS:
                return conn, resp
            location = resp.getheader("Location")
            conn.close()
            if not location:
                raise fail(f"redirect {resp.status} without a Location")
            target = self._follow(target, location, fail)
        raise fail(f"more than {self.max_redirects} redirects")

    def _connect(self, target: Target, fail: Fail) -> http.client.HTTPConnection:
        timeout = self.connect_timeout_s
        conn: http.client.HTTPConnection
        if target.scheme == "https":
            conn = http.client.HTTPSConnection(target.host, target.port, timeout=timeout, context=self.tls)
        else:
            conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout)
        host = target.host
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as exc:
            raise fail(f"TLS certificate of {host} refused: {exc.verify_message}") from None
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            raise fail(f"{host} closed the TLS handshake", retryable=True) from None
        except ssl.SSLError as exc:
            raise fail(f"TLS handshake with {host} failed: {exc.reason}") from None
        except TimeoutError:
            raise fail(f"connect to {host} timed out after {timeout:g} s", retryable=True) from None
        except OSError as exc:
            raise fail(f"cannot connect to {host}: {exc.strerror or exc}", retryable=True) from None
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout_s)  # from now on: the timeout of every read
        return conn

    def _request(
        self, conn: http.client.HTTPConnection, target: Target, extra: Mapping[str, str], fail: Fail
    ) -> http.client.HTTPResponse:
        headers = {"User-Agent": "edge-agent", "Accept-Encoding": "identity", **extra}
        if target.auth:
            headers["Authorization"] = target.auth
        # The whole answer (status line and headers) within read_timeout_s: a server that drips its headers
        # passes every single read's timeout; the timer cuts the socket, the read below then fails.
        cut = threading.Event()
        timer = threading.Timer(self.read_timeout_s, _cut, args=(conn, cut))
        timer.daemon = True
        timer.start()
        try:
            conn.request("GET", target.path, headers=headers)
            resp = conn.getresponse()
            if cut.is_set():  # the cut may end a header line early: what was parsed is not the answer
                raise TimeoutError
            return resp
        except http.client.InvalidURL:  # control characters in a path (a redirect's Location, say)
            conn.close()
            raise fail("the URL's path holds characters that cannot be sent") from None
        except TimeoutError:
            conn.close()
            raise fail(f"no complete answer within {self.read_timeout_s:g} s", retryable=True) from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if cut.is_set():
                raise fail(f"no complete answer within {self.read_timeout_s:g} s", retryable=True) from None
            raise fail(f"connection lost before the answer ({type(exc).__name__})", retryable=True) from None
        finally:
            timer.cancel()

    def _follow(self, current: Target, location: str, fail: Fail) -> Target:
        url = urljoin(current.url, location)
        try:
            nxt = parse_target(url)
        except ValueError as exc:
            raise fail(f"redirect to a bad URL ({exc})") from None
        shown = scrubber(url)(nxt.shown)
        if nxt.scheme != current.scheme:
            change = f"{current.scheme} -> {nxt.scheme}"
            raise fail(f"redirect to {shown} refused: it changes the scheme ({change})")
        if (nxt.host, nxt.port) != (current.host, current.port):
            if not self.follow_other_hosts:
                raise fail(f"redirect to another host refused ({shown})")
            return nxt  # its own credentials only: ours are never sent to another host
        return nxt if nxt.auth else replace(nxt, auth=current.auth)
