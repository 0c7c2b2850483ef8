"""Signatures of deployment documents (issue 37, 1): ed25519 over the canonical form, trusted keys by key
id; a document unsigned (unless allowed), signed by an unknown or another key, changed after signing, signed
over another form of its JSON, or with a malformed signature is refused with a one-line reason; key files
are made 0600 and never overwritten, and a bad key file is named, never quoted."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.config.keys import public_key_problem
from agent.deploy.document import canonical_bytes, parse_document
from agent.deploy.errors import DeployError, SignatureError
from agent.deploy.signing import (
    fingerprint,
    generate_keys,
    load_private_key,
    load_public_key,
    sign_document,
    verify_document,
)

SHA = "ab" * 32


def doc() -> dict[str, Any]:
    art = {"url": "https://store.example/det.onnx", "sha256": SHA, "size": 100}
    return {
        "model": "det",
        "version": "v2",
        "format": "nanodet",
        "artifacts": {"onnx": art, "labels": dict(art, size=7)},
        "watch_s": 60,
        "request_id": 7,
    }


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keys(tmp_path / "keys", "ops")


def refused(signed: dict[str, Any], trusted: dict[str, Any], allow_unsigned: bool = False) -> SignatureError:
    with pytest.raises(SignatureError) as info:
        verify_document(signed, trusted, allow_unsigned)
    assert "\n" not in str(info.value)
    return info.value


# ---- keys -------------------------------------------------------------------------------------------------
def test_generated_keys_are_pem_files_the_private_one_0600(keys: tuple[Path, Path]) -> None:
    private, public = keys
    assert (private.name, public.name) == ("ops.key", "ops.pub")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(private.parent).st_mode) == 0o700
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert load_private_key(private).public_key() == load_public_key(public)
    assert not [p.name for p in private.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_a_key_is_never_overwritten_unless_forced(keys: tuple[Path, Path]) -> None:
    private, public = keys
    before = private.read_bytes()
    with pytest.raises(DeployError, match="exists; a key is never overwritten"):
        generate_keys(private.parent, "ops")
    assert private.read_bytes() == before
    public.unlink()  # either file of the pair is enough to refuse
    with pytest.raises(DeployError, match=r"ops\.key: exists"):
        generate_keys(private.parent, "ops")
    generate_keys(private.parent, "ops", force=True)
    assert private.read_bytes() != before and stat.S_IMODE(os.stat(private).st_mode) == 0o600


def test_the_default_key_id_is_the_keys_fingerprint(tmp_path: Path) -> None:
    private, public = generate_keys(tmp_path)
    key_id = fingerprint(load_public_key(public))
    assert key_id.startswith("ed25519-") and len(key_id) == 24 and private.name == f"{key_id}.key"


@pytest.mark.parametrize("key_id", ["", "..", "a/b", "a b", "x" * 129])
def test_a_key_id_must_be_a_name(tmp_path: Path, key_id: str) -> None:
    with pytest.raises(DeployError, match="key id: must be a name"):
        generate_keys(tmp_path, key_id)
    assert not any(tmp_path.iterdir())


def test_bad_key_files_are_named_never_quoted(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, public = keys
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nSECRET-MARK\n-----END PUBLIC KEY-----\n")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_pub = tmp_path / "rsa.pub"
    rsa_pub.write_bytes(
        rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass"),
        )
    )
    assert public_key_problem(garbage) == "not a PEM public key"
    assert public_key_problem(private) == "not a PEM public key"  # the private key where the public belongs
    assert public_key_problem(rsa_pub) == "not an ed25519 key (RSAPublicKey)"
    assert public_key_problem(tmp_path / "none.pub") == "no such file"
    assert public_key_problem(tmp_path) == "is a directory, not a file"
    assert public_key_problem(public) is None
    with pytest.raises(SignatureError, match=r"trusted key ops .*garbage\.pem: not a PEM public key") as info:
        load_public_key(garbage, "ops")
    assert "SECRET-MARK" not in str(info.value)
    with pytest.raises(SignatureError, match=r"enc\.key: is encrypted"):
        load_private_key(encrypted)
    with pytest.raises(SignatureError, match=r"ops\.pub: not a PEM private key"):
        load_private_key(public)


# ---- signatures -------------------------------------------------------------------------------------------
def test_a_signed_document_verifies_by_its_key_id(keys: tuple[Path, Path]) -> None:
    private, public = keys
    signed = sign_document(doc(), private, "ops")
    assert signed["signature"]["key_id"] == "ops"
    assert len(base64.b64decode(signed["signature"]["ed25519"])) == 64
    assert verify_document(signed, {"ops": public}, allow_unsigned=False) == "ops"
    assert verify_document(signed, {"ops": load_public_key(public)}, allow_unsigned=False) == "ops"
    # Written and read back as any JSON file (indented, keys in another order): the same document.
    reread = json.loads(json.dumps(dict(reversed(list(signed.items()))), indent=3))
    _, raw = parse_document(json.dumps(reread).encode(), "f")
    assert verify_document(raw, {"ops": public}, allow_unsigned=False) == "ops"
    assert "signature" not in doc()  # the input is left alone


def test_signing_again_replaces_the_signature(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, _ = keys
    other_private, other_public = generate_keys(tmp_path / "other", "other")
    twice = sign_document(sign_document(doc(), private, "ops"), other_private, "other")
    assert verify_document(twice, {"other": other_public}, allow_unsigned=False) == "other"


def test_a_missing_signature_is_refused_unless_unsigned_is_allowed(keys: tuple[Path, Path]) -> None:
    _, public = keys
    exc = refused(doc(), {"ops": public})
    assert exc.field == "signature" and "not signed" in str(exc) and "allow_unsigned" in str(exc)
    refused(dict(doc(), signature=None), {"ops": public})
    assert verify_document(doc(), {"ops": public}, allow_unsigned=True) is None
    assert verify_document(doc(), {}, allow_unsigned=True) is None


def test_a_signature_present_is_checked_even_where_unsigned_is_allowed(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    _, public = keys
    stranger, _ = generate_keys(tmp_path / "s", "ops")
    signed = sign_document(doc(), stranger, "ops")
    assert refused(signed, {"ops": public}, allow_unsigned=True).field == "signature.ed25519"


def test_a_signature_by_another_key_under_a_trusted_key_id_is_refused(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    _, public = keys
    stranger, _ = generate_keys(tmp_path / "s", "ops")
    exc = refused(sign_document(doc(), stranger, "ops"), {"ops": public})
    assert exc.field == "signature.ed25519" and "does not match the document" in str(exc)


def test_an_unknown_key_id_is_refused_naming_the_trusted_ones(keys: tuple[Path, Path]) -> None:
    private, public = keys
    exc = refused(sign_document(doc(), private, "ci"), {"ops": public, "backup": public})
    assert exc.field == "signature.key_id"
    assert str(exc) == "signature.key_id: key ci is not trusted here (deploy.trusted_keys: backup, ops)"
    assert "none" in str(refused(sign_document(doc(), private, "ci"), {}))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("version",), "v3"),
        (("model",), "other"),
        (("artifacts", "onnx", "sha256"), "cd" * 32),
        (("artifacts", "onnx", "url"), "https://evil.example/det.onnx"),
        (("artifacts", "labels", "size"), 8),
        (("watch_s",), 60.0),  # another number form is another document: 60 and 60.0 differ on the wire
        (("request_id",), "7"),
        (("precision",), "fp32"),  # a key added
    ],
)
def test_a_document_changed_after_signing_is_refused(
    keys: tuple[Path, Path], path: tuple[str, ...], value: Any
) -> None:
    private, public = keys
    signed = sign_document(doc(), private, "ops")
    node = signed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert refused(signed, {"ops": public}).field == "signature.ed25519"
    removed = sign_document(doc(), private, "ops")
    removed.pop("watch_s")  # a key taken away
    assert refused(removed, {"ops": public}).field == "signature.ed25519"


def test_a_signature_over_another_form_of_the_json_is_refused(keys: tuple[Path, Path]) -> None:
    private, public = keys
    key = load_private_key(private)
    for other_form in (
        json.dumps(doc()).encode(),  # spaces, keys in the file's order
        json.dumps(doc(), sort_keys=True).encode(),
        canonical_bytes(doc()) + b"\n",
    ):
        raw = key.sign(other_form)
        signed = dict(doc(), signature={"key_id": "ops", "ed25519": base64.b64encode(raw).decode()})
        assert refused(signed, {"ops": public}).field == "signature.ed25519"


@pytest.mark.parametrize(
    ("signature", "field", "words"),
    [
        ("ops", "signature", "must be an object of key_id and ed25519"),
        ({"key_id": "ops"}, "signature", "must be an object of key_id and ed25519"),
        ({"key_id": "ops", "ed25519": "", "x": 1}, "signature", "nothing else"),
        ({"key_id": 5, "ed25519": "AA=="}, "signature.key_id", "not a key id"),
        ({"key_id": "../ops", "ed25519": "AA=="}, "signature.key_id", "not a key id"),
        ({"key_id": "ops", "ed25519": "not base64!"}, "signature.ed25519", "not base64"),
        ({"key_id": "ops", "ed25519": "é"}, "signature.ed25519", "not base64"),
        ({"key_id": "ops", "ed25519": "AAAA"}, "signature.ed25519", "3 bytes, an ed25519 signature has 64"),
        ({"key_id": "ops", "ed25519": "A" * 1000}, "signature.ed25519", "must be base64 of a 64-byte"),
        ({"key_id": "ops", "ed25519": 12}, "signature.ed25519", "must be base64 of a 64-byte"),
    ],
)
def test_a_malformed_signature_is_refused(
    keys: tuple[Path, Path], signature: Any, field: str, words: str
) -> None:
    _, public = keys
    exc = refused(dict(doc(), signature=signature), {"ops": public})
    assert exc.field == field and words in str(exc), str(exc)


def test_an_unusable_trusted_key_file_is_named(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, _ = keys
    signed = sign_document(doc(), private, "ops")
    exc = refused(signed, {"ops": tmp_path / "gone.pub"})
    assert exc.field is None and str(exc).startswith("trusted key ops ") and str(exc).endswith("no such file")
    exc = refused(signed, {"ops": private})
    assert "not a PEM public key" in str(exc)


def test_sign_refuses_a_key_id_that_is_no_name(keys: tuple[Path, Path]) -> None:
    private, _ = keys
    with pytest.raises(SignatureError, match="key id: must be a name"):
        sign_document(doc(), private, "a b")
