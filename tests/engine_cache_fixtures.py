"""Real TensorRT-RTX engines (built on the CPU in well under a second) and raw OCI pushes for the engine
cache tests: what a trusted but wrong, or an untrusted, party could put under a tag.

    a = build_tiny(tmp, "8.6")              # a plan for one device kind; build_tiny(tmp, "8.9"): another
    push_raw(reg, tag, [(bytes, media_type), ...], tmp)      # any artifact, pushed with plain oras-py
    signed_layers(key, plan, manifest, signer)               # the layers a correct push would have
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import oras.client
import requests
from fixtures_registry import DockerRegistry
from onnx import TensorProto, helper, numpy_helper

from engines.build.compat import BuildSpec, build_spec, differences
from engines.cache import artifact
from engines.cache.errors import CacheRejected
from engines.cache.signing import PlanSigner
from engines.fingerprint import Fingerprint
from engines.manifest import load_manifest
from engines.settings import BuildSettings
from engines.store import EngineStore


@dataclass(frozen=True)
class Engine:
    key: str
    plan: Path
    manifest: Path
    timing_cache: Path | None
    spec: BuildSpec


def tiny_onnx(path: Path) -> Path:
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def build_tiny(root: Path, onnx_path: Path, fp: Fingerprint, target_cc: str) -> Engine:
    """A real TensorRT-RTX plan of the tiny model, ahead of time for compute capability `target_cc`."""
    from engines.build.builder import build
    from engines.trt import import_trt

    store = EngineStore(root)
    settings = BuildSettings(onnx=onnx_path, target_compute_capability=target_cc)
    result = build(store, "tiny", settings, fingerprint=fp, api=import_trt("tensorrt_rtx"), force=True)
    assert result.manifest is not None and result.manifest.path is not None
    tc = (result.manifest.build.timing_cache or {}).get("path")
    return Engine(result.key, result.plan_path, result.manifest.path, Path(tc) if tc else None,
                  build_spec(settings, fp))


def fits(spec: BuildSpec) -> Callable[[Path], None]:
    """The compatibility check a device runs on a pulled manifest: it must describe the build `spec`."""

    def check(manifest: Path) -> None:
        reasons = differences(load_manifest(manifest), spec)
        if reasons:
            raise CacheRejected("; ".join(reasons))

    return check


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def signed_layers(
    key: str, plan: bytes, manifest: bytes, signer: PlanSigner, timing_cache: bytes | None = None,
    statement: dict[str, Any] | None = None,
) -> list[tuple[bytes, str]]:
    """The layers a correct push of these bytes would have; `statement` replaces the signed statement."""
    st = statement or artifact.statement(
        key, "dev-1", sha(plan), sha(manifest), None if timing_cache is None else sha(timing_cache)
    )
    sig = artifact.signature_document(st, signer.key_id, signer.sign(artifact.canonical(st)))
    layers = [(plan, artifact.PLAN), (manifest, artifact.MANIFEST), (sig, artifact.SIGNATURE)]
    if timing_cache is not None:
        layers.append((timing_cache, artifact.TIMING_CACHE))
    return layers


def push_raw(
    reg: DockerRegistry, tag: str, layers: list[tuple[bytes, str]], tmp: Path, config: str | None = None,
    repository: str = "site/engines",
) -> None:
    """Push `layers` under `tag` with plain oras-py (no checks of ours): what anyone with push rights can."""
    tmp.mkdir(parents=True, exist_ok=True)
    files = []
    for i, (data, media_type) in enumerate(layers):
        path = tmp / f"layer{i}"
        path.write_bytes(data)
        files.append(f"{path}:{media_type}")
    cfg = tmp / "config.json"
    cfg.write_bytes(b"{}")
    client = oras.client.OrasClient(hostname=f"127.0.0.1:{reg.port}", insecure=True)
    client.push(
        target=f"127.0.0.1:{reg.port}/{repository}:{tag}", files=files, disable_path_validation=True,
        manifest_config=f"{cfg}:{config or artifact.CONFIG}", quiet=True,
    )


def oci_manifest(reg: DockerRegistry, tag: str, repository: str = "site/engines") -> dict[str, Any]:
    r = requests.get(
        f"http://127.0.0.1:{reg.port}/v2/{repository}/manifests/{tag}",
        headers={"Accept": artifact.OCI_MANIFEST}, timeout=10,
    )
    r.raise_for_status()
    return dict(json.loads(r.content))


def layer_digest(reg: DockerRegistry, tag: str, media_type: str) -> str:
    return next(d["digest"] for d in oci_manifest(reg, tag)["layers"] if d["mediaType"] == media_type)
