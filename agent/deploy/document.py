"""The deployment document: what to deploy (a model of the config, a new version of it, its artifacts by
URL + sha256 + size) and how to judge it (gate, shadow, watch), signed over its canonical JSON.

    {"model": "det", "version": "2024-06-01", "format": "nanodet",
     "artifacts": {"onnx": {"url": "https://...", "sha256": "<64 hex>", "size": 4194304},
                   "labels": {...}, "calibration": {...}?},
     "precision": "fp16"?, "gate": {"min_agreement": 0.5, "frames": 50}?, "shadow": {...}?, "watch_s": 300?,
     "request_id": "..."?, "signature": {"key_id": "ops", "ed25519": "<base64 of 64 bytes>"}?}

Everything is bounded and strict: names, URL length, sha256 form, sizes, setting ranges; no unknown key, no
duplicate key, no NaN or infinity, no nesting deeper than the document's own. An error names the field and
never quotes what it holds (a URL may carry credentials, a 1 MB string must not become a 1 MB reason).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from agent.deploy.errors import DeployError
from agent.deploy.oci_ref import is_oci, parse_oci_url
from engines.precision import Precision
from pipelines.models.registry import formats

MAX_DOCUMENT_BYTES = 4 << 20  # larger than any field's bound: an oversized field is named by its own rule
MAX_DEPTH = 8  # nesting of objects/arrays (the document itself nests 3 deep: artifacts.onnx.url)
MAX_URL = 4096  # characters; artifact stores sign URLs with long query strings
MAX_SIZE = 1 << 40  # bytes of one artifact (1 TiB); deploy.max_artifact_mb is the device's own cap
MAX_SIGNATURE_TEXT = 128  # base64 of a 64-byte ed25519 signature is 88 characters

# A model, version or key id becomes a path component and a topic level: letters, digits, '.', '_', '-',
# starting with a letter or digit (so never '.', '..' or a dot-name of the version store).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "must be a name: letters, digits, '.', '_', '-', starting with a letter or digit"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(NAME_RULE)
    return v


def _sha256(v: str) -> str:
    if not _SHA256_RE.fullmatch(v):
        raise ValueError("must be a sha256: 64 lowercase hexadecimal digits")
    return v


def _url(v: str) -> str:
    # Never quoted back: a URL may hold credentials (user:password@, ?token=).
    if any(not (32 < ord(c) < 127) for c in v):
        raise ValueError("must be a URL of printable ASCII without spaces (percent-encode the rest)")
    if is_oci(v):
        parse_oci_url(v)  # a manifest of a registry, by digest (agent/deploy/oci_ref.py)
        return v
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018  (raises on a port that is no number or out of range)
    except ValueError:
        raise ValueError("is not a valid URL (host or port)") from None
    if parts.scheme.lower() not in ("https", "http"):
        raise ValueError(
            "must be an https:// URL (http:// only where the device's deploy.allow_http is on) or "
            "oci://host:port/repository@sha256:<64 hex>"
        )
    if not parts.hostname:
        raise ValueError("must name a host")
    return v


def _text(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return v


Name = Annotated[str, StringConstraints(max_length=128), AfterValidator(_name)]
Sha256 = Annotated[str, StringConstraints(max_length=64), AfterValidator(_sha256)]
Url = Annotated[str, StringConstraints(max_length=MAX_URL), AfterValidator(_url)]
# As the MQTT commands take it (agent.mqtt.commands.RequestId): echoed in the state and the result.
RequestId = Annotated[str, StringConstraints(max_length=128), AfterValidator(_text)] | Annotated[
    int, Field(ge=-(2**53), le=2**53)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Artifact(_Strict):
    url: Url
    sha256: Sha256
    size: int = Field(gt=0, le=MAX_SIZE)


class Artifacts(_Strict):
    onnx: Artifact
    labels: Artifact
    calibration: Artifact | None = None  # an archive of calibration images for an int8 build


class GateSettings(_Strict):
    """Overrides of the device's deploy.gate for this document (None: the device's)."""

    min_agreement: float | None = Field(None, ge=0.0, le=1.0)
    frames: int | None = Field(None, ge=1, le=10_000)


class ShadowSettings(_Strict):
    """Overrides of the device's deploy.shadow for this document (None: the device's)."""

    frames: int | None = Field(None, ge=1, le=100_000)
    max_latency_ratio: float | None = Field(None, ge=1.0, le=100.0)


class Signature(_Strict):
    key_id: Name
    ed25519: str = Field(min_length=1, max_length=MAX_SIGNATURE_TEXT)  # base64, checked by signing


class DeploymentDoc(_Strict):
    model: Name  # a model of the device's config
    version: Name
    format: Literal[formats()]  # type: ignore[valid-type]  (pipelines.models.registry's names)
    artifacts: Artifacts
    precision: Precision | None = None  # None: the config's models.M.precision
    gate: GateSettings = GateSettings()
    shadow: ShadowSettings = ShadowSettings()
    watch_s: float | None = Field(None, ge=0.0, le=86_400.0)  # 0: promoted without a watch period
    request_id: RequestId | None = None
    signature: Signature | None = None


# ---- the canonical form -----------------------------------------------------------------------------------
def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """What a signature covers: the document without `signature` as JSON with sorted keys, no spaces,
    UTF-8 (not \\u-escaped), NaN and infinity refused."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise DeployError(f"document has no canonical JSON form ({type(exc).__name__})") from None


