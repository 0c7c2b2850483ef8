"""Issue 29 (3, 4): engines without agent.yaml, previous plans and rollback, one job per model, progress.

- The store keeps the previous good plan of a key on replace and rolls back atomically (fake plans: fast);
  a write or rollback interrupted between its steps leaves one plan serving and the other kept.
- `edge-agent build` (a real TensorRT-RTX build, CPU, ahead of time) writes the daemon's layout and key
  (`edge-agent check` on a config naming the same model says ok); `engines list|show|rollback|prune`
  over that store, and their errors, each naming the path.
- Two `edge-agent rebuild --force` of an fp16 model (gate + build) as real processes: the second is refused
  at once naming the first (pid, start, command), a third with --wait starts no job until the first is done.
- The daemon's engine watcher swaps in a plan made current by `engines rollback` (real agent, mosquitto).
- Progress: summary lines when piped (nested TensorRT phases stay inside their outer phase), a bar on a
  terminal; the daemon logs a frame capture as one line, not one per frame; the job child reports the
  gate's frames as they are done (batch by batch).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from fixtures_agent import REPO, AgentProcess, decoded, run_cli, wait
from fixtures_mqtt import Broker, Subscriber
from test_engine_store import sample_manifest

from agent.lifecycle.progress import JobProgress
from engines.buildproc import Event, Progress
from engines.errors import BuildLockedError, StoreError
from engines.store import EngineStore

ASSETS = REPO / "agent" / "assets"
NANODET = ASSETS / "nanodet-m-416.onnx"
HAS_RTX = subprocess.run([sys.executable, "-c", "import tensorrt_rtx"], capture_output=True).returncode == 0
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="CI installs tensorrt-rtx (test extra)")


def put(store: EngineStore, i: int, key: str = "k1", model: str = "det") -> str:
    """Store fake plan `plan-{i}` as engine `key`; returns its sha256."""
    plan = f"plan-{i}".encode()
    sha = hashlib.sha256(plan).hexdigest()
    store.write(
        model, key, plan, sample_manifest(built_at=f"2026-01-0{i + 1}T00:00:00.000+00:00", plan_sha256=sha)
    )
    return sha


def listing(store: EngineStore, model: str = "det") -> list[str]:
    return sorted(p.name for p in store.model_dir(model).iterdir() if not p.name.startswith(".build"))


# ---- the store: previous plans, rollback, prune ------------------------------------------------------


def test_replace_keeps_the_previous_good_plan_and_rollback_swaps(tmp_path: Path) -> None:
    store = EngineStore(tmp_path / "e")
    s0 = put(store, 0)
    assert store.previous("det", "k1") is None
    s1 = put(store, 1)
    prev = store.previous("det", "k1")
    assert prev is not None and prev.manifest.build.plan_sha256 == s0
    assert prev.plan.read_bytes() == b"plan-0" and prev.record.name == f"k1-{s0[:12]}.prev"
    # A third build keeps one previous: the plan it replaced (plan-1); plan-0 goes.
    s2 = put(store, 2)
    assert store.previous("det", "k1").manifest.build.plan_sha256 == s1
    assert listing(store) == sorted(
        [f"k1-{s1[:12]}.plan", f"k1-{s1[:12]}.prev", f"k1-{s2[:12]}.plan", "k1.json"]
    )

    with store.lock("det"):
        now, prev = store.rollback("det", "k1")
    assert now.build.plan_sha256 == s1 and store.read_plan("det", "k1") == b"plan-1"
    assert prev is not None and prev.manifest.build.plan_sha256 == s2  # the same call rolls forward
    assert [m.key for m in store.entries("det")] == ["k1"]
    with store.lock("det"):
        store.rollback("det", "k1")
    assert store.read_plan("det", "k1") == b"plan-2"

    # A corrupt previous plan is refused, naming it; the current one stays.
    prev = store.previous("det", "k1")
    prev.plan.write_bytes(b"flipped")
    with pytest.raises(StoreError, match=rf"previous plan {prev.plan} .*sha256 mismatch"):
        store.rollback("det", "k1")
    assert store.read_plan("det", "k1") == b"plan-2"

    # Prune: the dry run lists, deletes nothing; prune deletes previous plans and killed writers' temps.
    temp = store.model_dir("det") / ".k1-x.plan.tmp-99-abcd"
    temp.write_bytes(b"half")
    before = listing(store)
    dry = store.prune_previous("det", dry_run=True)
    assert sorted(p.name for p in dry) == sorted([prev.plan.name, prev.record.name, temp.name])
    assert listing(store) == before and temp.exists()
    with store.lock("det"):
        assert sorted(p.name for p in store.prune_previous("det")) == sorted(p.name for p in dry)
    assert listing(store) == [f"k1-{s2[:12]}.plan", "k1.json"] and not temp.exists()
    with pytest.raises(
        StoreError, match=r"engine k1 of model 'det' has no previous plan to roll back to .*e/det"
    ):
        store.rollback("det", "k1")


def test_a_plan_refused_at_load_or_corrupt_is_not_kept_as_previous(tmp_path: Path) -> None:
    store = EngineStore(tmp_path / "e")
    put(store, 0)
    s1 = put(store, 1)
    store.set_refused_at_load("det", "k1", s1, {"at": "x", "error": "refused", "refusals": 1})
    put(store, 2)  # replaces the refused plan-1: plan-0 stays the previous one
    assert store.previous("det", "k1").plan.read_bytes() == b"plan-0"
    store.plan_path("det", "k1").write_bytes(b"corrupt")  # plan-2 rots on disk
    put(store, 3)
    assert store.previous("det", "k1").plan.read_bytes() == b"plan-0"


@pytest.mark.parametrize("fail", ["write-manifest", "rollback-commit", "rollback-cleanup"])
def test_interrupted_write_or_rollback_keeps_one_serving_one_kept(tmp_path: Path, monkeypatch, fail) -> None:
    import engines.store.commit as store_mod

    store = EngineStore(tmp_path / "e")
    s0, s1 = put(store, 0), put(store, 1)
    real = store_mod.atomic_write_bytes

    def failing(path: Path, data: bytes) -> None:
        if fail == "write-manifest" and path.suffix == ".json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if fail == "rollback-commit" and path.suffix == ".json":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        real(path, data)

    monkeypatch.setattr(store_mod, "atomic_write_bytes", failing)
    if fail == "write-manifest":
        with pytest.raises(StoreError, match="previous engine stays current"):
            put(store, 2)
        serving, kept = s1, s0
    elif fail == "rollback-commit":
        with pytest.raises(StoreError, match=r"cannot roll engine k1 of model 'det' back .*k1\.json"):
            store.rollback("det", "k1")
        serving, kept = s1, s0
    else:  # the record of the plan now current could not be deleted: a duplicate, ignored and cleaned
        monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)
        store.rollback("det", "k1")
        monkeypatch.undo()
        assert len(list(store.model_dir("det").glob("*.prev"))) == 2
        serving, kept = s0, s1
    monkeypatch.undo()
    assert store.manifest("det", "k1").build.plan_sha256 == serving
    assert store.previous("det", "k1").manifest.build.plan_sha256 == kept
    with store.lock("det"):
        store.clean_stale("det")
    assert sorted(listing(store)) == sorted(
        [f"k1-{serving[:12]}.plan", f"k1-{kept[:12]}.plan", f"k1-{kept[:12]}.prev", "k1.json"]
    )
    assert store.read_plan("det", "k1") == (b"plan-1" if serving == s1 else b"plan-0")


def test_pruning_a_key_takes_its_previous_plan_along(tmp_path: Path) -> None:
    store = EngineStore(tmp_path / "e", keep=1)
    put(store, 0, "k1")
    put(store, 1, "k1")
    put(store, 2, "k2")  # keep=1: k1 goes, with its previous plan and record
    assert listing(store) == sorted([f"k2-{hashlib.sha256(b'plan-2').hexdigest()[:12]}.plan", "k2.json"])


# ---- the lock names its holder -----------------------------------------------------------------------


def test_lock_refusal_names_pid_start_and_command(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    store.model_dir("det").mkdir()
    code = textwrap.dedent(f"""
        import sys, time
        from engines.store import EngineStore
        with EngineStore({str(tmp_path)!r}).lock("det", command="edge-agent rebuild -c agent.yaml --force"):
            print("locked", flush=True)
            time.sleep(30)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(BuildLockedError) as info:
            store.lock("det", wait_s=0).acquire()
        msg = str(info.value)
        assert f"another build of model 'det' is running (pid {holder.pid}, started 20" in msg
        assert "s ago, command: edge-agent rebuild -c agent.yaml --force; lock " in msg
        waits: list[str] = []
        with pytest.raises(BuildLockedError, match=r"waited 0\.3 s"):
            store.lock("det", wait_s=0.3, on_wait=waits.append).acquire()
        assert len(waits) == 1 and f"pid {holder.pid}" in waits[0]
    finally:
        holder.kill()
        holder.wait()
    with store.lock("det", wait_s=5, command="me") as lock:  # released by the holder's death
        pid, info = lock.holder()
        assert pid == os.getpid() and info is not None and info["command"] == "me" and info["pid"] == pid


