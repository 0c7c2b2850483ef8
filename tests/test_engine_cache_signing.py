"""Plan signing (engines.cache.signing, engines.cache.artifact): keys from PEM files with errors naming the
path and never the content, and a signature that holds only for its statement, key and signer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.deploy.signing import generate_keys, sign_document
from engines.cache import artifact
from engines.cache.errors import CacheRejected
from engines.cache.signing import PlanSigner, PlanTrust

SHA = "ab" * 32


def _statement(key: str = "f9b53c0f3af83491") -> dict:
    return artifact.statement(key, "orin-01", SHA, SHA, None)


def test_keys_from_files_sign_and_verify(tmp_path: Path) -> None:
    private, public = generate_keys(tmp_path, "orin-01")  # `edge-agent keys generate` makes these
    signer = PlanSigner.from_file(private, "orin-01")
    trust = PlanTrust.from_files({"orin-01": public})
    st = artifact.canonical(_statement())
    trust.verify("orin-01", st, signer.sign(st))
    assert repr(signer) == "PlanSigner(key_id='orin-01')" and trust.key_ids == ["orin-01"]


def test_bad_key_files_name_the_path_and_key_id_never_the_content(tmp_path: Path) -> None:
    private, public = generate_keys(tmp_path, "orin-01")
    with pytest.raises(ValueError, match=f"private key {public}: not a PEM private key"):
        PlanSigner.from_file(public, "orin-01")
    with pytest.raises(ValueError, match=f"trusted key fleet {private}: not a PEM public key") as e:
        PlanTrust.from_files({"fleet": private})
    assert "PRIVATE KEY" not in str(e.value)
    with pytest.raises(ValueError, match=f"trusted key fleet {tmp_path / 'nope.pub'}: no such file"):
        PlanTrust.from_files({"fleet": tmp_path / "nope.pub"})
    with pytest.raises(ValueError, match="key id: must be a name"):
        PlanSigner(Ed25519PrivateKey.generate(), "a/b")


def test_a_signature_holds_only_for_its_statement_and_key() -> None:
    signer = PlanSigner(Ed25519PrivateKey.generate(), "orin-01")
    trust = PlanTrust({"orin-01": signer._key.public_key()})
    st = artifact.canonical(_statement())
    sig = signer.sign(st)
    with pytest.raises(CacheRejected, match="does not match the statement"):
        trust.verify("orin-01", artifact.canonical(_statement("0000000000000000")), sig)
    with pytest.raises(CacheRejected, match="signature of 63 bytes"):
        trust.verify("orin-01", st, sig[:-1])
    with pytest.raises(CacheRejected, match=r"signed by key 'fleet', not trusted here \(trusted: orin-01\)"):
        trust.verify("fleet", st, sig)


def test_a_signed_deployment_document_does_not_pass_for_a_plan_statement() -> None:
    """Both are ed25519 over canonical JSON with the same keys: the statement's own schema keeps them
    apart (a device's deployment signature can never vouch for a plan)."""
    private = Ed25519PrivateKey.generate()
    doc = sign_document({"schema": artifact.STATEMENT_SCHEMA, "key": "x"}, private, "ops")
    layer = json.dumps({"schema": artifact.SIGNATURE_SCHEMA, "statement": {k: v for k, v in doc.items()
                        if k != "signature"}, "key_id": "ops", "ed25519": doc["signature"]["ed25519"]})
    with pytest.raises(CacheRejected, match="signature statement: must be an object of exactly"):
        artifact.parse_signature(layer.encode())


@pytest.mark.parametrize(
    ("layer", "why"),
    [
        (b"not json", "signature layer: not JSON"),
        (b'{"schema": "x"}', "must be an object of schema, statement, key_id, ed25519"),
        (json.dumps({"schema": "edge-agent/engine-signature/0", "statement": {}, "key_id": "a",
                     "ed25519": ""}).encode(), "schema is not edge-agent/engine-signature/1"),
        (json.dumps({"schema": artifact.SIGNATURE_SCHEMA, "statement": _statement(), "key_id": "a b",
                     "ed25519": ""}).encode(), "key_id is not a key id"),
        (json.dumps({"schema": artifact.SIGNATURE_SCHEMA, "statement": _statement(), "key_id": "a",
                     "ed25519": "%%"}).encode(), "ed25519 is not base64"),
        (json.dumps({"schema": artifact.SIGNATURE_SCHEMA, "statement": {**_statement(), "plan_sha256": "x"},
                     "key_id": "a", "ed25519": ""}).encode(), "plan_sha256 is not a sha256"),
    ],
)
def test_a_malformed_signature_layer_is_rejected(layer: bytes, why: str) -> None:
    with pytest.raises(CacheRejected, match=why):
        artifact.parse_signature(layer)
