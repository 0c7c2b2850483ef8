"""A config that refuses what would fail (issue 29): `edge-agent run -c F --check-config` says, one line per
problem naming the file and the key, everything that `run` would trip over: duplicate YAML keys, strings
where numbers or booleans belong, NaN and infinity, relative paths (camera files too) against the config's
folder, camera URLs, files that are directories, engine_dir, mqtt.prefix, the Prometheus port, GPU
preprocessing, absurd sizes; and no input, however mangled, ends in a traceback or echoes a secret."""

from __future__ import annotations

import math
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import preflight as pre
from agent.config import (
    ConfigError,
    camera_url_problem,
    load_config,
    parse_config,
    topic_prefix_problem,
)
from agent.mqtt.topics import Topics
from agent.preflight import preflight

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
LABELS = ASSETS / "coco.names"
CLIP = ASSETS / "bikes.mp4"
SECRET = "hunter2-s3cret"
ASCII = "may only hold ASCII letters (A-Z, a-z), digits (0-9), '_', '-' and '.'"
TOPIC_LEVEL = " (the name is a topic level; any other text goes in its display `name:`)"
LINE = re.compile(r" \(line [0-9]+\)$")
LINE_AND = re.compile(r" \(line [0-9]+; ")

BASE = f"""\
device_id: yard-01
engine_dir: engines
models:
  det:
    onnx: {MODEL}
    labels: {LABELS}
    format: nanodet
    backend: onnxruntime
cameras:
  gate:
    url: rtsp://viewer:{SECRET}@10.0.0.21:554/stream1
    model: det
    fps: 5
mqtt: {{enabled: false}}
"""


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    """The lines of the ConfigError that loading `text` raises, each checked to start with the file."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    lines = str(info.value).splitlines()
    assert lines and all(line.startswith(f"{path}: ") for line in lines), lines
    assert SECRET not in str(info.value)
    # The key's line (" (line N)") is checked in tests/test_config_operator.py; the rest is checked here.
    return [unlined(line.removeprefix(f"{path}: ")) for line in lines]


def unlined(line: str) -> str:
    """`line` without the key's line number, its other notes kept: "... (line 5; the value of ${X})"."""
    return LINE_AND.sub(" (", LINE.sub("", line))


def camera(**keys: Any) -> str:
    """BASE with the camera's keys replaced or added (flow YAML values)."""
    text = BASE
    for key, value in keys.items():
        line = f"    {key}: {value}\n"
        old = next((x for x in text.splitlines(keepends=True) if x.startswith(f"    {key}: ")), None)
        text = text.replace(old, line) if old else text.replace("    model: det\n", "    model: det\n" + line)
    return text


def with_mqtt(mqtt: str) -> str:
    return BASE.replace("mqtt: {enabled: false}", f"mqtt: {mqtt}")


