"""The entry points: load_config (a YAML file) and parse_config (a mapping) -> AgentConfig or ConfigError."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent.config.defaults import apply_camera_defaults
from agent.config.deploy import deploy_file_problems
from agent.config.engines import engines_file_problems
from agent.config.env import expand_env
from agent.config.errors import ConfigError
from agent.config.messages import format_errors, joined, placed
from agent.config.mqtt import mqtt_file_problems
from agent.config.schema import AgentConfig
from agent.config.sources import camera_file
from agent.config.yaml_loader import read_yaml

MAX_CONFIG_BYTES = 1 << 20


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None, env: dict[str, str] | None = None
) -> AgentConfig:
    """Validate a mapping (as loaded from YAML). Relative paths resolve against base_dir."""
    return _parse(data, source, base_dir, dict(os.environ) if env is None else env, [], {})


def _parse(
    data: Any,
    source: str,
    base_dir: Path | None,
    env: dict[str, str],
    problems: list[str],
    key_lines: dict[str, int],
) -> AgentConfig:
    """As parse_config; `problems`: lines found before (duplicate keys), reported with the schema's;
    `key_lines`: the line of each key in the file (yaml_loader), for the messages."""
    if not isinstance(data, dict):
        raise ConfigError(joined([*problems, f"{source}: the top level must be a mapping"], source))
    # Top-level x-* keys hold YAML anchors for the rest of the file (as in compose files): not config.
    data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("x-"))}
    failed: list[tuple[Any, ...]] = []
    used: dict[str, list[str]] = {}
    found: list[str] = []  # this file's problems: an unset variable, a bad value, ...
    try:
        data = expand_env(data, source, env, found, failed, used)
    except ConfigError as exc:
        raise ConfigError(joined([*problems, str(exc)], source)) from None
    try:
        data, taken, own = apply_camera_defaults(data, failed)
    except ConfigError as exc:
        raise ConfigError(joined([*problems, f"{source}: {exc}"], source)) from None
    found += [f"{source}: {line}" for line in own]
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as exc:
        found += format_errors(exc, source, failed)
        lines = [*problems, *placed(found, source, key_lines, used, taken)]
        raise ConfigError(joined(lines, source)) from None
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    found_files = mqtt_file_problems(cfg.mqtt) + deploy_file_problems(cfg.deploy)
    files = [f"{source}: {p}" for p in found_files + engines_file_problems(cfg.engines)]
    files = [line for line in files if "${" not in line]  # a path with an unset variable: reported above
    said = {_key_of(line, source) for line in found}  # a path refused above (a NUL in it): said once
    files = [line for line in files if _key_of(line, source) not in said]
    if problems or found or files:
        # Only values the schema took: with an unset variable (its text), the config goes with the error so
        # the caller can check its files and models too (every problem at once).
        lines = [*problems, *placed(found, source, key_lines, used, taken), *files]
        unset = bool(found) and all(line.endswith(" is not set") for line in found)
        raise ConfigError(joined(lines, source), config=cfg if unset else None)
    return cfg


def _key_of(line: str, source: str) -> str:
    return line.removeprefix(f"{source}: ").split(": ", 1)[0]


def _resolve_paths(cfg: AgentConfig, base: Path) -> AgentConfig:
    """Every relative path against the config file's folder (base), a camera's file `url` included."""

    def rel(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p)

    models = {
        name: m.model_copy(
            update={
                "onnx": rel(m.onnx),
                "labels": rel(m.labels),
                "calibration": m.calibration.model_copy(update={"folder": rel(m.calibration.folder)}),
                "engine_file": rel(m.engine_file),
            }
        )
        for name, m in cfg.models.items()
    }
    cameras = {}
    for name, cam in cfg.cameras.items():
        local = camera_file(cam.url) if cam.url is not None else None
        if local is not None and cam.url == local and not Path(local).is_absolute():
            cam = cam.model_copy(update={"url": str(base / local)})
        cameras[name] = cam
    update: dict[str, Any] = {"models": models, "cameras": cameras, "engine_dir": rel(cfg.engine_dir)}
    mqtt_update: dict[str, Any] = {"password_file": rel(cfg.mqtt.password_file)}
    if cfg.mqtt.tls is not None:
        tls = cfg.mqtt.tls
        files = {key: rel(getattr(tls, key)) for key in ("ca_file", "cert_file", "key_file")}
        mqtt_update["tls"] = tls.model_copy(update=files)
    update["mqtt"] = cfg.mqtt.model_copy(update=mqtt_update)
    update["deploy"] = cfg.deploy.resolved(rel)
    update["engines"] = cfg.engines.resolved(rel)
    return cfg.model_copy(update=update)


def load_config(path: str | Path, env: dict[str, str] | None = None) -> AgentConfig:
    path = Path(path)
    data, duplicates, key_lines = read_yaml(_read_text(path), path)
    env = dict(os.environ) if env is None else env
    return _parse(data, str(path), path.resolve().parent, env, duplicates, key_lines)


def _read_text(path: Path) -> str:
    """The file's text; ConfigError naming the file where it cannot be read, is too large or not UTF-8."""
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: cannot read config: is a directory, not a file")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: config larger than {MAX_CONFIG_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:  # a pipe (-c <(...)) has no size to stat
        raise ConfigError(f"{path}: config larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from None