# ---- progress ----------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_piped_is_a_few_summary_lines() -> None:
    out, clock = io.StringIO(), Clock()
    p = JobProgress("det", stream=out, tty=False, clock=clock)
    for i in range(41):  # 40 frames, 1 s each: a heartbeat every 10 s and one line at the end
        clock.t = float(i)
        p.step("accuracy gate fp16: candidate", i, 40)
    p.step("parse", 0, 1)
    p.step("parse", 1, 1)  # instant: no line
    clock.t = 50.0
    p.step("build", 0, 1)
    for i in range(300):  # TensorRT's phases, nested in "build": never a line of their own
        clock.t = 50.0 + i / 10
        p.step("Building engine", i % 7, 6)
    clock.t = 90.0
    p.step("build", 1, 1)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "det: accuracy gate fp16: candidate 10/40 after 10 s",
        "det: accuracy gate fp16: candidate 20/40 after 20 s",
        "det: accuracy gate fp16: candidate 30/40 after 30 s",
        "det: accuracy gate fp16: candidate 40/40 in 40.0 s",
        "det: build 0/1 after 10 s (Building engine 2/6)",
        "det: build 0/1 after 20 s (Building engine 4/6)",
        "det: build 1/1 in 40.0 s",
    ], lines


def test_progress_on_a_terminal_is_a_bar_per_frame() -> None:
    out, clock = io.StringIO(), Clock()
    p = JobProgress("det", stream=out, tty=True, clock=clock)
    for i in range(21):
        clock.t = i * 0.2
        p.step("accuracy gate fp16: fp32 reference", i, 20)
    text = out.getvalue()
    assert "det: accuracy gate fp16: fp32 reference" in text and "7/20" in text and "20/20" in text
    assert "fp32 reference 20/20 in 4.0 s" in text  # a line kept above the bar
    p.close()


