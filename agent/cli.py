"""`edge-agent` command line. Exit codes: 0 success, 1 check/gate failed, 2 usage or runtime error."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import string
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from agent import __version__, argtypes
from agent.config import AgentConfig, ConfigError, load_config, parse_config
from agent.logs import setup_logging
from engines.errors import EngineError
from engines.precision import REQUESTABLE

ASSETS = Path(__file__).resolve().parent / "assets"
LOG_LEVELS = ["debug", "info", "warning", "error"]
DEMO_MODEL = ASSETS / "nanodet-m-416.onnx"
DEMO_LABELS = ASSETS / "coco.names"
DEMO_CLIP = ASSETS / "bikes.mp4"
# What a shell shows for a command whose pipe's reader left (128 + SIGPIPE): `edge-agent ... | head`.
READER_LEFT = 128 + signal.SIGPIPE
_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")
FLEET_TIMEOUT_S = 10.0  # fleet status: the broker must answer within this (plus --wait)
log = logging.getLogger("agent.cli")


def demo_device_id(nodename: str) -> str:
    """`<hostname>-demo`: never the device id a service on this host takes by default (its host name), so a
    demo started next to a running agent does not publish over its status, camera states and engines."""
    name = "".join(c if c in _ID_CHARS else "-" for c in nodename).lstrip("_")
    return f"{name or 'edge-agent'}-demo"


def demo_config(mqtt_host: str = "localhost", mqtt_port: int = 1883, clip: Path | None = None) -> AgentConfig:
    """The embedded default: bundled NanoDet + street clip, ONNX Runtime on CPU, console output."""
    data = {
        "device_id": demo_device_id(os.uname().nodename),
        "engine_dir": str(Path.home() / ".cache" / "edge-agent" / "engines"),
        "models": {
            "nanodet": {
                "onnx": str(DEMO_MODEL),
                "format": "nanodet",
                "labels": str(DEMO_LABELS),
                "backend": "onnxruntime",
                "precision": "fp32",
            }
        },
        "cameras": {
            "street": {"url": str(clip or DEMO_CLIP), "model": "nanodet", "loop": True, "min_score": 0.4},
        },
        "mqtt": {"host": mqtt_host, "port": mqtt_port},
        "telemetry": {"interval_s": 10},
        "console": True,
    }
    return parse_config(data, "<demo>")


class _Console:
    """sys.stdout while an agent runs: console lines come from a scheduler thread, where a reader that left
    (`edge-agent demo | head`) raised BrokenPipeError with a traceback for every line. The first one sends
    the rest of the output to /dev/null and calls `on_gone` once (demo: stop; run: keep serving)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self.gone = False
        self.on_gone: Callable[[], None] = lambda: None

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._out.write(text)
            except BrokenPipeError:
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._lost()

    def _lost(self) -> None:
        with self._lock:
            if self.gone:
                return
            self.gone = True
        _discard_stdout()
        self.on_gone()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._out, name)


def _run_agent(
    cfg: AgentConfig,
    quiet_mqtt: bool = False,
    config_path: str | None = None,
    level: str = "info",
    stop_unread: bool = False,
) -> int:
    """Run until stopped. `stop_unread`: stop when stdout's reader leaves (the demo, whose output is the
    point); otherwise the console lines stop and the agent keeps serving."""
    console, saved = _Console(sys.stdout), sys.stdout
    sys.stdout = console  # before the agent: its console sink keeps the stream it finds here
    try:
        code = _serve(cfg, quiet_mqtt, config_path, level, console, stop_unread)
    finally:
        sys.stdout = saved
    return READER_LEFT if code == 0 and console.gone and stop_unread else code


def _serve(
    cfg: AgentConfig,
    quiet_mqtt: bool,
    config_path: str | None,
    level: str,
    console: _Console,
    stop_unread: bool,
) -> int:
    from agent.daemon import Agent  # heavy imports (cv2, onnxruntime) only for commands that run
    from agent.service.notify import Notifier, ServiceError
    from agent.shards.placement import place

    try:
        notifier = Notifier()
    except ServiceError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    gpus_seen = 0
    if cfg.pipeline.shards != 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        from engines.cuda.gpu_probe import NVML

        gpus_seen = NVML.count()  # several GPUs: shards spread over them unless pipeline.gpus says
    plan = place(cfg, gpus_seen=gpus_seen)
    agent: Any
    if plan.count > 1:  # pipeline.shards: a supervisor over worker processes (agent.shards)
        from agent.shards.sharded import ShardedAgent

        agent = ShardedAgent(cfg, config_path=config_path, notifier=notifier, level=level, plan=plan)
    else:
        agent = Agent(cfg, quiet_mqtt=quiet_mqtt, config_path=config_path, notifier=notifier)
    if stop_unread:
        console.on_gone = agent.request_stop
    else:
        console.on_gone = lambda: log.warning("console: stdout was closed; no more console lines")
    try:
        agent.start()
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        agent.stop()
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    agent.run_forever()
    # Stopped, "offline" published, handlers given back: a late Ctrl-C or SIGTERM must not turn the clean
    # exit into a KeyboardInterrupt traceback or a death by signal while the interpreter shuts down.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    cfg = demo_config(args.mqtt_host, args.mqtt_port, Path(args.clip) if args.clip else None)
    print(
        f"edge-agent demo: NanoDet-m on {Path(cfg.cameras['street'].url or '').name} "
        "with ONNX Runtime (CPU); "
        f"MQTT to {args.mqtt_host}:{args.mqtt_port} when a broker answers. Ctrl-C stops.",
        flush=True,
    )
    return _run_agent(cfg, quiet_mqtt=True, stop_unread=True)


