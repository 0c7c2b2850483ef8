"""Model files pushed to a real registry (tests/fixtures_registry.py) as deployments take them: one OCI
manifest per push, addressed by digest (`oci://127.0.0.1:PORT/models@sha256:...`), as `oras push` does it.

    pushed = push_files(reg, "models", [(onnx, ONNX_TYPE), (labels, LABELS_TYPE)], tag="v2")
    pushed.url()                    # oci://127.0.0.1:PORT/models@sha256:<manifest digest>
    pushed.artifact(onnx)           # {url, sha256, size} of one file, for a deployment document
    reg.blob_file(pushed.blobs[onnx])   # where the registry keeps that file's bytes (to tamper with)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixtures_registry import DockerRegistry

from agent.deploy.oci_ref import LAYER_TYPES
from engines.cache.ref import parse_cache_url
from engines.cache.registry import Registry

ONNX_TYPE, LABELS_TYPE = LAYER_TYPES["onnx"], LAYER_TYPES["labels"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Pushed:
    registry: DockerRegistry
    repository: str
    digest: str  # the manifest's
    blobs: dict[Path, str]  # file -> its layer's digest

    def url(self, digest: str | None = None, query: str = "") -> str:
        return f"oci://127.0.0.1:{self.registry.port}/{self.repository}@{digest or self.digest}{query}"

    def artifact(self, path: Path, **url: Any) -> dict[str, Any]:
        return {"url": self.url(**url), "sha256": sha256(path), "size": path.stat().st_size}


def push_files(
    reg: DockerRegistry, repository: str, files: list[tuple[Path, str]], tag: str = "latest",
    credentials_file: Path | None = None,
) -> Pushed:
    """`files` (path, media type) as the layers of one manifest under `tag`, pushed with oras-py."""
    ref = parse_cache_url(reg.url(repository))
    client = Registry(ref, credentials_file=credentials_file, ca_file=None, timeout_s=10)
    r = client.push(target=ref.target(tag), files=[f"{p}:{t}" for p, t in files],
                    disable_path_validation=True, quiet=True)
    digest = r.headers["Docker-Content-Digest"]
    return Pushed(reg, repository, digest, {p: f"sha256:{sha256(p)}" for p, _ in files})
