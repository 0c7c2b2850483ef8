"""`edge-agent fleet status`: the agents on a broker, from its retained messages (agent.mqtt.fleet);
`fleet deploy` and `fleet rollouts`: agent/cli/fleet_rollout.py."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agent.cli import fleet_rollout
from agent.cli.argtypes import port, seconds
from agent.config import load_config

FLEET_TIMEOUT_S = 10.0  # fleet status: the broker must answer within this (plus --wait)


def add_parsers(sub: Any) -> None:
    fl = sub.add_parser("fleet", help="the agents on a broker (no fleet server: retained MQTT messages)")
    fl_sub = fl.add_subparsers(dest="fleet_command", required=True)
    fs = fl_sub.add_parser(
        "status", help="table of every agent: state, version, cameras up, fps, engines, TensorRT, last seen"
    )
    fs.add_argument("-c", "--config", help="take broker, credentials, TLS and prefix from this agent.yaml")
    fs.add_argument("--mqtt-host", help="broker host (default: the config's, else localhost)")
    fs.add_argument("--mqtt-port", type=port, help="broker port (default: the config's, else 1883)")
    fs.add_argument("--prefix", help="topic prefix (default: the config's, else edge-agent)")
    fs.add_argument("--username")
    fs.add_argument("--password-file")
    fs.add_argument(
        "--wait",
        type=seconds(60),
        default=0.5,
        metavar="S",
        help="stop after S quiet seconds (0.5; at most 60)",
    )
    fs.add_argument(
        "--json", action="store_true", help="a JSON array, one object per agent, instead of the table"
    )
    fs.set_defaults(func=cmd_fleet_status)
    fleet_rollout.add_parsers(fl_sub)  # deploy (a rollout in waves), rollouts [ID]


def cmd_fleet_status(args: argparse.Namespace) -> int:
    """The fleet table from the broker's retained messages (agent.mqtt.fleet); broker settings from --config's
    mqtt section, overridden by the flags."""
    import json

    from agent.mqtt import MqttError, read_password_file
    from agent.mqtt.fleet import FleetError, collect, render, rows

    host, port, prefix, username, password, tls = "localhost", 1883, "edge-agent", None, None, None
    if args.config:
        m = load_config(args.config).mqtt
        host, port, prefix, username = m.host, m.port, m.prefix, m.username
        password = m.read_password()
        tls = m.tls.options() if m.tls is not None else None
    # A flag given overrides the config, even when it is empty or zero (then refused, not ignored).
    host = host if args.mqtt_host is None else args.mqtt_host
    port = port if args.mqtt_port is None else args.mqtt_port
    prefix = prefix if args.prefix is None else args.prefix
    username = username if args.username is None else args.username
    try:
        if args.password_file:
            password = read_password_file(args.password_file)
        table = rows(
            collect(
                host,
                port,
                prefix,
                username=username,
                password=password,
                tls=tls,
                quiet_s=args.wait,
                timeout_s=FLEET_TIMEOUT_S + args.wait,
            )
        )
    except (FleetError, MqttError) as exc:
        print(f"edge-agent fleet status: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(table, indent=2) if args.json else render(table))
    return 0
