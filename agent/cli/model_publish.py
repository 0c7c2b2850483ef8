"""`edge-agent models publish`: put a model's files into an OCI registry and print the `artifacts` of a
deployment document that names them by digest (agent/deploy/oci_ref.py).

    edge-agent models publish --onnx model.onnx [--labels labels.txt] [--calibration images.tar]
        --to oci://registry:5000/site/models [--tag det-2024-06-01] [--credentials-file F] [--ca-file F]

One manifest holds the files, each a layer of its media type (LAYER_TYPES); `--tag` (default `onnx-` and
16 hex digits of the ONNX's sha256) is only a handle for people: the printed URLs name the manifest's
digest, so moving the tag later changes nothing a signed document refers to. The registry client is the
engine cache's (engines/cache/registry.py: timeouts, Basic or Bearer login from the credentials file,
TLS against --ca-file, plain HTTP on loopback or with `?plain-http=true`). Exit: 0 pushed (stdout: the
artifacts JSON), 1 the registry refused or could not be reached, 2 bad input (one line each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROLES = ("onnx", "labels", "calibration")


def add_parser(m_sub: Any) -> None:
    p = m_sub.add_parser(
        "publish",
        help="push a model's files to an OCI registry; prints the document's artifacts (oci://...@sha256:)",
        description="Push the files as one OCI manifest (each a layer of its media type "
        "application/vnd.edge-agent.model.<onnx|labels|calibration>.v1) and print the `artifacts` object "
        "of a deployment document naming that manifest by digest, with each file's sha256 and size.",
    )
    p.add_argument("--onnx", required=True, metavar="FILE", help="the model")
    p.add_argument("--labels", metavar="FILE", help="its labels file")
    p.add_argument("--calibration", metavar="FILE", help="an archive of calibration images (int8)")
    p.add_argument("--to", required=True, metavar="URL", help="oci://host[:port]/repository[?plain-http=true]")
    p.add_argument("--tag", metavar="T", help="a tag for people (default: onnx-<16 hex of its sha256>)")
    p.add_argument("--credentials-file", metavar="F", help='the registry login: {"username", "password"}')
    p.add_argument("--ca-file", metavar="F", help="the registry's CA (PEM)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per request (default 30)")
    p.set_defaults(func=cmd_models_publish)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(args: argparse.Namespace) -> dict[str, Path]:
    files = {role: Path(getattr(args, role)) for role in ROLES if getattr(args, role)}
    for role, path in files.items():
        if not path.is_file():
            raise ValueError(f"--{role} {path}: no such file")
    return files


def cmd_models_publish(args: argparse.Namespace) -> int:
    from agent.deploy.oci_ref import LAYER_TYPES
    from engines.cache.ref import parse_cache_url, tag_problem

    try:
        path = args.to.partition("://")[2].partition("?")[0].partition("/")[2]
        if "@" in path or ":" in path.rsplit("/", 1)[-1]:
            raise ValueError("name the repository only (a tag goes in --tag; the digest comes from the push)")
        ref = parse_cache_url(args.to)
    except ValueError as exc:
        print(f"edge-agent models publish: --to: {exc}", file=sys.stderr)
        return 2
    try:
        files = _files(args)
        sums = {role: _sha256(path) for role, path in files.items()}
        tag = args.tag or f"onnx-{sums['onnx'][:16]}"
        if tag_problem(tag) is not None:
            raise ValueError(f"--tag: {tag_problem(tag)}")
        if args.timeout <= 0:
            raise ValueError("--timeout must be > 0")
    except (ValueError, OSError) as exc:
        print(f"edge-agent models publish: {exc}", file=sys.stderr)
        return 2
    layers = [(path, LAYER_TYPES[role]) for role, path in files.items()]
    try:
        digest = _push(ref, tag, layers, args)
    except RuntimeError as exc:
        print(f"edge-agent models publish: {exc}", file=sys.stderr)
        return 1
    query = "" if ref.plain_http is None else f"?plain-http={str(ref.plain_http).lower()}"
    url = f"oci://{ref.registry}/{ref.repository}@{digest}{query}"
    artifacts = {role: {"url": url, "sha256": sums[role], "size": path.stat().st_size}
                 for role, path in files.items()}
    print(json.dumps(artifacts, indent=2))
    print(f"pushed {ref.registry}/{ref.repository}:{tag} = {digest}", file=sys.stderr)
    return 0


def _push(ref: Any, tag: str, layers: list[tuple[Path, str]], args: argparse.Namespace) -> str:
    """The pushed manifest's digest; RuntimeError with one line (never a credential) otherwise."""
    import requests

    from engines.cache.errors import CacheUnavailable
    from engines.cache.registry import Registry, unavailable

    ca = Path(args.ca_file) if args.ca_file else None
    creds = Path(args.credentials_file) if args.credentials_file else None
    try:
        client = Registry(ref, credentials_file=creds, ca_file=ca, timeout_s=args.timeout)
        r = client.push(target=ref.target(tag), files=[f"{p}:{t}" for p, t in layers],
                        disable_path_validation=True, quiet=True)
    except CacheUnavailable as exc:
        raise RuntimeError(exc.reason) from None
    except requests.RequestException as exc:
        raise RuntimeError(unavailable(f"registry {ref.registry}", exc, args.timeout).reason) from None
    except ValueError as exc:  # oras: a 4xx answer ("Issue with URL: reason"; no credential in it)
        raise RuntimeError(f"registry {ref.registry}: push refused: {str(exc)[:200]}") from None
    digest = r.headers.get("Docker-Content-Digest", "")
    if not digest.startswith("sha256:"):
        raise RuntimeError(f"registry {ref.registry}: the push gave no manifest digest")
    return str(digest)