def test_daemon_logs_a_capture_once_and_each_gate_phase_once(caplog) -> None:
    from agent.lifecycle.builds import publish_progress
    from agent.lifecycle.state import ModelEngine, StateBoard

    published: list[dict] = []
    board = StateBoard(lambda name, state: published.append(state))
    target = SimpleNamespace(fingerprint=SimpleNamespace(manifest_dict=lambda: {}))
    me = ModelEngine(ctx=SimpleNamespace(name="det"), target=target)  # type: ignore[arg-type]
    me.state.update(state="building")
    caplog.set_level(logging.DEBUG, logger="agent.lifecycle.manager")
    for n in range(1, 41):
        me.last_progress_pub = 0.0  # as if half a second passed between frames
        publish_progress(board, me, Progress("capture frames", n, 40))
    for n in range(21):
        me.last_progress_pub = 0.0
        publish_progress(board, me, Progress("accuracy gate fp16: candidate", n, 20))
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert info == ["model det: accuracy gate fp16: candidate 0/20"], info
    assert len(published) == 61 and published[-1]["progress"] == {
        "phase": "accuracy gate fp16: candidate",
        "step": 20,
        "total": 20,
    }


# ---- edge-agent build / engines (real TensorRT-RTX) --------------------------------------------------


def engines_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=300)


