"""systemd notify protocol with the real agent: READY, WATCHDOG tied to frame progress, RELOADING, STOPPING.

A Unix datagram socket stands in for systemd's NOTIFY_SOCKET; messages are sent by the real
systemd-python (sd_notify). The agent runs the bundled NanoDet on ONNX Runtime over the bundled clip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_agent import bundled_model, wait_until
from fixtures_mqtt import free_port
from fixtures_notify import NotifySocket

from agent.cli.daemon import local_device
from agent.config import parse_config
from agent.device import Device
from agent.runtime.local import LocalRuntime
from agent.service.notify import Notifier, ServiceError, watchdog_interval
from agent.service.supervisor import ModelProgress, Progress, StallDetector, is_ready
from engines.runtimes.ort import OrtBackend

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
WATCHDOG_S = 1.2

pytest.importorskip("systemd.daemon", reason="systemd-python (README install step) is missing")


def config(tmp_path: Path, url: str, **camera: object) -> dict:
    return {
        "device_id": "svc",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"street": {"url": url, "model": "detector", "fps": 10, **camera}},
        "mqtt": {"enabled": False},
        "telemetry": {"interval_s": 60},
    }


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    try:
        yield sock
    finally:
        sock.close()


class Gate:
    """Makes the model's inference hang on demand: ONNX Runtime's run, on the model worker threads only
    (start-up warm-ups elsewhere are not held). The backend itself is the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        real = OrtBackend._infer_impl

        def gated(backend: OrtBackend, batch):  # type: ignore[no-untyped-def]
            if threading.current_thread().name.startswith("model-"):
                self.open.wait()
            return real(backend, batch)

        monkeypatch.setattr(OrtBackend, "_infer_impl", gated)


def in_process_agent(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch, url: str, **camera: object
) -> Device[LocalRuntime]:
    # libsystemd reads NOTIFY_SOCKET from the process environment itself.
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    monkeypatch.setenv("WATCHDOG_USEC", str(int(WATCHDOG_S * 1e6)))
    cfg = parse_config(config(tmp_path, url, **camera))
    return local_device(cfg, console=False, notifier=Notifier())


