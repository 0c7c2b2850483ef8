"""`edge-agent fleet deploy` and `fleet rollouts`: rollouts of a deployment document over MQTT
(agent/fleet/rollout.py).

    fleet deploy DOC (--devices a,b | --group G | --all) [--canary N] [--batch N|P%] [--max-failures K]
                 [--soak S] [--rollback-on-halt] [--skip-offline] [--offline-timeout S] [--device-timeout S]
                 [--wait [S]] [--json] [--resume ID] [broker options as `fleet status`]
    fleet rollouts [ID] [--json] [broker options]

Exit codes: 0 done, 1 halted or rolled back (or --wait S ran out: resumable), 2 bad input or no broker.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agent.cli.argtypes import port, seconds
from agent.config import load_config

TARGET_FLAGS = (
    "devices",
    "group",
    "all",
    "canary",
    "batch",
    "max_failures",
    "soak",
    "rollback_on_halt",
    "skip_offline",
    "offline_timeout",
    "device_timeout",
)


def broker_options(p: Any) -> None:
    """The broker flags of `fleet status`."""
    p.add_argument("-c", "--config", help="take broker, credentials, TLS and prefix from this agent.yaml")
    p.add_argument("--mqtt-host", help="broker host (default: the config's, else localhost)")
    p.add_argument("--mqtt-port", type=port, help="broker port (default: the config's, else 1883)")
    p.add_argument("--prefix", help="topic prefix (default: the config's, else edge-agent)")
    p.add_argument("--username")
    p.add_argument("--password-file")


def broker_of(args: argparse.Namespace) -> Any:
    """The Broker of the flags over -c's mqtt section (a flag given wins, even empty: then refused)."""
    from agent.fleet.rollout_bus import Broker
    from agent.mqtt import read_password_file

    host, port_, prefix, username, password, tls = "localhost", 1883, "edge-agent", None, None, None
    if args.config:
        m = load_config(args.config).mqtt
        host, port_, prefix, username = m.host, m.port, m.prefix, m.username
        password = m.read_password()
        tls = m.tls.options() if m.tls is not None else None
    if args.password_file:
        password = read_password_file(args.password_file)
    return Broker(
        host if args.mqtt_host is None else args.mqtt_host,
        port_ if args.mqtt_port is None else args.mqtt_port,
        prefix if args.prefix is None else args.prefix,
        username if args.username is None else args.username,
        password,
        tls,
    )


def add_parsers(fl_sub: Any) -> None:
    d = fl_sub.add_parser(
        "deploy",
        help="roll a deployment document out to many devices in waves (canary first), halting on failures",
        description="Send DOC (signed: models sign) as cmd/deploy to the target devices wave by wave: the "
        "canary first, then batches; each device must reach `serving` and hold it for the soak time. More "
        "than --max-failures failures halt the rollout. Its state is retained under "
        "{prefix}/_fleet/rollouts/ID (fleet rollouts ID); --resume ID goes on after this command was killed.",
    )
    d.add_argument("doc", metavar="DOC", help="the deployment document (JSON, signed)")
    d.add_argument("--devices", metavar="A,B", help="these device ids")
    d.add_argument("--group", metavar="G", help="the devices with G in their mqtt.groups")
    d.add_argument("--all", action="store_true", help="every device with a retained status")
    d.add_argument("--canary", type=int, metavar="N", help="devices of the first wave (default 1; 0: none)")
    d.add_argument(
        "--batch", metavar="N|P%", help="devices per later wave, or a share of the rest (default 25%%)"
    )
    d.add_argument("--max-failures", type=int, metavar="K", help="halt beyond K failed devices (default 0)")
    d.add_argument(
        "--soak", type=seconds(604_800, zero=True), metavar="S", help="serving this long counts (default 60)"
    )
    d.add_argument("--rollback-on-halt", action="store_true", help="on a halt, roll back what it changed")
    d.add_argument("--skip-offline", action="store_true", help="skip offline devices instead of failing them")
    d.add_argument(
        "--offline-timeout",
        type=seconds(604_800, zero=True),
        metavar="S",
        help="offline this long fails (60)",
    )
    d.add_argument("--device-timeout", type=seconds(604_800), metavar="S", help="command to serving (3600)")
    d.add_argument(
        "--wait",
        nargs="?",
        const=None,
        type=seconds(604_800),
        metavar="S",
        help="drive the rollout to its end (the default), or for at most S seconds (then resume it)",
    )
    d.add_argument("--json", action="store_true", help="print the final state as JSON instead of the table")
    d.add_argument("--resume", metavar="ID", help="go on with this rollout (DOC must be its document)")
    d.add_argument("--trust", action="append", default=[], metavar="ID=PUB", help="check DOC's signature")
    d.add_argument("--allow-unsigned", action="store_true", help="send a document without a signature")
    broker_options(d)
    d.set_defaults(func=cmd_fleet_deploy)

    r = fl_sub.add_parser("rollouts", help="the rollouts retained on the broker (ID: one in detail)")
    r.add_argument("id", metavar="ID", nargs="?", help="this rollout: its devices, stages and reasons")
    r.add_argument("--json", action="store_true")
    broker_options(r)
    r.set_defaults(func=cmd_fleet_rollouts)


