"""ed25519 key files and key ids: one rule for every signature the project checks (deployment documents in
agent.deploy.signing and the config's `deploy.trusted_keys`, engine plans in engines.cache.signing).

Keys are PEM files: a private key PKCS#8 without a passphrase, a public key SubjectPublicKeyInfo. Nothing
here logs or quotes what a key file holds; a reason names the path and what is wrong with it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# A key id is a config key and a file name: the rule of a name in a deployment document.
KEY_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KEY_ID_RULE = "must be a name: letters, digits, '.', '_', '-', starting with a letter or digit"
MAX_KEY_FILE = 16 * 1024  # bytes; an ed25519 PEM is ~120


class KeyFileError(Exception):
    """A key file that cannot be used: `reason` names what (`{what} {path}: ...`), never its content."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def key_id_problem(key_id: str) -> str | None:
    """Why `key_id` cannot name a key (it is a config key and a file name), or None."""
    return None if KEY_ID_RE.fullmatch(key_id) else KEY_ID_RULE + " (at most 128)"


def read_key_file(path: Path, what: str) -> bytes:
    """A key file's bytes (a regular file, at most MAX_KEY_FILE); KeyFileError naming `what` and the path."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise KeyFileError(f"{what} {path}: is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read
            raise KeyFileError(f"{what} {path}: is not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except FileNotFoundError:
        raise KeyFileError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise KeyFileError(f"{what} {path}: cannot read ({exc.strerror or exc})") from None
    except ValueError:  # a NUL in the path
        raise KeyFileError(f"{what} {path}: not a valid path") from None
    if len(data) > MAX_KEY_FILE:
        raise KeyFileError(f"{what} {path}: larger than {MAX_KEY_FILE} bytes: not a PEM key")
    return data


def read_public_key(path: Path, key_id: str | None = None) -> Ed25519PublicKey:
    """The ed25519 public key of a PEM file; KeyFileError naming the key id and the path."""
    what = "public key" if key_id is None else f"trusted key {key_id}"
    data = read_key_file(path, what)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"{what} {path}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{what} {path}: not an ed25519 key ({type(key).__name__.lstrip('_')})")
    return key


def read_private_key(path: Path) -> Ed25519PrivateKey:
    """The ed25519 private key of an unencrypted PEM file; KeyFileError naming the path."""
    data = read_key_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography: a password is needed
        raise KeyFileError(
            f"private key {path}: is encrypted (a key without a passphrase is needed)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"private key {path}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"private key {path}: not an ed25519 key ({type(key).__name__.lstrip('_')})")
    return key


def public_key_problem(path: Path) -> str | None:
    """Why `path` is not a readable PEM ed25519 public key ('no such file', 'not a PEM public key', ...),
    or None: the config checks its trusted keys with this at load."""
    try:
        read_public_key(path)
    except KeyFileError as exc:
        return exc.reason.removeprefix(f"public key {path}: ")
    return None
