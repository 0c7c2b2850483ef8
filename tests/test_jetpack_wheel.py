"""A pip TensorRT wheel shadowing JetPack's on a Jetson is named at start-up (issue 35, item 9): the check
(engines.trt.jetpack) with stand-in Jetson paths, and the line agent.preflight prints."""

from __future__ import annotations

import re
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import yaml

from agent.config import load_config
from agent.preflight import preflight
from engines.trt import jetpack
from engines.trt.jetpack import is_jetson, tensorrt_wheel_problem

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
TEGRA = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n"


def found_at(directory: str) -> jetpack.Finder:
    def find(name: str) -> ModuleSpec | None:
        if name != "tensorrt":
            return None
        return ModuleSpec(name, None, origin=f"{directory}/{name}/__init__.py")

    return find


def test_jetson_is_told_by_its_release_file_or_device_tree(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    assert not is_jetson(absent, absent)
    (tmp_path / "nv_tegra_release").write_text(TEGRA)
    assert is_jetson(tmp_path / "nv_tegra_release", absent)
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\0")
    assert is_jetson(absent, model)
    model.write_bytes(b"Raspberry Pi 5 Model B Rev 1.0\0")
    assert not is_jetson(absent, model)


@pytest.mark.parametrize(
    ("where", "wheel"),
    [
        ("/usr/lib/python3.10/dist-packages", False),  # JetPack's python3-libnvinfer
        ("/opt/edge-agent/.venv/lib/python3.10/site-packages", True),  # the [tensorrt] extra in a venv
        ("/usr/local/lib/python3.10/dist-packages", True),  # sudo pip install tensorrt
        ("/home/jetson/.local/lib/python3.10/site-packages", True),  # pip install --user
    ],
)
def test_a_wheel_over_jetpacks_tensorrt_is_named(tmp_path: Path, where: str, wheel: bool) -> None:
    release = tmp_path / "nv_tegra_release"
    release.write_text(TEGRA)
    problem = tensorrt_wheel_problem(release, tmp_path / "absent", found_at(where))
    if not wheel:
        assert problem is None
        return
    assert problem is not None
    assert f"imports tensorrt from {where}/tensorrt, a pip wheel, not JetPack's" in problem
    assert "pip uninstall tensorrt tensorrt-cu12" in problem
    assert "python3 -m venv --system-site-packages" in problem and "[tensorrt] extra" in problem


def test_no_problem_off_a_jetson_or_without_tensorrt(tmp_path: Path) -> None:
    venv = found_at("/srv/.venv/lib/python3.12/site-packages")
    assert tensorrt_wheel_problem(tmp_path / "a", tmp_path / "b", venv) is None  # a server: wheels are right
    release = tmp_path / "nv_tegra_release"
    release.write_text(TEGRA)
    assert tensorrt_wheel_problem(release, tmp_path / "b", lambda name: None) is None


def test_preflight_names_the_shadowing_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = tmp_path / "nv_tegra_release"
    release.write_text(TEGRA)
    monkeypatch.setattr(jetpack, "TEGRA_RELEASE", release)
    monkeypatch.setattr(jetpack, "FIND_SPEC", found_at(str(tmp_path / "venv/lib/python3.10/site-packages")))
    model = {
        "onnx": str(ASSETS / "nanodet-m-416.onnx"),
        "format": "nanodet",
        "labels": str(ASSETS / "coco.names"),
        "backend": "auto",
    }
    data = {
        "models": {"det": model},
        "cameras": {"cam": {"url": "rtsp://127.0.0.1:1/x", "model": "det"}},
        "mqtt": {"enabled": False},
        "engine_dir": str(tmp_path / "engines"),
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    lines = [x for x in preflight(load_config(path), str(path)) if "tensorrt" in x]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: models.det.backend: this Jetson imports")
    # ONNX Runtime only: TensorRT is never imported, nothing to say.
    model["backend"] = "onnxruntime"
    path.write_text(yaml.safe_dump(data))
    assert not [x for x in preflight(load_config(path), str(path)) if "pip wheel" in x]


def test_the_documented_floor_is_jetpack_6() -> None:
    """Item 6: JetPack 5.1's TensorRT bindings are Python 3.8 and CUDA 11.4, below the package's floor; every
    place that states a Jetson floor says JetPack 6, none JetPack 5."""
    root = Path(__file__).resolve().parents[1]
    texts = {
        name: (root / name).read_text()
        for name in ("README.md", "engines/SUPPORT.md", "pyproject.toml", "engines/trt/module.py")
    }
    for name, text in texts.items():
        assert "JetPack 6" in text or "JetPack >= 6" in text, name
        assert not re.search(r"JetPack >= ?5|JetPack 5(\.\d)? (or|and) (later|newer)", text), name
    assert "Python 3.8 and CUDA 11.4" in texts["README.md"]
