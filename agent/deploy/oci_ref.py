"""`oci://` artifact URLs of a deployment document: one manifest of an OCI registry, named by its digest.

    oci://registry.local:5000/site/models@sha256:<64 hex>[?plain-http=true|false]

By digest only: a tag can be moved to other content after the document was signed, a digest cannot (the
document's sha256 still checks the bytes; the digest makes the URL itself mean one thing). The registry
part follows `engines.cache` URLs (engines/cache/ref.py: host, port, repository, plain-http rules, no
credentials in the URL). The artifact is the manifest's single layer, or, in a manifest of several (one
push holding the ONNX and its labels), its one layer of the media type LAYER_TYPES names for the artifact.
Pure parsing: no network here (agent/deploy/oci_source.py fetches).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engines.cache.ref import CacheRef, parse_cache_url

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
# The media type that picks an artifact's layer out of a manifest of several layers.
LAYER_TYPES = {
    "onnx": "application/vnd.edge-agent.model.onnx.v1",
    "labels": "application/vnd.edge-agent.model.labels.v1",
    "calibration": "application/vnd.edge-agent.model.calibration.v1",
}
BY_DIGEST = "must name the manifest by digest: oci://host:port/repository@sha256:<64 hex>"


@dataclass(frozen=True)
class OciArtifactRef:
    ref: CacheRef  # registry, repository, plain-http choice
    digest: str  # sha256:<64 hex> of the OCI manifest

    @property
    def shown(self) -> str:
        """As reasons show it: no `@` (a URL masker would take `host:port/repo@` for a password)."""
        return f"{self.ref} manifest {self.digest[:19]}"


def is_oci(url: str) -> bool:
    return url.startswith("oci://")


def parse_oci_url(url: str) -> OciArtifactRef:
    """The registry, repository and manifest digest of an `oci://` artifact URL; ValueError saying what is
    wrong (never quoting the URL: it is a field of a document)."""
    if not is_oci(url):
        raise ValueError("must be an oci:// URL")
    rest, _, query = url[len("oci://") :].partition("?")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc and DIGEST_RE.fullmatch(netloc.rpartition("@")[2]):
        raise ValueError(f"names no repository ({BY_DIGEST})")
    if "@" in netloc:
        raise ValueError("credentials do not belong in the URL: use deploy.registry_credentials_file")
    if not slash or not path:
        raise ValueError(f"names no repository ({BY_DIGEST})")
    repository, at, digest = path.rpartition("@")
    if not at:
        last = path.rsplit("/", 1)[-1]
        if ":" in last:
            raise ValueError(f"names a tag, which can be moved to other content after signing: {BY_DIGEST}")
        raise ValueError(f"names no manifest digest ({BY_DIGEST})")
    if not DIGEST_RE.fullmatch(digest):
        raise ValueError(BY_DIGEST)
    if ":" in repository.rsplit("/", 1)[-1]:
        raise ValueError(f"names a tag and a digest: give the digest only ({BY_DIGEST})")
    ref = parse_cache_url(f"oci://{netloc}/{repository}" + (f"?{query}" if query else ""))
    return OciArtifactRef(ref, digest)
