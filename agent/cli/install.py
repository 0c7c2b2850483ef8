"""`edge-agent install-service` (the work itself: agent.service.install)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    ins = sub.add_parser(
        "install-service", help="create the service user, /etc/edge-agent and the systemd unit (root)"
    )
    ins.add_argument("--root", default="/", help="stage the install under DIR instead of / (packaging)")
    ins.add_argument("--user", default="edge-agent", help="service user (default: edge-agent)")
    ins.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be done and what would be refused, change nothing",
    )
    ins.set_defaults(func=cmd_install_service)


def cmd_install_service(args: argparse.Namespace) -> int:
    from agent.service.install import InstallError, install_service

    try:
        return install_service(Path(args.root), args.user, args.dry_run)
    except BrokenPipeError:
        raise  # stdout's reader left (`--dry-run | head`): main() ends quietly
    except (InstallError, OSError) as exc:
        print(f"edge-agent install-service: {exc}", file=sys.stderr)
        return 2
