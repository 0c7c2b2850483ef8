"""`edge-agent`'s argument parser: one set of subcommands per command group, in --help's order."""

from __future__ import annotations

import argparse

from agent import __version__
from agent.cli import bench, fleet, install, keys, lifecycle, models, serve
from agent.cli.engines import parsers as engines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edge-agent", description="Video analytics node: cameras -> detection -> MQTT"
    )
    p.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = p.add_subparsers(dest="command", required=True)
    serve.add_parsers(sub)  # demo, run, check-config
    lifecycle.add_parsers(sub)  # check, rebuild, calibrate, validate, profile
    install.add_parsers(sub)  # install-service
    fleet.add_parsers(sub)  # fleet status
    bench.add_parsers(sub)
    engines.add_parsers(sub)  # `build` and `engines list|show|rollback|prune` (no agent.yaml)
    keys.add_parsers(sub)  # keys generate
    models.add_parsers(sub)  # models sign|verify (deployment documents)
    return p
