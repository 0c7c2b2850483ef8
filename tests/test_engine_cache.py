"""The shared engine cache against a real registry (docker-registry) with real TensorRT-RTX plans: a round
trip, a miss, no push over a tag, and everything a pull must refuse (tampered blob, another plan under
the signature, another device kind's manifest, unsigned, untrusted, extra layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from engine_cache_fixtures import (
    Engine,
    build_tiny,
    fits,
    layer_digest,
    push_raw,
    signed_layers,
    tiny_onnx,
)
from fixtures_registry import DockerRegistry

from engines.cache import artifact
from engines.cache.client import EngineCache
from engines.cache.errors import CacheRejected
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust
from engines.manifest import load_manifest

pytest.importorskip("tensorrt_rtx")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Engine]:
    """Two real plans of one model: for compute capability 8.6 ("a", this machine's kind: its AOT target)
    and for 8.9 ("b", another device kind)."""
    from engines.fingerprint import probe_fingerprint
    from engines.trt import import_trt

    root = tmp_path_factory.mktemp("cache-engines")
    fp = probe_fingerprint(import_trt("tensorrt_rtx"))
    onnx_path = tiny_onnx(root / "tiny.onnx")
    return {
        "a": build_tiny(root / "a", onnx_path, fp, "8.6"),
        "b": build_tiny(root / "b", onnx_path, fp, "8.9"),
    }


@pytest.fixture
def signer() -> PlanSigner:
    return PlanSigner(Ed25519PrivateKey.generate(), "dev1")


@pytest.fixture
def trust(signer: PlanSigner) -> PlanTrust:
    return PlanTrust({"dev1": signer._key.public_key()})


def _cache(reg: DockerRegistry, timeout_s: float = 5.0) -> EngineCache:
    return EngineCache(parse_cache_url(reg.url()), timeout_s=timeout_s)


def _push(cache: EngineCache, e: Engine, signer: PlanSigner, builder: str = "dev-1"):
    return cache.push(e.key, e.plan, e.manifest, e.timing_cache, signer, builder)


def test_a_pushed_engine_pulls_back_verified_byte_for_byte(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, cache = engines["a"], _cache(registry)
    assert a.timing_cache is not None and a.timing_cache.exists()
    assert load_manifest(a.manifest).recorded_key == a.key  # the builder records the tag it goes under
    pushed = _push(cache, a, signer)
    assert pushed is not None and pushed.digest.startswith("sha256:") and pushed.bytes > a.plan.stat().st_size
    dest = tmp_path / "pulled"
    dest.mkdir()
    (dest / "stale").write_text("from an earlier pull")  # dest is replaced whole
    pulled = cache.pull(a.key, dest, trust, fits(a.spec))
    assert pulled is not None
    assert pulled.plan.read_bytes() == a.plan.read_bytes()
    assert pulled.manifest.read_bytes() == a.manifest.read_bytes()
    assert pulled.timing_cache is not None and pulled.timing_cache.read_bytes() == a.timing_cache.read_bytes()
    assert (pulled.digest, pulled.builder, pulled.key_id) == (pushed.digest, "dev-1", "dev1")
    assert sorted(p.name for p in dest.iterdir()) == ["engine.plan", "manifest.json", "timing.cache"]
    assert [p.name for p in tmp_path.iterdir()] == ["pulled"]  # no temp folder left


def test_a_missing_tag_is_a_miss(registry: DockerRegistry, trust: PlanTrust, tmp_path: Path) -> None:
    assert _cache(registry).pull("0123456789abcdef", tmp_path / "d", trust) is None
    assert not (tmp_path / "d").exists()


def test_a_push_never_replaces_a_tag(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, cache = engines["a"], _cache(registry)
    first = _push(cache, a, signer, "dev-1")
    assert first is not None
    assert _push(cache, a, signer, "dev-2") is None
    pulled = cache.pull(a.key, tmp_path / "d", trust)
    assert pulled is not None and (pulled.builder, pulled.digest) == ("dev-1", first.digest)


def test_a_push_refuses_a_manifest_of_another_key(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner
) -> None:
    a, b = engines["a"], engines["b"]
    with pytest.raises(ValueError, match="records key"):
        _cache(registry).push(a.key, b.plan, b.manifest, None, signer, "dev-1")
    assert not _cache(registry).exists(a.key)


def test_a_plan_blob_tampered_in_the_registry_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, cache = engines["a"], _cache(registry)
    assert _push(cache, a, signer) is not None
    blob = registry.blob_file(layer_digest(registry, a.key, artifact.PLAN))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    blob.write_bytes(bytes(data))
    with pytest.raises(CacheRejected, match="plan blob: sha256 or size does not match"):
        cache.pull(a.key, tmp_path / "d", trust, fits(a.spec))
    assert list(tmp_path.iterdir()) == []  # nothing kept, not even the temp folder


def test_another_plan_under_the_old_signature_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, b = engines["a"], engines["b"]
    good = signed_layers(a.key, a.plan.read_bytes(), a.manifest.read_bytes(), signer)
    swapped = [(b.plan.read_bytes(), artifact.PLAN), *good[1:]]  # the signature names a's plan
    push_raw(registry, a.key, swapped, tmp_path / "raw")
    with pytest.raises(CacheRejected, match="plan layer is not the one signed"):
        _cache(registry).pull(a.key, tmp_path / "d", trust)


def test_another_device_kinds_engine_under_the_tag_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    """b (compute capability 8.9) under a's tag, signed by a trusted key for that tag: its manifest records
    b's key. Forged to record a's key, the caller's compatibility check still refuses it."""
    a, b = engines["a"], engines["b"]
    layers = signed_layers(a.key, b.plan.read_bytes(), b.manifest.read_bytes(), signer)
    push_raw(registry, a.key, layers, tmp_path / "raw1")
    with pytest.raises(CacheRejected, match=f"records key '{b.key}', not the tag {a.key}"):
        _cache(registry).pull(a.key, tmp_path / "d", trust, fits(a.spec))

    forged = json.loads(b.manifest.read_text())
    forged["build"]["key"] = a.key
    layers = signed_layers(a.key, b.plan.read_bytes(), json.dumps(forged).encode(), signer)
    push_raw(registry, a.key, layers, tmp_path / "raw2")  # over the tag: anyone with push rights can
    with pytest.raises(CacheRejected, match=r"GPU none \(8.9\) -> none \(8.6\)"):
        _cache(registry).pull(a.key, tmp_path / "d", trust, fits(a.spec))
    assert not (tmp_path / "d").exists()


def test_an_unsigned_artifact_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], trust: PlanTrust, tmp_path: Path
) -> None:
    a = engines["a"]
    unsigned = [(a.plan.read_bytes(), artifact.PLAN), (a.manifest.read_bytes(), artifact.MANIFEST)]
    push_raw(registry, a.key, unsigned, tmp_path / "raw")
    with pytest.raises(CacheRejected, match="no signature layer"):
        _cache(registry).pull(a.key, tmp_path / "d", trust)