def cmd_run(args: argparse.Namespace) -> int:
    from agent.preflight import preflight

    cfg = load_config(args.config)
    problems = preflight(cfg, args.config)  # files, labels, model outputs vs format, classes
    if problems:
        raise ConfigError("\n".join(problems))
    if args.check_config:
        from agent.shards.placement import place

        plan = place(cfg)
        shards = f", {plan.why}" if plan.count > 1 or cfg.pipeline.shards != 1 else ""
        print(f"{args.config}: ok ({len(cfg.models)} model(s), {len(cfg.cameras)} camera(s){shards})")
        return 0
    level = args.log_level or cfg.log_level
    setup_logging(level)
    return _run_agent(cfg, config_path=args.config, level=level)


def cmd_bench(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from agent.bench.run import run_from_args

    return run_from_args(args)


def cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    from agent.lifecycle.commands import run_check

    return run_check(cfg, args.model, args.json)


def cmd_rebuild(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    from agent.lifecycle.commands import run_rebuild

    return run_rebuild(cfg, args.model, args.force, args.precision, args.wait)


def cmd_calibrate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    from agent.lifecycle.commands import run_calibrate

    folder = Path(args.source) if args.source else None
    return run_calibrate(cfg, args.model, folder, args.samples, args.held_out, args.interval)


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    from agent.lifecycle.commands import run_validate

    return run_validate(cfg, args.model, args.precision, args.method, args.json)


def cmd_profile(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    from agent.lifecycle.profile import run_profile

    return run_profile(cfg, args.model, args.precision, args.iterations, args.top, Path(args.out), args.json)


def cmd_install_service(args: argparse.Namespace) -> int:
    from agent.service.install import InstallError, install_service

    try:
        return install_service(Path(args.root), args.user, args.dry_run)
    except BrokenPipeError:
        raise  # stdout's reader left (`--dry-run | head`): main() ends quietly
    except (InstallError, OSError) as exc:
        print(f"edge-agent install-service: {exc}", file=sys.stderr)
        return 2


def cmd_fleet_status(args: argparse.Namespace) -> int:
    """The fleet table from the broker's retained messages (agent.fleet); broker settings from --config's
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


_count, _port, _seconds = argtypes.whole, argtypes.port, argtypes.seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edge-agent", description="Video analytics node: cameras -> detection -> MQTT"
    )
    p.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the bundled model on the bundled clip (no GPU, no broker needed)")
    d.add_argument("--mqtt-host", default="localhost")
    d.add_argument("--mqtt-port", type=_port, default=1883)
    d.add_argument("--clip", help="another video file to loop instead of the bundled one")
    d.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="run the daemon")
    r.add_argument("-c", "--config", required=True)
    r.add_argument("--check-config", action="store_true", help="validate the config and exit")
    r.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="default: the config's log_level")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser(
        "check", help="check every engine against this device (exit 0 fit, 1 rebuild, 2 error)"
    )
    c.add_argument("-c", "--config", required=True)
    c.add_argument("--model")
    c.add_argument("--json", action="store_true")
    c.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    c.set_defaults(func=cmd_check)

    rb = sub.add_parser("rebuild", help="build engines that do not fit (or all with --force); daemon may run")
    rb.add_argument("-c", "--config", required=True)
    rb.add_argument("--model")
    rb.add_argument("--force", action="store_true", help="build even if the stored engine fits")
    rb.add_argument("--precision", choices=REQUESTABLE)
    rb.add_argument(
        "--wait",
        type=_seconds(86400, zero=True),
        default=0.0,
        metavar="S",
        help="wait up to S seconds for another build of the same model (default: fail at once)",
    )
    rb.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    rb.set_defaults(func=cmd_rebuild)

    cal = sub.add_parser(
        "calibrate", help="capture the INT8 calibration set (+ held-out gate frames) from cameras or a folder"
    )
    cal.add_argument("-c", "--config", required=True)
    cal.add_argument("--model", help="default: every model")
    cal.add_argument("--from", dest="source", metavar="DIR", help="images/videos instead of cameras")
    cal.add_argument(
        "--samples",
        type=_count(0, 100_000),
        help="calibration frames, 0..100000 (default: models.M.calibration.samples)",
    )
    cal.add_argument(
        "--held-out", type=_count(1, 100_000), help="gate frames on top (default: samples/9, at least 20)"
    )
    cal.add_argument(
        "--interval",
        type=_seconds(86400),
        metavar="S",
        help="live cameras: seconds apart (default: its calibration.interval_s)",
    )
    cal.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    cal.set_defaults(func=cmd_calibrate)

    val = sub.add_parser("validate", help="accuracy gate on the held-out frames (exit 0 pass, 1 fail)")
    val.add_argument("-c", "--config", required=True)
    val.add_argument("--model", help="default: every model")
    val.add_argument("--precision", choices=REQUESTABLE, help="default: the model's")
    val.add_argument("--method", choices=["entropy", "minmax", "percentile"], help="int8 calibration method")
    val.add_argument("--json", action="store_true", help="print the validation object (+ model, precision)")
    val.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    val.set_defaults(func=cmd_validate)

    pr = sub.add_parser(
        "profile", help="per-layer time (p50, share) of one inference: table, JSON report and bar chart"
    )
    pr.add_argument("-c", "--config", required=True)
    pr.add_argument("--model", help="default: every model")
    pr.add_argument(
        "--precision",
        choices=["fp32", "fp16", "int8"],
        help="default: the model's (best: int8); on ONNX Runtime fp16/int8 are profiled next to fp32",
    )
    # --iterations and --top: whole numbers here, >= 1 checked by run_profile (its own message, exit 2)
    pr.add_argument("--iterations", type=int, default=50, help="profiled inferences (after one warm-up)")
    pr.add_argument("--top", type=int, default=15, help="layers in the table and the chart")
    pr.add_argument("--out", default="profile-out", help="folder for {model}.json, .png and ORT traces")
    pr.add_argument("--json", action="store_true", help="print the report instead of the table")
    pr.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    pr.set_defaults(func=cmd_profile)

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

    fl = sub.add_parser("fleet", help="the agents on a broker (no fleet server: retained MQTT messages)")
    fl_sub = fl.add_subparsers(dest="fleet_command", required=True)
    fs = fl_sub.add_parser(
        "status", help="table of every agent: state, version, cameras up, fps, engines, TensorRT, last seen"
    )
    fs.add_argument("-c", "--config", help="take broker, credentials, TLS and prefix from this agent.yaml")
    fs.add_argument("--mqtt-host", help="broker host (default: the config's, else localhost)")
    fs.add_argument("--mqtt-port", type=_port, help="broker port (default: the config's, else 1883)")
    fs.add_argument("--prefix", help="topic prefix (default: the config's, else edge-agent)")
    fs.add_argument("--username")
    fs.add_argument("--password-file")
    fs.add_argument(
        "--wait",
        type=_seconds(60),
        default=0.5,
        metavar="S",
        help="stop after S quiet seconds (0.5; at most 60)",
    )
    fs.add_argument(
        "--json", action="store_true", help="a JSON array, one object per agent, instead of the table"
    )
    fs.set_defaults(func=cmd_fleet_status)

    b = sub.add_parser(
        "bench",
        help="pipeline benchmark: stages, agent overhead, streams x batch sweep (JSON report + plot)",
        description="trtexec-like benchmark of the whole pipeline; see agent/bench.py and README (Benchmark)",
    )
    from agent.bench.args import add_arguments as add_bench_arguments

    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    from agent.lifecycle.engine_cli import add_parsers as add_engine_parsers

    add_engine_parsers(sub, LOG_LEVELS)  # `build` and `engines list|show|rollback|prune` (no agent.yaml)
    return p


# ---- stdout's reader leaving -------------------------------------------------------------------------
def _stdout_reader_left() -> bool:
    """stdout is a pipe (or socket) whose reading end is closed: poll says POLLERR (pipe) or POLLHUP."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file descriptor (tests' captures)
        return False


def _discard_stdout() -> None:
    """From now on stdout's descriptor is /dev/null: whatever is still buffered, and the interpreter's own
    flush at exit, go nowhere instead of raising BrokenPipeError again ("Exception ignored ...")."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)
    except (AttributeError, OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _command(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is handled below like any other write
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise  # --debug on another pipe's (a child's, a socket's): its traceback
        # `edge-agent check --json | head -3`: the reader has what it wanted. End quietly, as Unix tools do.
        _discard_stdout()
        return READER_LEFT
    return code


def _command(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except (ConfigError, EngineError) as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # a bug, or bad input we did not foresee: one line, the traceback on --debug
        if isinstance(exc, BrokenPipeError) and _stdout_reader_left():
            raise  # main() ends quietly; any other broken pipe (a child's, a socket's) is an error to report
        if args.debug:
            raise
        why = f"{type(exc).__name__}: {exc}"
        print(f"edge-agent: internal error: {why} (--debug shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
