"""The engine cache artifact: one OCI image manifest per compatibility key (tag = the key), with a config of
our own and exactly these layers (docs/DESIGN.md "Engine cache artifact"):

    plan          application/vnd.edge-agent.engine.plan.v1                  the TensorRT plan
    manifest      application/vnd.edge-agent.engine.manifest.v1+json         the engine manifest (its key)
    timing_cache  application/vnd.edge-agent.engine.timing-cache.v1          optional: the builder's cache
    signature     application/vnd.edge-agent.engine.signature.v1+json        the signed statement

The signature layer is `{"schema": SIGNATURE_SCHEMA, "statement": {...}, "key_id", "ed25519"}`; the
statement (schema STATEMENT_SCHEMA) names the key, the builder device and the sha256 of the plan, manifest
and timing cache (null: none), and the signature covers its canonical JSON (sorted keys, no spaces). Layer
titles and manifest annotations are informational: nothing read from them is trusted.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import json
import re
from dataclasses import dataclass
from typing import Any

from engines.cache.errors import CacheRejected
from engines.cache.ref import tag_problem
from engines.keys import key_id_problem

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.edge-agent.engine.config.v1+json"
PLAN = "application/vnd.edge-agent.engine.plan.v1"
MANIFEST = "application/vnd.edge-agent.engine.manifest.v1+json"
TIMING_CACHE = "application/vnd.edge-agent.engine.timing-cache.v1"
SIGNATURE = "application/vnd.edge-agent.engine.signature.v1+json"
ROLES = {PLAN: "plan", MANIFEST: "manifest", TIMING_CACHE: "timing_cache", SIGNATURE: "signature"}
REQUIRED = ("plan", "manifest", "signature")
STATEMENT_SCHEMA = "edge-agent/engine-statement/1"
SIGNATURE_SCHEMA = "edge-agent/engine-signature/1"
ANNOTATION_KEY = "io.edge-agent.engine.key"
ANNOTATION_BUILDER = "io.edge-agent.engine.builder"

MAX_OCI_MANIFEST = 64 * 1024
MAX_SIZE = {"manifest": 4 << 20, "signature": 16 << 10, "timing_cache": 1 << 30, "plan": 16 << 30}
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_HEX = re.compile(r"[0-9a-f]{64}")
_BUILDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


@dataclass(frozen=True)
class Layer:
    role: str  # plan | manifest | timing_cache | signature
    media_type: str
    digest: str  # sha256:HEX
    size: int

    @property
    def sha256(self) -> str:
        return self.digest.removeprefix("sha256:")


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def statement(
    key: str, builder: str, plan_sha256: str, manifest_sha256: str, timing_cache_sha256: str | None
) -> dict[str, Any]:
    if not _BUILDER.fullmatch(builder):
        raise ValueError("builder must be a device name (letters, digits, '._:@-', at most 128)")
    return {
        "schema": STATEMENT_SCHEMA,
        "key": key,
        "builder": builder,
        "plan_sha256": plan_sha256,
        "manifest_sha256": manifest_sha256,
        "timing_cache_sha256": timing_cache_sha256,
        "signed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def signature_document(st: dict[str, Any], key_id: str, signature: bytes) -> bytes:
    doc = {"schema": SIGNATURE_SCHEMA, "statement": st, "key_id": key_id,
           "ed25519": base64.b64encode(signature).decode("ascii")}
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


@dataclass(frozen=True)
class Signed:
    statement: dict[str, Any]
    key_id: str
    signature: bytes

    @property
    def statement_bytes(self) -> bytes:
        return canonical(self.statement)


def _check_statement(st: Any) -> dict[str, Any]:
    want = {"schema", "key", "builder", "plan_sha256", "manifest_sha256", "timing_cache_sha256", "signed_at"}
    if not isinstance(st, dict) or set(st) != want:
        raise CacheRejected(f"signature statement: must be an object of exactly {', '.join(sorted(want))}")
    if st["schema"] != STATEMENT_SCHEMA:
        raise CacheRejected(f"signature statement: schema is not {STATEMENT_SCHEMA}")
    if not isinstance(st["key"], str) or tag_problem(st["key"]) is not None:
        raise CacheRejected("signature statement: key is not a tag")
    if not isinstance(st["builder"], str) or not _BUILDER.fullmatch(st["builder"]):
        raise CacheRejected("signature statement: builder is not a device name")
    if not isinstance(st["signed_at"], str) or len(st["signed_at"]) > 64:
        raise CacheRejected("signature statement: signed_at is not a time")
    for name in ("plan_sha256", "manifest_sha256", "timing_cache_sha256"):
        value = st[name]
        if not (value is None and name == "timing_cache_sha256") and not (
            isinstance(value, str) and _HEX.fullmatch(value)
        ):
            raise CacheRejected(f"signature statement: {name} is not a sha256")
    return st


def parse_signature(data: bytes) -> Signed:
    """The signature layer's statement, key id and signature bytes; CacheRejected when malformed."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not UTF-8 or JSON, too deep, an integer of 4300+ digits
        raise CacheRejected("signature layer: not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"schema", "statement", "key_id", "ed25519"}:
        raise CacheRejected("signature layer: must be an object of schema, statement, key_id, ed25519")
    if doc["schema"] != SIGNATURE_SCHEMA:
        raise CacheRejected(f"signature layer: schema is not {SIGNATURE_SCHEMA}")
    key_id = doc["key_id"]
    if not isinstance(key_id, str) or key_id_problem(key_id) is not None:
        raise CacheRejected("signature layer: key_id is not a key id")
    try:
        raw = base64.b64decode(str(doc["ed25519"]).encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise CacheRejected("signature layer: ed25519 is not base64") from None
    return Signed(_check_statement(doc["statement"]), key_id, raw)


def _layer(i: int, d: Any) -> Layer:
    if not isinstance(d, dict):
        raise CacheRejected(f"OCI manifest: layer {i} is not an object")
    media_type, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
    role = ROLES.get(media_type) if isinstance(media_type, str) else None
    if role is None:
        raise CacheRejected(f"OCI manifest: layer {i} has an unknown media type {str(media_type)[:100]!r}")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise CacheRejected(f"OCI manifest: layer {i} ({role}) has no sha256 digest")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE[role]:
        raise CacheRejected(f"OCI manifest: layer {i} ({role}) has a bad size (at most {MAX_SIZE[role]})")
    return Layer(role, str(media_type), digest, size)


def parse_oci_manifest(data: bytes) -> dict[str, Layer]:
    """The layers of an engine artifact by role; CacheRejected for anything else (another config type,
    a missing, extra, repeated or unknown layer)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not UTF-8 or JSON, too deep, an integer of 4300+ digits
        raise CacheRejected("OCI manifest: not JSON") from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise CacheRejected("OCI manifest: not an image manifest of schemaVersion 2")
    if doc.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST:
        kind = str(doc.get("mediaType"))[:100]
        raise CacheRejected(f"OCI manifest: media type {kind!r}, not {OCI_MANIFEST}")
    config = doc.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != CONFIG:
        raise CacheRejected(f"OCI manifest: not an engine artifact (config media type is not {CONFIG})")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise CacheRejected("OCI manifest: no layers")
    found: dict[str, Layer] = {}
    for i, d in enumerate(layers):
        layer = _layer(i, d)
        if layer.role in found:
            raise CacheRejected(f"OCI manifest: more than one {layer.role} layer")
        found[layer.role] = layer
    missing = [r for r in REQUIRED if r not in found]
    if missing:
        raise CacheRejected(f"OCI manifest: no {', '.join(missing)} layer")
    return found
