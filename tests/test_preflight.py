"""Configs that are valid YAML and schema but cannot run: caught by `run --check-config` (exit 2, one
`FILE: key.path: message` line each, never a traceback), and by `run` before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.config import ConfigError, load_config
from agent.preflight import preflight

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"


def base(**model: object) -> dict:
    return {
        "models": {
            "det": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "onnxruntime",
                **model,
            }
        },
        "cameras": {"cam": {"url": "rtsp://127.0.0.1:1/x", "model": "det"}},
        "mqtt": {"enabled": False},
    }


def check(tmp_path: Path, data: dict | str | bytes) -> tuple[int, str, str]:
    path = tmp_path / "agent.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(path), "--check-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout, out.stderr


def test_the_bundled_model_config_passes(tmp_path: Path) -> None:
    rc, out, err = check(tmp_path, base())
    assert rc == 0 and "ok (1 model(s), 1 camera(s))" in out, err


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"format": "yolov8"}, "models.det.format: yolov8: the model's outputs"),
        ({"format": "yolov5"}, "models.det.format: yolov5"),
        ({"format": "efficient_nms"}, "models.det.format: must be one of"),
        ({"onnx": "/nonexistent/model.onnx"}, "models.det.onnx: /nonexistent/model.onnx: no such file"),
        ({"onnx": str(ASSETS / "coco.names")}, "models.det.onnx:"),
        ({"labels": "/nonexistent/labels.txt"}, "models.det.labels: cannot read label file"),
        ({"labels": None}, "models.det.labels: required"),
    ],
)
def test_model_problems_are_named(tmp_path: Path, change: dict, expect: str) -> None:
    rc, _out, err = check(tmp_path, base(**change))
    assert rc == 2, err
    assert f"{tmp_path / 'agent.yaml'}: {expect}" in err, err
    assert "Traceback" not in err


def test_labels_files_that_are_empty_or_not_utf8(tmp_path: Path) -> None:
    empty = tmp_path / "empty.names"
    empty.write_text("\n \n")
    latin = tmp_path / "latin.names"
    latin.write_bytes(b"person\ncaf\xe9\n")
    for path, expect in ((empty, "has no labels"), (latin, "is not UTF-8")):
        rc, _, err = check(tmp_path, base(labels=str(path)))
        assert rc == 2 and f"models.det.labels: label file {path} {expect}" in err, err


def test_camera_classes_are_checked_against_the_labels(tmp_path: Path) -> None:
    data = base()
    data["cameras"]["cam"]["classes"] = ["person", "unicorn"]
    rc, _, err = check(tmp_path, data)
    assert rc == 2 and "cameras.cam.classes: unknown class 'unicorn'" in err


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (b"models: {}\ncameras: {}\ndevice_id: caf\xe9\n", "not UTF-8 text (byte 0xe9 on line 3)"),
        (
            "a: &a [1,1,1,1,1,1,1,1,1]\n"
            + "".join(
                f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            "too many values",
        ),
        ("[" * 5000 + "]" * 5000, "invalid YAML"),
    ],
)
def test_hostile_files_are_refused_cleanly(tmp_path: Path, text: str | bytes, expect: str) -> None:
    rc, _, err = check(tmp_path, text)
    assert rc == 2 and expect in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("camera", "expect"),
    [
        ({"open_timeout_s": 1e308}, "cameras.cam.open_timeout_s: must be <= 3600"),
        ({"read_timeout_s": float("inf")}, "cameras.cam.read_timeout_s"),
        ({"fps": 1e9}, "cameras.cam.fps: must be <= 1000"),
    ],
)
def test_values_the_libraries_cannot_take(tmp_path: Path, camera: dict, expect: str) -> None:
    data = base()
    data["cameras"]["cam"].update(camera)
    rc, _, err = check(tmp_path, data)
    assert rc == 2 and expect in err, err


def test_preflight_reports_every_problem_at_once(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    data = base(format="yolov8")
    data["cameras"]["cam"]["classes"] = ["unicorn"]
    path.write_text(yaml.safe_dump(data))
    problems = preflight(load_config(path), str(path))
    assert len(problems) == 2 and all(p.startswith(f"{path}: ") for p in problems)


def test_cli_never_prints_a_traceback_for_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(base()))
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(path), "--log-level", "verbose"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "invalid choice: 'verbose'" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
