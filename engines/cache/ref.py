"""`engines.cache` URLs: `oci://host[:port]/repository[?plain-http=true|false]`.

    ref = parse_cache_url("oci://registry.local:5000/site/engines")
    ref.registry     # "registry.local:5000"   ref.repository  # "site/engines"
    ref.target(key)  # "registry.local:5000/site/engines:KEY"

Transport: HTTPS, verified against the system CAs or `engines.ca_file`. Plain HTTP only where the URL says
so (`?plain-http=true`, an operator's decision for a LAN registry: credentials then travel in clear) or
where the host is loopback (127.0.0.0/8, ::1, localhost: the traffic never leaves the machine) and no CA
file is given; `?plain-http=false` asks for HTTPS on loopback too. The tag is never part of the URL: it is
the engine's compatibility key. Errors name what is wrong and never quote the URL (it may hold a secret).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

# The OCI distribution spec's repository name and tag grammar.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
MAX_REPOSITORY = 255


@dataclass(frozen=True)
class CacheRef:
    host: str  # a DNS name, an IPv4 address or an IPv6 address (without brackets)
    port: int | None
    repository: str
    plain_http: bool | None = None  # what the URL said; None: not said (HTTPS, but loopback without CA)

    @property
    def registry(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def uses_http(self, ca_file: Path | None = None) -> bool:
        """Plain HTTP: said by the URL, or loopback with nothing said and no CA file given."""
        if self.plain_http is not None:
            return self.plain_http
        return self.loopback and ca_file is None

    @property
    def name(self) -> str:
        """The repository with its registry (`host:port/site/engines`), as oras-py names it."""
        return f"{self.registry}/{self.repository}"

    def target(self, tag: str) -> str:
        return f"{self.registry}/{self.repository}:{tag}"

    def __str__(self) -> str:  # safe to log: a CacheRef never holds a credential
        query = "" if self.plain_http is None else f"?plain-http={str(self.plain_http).lower()}"
        return f"oci://{self.registry}/{self.repository}{query}"


def tag_problem(tag: str) -> str | None:
    """Why `tag` cannot be an OCI tag, or None."""
    return None if TAG_RE.fullmatch(tag) else "must be an OCI tag ([A-Za-z0-9_][A-Za-z0-9._-], at most 128)"


def _host_port(netloc: str) -> tuple[str, int | None]:
    if "@" in netloc:
        raise ValueError("credentials do not belong in the URL (it is logged): use a credentials file")
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d*))?|([^:\[\]]*)(?::(\d*))?", netloc)
    if not m:
        raise ValueError("the host is not a name, an IPv4 address or a bracketed IPv6 address")
    host = m.group(1) or m.group(3) or ""
    port_text = m.group(2) if m.group(1) else m.group(4)
    if not host:
        raise ValueError("the URL names no registry host")
    if m.group(1):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("the host is not a valid IPv6 address") from None
    elif not _HOST_RE.fullmatch(host):
        raise ValueError("the host is not a valid host name or address")
    if port_text is None:
        return host, None
    # ASCII digits only: isdigit() and int() take any Unicode digit
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError("the port must be a number from 1 to 65535")
    return host, int(port_text)


def _plain_http(query: str) -> bool | None:
    plain: bool | None = None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError("the URL's options are not name=value pairs") from None
    for name, value in pairs:
        if name != "plain-http":
            raise ValueError(f"unknown URL option {name[:40]!r} (the only one is plain-http=true|false)")
        if value not in ("true", "false"):
            raise ValueError("plain-http must be true or false")
        plain = value == "true"
    return plain


def parse_cache_url(url: str) -> CacheRef:
    """The registry and repository of an `engines.cache` URL; ValueError naming what is wrong."""
    if not isinstance(url, str) or not url:
        raise ValueError("the cache URL is empty")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme != "oci":
        raise ValueError("must be an oci://host:port/repository URL")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        # urlsplit drops tabs and newlines silently: the config would keep (and log) a URL it never checked
        raise ValueError("the URL holds a space or a control character")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ValueError(f"not a valid URL ({e})") from None
    host, port = _host_port(parts.netloc)
    if parts.fragment:
        raise ValueError("a cache URL has no #fragment")
    repository = parts.path.strip("/")
    if not repository:
        raise ValueError("the URL names no repository (oci://host:port/site/engines)")
    if ":" in repository or "@" in repository:
        raise ValueError("the URL names a repository, not a tag or digest: the tag is the engine's key")
    if len(repository) > MAX_REPOSITORY or not REPOSITORY_RE.fullmatch(repository):
        raise ValueError(
            "the repository must be lowercase path components of letters and digits, separated by "
            "'.', '_', '__' or '-' (the OCI name rule)"
        )
    return CacheRef(host=host, port=port, repository=repository, plain_http=_plain_http(parts.query))
