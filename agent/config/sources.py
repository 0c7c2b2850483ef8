"""Camera sources: what a camera `url` may be (a file, a V4L2 device, a network stream) and which names a
local file."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from agent.config.names import host_problem

# Schemes a camera `url` may have besides file://: the FFmpeg network protocols that carry video.
STREAM_SCHEMES = ("rtsp", "rtsps", "http", "https", "rtmp", "rtmps", "srt", "udp", "rtp", "tcp")
_HOSTLESS = ("udp", "rtp", "srt", "tcp")  # udp://@:5000, srt://:9000?mode=listener: a port, maybe no host
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# A known scheme with its '://' mistyped: 'rtsp//10.0.0.5/s', 'rtsp:/10.0.0.5/s', 'http:cam/x'.
_SCHEME_TYPO = re.compile(r"(rtsps?|https?|rtmps?|srt|udp|rtp|tcp|file)(?::(?!//)|//)", re.IGNORECASE)
MAX_DEVICE_INDEX = 1023


def _is_device(url: str) -> bool:
    return (url.isascii() and url.isdigit()) or url.startswith("/dev/video")


def camera_file(url: str) -> str | None:
    """The local file that a camera `url` names (a file path or a file:// URL), else None (a network stream
    or a V4L2 device), as pipelines.sources.spec.resolve tells them apart."""
    if not url or _is_device(url):
        return None
    head, sep, _ = url.partition("://")
    if sep:
        return unquote(urlsplit(url).path) if head.lower() == "file" else None
    return url


def camera_url_problem(url: str) -> str | None:
    """Why `url` cannot be a camera source, or None. The message never quotes the URL (credentials)."""
    if not url.strip():
        return "must not be empty"
    if url != url.strip():
        return "must not start or end with spaces"
    if _is_device(url):
        if url.isdigit() and (len(url) > 4 or int(url) > MAX_DEVICE_INDEX):
            return f"a V4L2 device index is 0..{MAX_DEVICE_INDEX}"
        return None
    head, sep, _ = url.partition("://")
    if not sep:
        typo = _SCHEME_TYPO.match(url)
        if typo is not None:
            scheme = typo.group(1).lower()
            if scheme == "file":
                return "looks like a URL without '://' (write file:///absolute/path, or the path itself)"
            return f"looks like a URL without '://' (write {scheme}://host/path)"
        return None  # a file path: the preflight checks that it exists
    if not _SCHEME.fullmatch(head):
        return "is neither a file path nor a URL that starts with a scheme (rtsp://host/path)"
    scheme = head.lower()
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            return "a file URL must be file:///absolute/path (or give the path itself)"
        return None
    if scheme not in STREAM_SCHEMES:
        return f"unknown scheme '{scheme}' (known: {', '.join(STREAM_SCHEMES)}, file; or a file path)"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "must not contain spaces or control characters (percent-encode them, e.g. %20)"
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a bad port or IPv6 literal; not quoted (the text may hold the password)
        return (
            "has an invalid host or port (1..65535); a user name or password with '/', '?', '#' or '@'"
            " must be percent-encoded"
        )
    if port is not None and not 1 <= port <= 65535:
        return "port must be 1..65535"
    if host:
        problem = host_problem(host)
        if problem is not None:
            return f"host {problem}"
    elif scheme not in _HOSTLESS:
        return f"has no host (write {scheme}://host[:port]/path)"
    elif port is None:
        return f"needs a port ({scheme}://[host]:port)"
    return None