def test_ready_only_after_first_inference_and_watchdog_follows_frame_progress(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    agent = in_process_agent(tmp_path, notify, monkeypatch, str(ASSETS / "bikes.mp4"))
    try:
        agent.start()
        cam = agent.runtime.cameras["street"]
        assert wait_until(lambda: cam.state == "streaming" and cam.reader.frames_in > 3, 15)
        time.sleep(3 * agent.supervisor.tick_s)
        # The camera streams and the worker holds a batch, but nothing went through inference yet.
        assert notify.times("READY") == [], notify.messages
        assert notify.times("WATCHDOG") == []

        opened = time.monotonic()
        gate.open.set()
        assert notify.wait_for(lambda m: any("READY" in f for _, f in m), 15), notify.messages
        ready_at = notify.times("READY")[0]
        assert ready_at > opened
        assert agent.runtime.results_out["detector"] > 0
        ready = next(f for _, f in notify.messages if "READY" in f)
        assert ready["STATUS"].startswith("1/1 cameras streaming"), ready
        assert "detector onnxruntime fp32" in ready["STATUS"]
        assert notify.wait_for(lambda m: len([1 for _, f in m if "WATCHDOG" in f]) >= 4, 10)

        # The backend hangs: frames keep arriving, no result comes out -> pings stop within one interval.
        gate.open.clear()
        hung_at = time.monotonic()
        time.sleep(3 * WATCHDOG_S)
        late = [t for t in notify.times("WATCHDOG") if t > hung_at]
        assert all(t - hung_at <= WATCHDOG_S for t in late), (late, hung_at)
        assert not [t for t in late if t > hung_at + WATCHDOG_S]
        assert agent.supervisor.stalled == ["detector"]
        assert any("STALLED: detector" in f.get("STATUS", "") for t, f in notify.messages if t > hung_at)

        # It recovers: results flow again, pings resume.
        resumed = time.monotonic()
        gate.open.set()
        assert notify.wait_for(lambda m: any(t > resumed and "WATCHDOG" in f for t, f in m), 10)
        assert agent.supervisor.stalled == []
    finally:
        gate.open.set()
        agent.stop()
    assert notify.wait_for(lambda m: notify.lifecycle() == ["READY", "STOPPING"], 5), notify.lifecycle()


def test_zero_cameras_streaming_keeps_the_watchdog_fed(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"rtsp://127.0.0.1:{free_port()}/nothing"
    agent = in_process_agent(tmp_path, notify, monkeypatch, dead, open_timeout_s=0.5, read_timeout_s=0.5)
    try:
        agent.start()
        # Tried (and failed): READY anyway, the camera problem is reported on MQTT, not by a restart.
        assert notify.wait_for(lambda m: any("READY" in f for _, f in m), 15), notify.messages
        ready = next(f for _, f in notify.messages if "READY" in f)
        assert ready["STATUS"].startswith("0/1 cameras streaming")
        since = time.monotonic()
        time.sleep(3 * WATCHDOG_S)
        pings = [t for t in notify.times("WATCHDOG") if t > since]
        assert len(pings) >= 3 * WATCHDOG_S / agent.supervisor.tick_s - 3
        assert agent.runtime.cameras["street"].state in ("reconnecting", "failed")
    finally:
        agent.stop()


def test_reload_and_stop_sequence_of_the_real_process(tmp_path: Path, notify: NotifySocket) -> None:
    import yaml

    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, str(ASSETS / "bikes.mp4"))))
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000"}
    log = (tmp_path / "agent.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(path), "--log-level", "info"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        started = notify.wait_for(lambda m: "READY" in notify.lifecycle(), 60)
        assert started, (tmp_path / "agent.log").read_text()
        assert notify.wait_for(lambda m: len(notify.times("WATCHDOG")) >= 2, 10)
        proc.send_signal(signal.SIGHUP)
        reloaded = notify.wait_for(lambda m: notify.lifecycle() == ["READY", "RELOADING", "READY"], 30)
        assert reloaded, notify.lifecycle()
        reloading = next(f for _, f in notify.messages if "RELOADING" in f)
        # systemd (Type=notify-reload) matches MONOTONIC_USEC against CLOCK_MONOTONIC of the reload.
        assert abs(int(reloading["MONOTONIC_USEC"]) / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        seq = ["READY", "RELOADING", "READY", "STOPPING"]
        assert notify.wait_for(lambda m: notify.lifecycle() == seq, 5), notify.lifecycle()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        log.close()


def test_notify_socket_without_systemd_python_fails_fast_with_the_fix(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, str(ASSETS / "bikes.mp4"))))
    code = (
        "import sys; sys.modules['systemd'] = None\n"  # import systemd -> ImportError, as if not installed
        "from agent.cli import main\n"
        f"sys.exit(main(['run', '-c', {str(path)!r}]))"
    )
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "nobody.sock")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "systemd-python is not installed" in out.stderr and "edge-agent[systemd]" in out.stderr
    assert "Traceback" not in out.stderr


def test_notifier_refuses_to_start_half_configured() -> None:
    import builtins

    real_import = builtins.__import__

    def no_systemd(name, *a, **k):  # type: ignore[no-untyped-def]
        if name.startswith("systemd"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    builtins.__import__ = no_systemd
    try:
        with pytest.raises(ServiceError, match="edge-agent\\[systemd\\]"):
            Notifier({"NOTIFY_SOCKET": "/run/x"})
        assert Notifier({}).active is False  # outside systemd nothing is needed
    finally:
        builtins.__import__ = real_import


def test_watchdog_interval_follows_sd_watchdog_enabled_rules() -> None:
    me = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "3000000"}) == 3.0
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": me}) == 3.0
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None  # someone else's
    for bad in ("", "0", "-5", "abc", "1e6"):
        assert watchdog_interval({"WATCHDOG_USEC": bad}) is None


def progress(frames_in: int, results: int, running: bool = True, streaming: int = 1) -> Progress:
    m = ModelProgress(frames_in, results, running, "onnxruntime fp32", streaming)
    return Progress({"cam": "streaming" if streaming else "reconnecting"}, {"m": m}, 0.0)


def test_stall_detector_needs_frames_waiting_and_no_result_for_the_whole_window() -> None:
    d = StallDetector(stall_s=2.0)
    assert d.update(progress(10, 10), 0.0) == []
    assert d.update(progress(20, 20), 1.0) == []  # flowing
    assert d.update(progress(20, 20), 5.0) == []  # idle (camera silent): not a stall however long
    assert d.update(progress(21, 20), 6.0) == []  # a frame arrived after the idle time: not stalled yet
    assert d.update(progress(25, 20), 7.5) == []
    assert d.update(progress(30, 20), 8.1) == ["m"]  # > 2 s with frames waiting and no result
    assert d.update(progress(30, 20), 20.0) == ["m"]  # the waiting frame is still not served
    assert d.update(progress(35, 21), 21.0) == []  # a result: recovered
    assert d.update(progress(36, 22, running=False), 22.0) == ["m"]  # the worker thread died


