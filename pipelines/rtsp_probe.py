"""Why an RTSP camera cannot be opened: refused, timed out, unknown host, 401, 404, ...

OpenCV's FFmpeg backend reports only "cannot open", whatever the cause. After a failed open the reader
asks the camera itself: a TCP connect, then one RTSP DESCRIBE (with the URL's credentials, Basic or
Digest as the camera asks), and turns the answer into a short cause for `last_error`. The result never
contains the credentials. Runs only after a failure, bounded by a timeout.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
from urllib.parse import unquote, urlsplit, urlunsplit

_STATUS = re.compile(rb"^RTSP/1\.\d (\d{3}) ?([^\r\n]*)")
_CHALLENGE = re.compile(r'(\w+)="?([^",]*)"?')


def diagnose(url: str, timeout: float = 3.0) -> str:
    """A short cause, e.g. "connection refused", "authentication failed (401)", "not found (404)"."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 554
    if not host:
        return "no host in the URL"
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else ""
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    clean = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            code, reason, headers = _describe(sock, clean, 1, None)
            if code == 401 and user is not None:
                auth = _authorization(headers.get("www-authenticate", ""), user, password, clean)
                if auth is not None:
                    code, reason, headers = _describe(sock, clean, 2, auth)
    except socket.gaierror:
        return f"host not found: {host}"
    except ConnectionRefusedError:
        return f"connection refused by {host}:{port}"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as exc:
        return f"cannot reach {host}:{port}: {exc.strerror or type(exc).__name__}"
    except ValueError as exc:
        return f"not an RTSP server at {host}:{port} ({exc})"
    if code == 401:
        return "authentication failed (401)" if user is not None else "authentication required (401)"
    if code == 404:
        return "not found (404)"
    if code == 200:
        return "the camera answers but the stream could not be decoded (codec or transport)"
    return f"RTSP {code} {reason}".strip()


def _describe(sock: socket.socket, url: str, cseq: int, auth: str | None) -> tuple[int, str, dict[str, str]]:
    lines = [f"DESCRIBE {url} RTSP/1.0", f"CSeq: {cseq}", "Accept: application/sdp", "User-Agent: edge-agent"]
    if auth:
        lines.append(f"Authorization: {auth}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 16384:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    m = _STATUS.match(data)
    if m is None:
        raise ValueError("no RTSP status line")
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    headers = {}
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        headers.setdefault(key.strip().lower(), value.strip())
    # The body (SDP) is not read: the connection is closed right after.
    return int(m.group(1)), m.group(2).decode("latin-1"), headers


def _authorization(challenge: str, user: str, password: str, url: str) -> str | None:
    scheme, _, rest = challenge.partition(" ")
    if scheme.lower() == "basic":
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    if scheme.lower() != "digest":
        return None
    p = dict(_CHALLENGE.findall(rest))
    realm, nonce = p.get("realm", ""), p.get("nonce", "")

    def md5(text: str) -> str:
        return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()

    ha1, ha2 = md5(f"{user}:{realm}:{password}"), md5(f"DESCRIBE:{url}")
    fields = f'username="{user}", realm="{realm}", nonce="{nonce}", uri="{url}"'
    if "auth" in p.get("qop", "").split(","):
        cnonce, nc = os.urandom(8).hex(), "00000001"
        response = md5(f"{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}")
        return f'Digest {fields}, response="{response}", qop=auth, nc={nc}, cnonce="{cnonce}"'
    return f'Digest {fields}, response="{md5(f"{ha1}:{nonce}:{ha2}")}"'
