"""ed25519 keys and document signatures (`cryptography`).

A signature covers the canonical form of the document without its `signature` (document.canonical_bytes):
key order, spacing and indentation of the file do not matter, every value does. It is carried in the
document as `{"key_id": ID, "ed25519": base64 of the 64 signature bytes}`; a device trusts the public keys
its config lists by key id (deploy.trusted_keys) and refuses a document that is unsigned (unless
deploy.allow_unsigned), signed by another key, malformed, or changed after signing. A signature that is
present is always checked, allow_unsigned or not.

Keys are PEM files: the private key PKCS#8 without a passphrase, mode 0600 (it signs deployments: keep it
off the devices); the public key SubjectPublicKeyInfo, copied to each device. Nothing here logs or quotes
what a key file holds. Key files and key ids are read by the config's rules (agent.config.keys: the
trusted keys are checked at load by them too).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.config.keys import KEY_ID_RULE, KeyFileError, key_id_problem, read_private_key, read_public_key
from agent.deploy.document import canonical_bytes
from agent.deploy.errors import DeployError, SignatureError

PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"
SIGNATURE_BYTES = 64


def fingerprint(public: Ed25519PublicKey) -> str:
    """A key id derived from the public key itself: `ed25519-` + 16 hex digits of its sha256."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519-" + hashlib.sha256(raw).hexdigest()[:16]


# ---- key files --------------------------------------------------------------------------------------------
def generate_keys(
    directory: Path, key_id: str | None = None, *, force: bool = False
) -> tuple[Path, Path]:
    """A new key pair as `{directory}/{key_id}.key` (private, 0600) and `.pub` (public); key_id None: the
    key's fingerprint. An existing file is never replaced unless `force`. DeployError naming the path."""
    if key_id is not None and key_id_problem(key_id) is not None:
        raise DeployError(f"key id: {key_id_problem(key_id)}")
    key = Ed25519PrivateKey.generate()
    key_id = key_id or fingerprint(key.public_key())
    private_path = directory / f"{key_id}{PRIVATE_SUFFIX}"
    public_path = directory / f"{key_id}{PUBLIC_SUFFIX}"
    if not force:
        for path in (private_path, public_path):
            if os.path.lexists(path):
                raise DeployError(f"{path}: exists; a key is never overwritten (--force replaces it)")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise DeployError(f"{directory}: cannot create the key folder: {exc.strerror or exc}") from None
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600, force)
    _write_new(public_path, public_pem, 0o644, force)
    return private_path, public_path


def _write_new(path: Path, data: bytes, mode: int, replace: bool) -> None:
    """Write `path` whole or not at all (temp + fsync + link/rename + fsync of the folder), created with
    `mode` from the start (a private key is never readable by others, not even for a moment). Without
    `replace`, an existing file is refused by the link itself (no window between a check and the write)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have taken bits off: set them exactly
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:
        raise DeployError(f"{path}: exists; a key is never overwritten (--force replaces it)") from None
    except OSError as exc:
        raise DeployError(f"{path}: cannot write: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The ed25519 private key of a PEM file; SignatureError naming the path (never its content)."""
    try:
        return read_private_key(path)
    except KeyFileError as exc:
        raise SignatureError(exc.reason) from None


def load_public_key(path: Path, key_id: str | None = None) -> Ed25519PublicKey:
    """The ed25519 public key of a PEM file; SignatureError naming the key id and the path."""
    try:
        return read_public_key(path, key_id)
    except KeyFileError as exc:
        raise SignatureError(exc.reason) from None


# ---- signatures -------------------------------------------------------------------------------------------
def sign_document(
    doc: Mapping[str, Any], private_key: Path | Ed25519PrivateKey, key_id: str
) -> dict[str, Any]:
    """A copy of `doc` with `signature` set (an earlier signature is replaced)."""
    problem = key_id_problem(key_id)
    if problem is not None:
        raise SignatureError(f"key id: {problem}")
    key = load_private_key(private_key) if isinstance(private_key, Path) else private_key
    body = copy.deepcopy({k: v for k, v in doc.items() if k != "signature"})
    raw = key.sign(canonical_bytes(body))
    return {**body, "signature": {"key_id": key_id, "ed25519": base64.b64encode(raw).decode("ascii")}}


def verify_document(
    doc: Mapping[str, Any],
    trusted: Mapping[str, Path | Ed25519PublicKey],
    allow_unsigned: bool,
) -> str | None:
    """The key id that signed `doc`, or None for an unsigned document where `allow_unsigned`; SignatureError
    with a one-line reason otherwise (a signature present is checked even where unsigned is allowed)."""
    signature = doc.get("signature")
    if signature is None:
        if allow_unsigned:
            return None
        raise SignatureError(
            "signature: the document is not signed (unsigned documents need deploy.allow_unsigned: true)",
            "signature",
        )
    if not isinstance(signature, Mapping) or set(signature) != {"key_id", "ed25519"}:
        raise SignatureError("signature: must be an object of key_id and ed25519, nothing else", "signature")
    key_id = signature["key_id"]
    if not isinstance(key_id, str) or key_id_problem(key_id) is not None:
        raise SignatureError("signature.key_id: not a key id (" + KEY_ID_RULE + ")", "signature.key_id")
    if key_id not in trusted:
        known = ", ".join(sorted(trusted)[:8]) or "none"
        raise SignatureError(
            f"signature.key_id: key {key_id} is not trusted here (deploy.trusted_keys: {known})",
            "signature.key_id",
        )
    raw = _signature_bytes(signature["ed25519"])
    entry = trusted[key_id]
    public = entry if isinstance(entry, Ed25519PublicKey) else load_public_key(entry, key_id)
    try:
        public.verify(raw, canonical_bytes(doc))
    except InvalidSignature:
        raise SignatureError(
            f"signature.ed25519: does not match the document (changed after signing, or not signed by"
            f" key {key_id})",
            "signature.ed25519",
        ) from None
    return key_id


def _signature_bytes(text: Any) -> bytes:
    field = "signature.ed25519"
    if not isinstance(text, str) or len(text) > 4 * SIGNATURE_BYTES:
        raise SignatureError(f"{field}: must be base64 of a {SIGNATURE_BYTES}-byte ed25519 signature", field)
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise SignatureError(f"{field}: not base64", field) from None
    if len(raw) != SIGNATURE_BYTES:
        raise SignatureError(
            f"{field}: {len(raw)} bytes, an ed25519 signature has {SIGNATURE_BYTES}", field
        )
    return raw
