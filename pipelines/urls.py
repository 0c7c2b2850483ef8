"""Credential masking for camera URLs and any text that quotes them. Pure strings: no cv2, no numpy.

Imported by the config (whose reprs must not leak camera passwords) and by the camera readers; kept out
of :mod:`pipelines.sources` so that loading a config does not load OpenCV.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import unquote

# scheme://user:password@host... ; the password part is greedy up to the last "@" of the whitespace-free token
# so that an unencoded "@" in a password ("admin:p@ss@cam") is masked whole. Over-masking an odd URL is fine,
# leaking is not.
_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*):(?P<password>\S*)@")
# Some cameras take credentials in the query string instead (…?user=admin&password=…).
_QUERY_SECRET_RE = re.compile(
    r"(?P<head>[?&;](?:password|passwd|pwd|pass|token|secret|auth|key)=)[^&\s\"']*", re.IGNORECASE
)


def mask_url(url: str) -> str:
    """Return ``url`` (or any text containing URLs) with passwords replaced by ``***``.

    ``rtsp://admin:s3cret@10.0.0.21/stream`` -> ``rtsp://admin:***@10.0.0.21/stream``; a user without a
    password is left as is; query parameters such as ``password=`` or ``token=`` are masked too.
    """
    masked = _USERINFO_RE.sub(lambda m: f"{m.group('head')}:***@", url)
    return _QUERY_SECRET_RE.sub(lambda m: f"{m.group('head')}***", masked)


def secrets_of(text: str) -> list[str]:
    """Passwords found in ``text`` (raw and percent-decoded), to scrub them from messages that quote them
    outside a URL shape (an OpenCV or FFmpeg error, say)."""
    found: set[str] = set()
    for m in _USERINFO_RE.finditer(text):
        found.add(m.group("password"))
    for m in _QUERY_SECRET_RE.finditer(text):
        found.add(text[m.end("head") : m.end()])
    found |= {unquote(s) for s in found}
    # Longest first so that a secret containing another is replaced whole; skip empties and 1-2 char
    # values that would mangle unrelated text.
    return sorted((s for s in found if len(s) >= 3), key=len, reverse=True)


def scrubber(raw: str) -> Callable[[str], str]:
    """A function that masks URLs in a text and also the passwords of ``raw`` wherever they appear (a
    camera's reader scrubs every message it logs or keeps with the one of its own URL)."""
    secrets = secrets_of(raw)

    def scrub(text: str) -> str:
        text = mask_url(text)
        for secret in secrets:
            text = text.replace(secret, "***")
        return text

    return scrub