def _options(args: argparse.Namespace) -> Any:
    from agent.fleet.rollout_plan import RolloutOptions, parse_batch

    given = {
        "canary": args.canary,
        "max_failures": args.max_failures,
        "soak_s": args.soak,
        "offline_timeout_s": args.offline_timeout,
        "device_timeout_s": args.device_timeout,
    }
    kw: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if args.batch is not None:
        kw["batch"] = parse_batch(args.batch)
    return RolloutOptions(
        rollback_on_halt=args.rollback_on_halt, skip_offline=args.skip_offline, **kw
    ).check()


def _trusted(args: argparse.Namespace) -> dict[str, Path]:
    from agent.deploy.signing import key_id_problem
    from agent.fleet.rollout_plan import PlanError

    trusted: dict[str, Path] = {}
    for entry in args.trust:
        key_id, sep, path = entry.partition("=")
        if not sep or not path or key_id_problem(key_id) is not None:
            raise PlanError(f"--trust {entry[:60]}: must be ID=PUBLIC_KEY_FILE")
        trusted[key_id] = Path(path)
    return trusted


def cmd_fleet_deploy(args: argparse.Namespace) -> int:
    from agent.fleet.rollout import BusError, PlanError, Targets, run_rollout
    from agent.fleet.rollout_plan import split_devices
    from agent.fleet.rollout_table import LiveTable, as_json, render_detail
    from agent.mqtt import MqttError

    running: list[str] = []

    def started(r: Any) -> None:
        running.append(r.id)
        print(f"rollout {r.id}", file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        if args.resume is not None and any(getattr(args, f) not in (None, False) for f in TARGET_FLAGS):
            raise PlanError("--resume ID goes on with the rollout's own targets and options: give no other")
        if args.resume is not None:
            from agent.fleet.rollout_state import check_id

            try:
                check_id(args.resume)
            except PlanError as exc:  # the option named, as every other refusal does
                raise PlanError(f"--resume: {exc}") from None
        raw = _read(args.doc)
        live = None if args.json else LiveTable()
        targets = None
        options = None
        if args.resume is None:
            devices = tuple(split_devices(args.devices)) if args.devices is not None else ()
            targets = Targets(devices, args.group, args.all)
            options = _options(args)
        final = run_rollout(
            raw,
            broker_of(args),
            targets=targets,
            options=options,
            resume=args.resume,
            trusted=_trusted(args) or None,
            allow_unsigned=args.allow_unsigned,
            on_start=started,
            on_change=live,
            deadline_s=args.wait,
            where=args.doc,
        )
    except (PlanError, BusError, MqttError) as exc:
        print(f"edge-agent fleet deploy: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # its state stays as last written: running, resumable
        if not running:
            return 2
        print(f"interrupted: rollout {running[0]} stays running; go on with --resume {running[0]}")
        return 1
    if args.json:
        print(json.dumps(as_json(final), indent=2))
    else:
        if live is None or not live.tty:  # on a terminal the last redraw shows it already
            print(render_detail(final))
        if final.status == "running":
            print(f"still running after {args.wait:g} s: go on with --resume {final.id}")
    return 0 if final.status == "done" else 1


def _read(path: str) -> bytes:
    from agent.deploy.document import MAX_DOCUMENT_BYTES
    from agent.fleet.rollout_plan import PlanError

    try:
        with open(path, "rb") as f:
            return f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read ({exc.strerror or exc})") from None


def cmd_fleet_rollouts(args: argparse.Namespace) -> int:
    from agent.fleet.rollout_bus import BusError, read_rollouts
    from agent.fleet.rollout_plan import PlanError
    from agent.fleet.rollout_state import Rollout, check_id
    from agent.fleet.rollout_table import as_json, render_detail, render_list
    from agent.mqtt import MqttError

    try:
        rid = None if args.id is None else check_id(args.id)
        found = read_rollouts(broker_of(args), rid)
    except (PlanError, BusError, MqttError) as exc:
        print(f"edge-agent fleet rollouts: {exc}", file=sys.stderr)
        return 2
    if rid is None:
        print(
            json.dumps({k: as_json(v) for k, v in found.items()}, indent=2)
            if args.json
            else render_list(found)
        )
        return 0
    one = found.get(rid)
    if one is None:
        print(f"edge-agent fleet rollouts: {rid}: no such rollout", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(one), indent=2))
    elif isinstance(one, Rollout):
        print(render_detail(one))
    else:
        print(f"rollout {rid}: unreadable retained state: {one}")
    return 0 if isinstance(one, Rollout) else 1
