"""`edge-agent keys generate`: an ed25519 key pair that signs deployment documents (agent.deploy.signing).

The private key stays where documents are signed (`edge-agent models sign DOC --key K`); the public key is
copied to every device and named in its config (deploy.trusted_keys). Nothing here prints key material.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEVICE_KEY_DIR = Path("/etc/edge-agent/keys")  # where the printed config lines put the public key


def add_parsers(sub: Any) -> None:
    k = sub.add_parser("keys", help="ed25519 keys that sign deployment documents")
    k_sub = k.add_subparsers(dest="keys_command", required=True)
    g = k_sub.add_parser(
        "generate",
        help="a new key pair: DIR/ID.key (private, 0600) and DIR/ID.pub (public, for the devices)",
        description="Make an ed25519 key pair for `edge-agent models sign`. An existing key file is never "
        "replaced unless --force. Prints the key id and the config lines a device needs to trust it.",
    )
    g.add_argument("--dir", default="keys", metavar="D", help="where the key files go (default ./keys)")
    g.add_argument(
        "--key-id",
        metavar="ID",
        help="the key's name in deploy.trusted_keys (default: ed25519- + 16 hex digits of its sha256)",
    )
    g.add_argument("--force", action="store_true", help="replace existing key files of this key id")
    g.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from agent.deploy.errors import DeployError
    from agent.deploy.signing import PUBLIC_SUFFIX, generate_keys

    try:
        private, public = generate_keys(Path(args.dir), args.key_id, force=args.force)
    except DeployError as exc:
        print(f"edge-agent keys generate: {exc}", file=sys.stderr)
        return 2
    key_id = public.name.removesuffix(PUBLIC_SUFFIX)
    print(f"key id       {key_id}")
    print(f"private key  {private}  (mode 0600: it signs deployments, keep it off the devices)")
    print(f"public key   {public}  (copy it to every device that should trust this key)")
    print()
    print(f"sign a document:  edge-agent models sign DOC --key {private}")
    print("trust the key: add to each device's agent.yaml (the public key's path on the device):")
    print("deploy:")
    print("  enabled: true")
    print("  trusted_keys:")
    print(f"    {key_id}: {DEVICE_KEY_DIR / public.name}")
    return 0
