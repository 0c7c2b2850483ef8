"""Config validation: every error names the file and the key path; secrets never show."""

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config

BASE = """
device_id: yard-01
engine_dir: engines
models:
  detector:
    onnx: models/yolov8n.onnx
    format: yolov8
    labels: models/coco.names
cameras:
  gate:
    url: rtsp://viewer:${GATE_PASSWORD}@10.0.0.21:554/stream1
    model: detector
    fps: 10
    classes: [person, car]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return p


def test_valid_config_expands_env_and_resolves_paths(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE), env={"GATE_PASSWORD": "hunter2"})
    cam = cfg.cameras["gate"]
    assert cam.url == "rtsp://viewer:hunter2@10.0.0.21:554/stream1"
    assert cam.fps == 10
    assert cfg.models["detector"].onnx == tmp_path / "models/yolov8n.onnx"
    assert cfg.engine_dir == tmp_path / "engines"
    assert cfg.mqtt.port == 1883 and cfg.mqtt.qos == 0


def test_bad_type_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("fps: 10", "fps: -1"))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"GATE_PASSWORD": "x"})
    assert str(err.value) == f"{path}: cameras.gate.fps: must be > 0 (line 13)"


def test_not_a_number(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("fps: 10", "fps: fast"))
    with pytest.raises(ConfigError, match=r"cameras\.gate\.fps: must be a number \(line 13\)$"):
        load_config(path, env={"GATE_PASSWORD": "x"})


def test_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("fps: 10", "fps: 10\n    fsp: 3"))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"GATE_PASSWORD": "x"})
    assert str(err.value) == f"{path}: cameras.gate.fsp: unknown key (line 14)"


def test_missing_env_var(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    unset = "environment variable GATE_PASSWORD is not set"
    assert str(err.value) == f"{path}: cameras.gate.url: {unset} (line 11)"


def test_env_default(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("${GATE_PASSWORD}", "${GATE_PASSWORD:-guest}"))
    assert "viewer:guest@" in (load_config(path, env={}).cameras["gate"].url or "")


def test_unknown_model_reference(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("model: detector", "model: detectr"))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"GATE_PASSWORD": "x"})
    unknown = "unknown model 'detectr' (known: detector)"
    assert str(err.value) == f"{path}: cameras.gate.model: {unknown} (line 12)"


def test_bad_enum_and_several_errors(tmp_path: Path) -> None:
    text = BASE.replace("format: yolov8", "format: yolo9").replace("fps: 10", "fps: 0")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"GATE_PASSWORD": "x"})
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"{path}: models.detector.format: must be one of") for line in lines)
    assert f"{path}: cameras.gate.fps: must be > 0 (line 13)" in lines


def test_batch_order(tmp_path: Path) -> None:
    text = BASE.replace("format: yolov8", "format: yolov8\n    batch: {min: 4, opt: 2, max: 8}")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"models\.detector\.batch: must satisfy min <= opt <= max"):
        load_config(path, env={"GATE_PASSWORD": "x"})


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "models: [\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML \(line \d+"):
        load_config(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"/nonexistent/agent.yaml: cannot read config"):
        load_config("/nonexistent/agent.yaml")


def test_secrets_masked_in_repr(tmp_path: Path) -> None:
    text = BASE + "mqtt: {host: broker, username: agent, password: mqtt-s3cret}\n"
    cfg = load_config(write(tmp_path, text), env={"GATE_PASSWORD": "hunter2"})
    shown = repr(cfg) + str(cfg) + repr(cfg.cameras["gate"]) + repr(cfg.mqtt)
    assert "hunter2" not in shown and "mqtt-s3cret" not in shown
    assert "hunter2" not in cfg.cameras["gate"].display
    assert "10.0.0.21" in cfg.cameras["gate"].display
    assert cfg.mqtt.read_password() == "mqtt-s3cret"


def test_password_file(tmp_path: Path) -> None:
    (tmp_path / "mqtt.pw").write_text("pw-from-file\n")
    text = BASE + "mqtt: {username: agent, password_file: mqtt.pw}\n"
    cfg = load_config(write(tmp_path, text), env={"GATE_PASSWORD": "x"})
    assert cfg.mqtt.read_password() == "pw-from-file"


def test_unreadable_password_file_names_path(tmp_path: Path) -> None:
    # Checked at load (--check-config, reload), not when the daemon first connects.
    text = BASE + "mqtt: {username: agent, password_file: missing.pw}\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: mqtt\.password_file: cannot read .*missing\.pw"):
        load_config(path, env={"GATE_PASSWORD": "x"})


def test_secret_not_in_validation_error(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("fps: 10", "fps: [1]"))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"GATE_PASSWORD": "hunter2"})
    assert "hunter2" not in str(err.value)


def test_profiles_validated(tmp_path: Path) -> None:
    shapes = "{min: [1, 3, 640, 640], opt: [4, 3, 640, 640], max: [2, 3, 640, 640]}"
    profile = f"\n    profiles:\n      - {{images: {shapes}}}"
    path = write(tmp_path, BASE.replace("format: yolov8", "format: yolov8" + profile))
    with pytest.raises(
        ConfigError, match=r"models\.detector\.profiles\.0\.images: each dimension must satisfy"
    ):
        load_config(path, env={"GATE_PASSWORD": "x"})


def test_config_does_not_import_opencv() -> None:
    # Loading a config (CLI, tools, precision jobs) must not pay for or depend on OpenCV: a fresh
    # interpreter, since this test process has long imported cv2 through other tests.
    code = "import sys, agent.config; assert 'cv2' not in sys.modules, 'agent.config imported cv2'"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