def test_ready_waits_for_every_camera_to_be_tried_and_a_result_per_streaming_model() -> None:
    m_streaming_no_result = ModelProgress(5, 0, True, "x", 1)
    m_done = ModelProgress(5, 1, True, "x", 1)
    m_no_camera_up = ModelProgress(0, 0, True, "x", 0)
    assert not is_ready(Progress({"a": "starting"}, {"m": m_done}, 0))
    assert not is_ready(Progress({"a": "streaming"}, {"m": m_streaming_no_result}, 0))
    assert is_ready(Progress({"a": "streaming"}, {"m": m_done}, 0))
    assert is_ready(Progress({"a": "reconnecting"}, {"m": m_no_camera_up}, 0))
    assert is_ready(Progress({}, {"m": m_no_camera_up}, 0))


def test_start_up_asks_for_more_time_while_a_model_loads(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.service.notify import extending

    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    notifier = Notifier()
    with extending(notifier, "starting: loading model big", grant_s=0.6):
        time.sleep(1.0)
    done = time.monotonic()
    time.sleep(0.5)
    ext = [(t, f) for t, f in notify.messages if "EXTEND_TIMEOUT_USEC" in f]
    assert len(ext) >= 4  # at once, then every grant/3 while the block runs
    assert all(f["EXTEND_TIMEOUT_USEC"] == "600000" for _, f in ext)
    assert all(f["STATUS"] == "starting: loading model big" for _, f in ext)
    assert all(t <= done + 0.05 for t, _ in ext)  # nothing once the block ended

    # The real agent does it around each model it opens, before READY.
    agent = in_process_agent(tmp_path, notify, monkeypatch, str(ASSETS / "bikes.mp4"))
    try:
        agent.start()
        assert notify.wait_for(lambda m: "READY" in notify.lifecycle(), 30)
    finally:
        agent.stop()
    msgs = notify.messages
    ready_at = notify.times("READY")[0]
    loading = [t for t, f in msgs if f.get("STATUS") == "starting: loading model detector"]
    assert loading and loading[0] < ready_at


def test_reloads_reopen_add_and_remove_models_in_the_running_agent(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    data = config(tmp_path, str(ASSETS / "bikes.mp4"))
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    from agent.config import load_config

    agent = local_device(load_config(path), console=False, config_path=path, notifier=Notifier())
    try:
        agent.start()
        assert wait_until(lambda: agent.runtime.results_out["detector"] >= 2, 30)
        old_worker, old_backend = agent.runtime.workers["detector"], agent.runtime.workers["detector"].backend

        # 1. A changed model section: the model is reopened, its camera restarted on the new worker.
        data["models"]["detector"]["iou_threshold"] = 0.6
        path.write_text(yaml.safe_dump(data))
        assert agent.reload()
        assert agent.runtime.workers["detector"] is not old_worker and not old_worker.running
        assert not old_backend.loaded  # closed once its worker stopped
        n = agent.runtime.results_out["detector"]
        assert wait_until(lambda: agent.runtime.results_out["detector"] >= n + 2, 30)

        # 2. A second model with a camera of its own, then the first one removed with its camera.
        data["models"]["second"] = dict(data["models"]["detector"])
        data["cameras"]["side"] = {"url": str(ASSETS / "bikes.mp4"), "model": "second", "fps": 10}
        path.write_text(yaml.safe_dump(data))
        assert agent.reload()
        assert wait_until(lambda: agent.runtime.results_out.get("second", 0) >= 2, 30)
        del data["models"]["detector"], data["cameras"]["street"]
        path.write_text(yaml.safe_dump(data))
        assert agent.reload()
        assert set(agent.runtime.workers) == {"second"} and set(agent.runtime.cameras) == {"side"}
        assert agent.runtime.engines.models == [] or "detector" not in agent.runtime.engines.models
        n = agent.runtime.results_out["second"]
        assert wait_until(lambda: agent.runtime.results_out["second"] >= n + 2, 30)

        # 3. A broken one: refused, said in the service status, the agent as it was.
        path.write_text("models: {}\n")
        assert not agent.reload()
        assert agent.last_reload is not None and agent.last_reload["ok"] is False
        assert "agent.yaml: cameras: required key is missing" in agent.last_reload["error"]
        assert set(agent.runtime.workers) == {"second"}
        failed = notify.wait_for(lambda m: any("last reload failed" in f.get("STATUS", "") for _, f in m), 5)
        assert failed, notify.messages[-3:]
    finally:
        agent.stop()
    assert notify.wait_for(lambda m: notify.lifecycle().count("RELOADING") == 4, 5), notify.lifecycle()