def cli(path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line: `edge-agent run -c PATH --check-config`."""
    exe = Path(sys.executable).with_name("edge-agent")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [*cmd, "run", "-c", str(path), "--check-config"],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- 1. duplicate keys --------------------------------------------------------------------------------
def test_a_duplicate_key_names_both_lines(tmp_path: Path) -> None:
    text = camera(fps=5).replace("    fps: 5\n", "    fps: 5\n    fps: 6\n")
    assert refused(tmp_path, text) == [
        "cameras.gate.fps: duplicate key on lines 13 and 14 (YAML keeps only the last)"
    ]


def test_every_duplicate_and_the_schema_errors_come_together(tmp_path: Path) -> None:
    text = BASE.replace("mqtt: {enabled: false}", "mqtt: {enabled: false}\nmqtt: {enabled: true}")
    text = text.replace("    format: nanodet\n", "    format: nanodet\n    format: yolov8\n    streams: 0\n")
    lines = refused(tmp_path, text)
    assert "models.det.format: duplicate key on lines 7 and 8 (YAML keeps only the last)" in lines
    assert "mqtt: duplicate key on lines 16 and 17 (YAML keeps only the last)" in lines
    assert "models.det.streams: must be >= 1" in lines


def test_three_times_the_same_key_and_keys_that_are_equal_values(tmp_path: Path) -> None:
    text = BASE + "telemetry:\n  interval_s: 1\n  interval_s: 2\n  'interval_s': 3\n"
    assert refused(tmp_path, text) == [
        "telemetry.interval_s: duplicate key on lines 16, 17 and 18 (YAML keeps only the last)"
    ]


def test_a_merge_key_override_is_not_a_duplicate(tmp_path: Path) -> None:
    text = BASE.replace(
        "  gate:\n",
        "  base: &cam {url: rtsp://10.0.0.9/s, model: det, fps: 2}\n  gate:\n",
    ).replace("    model: det\n    fps: 5\n", "    model: det\n    <<: *cam\n    fps: 5\n")
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.cameras["gate"].fps == 5 and cfg.cameras["base"].fps == 2


# ---- 2. strict types ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            camera(loop='"yes"'),
            "cameras.gate.loop: must be true or false, not a string (write it without quotes)",
        ),
        (
            camera(loop='"true"'),
            "cameras.gate.loop: must be true or false, not a string (write it without quotes)",
        ),
        (camera(loop="1"), "cameras.gate.loop: must be true or false, not a number"),
        (camera(fps='"5"'), "cameras.gate.fps: must be a number, not a string (write it without quotes)"),
        (camera(fps="[5]"), "cameras.gate.fps: must be a number, not a list"),
        (camera(fps="true"), "cameras.gate.fps: must be a number, not true/false"),
        (camera(min_score=""), "cameras.gate.min_score: must be a number, not empty (null)"),
        (camera(classes="person"), "cameras.gate.classes: must be a list, not a string"),
        (camera(zones="[a]"), "cameras.gate.zones: must be a mapping, not a list"),
        (
            with_mqtt('{enabled: false, port: "1883"}'),
            "mqtt.port: must be an integer, not a string (write it without quotes)",
        ),
        (with_mqtt("{enabled: false, keepalive: 30.5}"), "mqtt.keepalive: must be an integer, got 30.5"),
        (
            with_mqtt("{enabled: false, tls: 'yes'}"),
            "mqtt.tls: must be true, false or a mapping of ca_file, cert_file, key_file, insecure",
        ),
        (
            with_mqtt("{enabled: false, username: u, password: 1234}"),
            "mqtt.password: must be a string, not a number",
        ),
        (BASE.replace("yard-01", "2024"), "device_id: must be a string, not a number"),
        (BASE.replace("onnx: ", "onnx: 5 #"), "models.det.onnx: must be a path (a string), not a number"),
        (BASE + "console: 'no'\n", "console: must be true or false, not a string (write it without quotes)"),
        (
            camera(zones="{z: {polygon: [[0, 0], [1, 0], ['0.5', 1]]}}"),
            "cameras.gate.zones.z.polygon.2.0: must be a number, not a string (write it without quotes)",
        ),
    ],
)
def test_no_string_to_number_or_boolean(tmp_path: Path, text: str, line: str) -> None:
    assert refused(tmp_path, text) == [line]


def test_what_stays_accepted(tmp_path: Path) -> None:
    text = camera(fps=5, min_score=1, loop="no", open_timeout_s="1e1", read_timeout_s="2.5e-1")
    text = text.replace(
        "mqtt: {enabled: false}", "mqtt: {enabled: false, offline_queue: 1e5, keepalive: 60.0}"
    )
    cfg = load_config(write(tmp_path, text), env={})
    cam = cfg.cameras["gate"]
    assert (cam.fps, cam.min_score, cam.loop, cam.open_timeout_s, cam.read_timeout_s) == (
        5.0,
        1.0,
        False,
        10.0,
        0.25,
    )
    assert isinstance(cam.fps, float)
    assert cfg.mqtt.offline_queue == 100000 and isinstance(cfg.mqtt.offline_queue, int)
    assert cfg.mqtt.keepalive == 60 and isinstance(cfg.mqtt.keepalive, int)
    assert cfg.models["det"].onnx == MODEL  # paths are strings in YAML


def test_a_substituted_variable_takes_its_fields_type(tmp_path: Path) -> None:
    text = camera(fps="${FPS}", loop="${LOOP}", min_score="${SCORE:-0.5}")
    text = text.replace(
        "mqtt: {enabled: false}",
        "mqtt:\n  enabled: false\n  port: ${PORT}\n  username: u\n  password: ${PW}\n  tls: ${TLS}\n",
    )
    env = {"FPS": "7", "LOOP": "false", "PORT": "1884", "PW": "12345", "TLS": "true"}
    cfg = load_config(write(tmp_path, text), env=env)
    cam = cfg.cameras["gate"]
    assert (cam.fps, cam.loop, cam.min_score, cfg.mqtt.port) == (7.0, False, 0.5, 1884)
    assert cfg.mqtt.tls is not None and not cfg.mqtt.tls.insecure
    assert cfg.mqtt.password is not None and cfg.mqtt.password.get_secret_value() == "12345"  # stays a string
    assert refused(tmp_path, camera(fps="${FPS}"), env={"FPS": "fast"}) == [
        "cameras.gate.fps: must be a number (the value of ${FPS})"
    ]


def test_every_unset_variable_in_one_go(tmp_path: Path) -> None:
    text = camera(fps="${FPS}", min_score="${SCORE}")
    assert refused(tmp_path, text) == [
        "cameras.gate.min_score: environment variable SCORE is not set",
        "cameras.gate.fps: environment variable FPS is not set",
    ]


# ---- 3. NaN and infinity ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "line"),
    [
        (camera(min_score=".nan"), "cameras.gate.min_score: must be a finite number, not NaN"),
        (camera(fps=".NaN"), "cameras.gate.fps: must be a finite number, not NaN"),
        (camera(open_timeout_s=".inf"), "cameras.gate.open_timeout_s: must be a finite number, not infinity"),
        (
            camera(read_timeout_s="-.inf"),
            "cameras.gate.read_timeout_s: must be a finite number, not infinity",
        ),
        (
            BASE.replace("    backend: onnxruntime\n", "    backend: onnxruntime\n    max_age_ms: .inf\n"),
            "models.det.max_age_ms: must be a finite number, not infinity",
        ),
        (
            camera(zones="{z: {polygon: [[0, 0], [1, 0], [.nan, 1]]}}"),
            "cameras.gate.zones.z.polygon.2.0: must be a finite number, not NaN",
        ),
        (BASE + "telemetry: {interval_s: .nan}\n", "telemetry.interval_s: must be a finite number, not NaN"),
    ],
)
def test_nan_and_infinity_are_not_numbers_here(tmp_path: Path, text: str, line: str) -> None:
    assert refused(tmp_path, text) == [line]


def test_nan_from_the_environment(tmp_path: Path) -> None:
    lines = refused(tmp_path, camera(min_score="${S}"), env={"S": "nan"})
    assert lines == ["cameras.gate.min_score: must be a finite number, not NaN (the value of ${S})"]


# ---- 4. paths against the config's folder ------------------------------------------------------------
def test_every_relative_path_resolves_against_the_config_folder(tmp_path: Path) -> None:
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "mqtt.pw").write_text("pw\n")
    text = f"""\
engine_dir: engines
models:
  det:
    onnx: models/det.onnx
    labels: models/det.names
    calibration: {{source: folder, folder: frames}}
cameras:
  file: {{url: clips/gate.mp4, model: det}}
  abs: {{url: {CLIP}, model: det}}
  furl: {{url: 'file://{CLIP}', model: det}}
  rtsp: {{url: 'rtsp://10.0.0.2/s', model: det}}
  v4l2: {{url: /dev/video0, model: det}}
  index: {{url: '0', model: det}}
mqtt: {{username: u, password_file: mqtt.pw}}
"""
    path = write(conf, text)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    old = Path.cwd()
    os.chdir(elsewhere)
    try:
        cfg = load_config(Path("..") / "etc" / "agent.yaml", env={})
    finally:
        os.chdir(old)
    base = path.resolve().parent
    m = cfg.models["det"]
    assert (m.onnx, m.labels, m.calibration.folder) == (
        base / "models/det.onnx",
        base / "models/det.names",
        base / "frames",
    )
    assert cfg.engine_dir == base / "engines" and cfg.mqtt.password_file == base / "mqtt.pw"
    urls = {name: cam.url for name, cam in cfg.cameras.items()}
    assert urls == {
        "file": str(base / "clips/gate.mp4"),
        "abs": str(CLIP),
        "furl": f"file://{CLIP}",
        "rtsp": "rtsp://10.0.0.2/s",
        "v4l2": "/dev/video0",
        "index": "0",
    }


# ---- 5. camera URLs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "expect"),
    [
        (f"rtsp//admin:{SECRET}@10.0.0.5 stream", "looks like a URL without '://' (write rtsp://host/path)"),
        ("rtsp:/10.0.0.5/stream", "looks like a URL without '://' (write rtsp://host/path)"),
        ("HTTP:cam/x", "looks like a URL without '://' (write http://host/path)"),
        ("rtsp:///stream", "has no host (write rtsp://host[:port]/path)"),
        ("rtsp://10.0.0.5:0/s", "port must be 1..65535"),
        ("rtsp://10.0.0.5:70000/s", "invalid host or port (1..65535)"),
        (f"rtsp://admin:{SECRET}@10.0.0.5:port/s", "invalid host or port"),
        (f"rtsp://admin:ab/{SECRET}@10.0.0.5/s", "must be percent-encoded"),
        (f"rtsp://admin:{SECRET}@10.0.0.5/my stream", "must not contain spaces"),
        ("rtsp://bad_host-/s", "host must be a host name or an IP address"),
        ("rtsp://[::1/s", "invalid host or port"),
        (f"gopher://u:{SECRET}@h/s", "unknown scheme 'gopher'"),
        ("file://clips/gate.mp4", "a file URL must be file:///absolute/path"),
        ("udp://", "needs a port (udp://[host]:port)"),
        (" rtsp://10.0.0.5/s", "must not start or end with spaces"),
        ("", "must not be empty"),
        ("99999", "a V4L2 device index is 0..1023"),
        ("1" * 5000, "a V4L2 device index is 0..1023"),
    ],
)
def test_camera_urls_are_parsed(tmp_path: Path, url: str, expect: str) -> None:
    lines = refused(tmp_path, camera(url=yaml.safe_dump(url).removesuffix("\n...\n").strip()))
    assert len(lines) == 1 and lines[0].startswith("cameras.gate.url: ") and expect in lines[0], lines
    assert SECRET not in lines[0] and "10.0.0.5" not in lines[0]  # never the URL itself


@pytest.mark.parametrize(
    "url",
    [
        "rtsp://u:p%2Fw@10.0.0.5:554/s?x=1",
        "rtsps://[fe80::1]:322/s",
        "http://cam.local/mjpg",
        "https://cam.example.com./live.m3u8",
        "udp://@:5000",
        "srt://:9000?mode=listener",
        "file:///var/clips/a.mp4",
        "file://localhost/var/clips/a.mp4",
        "/dev/video0",
        "0",
        "clips/a clip.mp4",
        "rtsp/clip.mp4",  # a folder named rtsp
    ],
)
def test_good_camera_urls(url: str) -> None:
    assert camera_url_problem(url) is None


def test_a_pipeline_camera_needs_gstreamer_in_cv2(monkeypatch: pytest.MonkeyPatch) -> None:
    import cv2

    data = {
        "models": {
            "det": {"onnx": str(MODEL), "labels": str(LABELS), "format": "nanodet", "backend": "onnxruntime"}
        },
        "cameras": {
            "jetson": {"pipeline": "videotestsrc ! videoconvert ! appsink", "model": "det"},
            "off": {"pipeline": "videotestsrc ! appsink", "model": "det", "enabled": False},
        },
    }
    cfg = parse_config(data, "agent.yaml")
    monkeypatch.setattr(
        cv2, "getBuildInformation", lambda: "  Video I/O:\n    GStreamer:                   NO\n"
    )
    problems = preflight(cfg, "agent.yaml")
    assert problems == [
        "agent.yaml: cameras.jetson.pipeline: needs OpenCV built with GStreamer, but this cv2 "
        f"{cv2.__version__} has none (on a Jetson use JetPack's system cv2; else give a 'url')"
    ]
    monkeypatch.setattr(cv2, "getBuildInformation", lambda: "    GStreamer:                   YES (1.20.3)\n")
    assert preflight(cfg, "agent.yaml") == []
    with pytest.raises(ConfigError, match=r"cameras\.jetson\.pipeline: must end in an appsink element"):
        parse_config({**data, "cameras": {"jetson": {"pipeline": "videotestsrc ! fakesink", "model": "det"}}})


def test_a_local_video_file_must_exist(tmp_path: Path) -> None:
    (tmp_path / "folder.mp4").mkdir()
    data = yaml.safe_load(BASE)
    data["cameras"] = {
        "missing": {"url": "clips/none.mp4", "model": "det"},
        "folder": {"url": "folder.mp4", "model": "det"},
        "furl": {"url": "file:///nonexistent/x.mp4", "model": "det"},
        "off": {"url": "gone.mp4", "model": "det", "enabled": False},  # never opened
        "ok": {"url": str(CLIP), "model": "det"},
    }
    path = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    assert preflight(load_config(path, env={}), str(path)) == [
        f"{path}: cameras.missing.url: {tmp_path / 'clips/none.mp4'}: no such file",
        f"{path}: cameras.folder.url: {tmp_path / 'folder.mp4'}: is a directory, not a file",
        f"{path}: cameras.furl.url: /nonexistent/x.mp4: no such file",
    ]


# ---- 6. a directory where a file belongs --------------------------------------------------------------
def test_directories_where_files_belong(tmp_path: Path) -> None:
    for name in ("model.onnx", "labels.txt", "pw", "ca.pem"):
        (tmp_path / name).mkdir()
    text = BASE.replace(str(MODEL), "model.onnx").replace(str(LABELS), "labels.txt")
    path = write(tmp_path, text)
    problems = preflight(load_config(path, env={}), str(path))
    assert problems == [
        f"{path}: models.det.labels: {tmp_path / 'labels.txt'}: is a directory, not a file",
        f"{path}: models.det.onnx: {tmp_path / 'model.onnx'}: is a directory, not a file",
    ]
    lines = refused(tmp_path, with_mqtt("{username: u, password_file: pw, tls: {ca_file: ca.pem}}"))
    assert lines == [
        f"mqtt.password_file: {tmp_path / 'pw'}: is a directory, not a file",
        f"mqtt.tls.ca_file: {tmp_path / 'ca.pem'}: cannot read (Is a directory)",
    ]
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read config: is a directory"):
        load_config(tmp_path)


def test_a_fifo_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "labels.fifo")  # reading it would block --check-config forever
    path = write(tmp_path, BASE.replace(str(LABELS), "labels.fifo"))
    problems = preflight(load_config(path, env={}), str(path))
    assert problems == [f"{path}: models.det.labels: {tmp_path / 'labels.fifo'}: is not a regular file"]
    assert refused(tmp_path, with_mqtt("{tls: {ca_file: labels.fifo}}")) == [
        f"mqtt.tls.ca_file: {tmp_path / 'labels.fifo'}: is not a regular file"
    ]


# ---- 7. engine_dir ------------------------------------------------------------------------------------
def test_engine_dir_must_be_creatable_and_writable(tmp_path: Path) -> None:
    graph = BASE.replace("    backend: onnxruntime\n", "    backend: onnxruntime\n    postprocess: graph\n")
    path = write(tmp_path, graph.replace("engine_dir: engines", "engine_dir: /proc/nope"))
    problems = preflight(load_config(path, env={}), str(path))
    assert problems == [
        f"{path}: engine_dir: /proc/nope: cannot be created (No such file or directory) (models det keep "
        "engines there)"
    ]
    (tmp_path / "file").write_text("x")
    path = write(tmp_path, graph.replace("engine_dir: engines", "engine_dir: file"))
    assert preflight(load_config(path, env={}), str(path)) == [
        f"{path}: engine_dir: {tmp_path / 'file'}: exists and is not a directory (models det keep engines "
        "there)"
    ]
    # Checked by creating it: what the check made is gone again; ONNX Runtime alone needs no store.
    path = write(tmp_path, graph.replace("engine_dir: engines", "engine_dir: a/b/c"))
    assert preflight(load_config(path, env={}), str(path)) == []
    assert not (tmp_path / "a").exists()
    path = write(tmp_path, BASE.replace("engine_dir: engines", "engine_dir: /proc/nope"))
    assert preflight(load_config(path, env={}), str(path)) == []


def test_directory_problem_when_not_writable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        probe = locked / "x"
        writable = True
        try:
            probe.write_text("")
            probe.unlink()
        except OSError:
            writable = False
        problem = pre.directory_problem(locked)
        if writable:  # root writes anywhere: nothing to refuse
            assert problem is None
        else:
            assert problem == f"{locked}: is not writable (Permission denied)"
    finally:
        locked.chmod(0o700)


def test_a_tensorrt_backend_that_cannot_run_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.lifecycle import serving
    from engines.errors import UnavailableError

    def no_trt(flavor: str | None = None) -> Any:
        raise UnavailableError(f"{flavor or 'tensorrt'}: not installed")

    monkeypatch.setattr(serving, "import_trt", no_trt)
    text = BASE.replace("backend: onnxruntime", "backend: tensorrt").replace(
        "engine_dir: engines", "engine_dir: /proc/nope"
    )
    path = write(tmp_path, text)
    assert preflight(load_config(path, env={}), str(path)) == [
        f"{path}: models.det.backend: tensorrt requested, but tensorrt: not installed",
        f"{path}: engine_dir: /proc/nope: cannot be created (No such file or directory) (models det keep "
        "engines there)",
    ]
    # auto without TensorRT is ONNX Runtime, as `run` serves it: no engine store needed.
    path = write(tmp_path, text.replace("backend: tensorrt", "backend: auto"))
    assert preflight(load_config(path, env={}), str(path)) == []


# ---- 8. mqtt.prefix -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix", "why"),
    [
        ("a//b", " without an empty level ('//')"),
        ("a/+/b", " without the wildcards '+' or '#'"),
        ("a/#", " without the wildcards '+' or '#'"),
        ("$SYS/x", " not starting with '$'"),
        ("/a", " without a leading or trailing '/'"),
        ("a/", " without a leading or trailing '/'"),
        ("", ", not empty"),
        ("a\tb", " without control characters"),
        ("x" * 600, " of at most 512 bytes"),
    ],
)
def test_mqtt_prefix_rules(tmp_path: Path, prefix: str, why: str) -> None:
    lines = refused(
        tmp_path, with_mqtt(f"{{enabled: false, prefix: {yaml.safe_dump(prefix).splitlines()[0]}}}")
    )
    assert lines == [
        f"mqtt.prefix: must be a topic prefix{why}"
        + (" (such topics are the broker's, e.g. $SYS)" if "$" in why else "")
    ]
    ha = refused(
        tmp_path, BASE + f"homeassistant: {{discovery_prefix: {yaml.safe_dump(prefix).splitlines()[0]}}}\n"
    )
    assert len(ha) == 1 and ha[0].startswith("homeassistant.discovery_prefix: must be a topic prefix")


def test_every_prefix_the_config_takes_makes_topics() -> None:
    rng = random.Random(29)
    alphabet = "ab/$+#-_.é\t "
    for _ in range(3000):
        prefix = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        if topic_prefix_problem(prefix) is None:
            topics = Topics(prefix, "dev")  # raised ValueError ("internal error") for 'a//b' before
            assert topics.status.startswith(prefix + "/")
    assert topic_prefix_problem("site/edge-agent") is None and topic_prefix_problem("a/$b") is None


# ---- 9. the Prometheus port ---------------------------------------------------------------------------
def test_a_prometheus_port_in_use_is_refused_at_check_time(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys\ns = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        path = write(tmp_path, BASE + f"telemetry: {{prometheus_port: {port}}}\n")
        cfg = load_config(path, env={})
        assert preflight(cfg, str(path)) == [
            f"{path}: telemetry.prometheus_port: {port} is in use (another process listens on it)"
        ]
    finally:
        holder.kill()
        holder.wait()


def test_the_agents_own_metrics_port_passes_a_reload() -> None:
    # A reload runs the preflight inside the agent, whose /metrics holds the port.
    own = socket.socket()
    own.bind(("0.0.0.0", 0))
    own.listen()
    try:
        assert pre.port_problem(own.getsockname()[1]) is None
    finally:
        own.close()


# ---- 10. preprocess: gpu ------------------------------------------------------------------------------
def test_gpu_preprocessing_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.cuda.buffers as cb
    from engines.errors import UnavailableError

    data = {
        "models": {
            "a": {
                "onnx": str(MODEL),
                "labels": str(LABELS),
                "format": "nanodet",
                "backend": "onnxruntime",
                "preprocess": "gpu",
            },
            "b": {"onnx": str(MODEL), "labels": str(LABELS), "format": "nanodet", "backend": "onnxruntime"},
        },
        "cameras": {},
    }
    cfg = parse_config(data, "agent.yaml")

    def missing() -> Any:
        raise UnavailableError("device buffers need cuda-python (pip install cuda-python)")

    monkeypatch.setattr(cb, "import_cudart", missing)
    assert preflight(cfg, "agent.yaml") == [
        "agent.yaml: models.a.preprocess: gpu is not available here: device buffers need cuda-python (pip "
        "install cuda-python) (or use cpu)"
    ]

    class NoDevice:
        @staticmethod
        def cudaGetDeviceCount() -> tuple[int, int]:
            return 0, 0

    real_import = pre.importlib.import_module
    monkeypatch.setattr(cb, "import_cudart", lambda: NoDevice)
    monkeypatch.setattr(
        pre.importlib, "import_module", lambda n: object() if n.startswith("cuda.") else real_import(n)
    )
    assert preflight(cfg, "agent.yaml") == [
        "agent.yaml: models.a.preprocess: gpu is not available here: no CUDA GPU is visible (or use cpu)"
    ]


def test_cuda_is_not_imported_unless_asked_for(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    code = (
        "import sys; from agent.config import load_config; from agent.preflight import preflight\n"
        f"assert preflight(load_config({str(path)!r}, env={{}}), 'x') == []\n"
        "assert not [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')], 'CUDA imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---- 11. absurd sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "line"),
    [
        (with_mqtt("{enabled: false, offline_queue: 1e11}"), "mqtt.offline_queue: must be <= 1000000"),
        (
            with_mqtt("{enabled: false, offline_queue: 100000000000}"),
            "mqtt.offline_queue: must be <= 1000000",
        ),
        (
            BASE.replace("    backend: onnxruntime\n", "    backend: onnxruntime\n    max_age_ms: 1e12\n"),
            "models.det.max_age_ms: must be <= 3600000",
        ),
        (
            BASE.replace("    backend: onnxruntime\n", "    backend: auto\n    engine: {dla_core: 99}\n"),
            "models.det.engine.dla_core: must be <= 15",
        ),
        (camera(fps="1e300"), "cameras.gate.fps: must be <= 1000"),
        (
            BASE.replace(
                "    backend: onnxruntime\n",
                "    backend: onnxruntime\n    profiles: [{images: {min: [1], opt: [1], max: [1e9]}}]\n",
            ),
            "models.det.profiles.0.images: each dimension must be <= 65536",
        ),
        (
            BASE.replace("gate:", "g" * 129 + ":"),
            "cameras." + "g" * 129 + ": name at most 128 characters" + TOPIC_LEVEL,
        ),
    ],
)
def test_absurd_values_have_an_upper_bound(tmp_path: Path, text: str, line: str) -> None:
    assert refused(tmp_path, text) == [line]


# ---- the whole input space ----------------------------------------------------------------------------
def test_hostile_strings_and_keys(tmp_path: Path) -> None:
    lines = refused(tmp_path, BASE.replace("  gate:", '  "ga\\0te":'))
    assert lines[0] == "cameras.ga\\x00te: the key must not contain a NUL character"
    lines = refused(tmp_path, BASE.replace("yard-01", '"yard\\ud800"'))
    assert lines == ["device_id: is not valid Unicode text (a lone surrogate)"]
    lines = refused(tmp_path, BASE.replace("  gate:", '  "\\e[31mred":'))
    assert lines == ["cameras.\\x1b[31mred: name " + ASCII + TOPIC_LEVEL]
    lines = refused(tmp_path, BASE.replace("yard-01", '"yard\\n"'))  # '$' in a regex lets a '\n' by
    assert lines == ["device_id: " + ASCII]
    assert refused(tmp_path, camera(fps="2024-13-45")) == [
        "invalid YAML: a value cannot be read (ValueError: month must be in 1..12)"
    ]
    assert refused(tmp_path, camera(fps="1" * 5000)) == [
        "invalid YAML: a value cannot be read (an integer of more than 4300 digits)"
    ]
    assert refused(tmp_path, "{}") == ["models: required key is missing", "cameras: required key is missing"]
    assert refused(tmp_path, "models: {}\ncameras: {}\n") == ["models: at least one model is required"]
    assert refused(tmp_path, "models:\ncameras:\n") == [
        "models: must be a mapping, not empty (null)",
        "cameras: must be a mapping, not empty (null)",
    ]
    lines = refused(tmp_path, BASE + "cameras2: 1\n" + "".join(f"k{i}: 1\n" for i in range(80)))
    assert len(lines) == 51 and lines[-1] == "... and 31 more"


def test_cross_checks_report_every_problem(tmp_path: Path) -> None:
    data = yaml.safe_load(BASE)
    data["cameras"]["b"] = {"url": "x.mp4", "model": "nope"}
    data["cameras"]["c"] = {
        "url": "y.mp4",
        "model": "gone",
        "tracking": {"enabled": False},
        "lines": {"l": {"points": [[0, 0], [1, 1]]}},
    }
    assert refused(tmp_path, yaml.safe_dump(data)) == [
        "cameras.b.model: unknown model 'nope' (known: det)",
        "cameras.c.model: unknown model 'gone' (known: det)",
        "cameras.c.lines: need tracking (cameras.c.tracking.enabled is false)",
    ]


JUNK: list[Any] = [
    None,
    True,
    0,
    -1,
    1,
    2**70,
    -(2**70),
    1e308,
    -1e-308,
    math.nan,
    math.inf,
    "",
    " ",
    "x",
    "5",
    "yes",
    "${UNSET}",
    "${HOME}",
    "é",
    "\u202e",
    "a\x00b",
    "\ud800",
    "rtsp//h s",
    "/proc/nope",
    "a//b",
    "$SYS",
    [],
    [1, "a"],
    {},
    {"a": 1},
    {"": None},
    "x" * 3000,
    [[0, 0], [1, 0], [0, 1]],
]


def _mutate(node: Any, rng: random.Random) -> Any:
    """`node` with one leaf, key or mapping replaced by junk."""
    if isinstance(node, dict) and node:
        node = dict(node)
        key = rng.choice(list(node))
        roll = rng.random()
        if roll < 0.1:
            node[rng.choice(JUNK[:26]) if rng.random() < 0.5 else f"{key}x"] = rng.choice(JUNK)
        elif roll < 0.2:
            del node[key]
        else:
            node[key] = _mutate(node[key], rng)
        return node
    if isinstance(node, list) and node:
        node = list(node)
        i = rng.randrange(len(node))
        node[i] = _mutate(node[i], rng)
        return node
    return rng.choice(JUNK)


def _valid() -> dict[str, Any]:
    return {
        "device_id": "fuzz",
        "engine_dir": "engines",
        "models": {
            "det": {
                "onnx": str(MODEL),
                "labels": str(LABELS),
                "format": "nanodet",
                "backend": "onnxruntime",
                "batch": {"min": 1, "opt": 1, "max": 2},
                "threads": {"intra": 1},
                "calibration": {"samples": 10},
                "engine": {"workspace_mb": 64},
            }
        },
        "cameras": {
            "gate": {
                "url": f"rtsp://u:{SECRET}@10.0.0.1/s",
                "model": "det",
                "fps": 5,
                "classes": ["person"],
                "zones": {"z": {"polygon": [[0, 0], [1, 0], [1, 1]], "labels": ["person"]}},
                "lines": {"l": {"points": [[0, 0.5], [1, 0.5]]}},
                "tracking": {"low_score": 0.2},
                "events": {"snapshot": {"enabled": True}},
                "frame_size": {"w": 640, "h": 480},
            },
            "clip": {"url": str(CLIP), "model": "det", "loop": True},
        },
        "mqtt": {"enabled": False, "host": "broker", "username": "u", "password": SECRET, "prefix": "site/a"},
        "telemetry": {"interval_s": 5},
        "homeassistant": {"enabled": True},
        "pipeline": {"shards": 1, "restart": {"min_s": 1, "max_s": 2}},
    }


def test_fuzzed_mappings_load_or_refuse_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        pre, "_probe", lambda path: pytest.fail("no ONNX probe in the fuzz: check_model stubbed")
    )
    monkeypatch.setattr(pre, "check_model", lambda name, m, source: ([], None))
    rng = random.Random(2029)
    seen_ok = seen_refused = 0
    for _ in range(1500):
        data = _valid()
        for _ in range(rng.randint(1, 4)):
            data = _mutate(data, rng)
        try:
            cfg = parse_config(data, "F", env={"HOME": "/root"})
        except ConfigError as exc:
            text = str(exc)
            assert text and all(line.startswith("F: ") for line in text.splitlines()), text
            assert SECRET not in text, text
            seen_refused += 1
            continue
        seen_ok += 1
        problems = preflight(cfg, "F")
        assert all(isinstance(p, str) and p.startswith("F: ") and SECRET not in p for p in problems), problems
    assert seen_ok > 50 and seen_refused > 500


def test_fuzzed_yaml_text_loads_or_refuses_cleanly(tmp_path: Path) -> None:
    valid = yaml.safe_dump(_valid(), sort_keys=False)
    rng = random.Random(29)
    pieces = [
        "\n",
        ": ",
        "- ",
        "{",
        "}",
        "[",
        "]",
        "&a ",
        "*a",
        "<<: *a",
        "!!int ",
        "\t",
        "'",
        '"',
        "#",
        "? ",
        "%YAML 1.1\n",
        "---\n",
        "\\x",
        "1e999",
        ".nan",
        "~",
        "0x1F",
        "0o7",
        "1_000",
        "2001-02-03",
        "é",
    ]
    path = tmp_path / "agent.yaml"
    for _ in range(800):
        text = valid
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            roll = rng.random()
            if roll < 0.4:
                text = text[:i] + rng.choice(pieces) + text[i:]
            elif roll < 0.7:
                text = text[:i] + text[i + rng.randint(1, 20) :]
            else:
                lines = text.splitlines(keepends=True)
                j = rng.randrange(len(lines))
                text = "".join([*lines[: j + 1], lines[j], *lines[j + 1 :]])  # a duplicated line
        path.write_text(text)
        try:
            load_config(path, env={})
        except ConfigError as exc:
            assert all(line.startswith(f"{path}: ") for line in str(exc).splitlines()), str(exc)
            assert SECRET not in str(exc)


# ---- the real command line ----------------------------------------------------------------------------
def test_cli_names_every_schema_problem_at_once(tmp_path: Path) -> None:
    text = camera(fps='"5"', loop='"yes"', min_score=".nan", url=f"'rtsp//admin:{SECRET}@10.0.0.5 stream'")
    text = text.replace("    model: det\n", "    model: det\n    model: det\n")
    text = text.replace(
        "mqtt: {enabled: false}", "mqtt: {enabled: false, prefix: a//b, port: '1883', offline_queue: 1e11}"
    )
    path = write(tmp_path, text)
    out = cli(path)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr and SECRET not in out.stderr
    lines = [unlined(line) for line in out.stderr.splitlines() if line]
    expected = [
        f"{path}: cameras.gate.model: duplicate key on lines 12 and 13 (YAML keeps only the last)",
        f"{path}: cameras.gate.url: looks like a URL without '://' (write rtsp://host/path)",
        f"{path}: cameras.gate.fps: must be a number, not a string (write it without quotes)",
        f"{path}: cameras.gate.min_score: must be a finite number, not NaN",
        f"{path}: cameras.gate.loop: must be true or false, not a string (write it without quotes)",
        f"{path}: mqtt.port: must be an integer, not a string (write it without quotes)",
        f"{path}: mqtt.prefix: must be a topic prefix without an empty level ('//')",
        f"{path}: mqtt.offline_queue: must be <= 1000000",
    ]
    assert lines[0] == "edge-agent: " + expected[0]
    assert sorted([lines[0].removeprefix("edge-agent: "), *lines[1:]]) == sorted(expected), lines


def test_cli_names_every_host_problem_at_once(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").mkdir()
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    text = (
        BASE.replace(str(MODEL), "model.onnx")
        .replace("engine_dir: engines", "engine_dir: /proc/nope")
        .replace(
            "    backend: onnxruntime\n",
            "    backend: onnxruntime\n    postprocess: graph\n    preprocess: gpu\n",
        )
        .replace(f"rtsp://viewer:{SECRET}@10.0.0.21:554/stream1", "clips/gate.mp4")
        .replace("    fps: 5\n", "    fps: 5\n    min_score: 0.5\n")
    ) + f"telemetry: {{prometheus_port: {port}}}\n"
    path = write(tmp_path, text)
    try:
        out = cli(path, cwd=tmp_path.parent)
    finally:
        busy.close()
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr
    err = out.stderr
    for expect in (
        f"{path}: models.det.onnx: {tmp_path / 'model.onnx'}: is a directory, not a file",
        f"{path}: cameras.gate.url: {tmp_path / 'clips/gate.mp4'}: no such file",
        f"{path}: models.det.preprocess: gpu is not available here:",
        f"{path}: engine_dir: /proc/nope: cannot be created",
        f"{path}: telemetry.prometheus_port: {port} is in use",
    ):
        assert expect in err, (expect, err)


def test_cli_passes_a_good_config_from_another_folder(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "clips").mkdir()
    (conf / "clips" / "gate.mp4").symlink_to(CLIP)
    text = BASE.replace(f"rtsp://viewer:{SECRET}@10.0.0.21:554/stream1", "clips/gate.mp4")
    out = cli(write(conf, text), cwd=tmp_path)
    assert out.returncode == 0 and ": ok (1 model(s), 1 camera(s))" in out.stdout, out
