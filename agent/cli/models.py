"""`edge-agent models ...`: deployment documents and the model versions of a device (issue 37).

    models sign DOC --key K     sign a deployment document (agent.deploy.signing), written atomically
    models verify DOC           check its signature against a config's trusted keys (or --trust ID=PUB)
    models publish --onnx F --to oci://...   push a model's files to a registry (agent/cli/model_publish.py)

Exit codes as every command: 0 done, 1 a check failed (a signature refused), 2 bad input (one line why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agent.cli import model_publish, model_versions
from agent.config import load_config


def add_parsers(sub: Any) -> None:
    m = sub.add_parser(
        "models",
        help="deployment documents (sign, verify) and the model versions of a device (deploy, list, show, "
        "rollback)",
    )
    m_sub = m.add_subparsers(dest="models_command", required=True)
    _add_sign(m_sub)
    _add_verify(m_sub)
    model_publish.add_parser(m_sub)  # publish --onnx F [--labels F] --to oci://host:port/repo
    model_versions.add_parsers(m_sub)  # deploy FILE, list, show MODEL, rollback MODEL [--to V]


# ---- sign -------------------------------------------------------------------------------------------------
def _add_sign(m_sub: Any) -> None:
    s = m_sub.add_parser(
        "sign",
        help="sign a deployment document with an ed25519 private key (edge-agent keys generate)",
        description="Validate DOC as a deployment document, then sign its canonical JSON (sorted keys, no "
        "spaces, without `signature`) and write it with `signature: {key_id, ed25519}`; an earlier "
        "signature is replaced. The file is replaced whole or not at all.",
    )
    s.add_argument("doc", metavar="DOC", help="the deployment document (JSON)")
    s.add_argument("--key", required=True, metavar="K", help="the private key (PEM, ed25519)")
    s.add_argument(
        "--key-id",
        metavar="ID",
        help="the key id devices trust (default: K's file name without .key, as `keys generate` "
        "names it)",
    )
    s.add_argument("--out", metavar="F", help="write the signed document here (default: DOC; - stdout)")
    s.set_defaults(func=cmd_models_sign)


def cmd_models_sign(args: argparse.Namespace) -> int:
    from agent.deploy.document import document_digest, parse_document
    from agent.deploy.errors import DeployError
    from agent.deploy.signing import (
        fingerprint,
        key_id_problem,
        load_private_key,
        sign_document,
        verify_document,
    )
    from engines.store.fsutil import atomic_write_bytes

    doc_path = Path(args.doc)
    try:
        _, body = parse_document(_read_doc(doc_path), str(doc_path))
        key = load_private_key(Path(args.key))
        key_id = args.key_id
        if key_id is None:
            stem = Path(args.key).name.removesuffix(".key")
            key_id = stem if key_id_problem(stem) is None else fingerprint(key.public_key())
        signed = sign_document(body, key, key_id)
        verify_document(signed, {key_id: key.public_key()}, allow_unsigned=False)  # what a device will do
        text = (json.dumps(signed, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        out = doc_path if args.out is None else Path(args.out)
        if args.out == "-":
            sys.stdout.write(text.decode("utf-8"))
        else:
            try:
                atomic_write_bytes(out, text)
            except OSError as exc:
                raise DeployError(f"{out}: cannot write: {exc.strerror or exc}") from None
    except DeployError as exc:
        print(f"edge-agent models sign: {exc}", file=sys.stderr)
        return 2
    said = f"signed with key {key_id}; document {document_digest(signed)[:16]}"
    print(said if args.out == "-" else f"{out}: {said}", file=sys.stderr if args.out == "-" else sys.stdout)
    return 0


def _read_doc(path: Path) -> bytes:
    from agent.deploy.document import MAX_DOCUMENT_BYTES
    from agent.deploy.errors import DeployError

    try:
        with open(path, "rb") as f:
            return f.read(MAX_DOCUMENT_BYTES + 1)  # parse_document refuses what is larger
    except FileNotFoundError:
        raise DeployError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DeployError(f"{path}: is a directory, not a file") from None
    except OSError as exc:
        raise DeployError(f"{path}: cannot read ({exc.strerror or exc})") from None


# ---- verify -----------------------------------------------------------------------------------------------
def _add_verify(m_sub: Any) -> None:
    v = m_sub.add_parser(
        "verify",
        help="check a deployment document and its signature as a device would",
        description="Validate DOC and verify its signature against the trusted keys of -c's deploy section "
        "and/or --trust ID=PUB. Exit 0: valid and signed by a trusted key (or unsigned where allowed); "
        "1: the signature is refused; 2: the document, the keys or the config are bad.",
    )
    v.add_argument("doc", metavar="DOC", help="the deployment document (JSON)")
    v.add_argument("-c", "--config", help="trust the keys (and allow_unsigned) of this agent.yaml")
    v.add_argument(
        "--trust", action="append", default=[], metavar="ID=PUB",
        help="trust this public key as ID (repeatable)",
    )
    v.add_argument("--allow-unsigned", action="store_true", help="accept a document without a signature")
    v.set_defaults(func=cmd_models_verify)


def cmd_models_verify(args: argparse.Namespace) -> int:
    from agent.deploy.document import document_digest, parse_document
    from agent.deploy.errors import DeployError, SignatureError
    from agent.deploy.signing import key_id_problem, load_public_key, verify_document

    trusted: dict[str, Path] = {}
    allow_unsigned = bool(args.allow_unsigned)
    if args.config:
        deploy = load_config(args.config).deploy  # ConfigError: main() says it, exit 2
        trusted.update(deploy.trusted_keys)
        allow_unsigned |= deploy.allow_unsigned
    try:
        for entry in args.trust:
            key_id, sep, path = entry.partition("=")
            if not sep or not path or key_id_problem(key_id) is not None:
                raise DeployError(f"--trust {entry}: must be ID=PUBLIC_KEY_FILE (ID a key id)")
            load_public_key(Path(path), key_id)
            trusted[key_id] = Path(path)
        if not trusted and not allow_unsigned:
            raise DeployError("no trusted key: give -c CONFIG (its deploy.trusted_keys) or --trust ID=PUB")
        _, body = parse_document(_read_doc(Path(args.doc)), args.doc)
        key_id = verify_document(body, trusted, allow_unsigned)
    except SignatureError as exc:
        print(f"edge-agent models verify: {exc}", file=sys.stderr)
        return 1 if exc.field is not None else 2  # a refused signature; else a key file that is unusable
    except DeployError as exc:
        print(f"edge-agent models verify: {exc}", file=sys.stderr)
        return 2
    who = "unsigned (allowed)" if key_id is None else f"signed by trusted key {key_id}"
    print(f"{args.doc}: valid; {who}; document {document_digest(body)[:16]}")
    return 0
