"""The engine job's walk (agent.lifecycle.runner.JobRunner), shared by the daemon and `edge-agent rebuild`:
lock -> frames -> request -> child -> events, the lock released however it ends.

The model's build lock and the engine store are real (flock on a file under tmp_path; another process
holds it for real); the child job is stood in for (fake_start_job: no TensorRT here), and so is the
capability set plan_steps reads (fake_caps)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.lifecycle import runner as runner_mod
from agent.lifecycle.calibration import CalibrationError
from agent.lifecycle.job import JobRequest, JobResult
from agent.lifecycle.runner import JobRunner, LockUnavailable
from engines.buildproc import Event, Progress
from engines.errors import BuildLockedError
from engines.store import EngineStore

REPO = Path(__file__).resolve().parents[1]
MODEL = "det"


def fake_caps(*precisions: str) -> Any:
    return SimpleNamespace(precisions=lambda: list(precisions), strongly_typed=True)


def held_here(store: EngineStore) -> bool:
    """Whether the model's build lock is held now (a second take fails at once)."""
    lock = store.lock(MODEL, wait_s=0)
    try:
        lock.acquire()
    except BuildLockedError:
        return True
    lock.release()
    return False


class Rig:
    """A runner over a real store, recording each step of the walk in order."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = EngineStore(tmp_path / "engines")
        self.steps: list[Any] = []
        self.requests: list[JobRequest] = []
        self.envs: list[dict[str, str] | None] = []
        self.frames_error: Exception | None = None
        self.child_error: Exception | None = None
        self.result = JobResult(True, "fp16", "fp16", True, "k1", message="built")
        self.runner = JobRunner(lambda: self.store, self)
        self.ctx: Any = SimpleNamespace(name=MODEL)
        monkeypatch.setattr(runner_mod, "start_job", self.fake_start_job)

    def ensure(self, ctx: Any, calibration: bool, on_event: Any) -> None:
        """The FrameSource: records whether the lock is held while frames are taken."""
        self.steps.append(("frames", calibration, held_here(self.store)))
        on_event(Progress("capture frames", 1, 1))
        if self.frames_error is not None:
            raise self.frames_error

    def fake_start_job(self, request: JobRequest, on_event: Any, env: dict[str, str] | None = None) -> Any:
        self.steps.append(("child", held_here(self.store)))
        self.requests.append(request)
        self.envs.append(env)
        if self.child_error is not None:
            raise self.child_error
        on_event(Progress("build", 1, 1))
        return SimpleNamespace(wait=self.result.to_event, kill=lambda: None)

    def on_event(self, ev: Event) -> None:
        assert isinstance(ev, Progress)
        self.steps.append(("event", ev.phase))

    def run(self, precision: str = "fp16", **kw: Any) -> JobResult:
        caps = fake_caps("fp32", "fp16", "int8")
        return self.runner.run(self.ctx, caps, precision, False, self.on_event, **kw)  # type: ignore[arg-type]


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch)


def test_the_walk_in_order_under_the_lock(rig: Rig) -> None:
    started: list[Any] = []
    result = rig.run("fp16", on_start=started.append)
    assert result.ok and result.key == "k1"
    assert rig.steps == [
        ("frames", False, True),  # gate frames only (fp16), the lock held
        ("event", "capture frames"),
        ("child", True),
        ("event", "build"),
    ]
    request = rig.requests[0]
    assert request.precision == "fp16" and request.lock_fd is not None  # the lock handed down
    assert rig.envs == [None] and len(started) == 1
    assert not held_here(rig.store)  # released after the job


def test_no_frames_for_fp32_and_calibration_frames_for_int8(rig: Rig) -> None:
    rig.run("fp32")
    assert [s[0] for s in rig.steps] == ["child", "event"]
    rig.steps.clear()
    rig.run("int8")
    assert rig.steps[0] == ("frames", True, True)


@pytest.mark.parametrize("where", ["frames", "child"])
def test_the_lock_is_released_when_a_step_fails(rig: Rig, where: str) -> None:
    if where == "frames":
        rig.frames_error = CalibrationError("model det: no calibration set")
    else:
        rig.child_error = OSError("cannot start the child")
    with pytest.raises((CalibrationError, OSError)):
        rig.run("fp16")
    assert not held_here(rig.store)
    if where == "frames":
        assert not rig.requests  # no child after a failed capture
    rig.frames_error = rig.child_error = None
    assert rig.run("fp16").ok  # the next job takes the lock


def test_a_lock_held_by_another_process_refuses_the_job(rig: Rig) -> None:
    script = (
        "import sys; from engines.store import EngineStore\n"
        f"lock = EngineStore({str(rig.store.root)!r}).lock({MODEL!r}, command='other build')\n"
        "lock.acquire(); print('held', flush=True); sys.stdin.read()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        with pytest.raises(LockUnavailable) as info:
            rig.run("fp16")
        assert isinstance(info.value.error, BuildLockedError)
        assert f"pid {other.pid}" in str(info.value) and "other build" in str(info.value)
        assert rig.steps == []  # neither frames nor child
    finally:
        other.communicate("", timeout=30)
    assert rig.run("fp16").ok


def test_a_lock_held_by_this_process_is_waited_for(rig: Rig) -> None:
    """A sibling manager (another GPU model building the same model) holds it: the job waits, then runs."""
    sibling = rig.store.lock(MODEL, wait_s=0)
    sibling.acquire()
    order: list[str] = []

    def release_later() -> None:
        order.append("sibling done")
        sibling.release()

    timer = threading.Timer(0.3, release_later)
    timer.start()
    result = rig.run("fp32", on_start=lambda _job: order.append("child"))
    timer.join()
    assert result.ok and order == ["sibling done", "child"]


def test_stop_and_the_build_gate(rig: Rig) -> None:
    gate = threading.Lock()
    rig.runner.build_gate = gate
    rig.runner.env = {"CUDA_VISIBLE_DEVICES": "1"}
    seen: list[bool] = []
    rig.runner.frames = rig
    result = rig.run("fp32", on_start=lambda _job: seen.append(gate.locked()))
    assert result.ok and seen == [True] and not gate.locked()  # the child ran inside the gate
    assert rig.envs == [{"CUDA_VISIBLE_DEVICES": "1"}]
    rig.runner.stop.set()
    stopped = rig.run("fp16")
    assert not stopped.ok and stopped.error == "stopped" and len(rig.requests) == 1  # no second child
    assert not held_here(rig.store)
