"""Bad configurations through the real command line: `edge-agent run -c F --check-config` refuses each with
exit status 2 and one line `F: key.path: message` (a file that cannot be read as a whole: `F: message`),
never a traceback; the unbroken config passes (the control that shows these tests can tell)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import run_cli

from faults.harness import CLIP, LABELS, MODEL

ASSETS = MODEL.parent


def base(tmp_path: Path) -> dict[str, Any]:
    return {
        "device_id": "cfg",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "detector": {
                "onnx": str(MODEL),
                "format": "nanodet",
                "labels": str(LABELS),
                "backend": "onnxruntime",
                "precision": "fp32",
            }
        },
        "cameras": {"street": {"url": str(CLIP), "model": "detector"}},
        "mqtt": {"host": "127.0.0.1", "port": 1883},
    }


def _labels(tmp_path: Path, data: dict[str, Any], content: bytes) -> dict[str, Any]:
    path = tmp_path / "labels.txt"
    path.write_bytes(content)
    data["models"]["detector"]["labels"] = str(path)
    return data


def _set(*keys: str, value: object) -> Callable[[Path, dict[str, Any]], dict[str, Any]]:
    def change(tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return data

    return change


def _not_utf8_config(tmp_path: Path, data: dict[str, Any]) -> bytes:
    text = yaml.safe_dump(data, sort_keys=False).encode()
    return text.replace(b"device_id: cfg", b"device_id: cfg  # caf\xe9 (Latin-1)")


# (id, change of the base config -> the new mapping, or the file's bytes; key path the error line must
# name, None for the file as a whole; fragments of which the message must hold one, case-insensitive)
CASES: list[
    tuple[str, Callable[[Path, dict[str, Any]], dict[str, Any] | bytes], str | None, tuple[str, ...]]
] = [
    ("config-not-utf8", _not_utf8_config, None, ("utf-8",)),
    ("labels-empty", lambda p, d: _labels(p, d, b"\n  \n"), "models.detector.labels", ("no labels", "empty")),
    (
        "labels-not-utf8",
        lambda p, d: _labels(p, d, b"person\ncaf\xe9\n"),
        "models.detector.labels",
        ("utf-8",),
    ),
    (
        "format-unknown",
        _set("models", "detector", "format", value="yolov99"),
        "models.detector.format",
        ("one of",),
    ),
    ("mqtt-host-empty", _set("mqtt", "host", value=""), "mqtt.host", ("empty",)),
    ("keepalive-100000", _set("mqtt", "keepalive", value=100000), "mqtt.keepalive", ("65535",)),
    (
        "open-timeout-1e308",
        _set("cameras", "street", "open_timeout_s", value=1e308),
        "cameras.street.open_timeout_s",
        ("<=",),
    ),
    (
        "nanodet-declared-yolov8",
        _set("models", "detector", "format", value="yolov8"),
        "models.detector.format",
        ("yolov8",),
    ),
    (
        "model-missing",
        _set("models", "detector", "onnx", value="/nonexistent/model.onnx"),
        "models.detector.onnx",
        ("no such file", "not found", "does not exist"),
    ),
    (
        "labels-missing",
        _set("models", "detector", "labels", value="/nonexistent/coco.names"),
        "models.detector.labels",
        ("no such file", "not found", "does not exist", "cannot read"),
    ),
    ("log-level-verbose-in-file", _set("log_level", value="verbose"), "log_level", ("one of",)),
]


def check_config(path: Path, *extra: str) -> tuple[int, str, str]:
    done = run_cli("run", "-c", str(path), "--check-config", *extra, timeout=60)
    return done.returncode, done.stdout, done.stderr


def assert_no_crash(out: str, err: str) -> None:
    for text in (out, err):
        assert "Traceback" not in text, text
        assert "internal error" not in text, text


def test_the_unbroken_config_passes(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(base(tmp_path)))
    rc, out, err = check_config(path)
    assert rc == 0, err
    assert f"{path}: ok" in out


@pytest.mark.parametrize(("case", "change", "key", "fragments"), CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_refused_with_exit_2_and_a_keyed_line(
    tmp_path: Path,
    case: str,
    change: Callable[[Path, dict[str, Any]], dict[str, Any] | bytes],
    key: str | None,
    fragments: tuple[str, ...],
) -> None:
    path = tmp_path / "agent.yaml"
    made = change(tmp_path, base(tmp_path))
    path.write_bytes(made if isinstance(made, bytes) else yaml.safe_dump(made, sort_keys=False).encode())
    rc, out, err = check_config(path)
    assert_no_crash(out, err)
    assert rc == 2, f"{case}: exit {rc}\nstdout: {out}\nstderr: {err}"
    assert ": ok (" not in out, out
    head = f"{path}: {key}: " if key is not None else f"{path}: "
    lines = [line for line in err.splitlines() if head in line]
    assert lines, f"{case}: no line with {head!r} in:\n{err}"
    assert any(f in line.lower() for line in lines for f in fragments), (case, fragments, lines)


def test_unknown_log_level_on_the_command_line_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(base(tmp_path)))
    rc, out, err = check_config(path, "--log-level", "verbose")
    assert_no_crash(out, err)
    assert rc == 2, (out, err)
    assert "--log-level" in err and "'verbose'" in err, err
    assert "debug" in err and "error" in err, err  # the choices are named
    assert ": ok (" not in out