def document_digest(doc: Mapping[str, Any]) -> str:
    """The id of a document: sha256 (hex) of its canonical form; the same signed or not."""
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()


# ---- parsing ----------------------------------------------------------------------------------------------
def parse_document(raw: bytes | Mapping[str, Any], where: str) -> tuple[DeploymentDoc, dict[str, Any]]:
    """The document from JSON bytes (a file, an MQTT payload) or a decoded mapping, and the raw dict its
    signature is checked over. DeployError naming `where` (a file, `cmd/deploy`) and the field."""
    prefix = f"{where}: " if where else ""
    data = _decode(raw, prefix) if isinstance(raw, (bytes, bytearray)) else raw
    if not isinstance(data, Mapping):
        raise DeployError(f"{prefix}a deployment document must be a JSON object")
    too_deep = _too_deep(data, MAX_DEPTH)
    if too_deep is not None:
        raise DeployError(f"{prefix}{too_deep}: nested deeper than {MAX_DEPTH} levels", too_deep)
    try:
        doc = DeploymentDoc.model_validate(dict(data))
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=True, include_context=True)
        field, message = _explain(errors[0])
        others = len({_explain(e)[0] for e in errors} - {field})
        more = f" (and {others} more field{'s' if others > 1 else ''})" if others else ""
        raise DeployError(f"{prefix}{field}: {message}{more}", field) from None
    body = copy.deepcopy(dict(data))
    canonical_bytes(body)  # a mapping given by a caller may hold what JSON cannot
    return doc, body


def _decode(raw: bytes | bytearray, prefix: str) -> Any:
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise DeployError(f"{prefix}document larger than {MAX_DOCUMENT_BYTES} bytes")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DeployError(f"{prefix}document is not UTF-8 (byte {exc.start})") from None
    try:
        # NaN and Infinity are read (as Python's json does) so that the schema refuses them by field.
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_int)
    except RecursionError:
        raise DeployError(f"{prefix}document nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        where_bad = f"line {exc.lineno}, column {exc.colno}"
        raise DeployError(f"{prefix}not valid JSON ({where_bad}: {exc.msg})") from None
    except _DuplicateKey as exc:
        twice = f"{prefix}{exc.key}: key given twice (a signature covers one meaning)"
        raise DeployError(twice, exc.key) from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(_key(key))
        out[key] = value
    return out


class HugeInteger:
    """An integer of more digits than any field takes, kept as its length: Python refuses to convert
    more than 4300 digits, and the schema names the field that holds it."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _int(text: str) -> int | HugeInteger:
    return int(text) if len(text) <= 32 else HugeInteger(len(text.lstrip("-")))


def _too_deep(obj: Any, limit: int) -> str | None:
    """The path of the first container nested deeper than `limit`, or None (iterative: no recursion)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(obj, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, (Mapping, list, tuple)):
            if len(path) >= limit:
                return ".".join(path[:limit]) or "document"
            items = node.items() if isinstance(node, Mapping) else enumerate(node)
            stack.extend((v, (*path, _key(k))) for k, v in items)
    return None


def _key(key: Any) -> str:
    """A key as an error may show it: a name as it is, anything else only by its length."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if isinstance(key, str) and len(key) <= 64 and re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        return key
    return f"<a key of {len(key)} characters>" if isinstance(key, str) else "<a key that is no string>"


# ---- errors as one line naming the field ------------------------------------------------------------------
def _kind(v: Any) -> str:
    """What a wrong value is, never the value itself."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number with a fraction" if math.isfinite(v) else "NaN or infinity"
    if isinstance(v, HugeInteger):
        return f"an integer of {v.digits} digits"
    if isinstance(v, str):
        return f"a string of {len(v)} characters"
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, (list, tuple)):
        return "an array"
    return type(v).__name__


_TYPES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
}


def _explain(err: Any) -> tuple[str, str]:
    """(field, message) of one pydantic error; the input is looked at for its kind only."""
    loc = tuple(err["loc"])
    field = ".".join(_key(p) for p in loc) or "document"
    kind, ctx = err["type"], err.get("ctx") or {}
    if loc[:1] == ("request_id",):  # a union: pydantic tells each branch's failure (str, int) apart
        return "request_id", "must be a string (at most 128 characters) or an integer within +-2^53"
    if isinstance(err.get("input"), HugeInteger):
        return field, f"out of range: an integer of {err['input'].digits} digits"
    if kind in _TYPES:
        return field, f"must be {_TYPES[kind]}, not {_kind(err.get('input'))}"
    messages = {
        "extra_forbidden": "unknown key",
        "missing": "required key is missing",
        "finite_number": "must be a finite number, not NaN or infinity",
        "string_too_long": f"too long: at most {ctx.get('max_length')} characters",
        "string_too_short": "must not be empty",
        "greater_than": f"must be > {ctx.get('gt')}",
        "greater_than_equal": f"must be >= {ctx.get('ge')}",
        "less_than": f"must be < {ctx.get('lt')}",
        "less_than_equal": f"must be <= {ctx.get('le')}",
        "literal_error": f"must be one of {ctx.get('expected')}",
        "value_error": str(err.get("msg", "")).removeprefix("Value error, "),  # our own validators' words
    }
    return field, messages.get(kind, f"is not valid ({kind})")
