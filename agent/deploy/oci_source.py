"""An `oci://...@sha256:` artifact (agent/deploy/oci_ref.py) turned into the blob download that
agent.deploy.download runs as it runs any HTTP(S) download: same part file, Range resume, retries, stall
rule, size cap, disk checks, progress and cancel.

    source = OciSource.for_fetch(url, "artifacts.onnx", policy)   # DownloadError: bad URL, HTTP refused
    target = source.resolve(sha256, size, fail)                   # the blob's GET, with the registry login

`resolve` asks the registry (engines/cache/registry.py: oras-py's Registry with timeouts, no retries of
its own, Basic or Bearer login from `deploy.registry_credentials_file`, TLS against `deploy.ca_file`) for
the manifest by digest, checks its sha256 against the URL's digest, picks the artifact's layer (the single
one, or the one of the artifact's media type) and checks that layer's digest and size against the
document's sha256 and size before a byte of the blob is fetched. A registry that cannot be reached (down,
timeout, 5xx) is a retryable error (the download's retries apply); anything else refuses the artifact.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import requests
import urllib3

from agent.deploy.errors import DownloadError
from agent.deploy.oci_ref import DIGEST_RE, LAYER_TYPES, OciArtifactRef, parse_oci_url
from agent.deploy.transport import Fail, Target
from engines.cache.errors import CacheUnavailable

if TYPE_CHECKING:
    from engines.cache.registry import Registry

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MAX_MANIFEST = 64 * 1024
# CacheUnavailable reasons that are a network fault (retried), not a refusal (TLS, login, 403).
_TRANSIENT = ("connection", "no answer", "answered 5", "too slow")
# The registry client names the engine cache's keys; here the deploy section's apply.
_KEYS = {"engines.timeout_s": "deploy.read_timeout_s", "engines.ca_file": "deploy.ca_file"}


class Policy(Protocol):
    """What is read of agent.deploy.download.FetchPolicy (which imports this module)."""

    @property
    def allow_http(self) -> bool: ...
    @property
    def ca_file(self) -> Path | None: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def read_timeout_s(self) -> float: ...
    @property
    def registry_credentials_file(self) -> Path | None: ...


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str
    size: int


def _words(reason: str) -> str:
    for engines_key, deploy_key in _KEYS.items():
        reason = reason.replace(engines_key, deploy_key)
    return reason


class OciSource:
    def __init__(self, art: OciArtifactRef, field: str, policy: Policy) -> None:
        self.art, self.field, self.policy = art, field, policy
        self.kind = field.rpartition(".")[2]  # artifacts.onnx -> onnx: its layer's media type
        self.scheme = "http" if art.ref.uses_http(policy.ca_file) else "https"
        self.shown = f"{field} ({art.shown})"

    @classmethod
    def for_fetch(cls, url: str, field: str, policy: Policy) -> OciSource:
        """DownloadError naming `{field}.url` for a bad URL, or plain HTTP off this machine without
        deploy.allow_http (loopback is plain HTTP without a CA file, as for engines.cache)."""
        try:
            source = cls(parse_oci_url(url), field, policy)
        except ValueError as exc:
            raise DownloadError(f"download of {field}: bad URL ({exc})", f"{field}.url") from None
        if source.scheme == "http" and not source.art.ref.loopback and not policy.allow_http:
            what = "plain-HTTP registry refused (deploy.allow_http is off)"
            raise DownloadError(f"download of {source.shown}: {what}", f"{field}.url")
        return source

    def resolve(self, sha256: str, size: int, fail: Fail) -> Target:
        """The blob's GET (with the registry's login) once manifest and layer agree with the document."""
        registry = self._registry()
        try:
            layer = self._layer(self._manifest(registry, fail), fail)
            auth = registry.authorization()
        finally:
            registry.session.close()
        if layer.digest != f"sha256:{sha256}":
            raise fail(f"its layer is {layer.digest[:19]}..., not the document's sha256", part="sha256")
        if layer.size != size:
            raise fail(f"its layer has {layer.size} bytes, the document says {size}", part="size")
        ref = self.art.ref
        path = f"/v2/{ref.repository}/blobs/{layer.digest}"
        return Target(f"{self.scheme}://{ref.registry}{path}", self.scheme, ref.host, ref.port, path, auth)

    def _registry(self) -> Registry:
        from engines.cache.registry import Registry  # oras: loaded only where an oci:// artifact is

        policy, key = self.policy, "deploy.registry_credentials_file"
        try:
            return Registry(self.art.ref, credentials_file=policy.registry_credentials_file,
                            ca_file=policy.ca_file, timeout_s=policy.read_timeout_s,
                            connect_timeout_s=policy.connect_timeout_s)
        except CacheUnavailable as exc:  # the login file: its path only, never what it holds
            raise DownloadError(f"{key}: {exc.reason.removeprefix('credentials file ')}", key) from None

    def _manifest(self, registry: Registry, fail: Fail) -> bytes:
        ref, digest = self.art.ref, self.art.digest
        url = f"{registry.prefix}://{ref.registry}/v2/{ref.repository}/manifests/{digest}"
        accept = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, *INDEX_TYPES))
        try:
            r = registry.do_request(url, "GET", headers={"Accept": accept}, stream=True)
            with r:
                status = r.status_code
                body = r.raw.read(MAX_MANIFEST + 1, decode_content=True) if status == 200 else b""
        except CacheUnavailable as exc:
            reason = exc.reason
            raise fail(_words(reason), retryable=any(w in reason for w in _TRANSIENT)) from None
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            what = f"connection lost reading the manifest ({type(exc).__name__})"
            raise fail(what, retryable=True) from None
        if status == 404:
            raise fail("the registry has no manifest of this digest in this repository")
        if status != 200:
            raise fail(f"the registry answered {status} for the manifest", retryable=status in (408, 429))
        if len(body) > MAX_MANIFEST:
            raise fail(f"the manifest is larger than {MAX_MANIFEST} bytes")
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise fail("the manifest the registry sent does not match the URL's digest")
        return bytes(body)

    def _layer(self, body: bytes, fail: Fail) -> Layer:
        try:
            m: Any = json.loads(body)
        except (ValueError, RecursionError):  # too deep, or an integer of 4300+ digits, counts as not JSON
            raise fail("the manifest is not JSON") from None
        if not isinstance(m, dict):
            raise fail("the manifest is not a JSON object")
        if m.get("mediaType") in INDEX_TYPES or "manifests" in m:
            raise fail("the digest names an image index: give the digest of the manifest holding the file")
        if m.get("schemaVersion") != 2 or m.get("mediaType") not in (None, OCI_MANIFEST, DOCKER_MANIFEST):
            raise fail("not an OCI image manifest (schemaVersion 2)")
        raw: list[Any] = m["layers"] if isinstance(m.get("layers"), list) else []
        layers = [la for la in map(_descriptor, raw) if la is not None]
        if not layers or len(layers) != len(raw):
            raise fail("the manifest has no layers, or a malformed one")
        if len(layers) == 1:
            return layers[0]
        wanted = LAYER_TYPES.get(self.kind, "")
        of_kind = [la for la in layers if la.media_type == wanted]
        if len(of_kind) != 1:
            kind = f"of media type {wanted}" if wanted else "for this artifact"
            raise fail(f"the manifest has {len(layers)} layers and {len(of_kind)} {kind}: one expected")
        return of_kind[0]


def _descriptor(d: Any) -> Layer | None:
    if not isinstance(d, dict):
        return None
    media, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
    if not isinstance(media, str) or not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return None
    return Layer(media, digest, size)