@needs_rtx
@pytest.mark.slow
def test_build_without_config_and_the_engines_commands(tmp_path: Path) -> None:
    out = tmp_path / "store"
    first = engines_cli("build", "--onnx", str(NANODET), "--name", "det", "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert "det: built fp32 engine " in first.stdout and f"plan      {out}/det/" in first.stdout
    assert "Traceback" not in first.stderr and "Cuda Runtime" not in first.stderr  # no benign TRT noise
    # The daemon's layout and key: a config naming the same ONNX (fp32, default streams) finds it fitting.
    config = tmp_path / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine_dir": str(out),
                "models": {
                    "det": {
                        "onnx": str(NANODET),
                        "format": "nanodet",
                        "labels": str(ASSETS / "coco.names"),
                        "backend": "tensorrt_rtx",
                        "precision": "fp32",
                    }
                },
                "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "det"}},
                "mqtt": {"enabled": False},
            }
        )
    )
    check = run_cli("check", "-c", str(config), "--json", timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

    again = engines_cli("build", "--onnx", str(NANODET), "--name", "det", "--out", str(out))
    assert again.returncode == 0 and "up to date; nothing to build" in again.stdout
    assert "nothing to build (--force rebuilds)" in again.stdout  # issue 36 (17): it said "use force"
    forced = engines_cli(
        "build", "--onnx", str(NANODET), "--name", "det", "--out", str(out), "--force", "--json"
    )
    assert forced.returncode == 0, forced.stderr
    result = json.loads(forced.stdout)
    first_plan = next(
        line.split()[1] for line in first.stdout.splitlines() if line.strip().startswith("plan")
    )
    assert result["built"] and result["previous"] == first_plan and result["plan"] != first_plan

    # Issue 36 (17): only the key the model serves is "current", and only -c agent.yaml tells which one
    # (before: every key of the model was "current"); without it the newest key is "newest".
    put(EngineStore(out), 0, key="0123456789abcdef")  # an older key of other settings: kept
    rows = json.loads(engines_cli("engines", "list", "--dir", str(out), "--json").stdout)
    assert [(r["model"], r["state"], r["plan"]) for r in rows][:2] == [
        ("det", "newest", result["plan"]),
        ("det", "previous", first_plan),
    ]
    assert [r["state"] for r in rows[2:]] == ["kept"]
    served = json.loads(engines_cli("engines", "list", "-c", str(config), "--json").stdout)
    assert [(r["key"], r["state"]) for r in served] == [
        (result["key"], "current"),
        (result["key"], "previous"),
        ("0123456789abcdef", "kept"),
    ]
    assert (
        rows[0]["trt_flavor"] == "tensorrt_rtx"
        and rows[0]["precision"] == "fp32"
        and rows[0]["size_bytes"] > 1e6
    )
    table = engines_cli("engines", "list", "-c", str(config)).stdout
    assert "current" in table and "previous" in table and "TensorRT-RTX" in table and "none (8.6)" in table
    assert [line.split()[2] for line in table.splitlines()[1:4]] == ["current", "previous", "kept"]
    assert "kept      another key (other settings, TensorRT or GPU), kept for a revert" in table

    shown = json.loads(engines_cli("engines", "show", "det", "--dir", str(out), "--json").stdout)
    assert (
        shown["schema"] == "edge-agent/engine-manifest/1"
        and shown["build"]["plan_sha256"] == rows[0]["plan_sha256"]
    )
    human = engines_cli("engines", "show", "det", "--dir", str(out)).stdout
    assert "sha256 verified" in human and "previous" in human and "(x2 execution contexts)" in human

    rolled = engines_cli("engines", "rollback", "det", "--dir", str(out))
    assert rolled.returncode == 0, rolled.stderr
    assert Path(first_plan).name in rolled.stdout and "is current" in rolled.stdout
    assert run_cli("check", "-c", str(config), timeout=120).returncode == 0  # the previous plan serves again
    assert EngineStore(out).plan_path("det", rows[0]["key"]) == Path(first_plan)

    dry = engines_cli("engines", "prune", "--dir", str(out), "--dry-run")
    assert (
        dry.returncode == 0
        and f"would delete {result['plan']}" in dry.stdout
        and Path(result["plan"]).exists()
    )
    pruned = engines_cli("engines", "prune", "-c", str(config))
    assert pruned.returncode == 0 and f"deleted {result['plan']}" in pruned.stdout
    assert not Path(result["plan"]).exists() and Path(first_plan).exists()
    nothing = engines_cli("engines", "rollback", "det", "--dir", str(out))
    assert nothing.returncode == 2 and "has no previous plan to roll back to" in nothing.stderr
    assert str(out / "det") in nothing.stderr

    # Every bad input: one line naming the path or value.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("x")
    errors = {
        (
            "engines",
            "list",
            "--dir",
            str(tmp_path / "nope"),
        ): f"engine store {tmp_path / 'nope'} does not exist",
        ("engines", "list", "--dir", str(tmp_path / "notes")): f"{tmp_path / 'notes'} is not an engine store",
        ("engines", "show", "cat", "--dir", str(out)): "model 'cat' is not in engine store",
        (
            "engines",
            "show",
            "det",
            "beef",
            "--dir",
            str(out),
        ): f"model 'det' has no engine 'beef' in {out / 'det'}",
        ("engines", "show", "det", "--previous", "--dir", str(out)): "has no previous plan",
        ("build", "--onnx", str(tmp_path / "x.onnx")): f"--onnx {tmp_path / 'x.onnx'}: does not exist",
        ("build", "--onnx", str(NANODET), "--precision", "int8"): "--precision int8 needs --calib DIR",
        ("build", "--onnx", str(NANODET), "--calib", str(tmp_path / "notes"), "--precision", "int8"): (
            f"--calib {tmp_path / 'notes'}: holds no .npy tensors and no images"
        ),
        ("build", "--onnx", str(NANODET), "--shapes", "input_1:0:2x3x416x416", "--out", str(out)): (
            "input 'input_1:0' min dim 0 is 2 but the ONNX model fixes it at 1"
        ),
        (
            "build",
            "--onnx",
            str(NANODET),
            "--shapes",
            "1x3x416x416",
        ): "--shapes '1x3x416x416': expected NAME:DIMS",
    }
    for argv, expected in errors.items():
        run = engines_cli(*argv)
        assert run.returncode == 2 and expected in run.stderr, (argv, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr


# ---- one job per model: two real `rebuild` processes ----------------------------------------------------


def fp16_config(tmp_path: Path) -> Path:
    data = {
        "device_id": "one-at-a-time",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            "det": {
                "onnx": str(NANODET),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "tensorrt_rtx",
                "precision": "fp16",
                "streams": 1,
                "calibration": {"samples": 360},  # fp16: 40 held-out frames for the gate
            }
        },
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "det", "min_score": 0.35}},
        "mqtt": {"enabled": False},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def rebuild(config: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "rebuild", "-c", str(config), "--force", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@needs_rtx
@pytest.mark.slow
def test_two_rebuilds_of_a_model_never_overlap(tmp_path: Path) -> None:
    import psutil

    config = fp16_config(tmp_path)
    lock_file = tmp_path / "engines" / "det" / ".build.lock"
    first = rebuild(config)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            lock_file.is_file() and lock_file.read_text().startswith(f"{first.pid}\n")
        ):
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()
        # 1. Refused at once, naming the holder: the first rebuild, busy with frames or the gate.
        t0 = time.monotonic()
        second = run_cli("rebuild", "-c", str(config), "--force", timeout=60)
        assert time.monotonic() - t0 < 30 and second.returncode == 2
        assert f"det: another build of model 'det' is running (pid {first.pid}, started " in second.stderr
        assert "rebuild -c " in second.stderr and "[engine job: model det, precision fp16]" in second.stderr
        assert first.poll() is None, "the first rebuild ended before the second was refused: test too slow?"
        # 2. --wait: it waits, and starts nothing (no frames, no gate, no job child) until the first is done.
        third = rebuild(config, "--wait", "300")
        polls = 0
        while True:
            jobs = [c for c in psutil.Process(third.pid).children() if "agent.lifecycle.job" in c.cmdline()]
            if not lock_file.read_text().startswith(f"{first.pid}\n"):  # read after: the first's lock is gone
                break
            assert not jobs, "the waiting rebuild started a job while the first one held the lock"
            assert third.poll() is None
            polls += 1
            time.sleep(0.2)
        assert polls > 5
        out1, err1 = first.communicate()
        assert first.returncode == 0, err1
        out3, err3 = third.communicate(timeout=300)
        assert third.returncode == 0, err3
    finally:
        for p in (first, locals().get("third")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert f"waiting up to 300 s for another build (pid {first.pid}" in err3
    for out in (out1, out3):
        assert "gate fp16 passed" in out and "fp16 -> fp16" in out and "built engine" in out
    # Piped, progress is a few lines (never one per frame): captured frames, the phases that took a while.
    assert "det: captured 0 calibration + 40 held-out frames" in err1
    assert len([line for line in err1.splitlines() if "accuracy gate" in line]) <= 12, err1
    # The third build replaced the first's plan, which is kept as the previous one.
    store = EngineStore(tmp_path / "engines")
    key = store.entries("det")[0].key
    built_first = (
        next(line for line in out1.splitlines() if "built engine" in line).rsplit("-> ", 1)[1].split()[0]
    )
    assert store.previous("det", key).plan == Path(built_first)

    # The job child reports the gate frame by frame (the events the bar and the daemon's state follow).
    from agent.config import load_config
    from agent.lifecycle.job import JobRequest, start_job
    from agent.lifecycle.model import ModelContext

    events: list[Event] = []
    ctx = ModelContext.from_config(load_config(config), "det")
    result = start_job(JobRequest(ctx, "fp16"), events.append).wait(timeout=300)
    assert result.ok and not result.fields["built"], result
    steps = [(e.phase, e.step, e.total) for e in events if isinstance(e, Progress)]
    reference = [s for s in steps if s[0] == "accuracy gate fp16: fp32 reference"]
    candidate = [s for s in steps if s[0] == "accuracy gate fp16: candidate"]
    for frames in (reference, candidate):  # batch by batch (ONNX Runtime takes 8 frames at a time)
        done = [s[1] for s in frames]
        assert done == sorted(done) and done[0] == 0 and done[-1] == 40 and len(done) >= 6, frames
        assert {s[2] for s in frames} == {40}


# ---- the daemon swaps in a rolled-back plan ---------------------------------------------------------


@needs_rtx
@pytest.mark.slow
def test_daemon_picks_up_a_rollback(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
device_id: roll
engine_dir: {tmp_path / "engines"}
models:
  detector: {{onnx: {NANODET}, format: nanodet, labels: {ASSETS / "coco.names"}, backend: tensorrt_rtx,
              precision: fp32}}
cameras:
  street: {{url: {ASSETS / "bikes.mp4"}, model: detector, fps: 5}}
mqtt: {{host: 127.0.0.1, port: {mqtt_broker.port}}}
""")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/roll/engines/#")
    agent = start_agent(config)

    def states(m: list) -> list[dict]:
        return decoded(m, "/engines/detector")

    # Without a GPU the built plan cannot run: the state says `fallback` (ONNX Runtime serves) and names
    # the plan it holds; with one it is `ready`. Either way the plan is the one the daemon adopted.
    held = ("ready", "fallback")

    def built(m: list) -> bool:
        return any(s["state"] in held and s.get("plan_sha256") for s in states(m))

    msgs = wait(sub, built, 90, agent, "first engine")
    first = next(s for s in states(msgs) if s["state"] in held and s.get("plan_sha256"))["plan_sha256"]
    cli = run_cli("rebuild", "-c", str(config), "--force", "--wait", "60", timeout=180)
    assert cli.returncode == 0, cli.stderr

    def serving(sha: str) -> Callable[[list], bool]:
        return lambda m: bool(states(m)) and states(m)[-1].get("plan_sha256") == sha

    store = EngineStore(tmp_path / "engines", check_writable=False)
    second = store.entries("detector")[0].build.plan_sha256
    wait(sub, serving(second), 30, agent, "the rebuilt plan adopted")
    rolled = run_cli("engines", "rollback", "detector", "-c", str(config), "--wait", "30", timeout=60)
    assert rolled.returncode == 0, rolled.stderr
    msgs = wait(sub, serving(first), 30, agent, "the rolled-back plan adopted")
    assert states(msgs)[-1]["state"] in held
    assert "new engine" in agent.text() and "built by another process" in agent.text()


# ---- issue 36 (4): prune and list touch only an engine store, and only what its naming owns -------------


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_prune_and_list_refuse_a_folder_that_is_no_engine_store(tmp_path: Path, capsys) -> None:
    """A folder with someone's plans (no marker, no manifest) is a one-line error; a dry run or a real
    prune changes nothing there (before: the dry run proposed deleting models/important.plan and wrote
    models/.build.lock, the real prune deleted the plan)."""
    from agent.cli import main

    folder = tmp_path / "work"
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "important.plan").write_bytes(b"a week of tuning")
    (folder / "important.plan").write_bytes(b"another")
    (folder / "models" / "notes.json").write_text('{"not": "a manifest"}')
    before = tree(folder)
    for argv in (["prune", "--dry-run"], ["prune"], ["list"], ["prune", "--model", "models"]):
        assert main(["engines", *argv, "--dir", str(folder)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{folder} is not an engine store" in err, err
        assert tree(folder) == before and not (folder / "models" / ".build.lock").exists()


def test_prune_in_a_store_deletes_only_what_the_store_owns(tmp_path: Path, capsys) -> None:
    """A store (marked by the store, or an older one known by its manifests) holding an unrelated
    important.plan: the dry run writes nothing (no lock file), the real prune deletes the store's stale
    files (a previous plan, an orphan plan of a fingerprint key) and never important.plan."""
    from agent.cli import main
    from engines.store.marker import MARKER_NAME

    root = tmp_path / "engines"
    store = EngineStore(root)
    assert (root / MARKER_NAME).is_file()
    s0, s1 = put(store, 0), put(store, 1)
    d = store.model_dir("det")
    (d / "important.plan").write_bytes(b"not ours")
    (d / "important-0123456789ab.plan").write_bytes(b"not ours either")
    orphan = d / "feedc0deba5e1234.plan"  # a fingerprint key without manifest: a killed build's
    orphan.write_bytes(b"half")
    (d / ".build.lock").unlink(missing_ok=True)
    for marked in (False, True):  # an older store (no marker) is recognised by its manifest
        if not marked:
            (root / MARKER_NAME).unlink()
        before = tree(root)
        assert main(["engines", "prune", "--dry-run", "--dir", str(root)]) == 0
        out = capsys.readouterr().out
        assert tree(root) == before and not (d / ".build.lock").exists()
        assert "important" not in out and str(orphan) in out and f"k1-{s0[:12]}.plan" in out
        if not marked:
            (root / MARKER_NAME).write_bytes(b"")
    assert main(["engines", "prune", "--dir", str(root)]) == 0
    assert not orphan.exists() and not (d / f"k1-{s0[:12]}.plan").exists()
    assert (d / "important.plan").read_bytes() == b"not ours"
    assert (d / "important-0123456789ab.plan").read_bytes() == b"not ours either"
    assert store.read_plan("det", "k1") == b"plan-1" and s1


# ---- issue 36 (9): a missing TensorRT says how to get it ------------------------------------------------


@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt_rtx"])
def test_build_without_the_flavour_names_the_extra(monkeypatch, capsys, backend: str) -> None:
    """Before: "no TensorRT module is importable (tensorrt: No module named 'tensorrt')" and nothing on how
    to get it. Now the extra (and JetPack's system package for a Jetson, where the PyPI wheel is wrong)."""
    from agent.cli import main

    monkeypatch.setitem(sys.modules, backend, None)  # `import tensorrt[_rtx]` raises ImportError
    assert main(["build", "--onnx", str(NANODET), "--backend", backend]) == 2
    err = capsys.readouterr().err
    extra = backend.replace("_", "-")
    assert f"pip install 'edge-agent[{extra}]'" in err and len(err.strip().splitlines()) == 1
    assert ("JetPack's python3-libnvinfer" in err) == (backend == "tensorrt")


# ---- issue 36 (10): an INT8 build that fell back to the folded Q/DQ graph says so ------------------------


def test_int8_build_says_the_unfolded_graph_failed_and_the_folded_was_built(tmp_path: Path, capsys) -> None:
    """What `build --precision int8` on TensorRT-RTX tried (the unfolded Q/DQ graph hits its internal
    error, tests/test_precision_build.py; the folded one builds, tests/test_int8_rtx.py). Before: "int8 not
    built: ... (fold first ...)" then "built int8 engine", as if nothing had been folded."""
    from agent.cli.engines.build import _say
    from agent.lifecycle.standalone import StandaloneResult

    why = "TensorRT-RTX hit an internal error on this Q/DQ graph; ... (fold first, e.g. ...)"
    plan = tmp_path / "k-0123456789ab.plan"
    plan.write_bytes(b"x")
    result = StandaloneResult(
        "det", "k", "int8", True, plan, tmp_path / "k.json", 12.0, "built", "no GPU", None,
        [
            {"precision": "int8", "built": False, "reason": why},
            {"precision": "int8 (folded)", "built": True, "reason": None},
        ],
    )  # fmt: skip
    _say(result, str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"det: int8 from the unfolded Q/DQ graph failed to build: {why}; the folded Q/DQ graph was tried next"
    )
    assert lines[1].startswith("det: built int8 engine k from the folded Q/DQ graph in 12.0 s")
    # No calibration data: int8 was left out, not failed; fp16 built.
    result = StandaloneResult(
        "det", "k", "fp16", True, plan, tmp_path / "k.json", 1.0, "built", "no GPU", None,
        [
            {"precision": "int8", "built": False, "reason": "no --calib DIR", "skipped": True},
            {"precision": "fp16", "built": True, "reason": None},
        ],
    )  # fmt: skip
    _say(result, str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "det: int8 not built: no --calib DIR"
    assert lines[1].startswith("det: built fp16 engine k in")
