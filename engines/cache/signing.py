"""Plan signatures (ed25519, `cryptography`). A plan is code: a device loads a pulled plan only when its
signed statement verifies against a key it trusts.

    signer = PlanSigner.from_file(Path("keys/dev1.key"), "dev1")   # or PlanSigner(private_key, "dev1")
    trust = PlanTrust.from_files({"dev1": Path("keys/dev1.pub"), "fleet": ...})
    trust.verify("dev1", statement, signer.sign(statement))        # CacheRejected when it does not hold

What is signed is the artifact's statement (engines.cache.artifact.statement_bytes): the key, the builder
device and the sha256 of the plan, manifest and timing cache, under a schema name of its own, so no other
signed thing of the project (a deployment document) can pass for a plan's statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from engines.cache.errors import CacheRejected
from engines.keys import KeyFileError, key_id_problem, read_private_key, read_public_key

SIGNATURE_BYTES = 64


class PlanSigner:
    """Signs statements with this device's (or the fleet's) private key, known to the others as `key_id`."""

    def __init__(self, private_key: Ed25519PrivateKey, key_id: str) -> None:
        problem = key_id_problem(key_id)
        if problem is not None:
            raise ValueError(f"key id: {problem}")
        self._key = private_key
        self.key_id = key_id

    @classmethod
    def from_file(cls, path: Path, key_id: str) -> PlanSigner:
        """ValueError naming the path (never what the file holds) when it is no ed25519 private key."""
        try:
            return cls(read_private_key(path), key_id)
        except KeyFileError as e:
            raise ValueError(e.reason) from None

    def sign(self, statement: bytes) -> bytes:
        return self._key.sign(statement)

    def __repr__(self) -> str:  # never the key
        return f"PlanSigner(key_id={self.key_id!r})"


class PlanTrust:
    """The public keys whose plans this device loads, by key id."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self._keys = dict(keys)

    @classmethod
    def from_files(cls, paths: Mapping[str, Path]) -> PlanTrust:
        """ValueError naming the key id and path of a file that is no ed25519 public key."""
        keys = {}
        for key_id, path in paths.items():
            try:
                keys[key_id] = read_public_key(path, key_id)
            except KeyFileError as e:
                raise ValueError(e.reason) from None
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, key_id: str, statement: bytes, signature: bytes) -> None:
        """Returns when `signature` is `key_id`'s over `statement`; CacheRejected otherwise."""
        public = self._keys.get(key_id)
        if public is None:
            known = ", ".join(self.key_ids[:8]) or "none"
            raise CacheRejected(f"signed by key {key_id[:128]!r}, not trusted here (trusted: {known})")
        if len(signature) != SIGNATURE_BYTES:
            raise CacheRejected(f"signature of {len(signature)} bytes: an ed25519 signature has 64")
        try:
            public.verify(signature, statement)
        except InvalidSignature:
            raise CacheRejected(
                "signature does not match the statement (changed after signing, or not signed by key "
                f"{key_id})"
            ) from None
