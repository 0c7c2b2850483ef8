"""`edge-agent demo` and `run`: an agent (or a sharded supervisor) serving until stopped; `check-config`
(= `run --check-config`): the config checked."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import string
import sys
from pathlib import Path
from typing import Any

from agent.cli.argtypes import LOG_LEVELS, port
from agent.cli.stdout import READER_LEFT, Console
from agent.config import AgentConfig, ConfigError, load_config, parse_config
from agent.config.summary import counted
from agent.service.logs import setup_logging

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # agent/assets
DEMO_MODEL = ASSETS / "nanodet-m-416.onnx"
DEMO_LABELS = ASSETS / "coco.names"
DEMO_CLIP = ASSETS / "bikes.mp4"
_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")
SERVICE_CONFIG = "/etc/edge-agent/agent.yaml"  # where install-service puts it (agent.service.install.CONFIG)
log = logging.getLogger("agent.cli")  # the name its console warning always had


def add_parsers(sub: Any) -> None:
    d = sub.add_parser("demo", help="run the bundled model on the bundled clip (no GPU, no broker needed)")
    d.add_argument("--mqtt-host", default="localhost")
    d.add_argument("--mqtt-port", type=port, default=1883)
    d.add_argument("--clip", help="another video file to loop instead of the bundled one")
    d.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="run the daemon")
    r.add_argument("-c", "--config", required=True)
    r.add_argument("--check-config", action="store_true", help="validate the config and exit")
    r.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="default: the config's log_level")
    r.set_defaults(func=cmd_run)

    cc = sub.add_parser(
        "check-config",
        help="validate a config (schema, files, models): 0 ok, 2 with every problem (= run --check-config)",
    )
    cc.add_argument("-c", "--config", default=SERVICE_CONFIG, help=f"default: {SERVICE_CONFIG} (the service)")
    cc.set_defaults(func=cmd_check_config)


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


def clip_problem(clip: Path) -> str | None:
    """Why the demo cannot play `clip` (None: it decodes a first frame). Without this check a missing or
    undecodable clip made the camera retry forever and the demo never ended."""
    from agent.config.files import file_problem

    problem = file_problem(clip)
    if problem is not None:
        return problem
    import cv2

    import pipelines.sources.spec  # noqa: F401  (keeps OpenCV's and FFmpeg's own lines off stderr)

    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    try:
        ok, frame = cap.read() if cap.isOpened() else (False, None)
    finally:
        cap.release()
    return None if ok and frame is not None else "not a video FFmpeg can decode (no first frame)"


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.clip:
        problem = clip_problem(Path(args.clip))
        if problem is not None:
            print(f"edge-agent demo: --clip {args.clip}: {problem}", file=sys.stderr)
            return 2
    cfg = demo_config(args.mqtt_host, args.mqtt_port, Path(args.clip) if args.clip else None)
    print(
        f"edge-agent demo: NanoDet-m on {Path(cfg.cameras['street'].url or '').name} "
        "with ONNX Runtime (CPU); "
        f"MQTT to {args.mqtt_host}:{args.mqtt_port} when a broker answers. Ctrl-C stops.",
        flush=True,
    )
    return run_agent(cfg, quiet_mqtt=True, stop_unread=True)


def checked_config(path: str) -> AgentConfig:
    """The config at `path`, loaded and preflighted (files, labels, model outputs vs format, classes):
    ConfigError with every problem otherwise."""
    from agent.preflight import preflight

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        if exc.config is None:  # the schema refused it: nothing to check the files of
            raise
        # An unset variable (or a file named in the config): the rest is checked too, every problem at once.
        more = [line for line in preflight(exc.config, path) if "${" not in line]  # its variable is named
        raise ConfigError("\n".join([str(exc), *more])) from None
    problems = preflight(cfg, path)
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def cmd_check_config(args: argparse.Namespace) -> int:
    """`edge-agent check-config [-c F]` and `run -c F --check-config`: one line when ok (exit 0); every
    problem and exit 2 otherwise (agent.cli.main prints a ConfigError)."""
    cfg = checked_config(args.config)
    from agent.shards.placement import place

    plan = place(cfg)
    shards = f", {plan.why}" if plan.count > 1 or cfg.pipeline.shards != 1 else ""
    print(f"{args.config}: ok ({counted(cfg)}{shards})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.check_config:
        return cmd_check_config(args)
    cfg = checked_config(args.config)
    level = args.log_level or cfg.log_level
    setup_logging(level)
    return run_agent(cfg, config_path=args.config, level=level)


def run_agent(
    cfg: AgentConfig,
    quiet_mqtt: bool = False,
    config_path: str | None = None,
    level: str = "info",
    stop_unread: bool = False,
) -> int:
    """Run until stopped. `stop_unread`: stop when stdout's reader leaves (the demo, whose output is the
    point); otherwise the console lines stop and the agent keeps serving."""
    console, saved = Console(sys.stdout), sys.stdout
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
    console: Console,
    stop_unread: bool,
) -> int:
    from agent.cli.daemon import local_device, sharded_device  # heavy imports only for commands that run
    from agent.device import Device
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
    agent: Device[Any]
    if plan.count > 1:  # pipeline.shards: a supervisor over worker processes (agent.shards)
        agent = sharded_device(cfg, plan, level=level, config_path=config_path, notifier=notifier)
    else:
        agent = local_device(cfg, quiet_mqtt=quiet_mqtt, config_path=config_path, notifier=notifier)
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