def test_a_plain_oras_push_is_not_an_engine_artifact_and_not_replaced(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a = engines["a"]
    push_raw(registry, a.key, [(a.plan.read_bytes(), artifact.PLAN)], tmp_path / "raw",
             config="application/vnd.unknown.config.v1+json")
    with pytest.raises(CacheRejected, match="not an engine artifact"):
        _cache(registry).pull(a.key, tmp_path / "d", trust)
    assert _push(_cache(registry), a, signer) is None  # whatever holds the tag, a push never replaces it


def test_an_extra_or_unknown_layer_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a = engines["a"]
    good = signed_layers(a.key, a.plan.read_bytes(), a.manifest.read_bytes(), signer)
    push_raw(registry, a.key, [*good, (b"#!/bin/sh\n", "application/x-sh")], tmp_path / "raw")
    with pytest.raises(CacheRejected, match="unknown media type 'application/x-sh'"):
        _cache(registry).pull(a.key, tmp_path / "d", trust)
    push_raw(registry, "0000000000000000", [*good, good[0]], tmp_path / "raw2")
    with pytest.raises(CacheRejected, match="more than one plan layer"):
        _cache(registry).pull("0000000000000000", tmp_path / "d", trust)


def test_an_untrusted_key_or_a_changed_statement_is_rejected(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, cache = engines["a"], _cache(registry)
    stranger = PlanSigner(Ed25519PrivateKey.generate(), "stranger")
    assert _push(cache, a, stranger) is not None
    with pytest.raises(CacheRejected, match="signed by key 'stranger', not trusted here"):
        cache.pull(a.key, tmp_path / "d", trust)
    impostor = PlanSigner(Ed25519PrivateKey.generate(), "dev1")  # a trusted id, another key
    other = "1111111111111111"
    plan, manifest = a.plan.read_bytes(), a.manifest.read_bytes()
    layers = signed_layers(other, plan, manifest, impostor)
    push_raw(registry, other, layers, tmp_path / "raw")
    with pytest.raises(CacheRejected, match="signature does not match the statement"):
        cache.pull(other, tmp_path / "d", trust)
    # Signed by the trusted key for another tag: the statement names the key it was signed for.
    layers = signed_layers(a.key, plan, manifest, signer)
    push_raw(registry, other, layers, tmp_path / "raw2")
    with pytest.raises(CacheRejected, match=f"signed for key {a.key}, found under tag {other}"):
        cache.pull(other, tmp_path / "d", trust)
    assert not (tmp_path / "d").exists()


def test_a_failing_compatibility_check_rejects_whatever_it_raises(
    registry: DockerRegistry, engines: dict[str, Engine], signer: PlanSigner, trust: PlanTrust, tmp_path: Path
) -> None:
    a, cache = engines["a"], _cache(registry)
    assert _push(cache, a, signer) is not None

    def refuse(manifest: Path) -> None:
        assert manifest.name == "manifest.json" and manifest.exists()  # checked before the rename
        raise ValueError("TensorRT-RTX 1.7 here, 1.8 there")

    with pytest.raises(CacheRejected, match=r"does not fit this device: TensorRT-RTX 1\.7 here, 1\.8 there"):
        cache.pull(a.key, tmp_path / "d", trust, refuse)
    assert list(tmp_path.iterdir()) == []
