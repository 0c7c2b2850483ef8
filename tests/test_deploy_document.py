"""The deployment document (issue 37, 1): every field bounded and typed; a document fuzzed field by field
(wrong types, sizes, unknown keys, 1 MB strings, NaN/infinity, nesting, negative sizes, bad sha256) is
refused with an error naming the field that never quotes what the field held; the canonical form and the
digest do not depend on key order or spacing."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from agent.deploy.document import (
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    DeploymentDoc,
    canonical_bytes,
    document_digest,
    parse_document,
)
from agent.deploy.errors import DeployError

SHA = "0123456789abcdef" * 4
MARK = "SECRET-MARK"  # in every bad string: a reason must never hold it
MEGA = MARK * (1_000_000 // len(MARK))


def base() -> dict[str, Any]:
    return {
        "model": "det",
        "version": "2024-06-01.2",
        "format": "nanodet",
        "artifacts": {
            "onnx": {"url": "https://store.example/m/det.onnx", "sha256": SHA, "size": 4_194_304},
            "labels": {"url": "https://store.example/m/labels.txt", "sha256": SHA, "size": 620},
            "calibration": {"url": "https://store.example/m/calib.tar", "sha256": SHA, "size": 10},
        },
        "precision": "int8",
        "gate": {"min_agreement": 0.5, "frames": 50},
        "shadow": {"frames": 100, "max_latency_ratio": 2.0},
        "watch_s": 300,
        "request_id": "r-1",
        "signature": {"key_id": "ops", "ed25519": "A" * 86 + "=="},
    }


def leaves(doc: dict[str, Any], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in doc.items():
        path = (*at, key)
        out += leaves(value, path) if isinstance(value, dict) else [path]
    return out


def objects(doc: dict[str, Any], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [at]
    for key, value in doc.items():
        if isinstance(value, dict):
            out += objects(value, (*at, key))
    return out


def put(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def refused(doc: Any, as_bytes: bool = True) -> DeployError:
    raw = json.dumps(doc).encode() if as_bytes else doc
    with pytest.raises(DeployError) as info:
        parse_document(raw, "deploy.json")
    exc = info.value
    assert MARK not in str(exc) and "\n" not in str(exc) and len(str(exc)) <= 500, str(exc)
    assert str(exc).startswith("deploy.json: ")
    return exc


def test_a_full_document_and_a_minimal_one_parse() -> None:
    doc, raw = parse_document(json.dumps(base()).encode(), "deploy.json")
    assert isinstance(doc, DeploymentDoc) and doc.precision == "int8" and doc.gate.frames == 50
    assert doc.artifacts.calibration is not None and doc.signature is not None
    assert raw == base()
    minimal = {k: v for k, v in base().items() if k in ("model", "version", "format", "artifacts")}
    doc, _ = parse_document(minimal, "cmd/deploy")
    assert doc.precision is None and doc.gate.min_agreement is None and doc.signature is None


# Nothing of these fits any leaf of the document (it has no boolean, list or object leaf; no string or number
# of a million characters; no NaN).
WRONG_EVERYWHERE = {
    "true": True,
    "list": [MARK],
    "object": {"x": MARK},
    "1 MB string": MEGA,
    "NaN": math.nan,
    "infinity": math.inf,
    "-infinity": -math.inf,
}


@pytest.mark.parametrize("path", leaves(base()), ids=".".join)
@pytest.mark.parametrize("kind", list(WRONG_EVERYWHERE))
def test_every_field_refuses_what_no_field_takes_naming_the_field(path: tuple[str, ...], kind: str) -> None:
    exc = refused(put(base(), path, WRONG_EVERYWHERE[kind]))
    assert exc.field == ".".join(path)
    assert f"deploy.json: {'.'.join(path)}: " in str(exc)


@pytest.mark.parametrize("path", leaves(base()), ids=".".join)
def test_every_field_refuses_a_negative_number_or_the_wrong_type(path: tuple[str, ...]) -> None:
    value = base()
    for key in path:
        value = value[key]
    wrong = -1 if isinstance(value, str) else MARK  # a string field gets a number and the other way round
    if path == ("request_id",):
        wrong = [MARK]
    exc = refused(put(base(), path, wrong))
    assert exc.field == ".".join(path)


@pytest.mark.parametrize("at", objects(base()), ids=lambda p: ".".join(p) or "top")
def test_every_object_refuses_an_unknown_key(at: tuple[str, ...]) -> None:
    doc = base()
    node = doc
    for key in at:
        node = node[key]
    node["unexpected"] = MARK
    exc = refused(doc)
    assert exc.field == ".".join((*at, "unexpected")) and str(exc).endswith("unknown key")
    node.pop("unexpected")
    node[MEGA] = 1  # a 1 MB key is named by its length only
    exc = refused(doc)
    assert "<a key of 999999 characters>" in str(exc)


@pytest.mark.parametrize("at", objects(base()), ids=lambda p: ".".join(p) or "top")
def test_every_object_needs_its_required_keys(at: tuple[str, ...]) -> None:
    required = {
        (): ["model", "version", "format", "artifacts"],
        ("artifacts",): ["onnx", "labels"],
        ("artifacts", "onnx"): ["url", "sha256", "size"],
        ("artifacts", "labels"): ["url", "sha256", "size"],
        ("artifacts", "calibration"): ["url", "sha256", "size"],
        ("signature",): ["key_id", "ed25519"],
    }.get(at, [])
    for key in required:
        doc = base()
        node = doc
        for part in at:
            node = node[part]
        node.pop(key)
        exc = refused(doc)
        assert exc.field == ".".join((*at, key)) and "required key is missing" in str(exc)


CASES = [
    # (path, value, words of the reason)
    (("model",), "", "must be a name"),
    (("model",), "..", "must be a name"),
    (("version",), ".hidden", "must be a name"),
    (("version",), f"a/{MARK}", "must be a name"),
    (("version",), f"a {MARK}", "must be a name"),
    (("version",), "é", "must be a name"),
    (("version",), "v" * 129, "at most 128 characters"),
    (("format",), f"{MARK}", "must be one of"),
    (("precision",), "int4", "must be one of 'fp32', 'fp16', 'int8' or 'best'"),
    (("artifacts", "onnx", "sha256"), SHA.upper(), "64 lowercase hexadecimal digits"),
    (("artifacts", "onnx", "sha256"), SHA[:-1], "64 lowercase hexadecimal digits"),
    (("artifacts", "onnx", "sha256"), SHA + "0", "at most 64 characters"),
    (("artifacts", "labels", "sha256"), "g" * 64, "64 lowercase hexadecimal digits"),
    (("artifacts", "onnx", "size"), 0, "must be > 0"),
    (("artifacts", "onnx", "size"), -4096, "must be > 0"),
    (("artifacts", "onnx", "size"), 2**40 + 1, "must be <= 1099511627776"),
    (("artifacts", "onnx", "size"), 4096.0, "must be an integer, not a number with a fraction"),
    (("artifacts", "onnx", "size"), "4096", "must be an integer, not a string of 4 characters"),
    (("artifacts", "onnx", "url"), f"ftp://u:{MARK}@store.example/x", "must be an https:// URL"),
    (("artifacts", "onnx", "url"), f"https://u:{MARK}@store.example:99999/x", "not a valid URL"),
    (("artifacts", "onnx", "url"), f"https://store.example/{MARK} x", "printable ASCII without spaces"),
    (("artifacts", "onnx", "url"), f"https:///{MARK}", "must name a host"),
    (("artifacts", "onnx", "url"), "https://store.example/" + "a" * 4096, "at most 4096 characters"),
    (("gate", "min_agreement"), 1.5, "must be <= 1.0"),
    (("gate", "min_agreement"), -0.1, "must be >= 0.0"),
    (("gate", "frames"), 0, "must be >= 1"),
    (("gate", "frames"), 10**9, "must be <= 10000"),
    (("shadow", "max_latency_ratio"), 0.5, "must be >= 1.0"),
    (("shadow", "frames"), 2.5, "must be an integer"),
    (("watch_s",), -1, "must be >= 0.0"),
    (("watch_s",), 86_401, "must be <= 86400.0"),
    (("request_id",), 2**60, "an integer within +-2^53"),
    (("request_id",), "r" * 129, "at most 128 characters"),
    (("request_id",), 1.5, "a string"),
    (("signature", "key_id"), "../etc", "must be a name"),
    (("signature", "ed25519"), "A" * 129, "at most 128 characters"),
    (("signature", "ed25519"), "", "must not be empty"),
    (("artifacts",), [], "must be an object, not an array"),
    (("artifacts", "onnx"), None, "must be an object, not null"),
    (("gate",), MARK, "must be an object, not a string of 11 characters"),
]


@pytest.mark.parametrize(("path", "value", "words"), CASES, ids=lambda v: str(v)[:40])
def test_each_bound_is_refused_with_its_own_reason(path: tuple[str, ...], value: Any, words: str) -> None:
    for as_bytes in (True, False):  # a file or an MQTT payload, and a mapping already decoded
        exc = refused(put(base(), path, value), as_bytes)
        assert exc.field == ".".join(path), str(exc)
        assert words in str(exc), str(exc)


def test_http_urls_and_credentials_in_urls_are_the_downloaders_business() -> None:
    # The document takes both; deploy.allow_http and the credential masking apply when fetching.
    doc = put(base(), ("artifacts", "labels", "url"), f"http://u:{MARK}@store.example/l.txt?token=x")
    parsed, _ = parse_document(doc, "cmd/deploy")
    assert parsed.artifacts.labels.url.startswith("http://")


def test_numbers_beyond_json_and_python_are_named_by_field() -> None:
    text = json.dumps(base()).replace('"size": 620', '"size": 1' + "0" * 5000)
    exc = refused(text.encode(), as_bytes=False)
    assert exc.field == "artifacts.labels.size" and "an integer of 5001 digits" in str(exc)
    text = json.dumps(base()).replace('"watch_s": 300', '"watch_s": 1e400')  # float('inf')
    exc = refused(text.encode(), as_bytes=False)
    assert exc.field == "watch_s" and "finite number" in str(exc)
    text = json.dumps(base()).replace('"watch_s": 300', '"watch_s": NaN')
    assert refused(text.encode(), as_bytes=False).field == "watch_s"


def test_nesting_is_refused_naming_where_it_goes_too_deep() -> None:
    deep: Any = MARK
    for _ in range(MAX_DEPTH + 2):
        deep = {"d": deep}
    exc = refused(put(base(), ("gate", "frames"), deep))
    assert exc.field is not None and exc.field.startswith("gate.frames.d") and "nested deeper" in str(exc)
    # Nesting too deep for Python's own parser (a 100 000-level array) is still one line, not a traceback.
    exc = refused(b"[" * 100_000, as_bytes=False)
    assert "nested deeper" in str(exc)


def test_what_is_not_a_json_object_is_refused_in_one_line() -> None:
    assert "must be a JSON object" in str(refused(b"[1, 2]", as_bytes=False))
    assert "not UTF-8" in str(refused(b'{"model": "\xff"}', as_bytes=False))
    assert "not valid JSON (line 1, column" in str(refused(b'{"model": ', as_bytes=False))
    too_big = b'{"model": "' + b"m" * MAX_DOCUMENT_BYTES + b'"}'
    assert f"larger than {MAX_DOCUMENT_BYTES} bytes" in str(refused(too_big, as_bytes=False))


def test_a_key_given_twice_is_refused() -> None:
    # Two readers could take different ones: a signature must cover exactly one meaning.
    text = json.dumps(base())[:-1] + ', "version": "other"}'
    exc = refused(text.encode(), as_bytes=False)
    assert exc.field == "version" and "key given twice" in str(exc)


def test_several_problems_are_counted_by_field_and_the_first_named() -> None:
    doc = put(put(base(), ("model",), 5), ("watch_s",), -1)
    exc = refused(doc)
    assert exc.field == "model" and str(exc).endswith("(and 1 more field)")
    exc = refused(put(put(base(), ("model",), 5), ("version",), 5) | {"watch_s": -1})
    assert str(exc).endswith("(and 2 more fields)")


def test_text_without_a_utf8_form_is_refused() -> None:
    exc = refused(put(base(), ("request_id",), "\ud800"), as_bytes=False)  # a lone surrogate
    assert exc.field == "request_id"


# ---- canonical form and digest ----------------------------------------------------------------------------
def test_the_canonical_form_is_sorted_compact_utf8_and_leaves_the_signature_out() -> None:
    signature = {"key_id": "k", "ed25519": "x"}
    doc = {"version": "é", "model": "m", "signature": signature, "gate": {"b": 1, "a": 2}}
    assert canonical_bytes(doc) == '{"gate":{"a":2,"b":1},"model":"m","version":"é"}'.encode()


def test_the_digest_depends_on_every_value_not_on_order_spacing_or_signature() -> None:
    doc = base()
    digest = document_digest(doc)
    reordered = json.loads(json.dumps(dict(reversed(list(doc.items()))), indent=4))
    assert document_digest(reordered) == digest
    assert document_digest({k: v for k, v in doc.items() if k != "signature"}) == digest
    for path in leaves(base()):
        if path[0] != "signature":
            assert document_digest(put(doc, path, "changed")) != digest, path


def test_a_mapping_that_json_cannot_carry_has_no_canonical_form() -> None:
    with pytest.raises(DeployError, match="no canonical JSON form"):
        canonical_bytes({"model": math.nan})
    with pytest.raises(DeployError, match="no canonical JSON form"):
        canonical_bytes({"model": b"bytes"})
