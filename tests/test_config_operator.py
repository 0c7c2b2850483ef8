"""What an operator meets writing a config (issue 36): names and display names, the key's line in every
schema error, x-* anchor holders, variables (named in errors, reported with every other problem),
camera_defaults, check-config's summary, and the shipped first config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.config import ConfigError, load_config
from agent.config.reload import plan_reload
from pipelines.models import formats

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
SECRET = "hunter2-s3cret"
ENV = {k: v for k, v in os.environ.items() if k != "GATE_PASSWORD"}

BASE = f"""\
device_id: yard-01
models:
  det:
    onnx: {ASSETS / "nanodet-m-416.onnx"}
    labels: {ASSETS / "coco.names"}
    format: nanodet
    backend: onnxruntime
cameras:
  gate:
    url: rtsp://10.0.0.21/stream1
    model: det
mqtt: {{enabled: false}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def refused(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    """The lines of the ConfigError that loading `text` raises, without the file's name."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    lines = str(info.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    return [line.removeprefix(f"{path}: ") for line in lines]


def edge_agent(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command line, in an environment without the examples' variable."""
    exe = Path(sys.executable).with_name("edge-agent")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli"]
    return subprocess.run(
        [*cmd, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )


# ---- 13. names: ASCII ids, any text as a display name ---------------------------------------------------
def test_a_unicode_camera_id_is_refused_saying_ascii_and_where_other_text_goes(tmp_path: Path) -> None:
    [line] = refused(tmp_path, BASE.replace("  gate:", "  Einfahrt-Süd:"))
    assert line.startswith("cameras.Einfahrt-Süd: name may only hold ASCII letters (A-Z, a-z), digits (0-9)")
    assert "display `name:`" in line and line.endswith("(line 9)")


def test_display_names_are_free_text_with_bounds(tmp_path: Path) -> None:
    text = BASE.replace("    model: det\n", "    model: det\n    name: Einfahrt Süd 🚗\n")
    regions = "    zones: {door: {name: Tür, polygon: [[0, 0], [1, 0], [1, 1]]}}\n"
    regions += "    lines: {walk: {name: Gehweg → Hof, points: [[0, 0.5], [1, 0.5]]}}\n"
    text = text.replace("mqtt:", regions + "mqtt:")
    cam = load_config(write(tmp_path, text)).cameras["gate"]
    assert cam.name == "Einfahrt Süd 🚗" and cam.zones["door"].name == "Tür"
    assert cam.lines["walk"].name == "Gehweg → Hof"
    bad_names = (('"a\\tb"', "control characters"), ('"  "', "must not be empty"), ("x" * 65, "at most 64"))
    for bad, why in bad_names:
        [line] = refused(tmp_path, BASE.replace("    model: det\n", f"    model: det\n    name: {bad}\n"))
        assert line.startswith("cameras.gate.name: ") and why in line and line.endswith("(line 12)"), line


# ---- 16. where an error is, anchors, variables ------------------------------------------------------------
def test_schema_errors_name_the_line_of_their_key(tmp_path: Path) -> None:
    text = BASE.replace("    model: det\n", "    model: det\n    fps: -1\n    fsp: 3\n")
    text = text.replace("mqtt:", "    zones: {z: {polygon: [[0, 0], [1, 0], [x, 1]]}}\nmqtt:")
    text = text.replace("format: nanodet", "format: yolo9")
    names = [f"'{f}'" for f in formats()]  # the registry's, in its order
    one_of = f"{', '.join(names[:-1])} or {names[-1]}"
    assert sorted(refused(tmp_path, text)) == sorted(
        [
            f"models.det.format: must be one of {one_of} (line 6)",
            "cameras.gate.fps: must be > 0 (line 12)",
            "cameras.gate.fsp: unknown key (line 13)",
            "cameras.gate.zones.z.polygon.2.0: must be a number (line 14)",
        ]
    )
    # A check across keys names its key's line too; a required key that is missing, its section's.
    lines = refused(tmp_path, BASE.replace("    model: det\n", "    model: nope\n"))
    assert lines == ["cameras.gate.model: unknown model 'nope' (known: det) (line 11)"]
    lines = refused(tmp_path, BASE.replace("    model: det\n", ""))
    assert lines == ["cameras.gate.model: required key is missing (line 9)"]


def test_top_level_x_keys_hold_anchors_and_are_not_config(tmp_path: Path) -> None:
    text = BASE.replace("cameras:\n", "x-camera: &cam {model: det, fps: 5, min_score: 0.5}\ncameras:\n")
    text = text.replace("    model: det\n", "    <<: *cam\n    fps: 7\n")
    text = text.replace("mqtt:", "  yard:\n    <<: *cam\n    url: rtsp://10.0.0.22/s\nmqtt:")
    cfg = load_config(write(tmp_path, text))
    assert (cfg.cameras["gate"].fps, cfg.cameras["yard"].fps, cfg.cameras["yard"].min_score) == (7, 5, 0.5)
    # Only at the top level: elsewhere an x- key is an unknown key as any other.
    lines = refused(tmp_path, BASE.replace("    model: det\n", "    model: det\n    x-note: 1\n"))
    assert lines == ["cameras.gate.x-note: unknown key (line 12)"]


def test_a_variable_in_a_flow_mapping_gets_the_fix_in_its_error(tmp_path: Path) -> None:
    text = BASE.replace("mqtt: {enabled: false}", "mqtt: {enabled: false, host: ${BROKER:-localhost}}")
    [line] = refused(tmp_path, text)
    assert line.startswith("invalid YAML (line 12, column")
    assert 'must be quoted: key: "${VAR:-default}"' in line
    text = BASE.replace("mqtt: {enabled: false}", 'mqtt: {enabled: false, host: "${BROKER:-localhost}"}')
    assert load_config(write(tmp_path, text)).mqtt.host == "localhost"


def test_a_bad_value_from_a_variable_names_the_variable_never_the_value(tmp_path: Path) -> None:
    mqtt = "mqtt:\n  enabled: false\n  port: ${PORT}\n  password: ${PW}"
    text = BASE.replace("mqtt: {enabled: false}", mqtt)
    text = text.replace("    model: det\n", "    model: det\n    fps: ${FPS:-fast}\n")
    lines = refused(tmp_path, text, env={"PORT": "18x83", "PW": f"{SECRET}\x00"})
    assert sorted(lines) == [
        "cameras.gate.fps: must be a number (line 12; the value of ${FPS})",
        "mqtt.password: must not contain a NUL character (line 16; the value of ${PW})",
        "mqtt.port: must be an integer (line 15; the value of ${PORT})",
    ]
    assert not any(SECRET in line or "18x83" in line for line in lines)


# ---- 14. every problem at once, with unset variables -----------------------------------------------------
def test_an_unset_variable_does_not_hide_the_other_problems(tmp_path: Path) -> None:
    text = BASE.replace("rtsp://10.0.0.21/stream1", "rtsp://viewer:${GATE_PASSWORD}@10.0.0.21/stream1")
    text = text.replace(str(ASSETS / "nanodet-m-416.onnx"), str(tmp_path / "yolov8n.onnx"))
    path = write(tmp_path, text)
    for args in (["check-config", "-c", str(path)], ["run", "-c", str(path), "--check-config"]):
        out = edge_agent(*args)
        assert out.returncode == 2, out
        assert "environment variable GATE_PASSWORD is not set (line 10)" in out.stderr, out.stderr
        assert "yolov8n.onnx" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_path_that_holds_an_unset_variable_is_named_once(tmp_path: Path) -> None:
    text = BASE.replace(str(ASSETS / "nanodet-m-416.onnx"), "${MODELS}/yolov8n.onnx")
    out = edge_agent("check-config", "-c", str(write(tmp_path, text)))
    assert out.returncode == 2, out
    unset = "models.det.onnx: environment variable MODELS is not set (line 4)"
    assert out.stderr.splitlines() == [f"edge-agent: {tmp_path / 'agent.yaml'}: {unset}"]


def test_the_shipped_full_example_lists_every_problem(tmp_path: Path) -> None:
    out = edge_agent("check-config", "-c", str(REPO / "examples" / "agent.yaml"))
    assert out.returncode == 2, out
    assert "GATE_PASSWORD is not set" in out.stderr and "yolov8n.onnx" in out.stderr, out.stderr


def test_the_shipped_first_config_runs_as_it_is() -> None:
    first = REPO / "examples" / "first.yaml"
    out = edge_agent("check-config", "-c", str(first))
    assert out.returncode == 0 and out.stdout.strip() == f"{first}: ok (1 model(s), 1 camera(s))", out
    exe = Path(sys.executable).with_name("edge-agent")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli"]
    proc = subprocess.Popen(
        [*cmd, "run", "-c", str(first)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the console's first line per camera: it runs, it detects
        assert line.split()[1:3] == ["street", line.split()[2]] and "[onnxruntime/fp32 b1]" in line, line
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err


# ---- 17. check-config's summary ----------------------------------------------------------------------
def test_check_config_counts_disabled_cameras_apart(tmp_path: Path) -> None:
    yard = "  yard:\n    url: rtsp://10.0.0.22/s\n    model: det\n    enabled: false\n"
    text = BASE.replace("mqtt:", yard + "mqtt:")
    path = write(tmp_path, text)
    out = edge_agent("check-config", "-c", str(path))
    assert out.returncode == 0, out
    assert out.stdout.strip() == f"{path}: ok (1 model(s), 1 camera(s), 1 disabled)"


# ---- 18. camera_defaults -------------------------------------------------------------------------------
DEFAULTS = """\
camera_defaults:
  fps: 5
  classes: [person, car]
  tracking: {max_lost_s: 3, min_hits: 3}
  events: {objects: none}
  zones: {door: {polygon: [[0, 0], [1, 0], [1, 1]], labels: [person]}}
"""


def cameras(own: str = "") -> str:
    return BASE.replace("cameras:\n", DEFAULTS + "cameras:\n").replace(
        "mqtt:",
        "  yard:\n    url: rtsp://10.0.0.22/s\n    model: det\n" + own + "mqtt:",
    )


def test_camera_defaults_reach_every_camera_and_a_cameras_own_keys_win(tmp_path: Path) -> None:
    own = (
        "    fps: 10\n    classes: [car, person]\n    tracking: {min_hits: 1}\n"
        "    zones: {door: {polygon: [[0, 0], [0.5, 0], [0.5, 0.5]]},"
        " gate: {polygon: [[0, 0], [1, 0], [0, 1]]}}\n"
    )
    cfg = load_config(write(tmp_path, cameras(own)))
    gate, yard = cfg.cameras["gate"], cfg.cameras["yard"]
    assert (gate.fps, gate.classes) == (5, ["person", "car"])
    assert (gate.tracking.max_lost_s, gate.tracking.min_hits) == (3, 3)
    assert gate.events.objects == "none" and list(gate.zones) == ["door"]
    # Sections merge key by key; a list is one value (yard's classes replace the default's).
    assert (yard.fps, yard.classes) == (10, ["car", "person"])
    assert (yard.tracking.max_lost_s, yard.tracking.min_hits) == (3, 1)
    assert sorted(yard.zones) == ["door", "gate"]
    assert yard.zones["door"].polygon == [(0, 0), (0.5, 0), (0.5, 0.5)]
    assert yard.zones["door"].labels == ["person"]  # the default zone's key the camera did not write


def test_an_error_in_camera_defaults_is_named_there_once(tmp_path: Path) -> None:
    text = cameras().replace("  fps: 5\n", "  fps: -1\n  url: rtsp://x/y\n")
    assert refused(tmp_path, text) == [
        "camera_defaults.url: a camera's own key (its source, display name or shard), not a default"
        " (line 10)",
        "camera_defaults.fps: must be > 0 (line 9)",
    ]


def test_an_error_that_comes_from_the_merge_names_the_camera_and_camera_defaults(tmp_path: Path) -> None:
    text = cameras("    min_score: 0.3\n").replace("  tracking: {max_lost_s: 3, min_hits: 3}\n", "")
    text = text.replace("  fps: 5\n", "  fps: 5\n  tracking: {low_score: 0.35}\n")
    assert refused(tmp_path, text) == [
        "cameras.yard.tracking.low_score: 0.35 is above min_score 0.3 (it is the floor below min_score where"
        " detections only keep tracks alive) (line 10; from camera_defaults)"
    ]


def _plan(old: str, new: str, tmp_path: Path) -> Any:
    a = load_config(write(tmp_path, old))
    b = load_config(write(tmp_path, new))
    return plan_reload(a, b)


def test_a_change_of_camera_defaults_plans_as_the_same_change_in_each_camera(tmp_path: Path) -> None:
    by_defaults = _plan(cameras(), cameras().replace("max_lost_s: 3", "max_lost_s: 4"), tmp_path)
    own = "    model: det\n    fps: 5\n    classes: [person, car]\n"
    own += "    tracking: {max_lost_s: 3, min_hits: 3}\n    events: {objects: none}\n"
    own += "    zones: {door: {polygon: [[0, 0], [1, 0], [1, 1]], labels: [person]}}\n"
    yard = "  yard:\n    url: rtsp://10.0.0.22/s\n" + own
    each = BASE.replace("    model: det\n", own).replace("mqtt:", yard + "mqtt:")
    # Written in each camera, the cameras are those camera_defaults makes.
    assert load_config(write(tmp_path, each)) == load_config(write(tmp_path, cameras())).model_copy(
        update={"camera_defaults": load_config(write(tmp_path, each)).camera_defaults}
    )
    by_cameras = _plan(each, each.replace("max_lost_s: 3", "max_lost_s: 4"), tmp_path)
    assert by_defaults.cameras_analytics == by_cameras.cameras_analytics == ["gate", "yard"]
    assert [c.key for c in by_defaults.changes] == [c.key for c in by_cameras.changes]
    assert by_defaults.summary() == by_cameras.summary()
    restart = _plan(cameras(), cameras().replace("  fps: 5\n", "  fps: 6\n"), tmp_path)
    assert restart.cameras_restarted == ["gate", "yard"] and not restart.live, restart


def test_camera_defaults_are_bounded_as_aliases_are(tmp_path: Path) -> None:
    many = "".join(f"  c{i}:\n    url: rtsp://10.0.0.21/s\n" for i in range(100))
    polygon = [[i / 20, (i % 2) / 2] for i in range(20)]
    zones = ", ".join(f"z{i}: {{polygon: {polygon}}}" for i in range(32))
    defaults = f"camera_defaults:\n  model: det\n  zones: {{{zones}}}\n"
    text = BASE.replace("cameras:\n", defaults + "cameras:\n" + many)
    assert refused(tmp_path, text) == ["camera_defaults: too many values once merged into 101 cameras"]


def test_a_new_display_name_renames_without_touching_the_camera_or_its_counts(tmp_path: Path) -> None:
    zone = "    zones: {door: {name: Tür, polygon: [[0, 0], [1, 0], [1, 1]]}}\n"
    old = BASE.replace("    model: det\n", "    model: det\n    name: Tor\n" + zone)
    new = old.replace("name: Tor", "name: Tor Nord").replace("name: Tür", "name: Haustür")
    p = _plan(old, new, tmp_path)
    assert p.cameras_live == ["gate"] and not (p.cameras_analytics or p.cameras_restarted), p


def test_an_unset_variable_in_camera_defaults_is_named_once(tmp_path: Path) -> None:
    text = cameras().replace("max_lost_s: 3", "max_lost_s: \"${LOST}\"")
    assert refused(tmp_path, text) == [
        "camera_defaults.tracking.max_lost_s: environment variable LOST is not set (line 11)"
    ]
    assert load_config(write(tmp_path, text), env={"LOST": "4"}).cameras["yard"].tracking.max_lost_s == 4
