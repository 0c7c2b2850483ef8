"""Real TensorRT-RTX builds of the bundled NanoDet on this CPU-only machine (AOT, no GPU needed)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("tensorrt_rtx")

from agent.config import ModelConfig
from agent.lifecycle.job import JobRequest, start_job
from agent.lifecycle.model import ModelContext
from engines.build.builder import build
from engines.build.compat import check
from engines.buildproc import ChildProcess, Progress
from engines.errors import BuildError, BuildLockedError, StoreError
from engines.fingerprint import probe_fingerprint
from engines.manifest import (
    BUILD_SPEC,
    FINGERPRINT_SPEC,
    OPTIONAL_BUILD_SPEC,
    OPTIONAL_FINGERPRINT_SPEC,
    SCHEMA,
    load_manifest,
)
from engines.settings import BuildSettings
from engines.store import EngineStore, sha256_file
from engines.trt import import_trt

NANODET = Path(__file__).resolve().parent.parent / "agent" / "assets" / "nanodet-m-416.onnx"
MODEL = "det"
pytestmark = pytest.mark.slow


def start_fp32_job(onnx: Path, engine_dir: Path, force: bool = False, on_event=None) -> ChildProcess:
    """The agent's build child (the one the daemon and the CLI use) for an fp32 engine of `onnx`."""
    # One execution context: the same engine key as the fp32_settings fixture.
    mcfg = ModelConfig(onnx=onnx, backend="tensorrt_rtx", precision="fp32", streams=1)
    ctx = ModelContext(MODEL, mcfg, engine_dir, 0.4)
    return start_job(JobRequest(ctx, "fp32", force), on_event)


@pytest.fixture(scope="session")
def api():
    return import_trt("tensorrt_rtx")


@pytest.fixture(scope="session")
def fp(api):
    return probe_fingerprint(api)


@pytest.fixture(scope="session")
def fp32_settings() -> BuildSettings:
    return BuildSettings(onnx=NANODET, precision="fp32")


@pytest.fixture(scope="session")
def built(tmp_path_factory, api, fp, fp32_settings):
    """One real FP32 build, shared read-only; tests that change things work on a copy."""
    root = tmp_path_factory.mktemp("engines-fp32")
    store = EngineStore(root)
    events: list[tuple[str, int, int]] = []
    result = build(
        store,
        MODEL,
        fp32_settings,
        api=api,
        fingerprint=fp,
        agent_version="0.1.0-test",
        on_progress=lambda *e: events.append(e),
    )
    return root, result, events


@pytest.fixture
def store_copy(built, tmp_path) -> EngineStore:
    root = tmp_path / "engines"
    shutil.copytree(built[0], root)
    return EngineStore(root)


def test_fp32_build_writes_plan_and_complete_manifest(built, fp32_settings, fp):
    root, result, events = built
    plan_name = f"{result.key}-{result.manifest.build.plan_sha256[:12]}.plan"  # named by content hash
    assert result.built and result.plan_path == root / MODEL / plan_name
    m = load_manifest(root / MODEL / f"{result.key}.json")
    raw = json.loads(m.path.read_text())
    assert raw["schema"] == SCHEMA and set(raw) == {"schema", "fingerprint", "build", "validation"}
    assert set(raw["fingerprint"]) == set(FINGERPRINT_SPEC) | set(OPTIONAL_FINGERPRINT_SPEC)
    # New builds write the optional fields too (older manifests without them still load).
    # Every field a build writes; refused_at_load is written later, by the daemon that could not load it.
    # refused_at_load: set by the daemon later; jetson: builds on a Jetson only (this one is not).
    assert set(raw["build"]) == set(BUILD_SPEC) | (set(OPTIONAL_BUILD_SPEC) - {"refused_at_load", "jetson"})
    assert (
        raw["fingerprint"]["trt_flavor"] == "tensorrt_rtx"
        and raw["fingerprint"]["compute_capability"] == "8.6"
    )
    b = raw["build"]
    assert b["precision"] == "fp32" and b["calibration"] is None and raw["validation"] is None
    assert b["profiles"] == [
        {"input_1:0": {"min": [1, 3, 416, 416], "opt": [1, 3, 416, 416], "max": [1, 3, 416, 416]}}
    ]
    assert b["plan_sha256"] == sha256_file(result.plan_path) and b["onnx_sha256"] == sha256_file(NANODET)
    assert b["agent_version"] == "0.1.0-test" and b["build_s"] > 0
    assert (
        Path(b["timing_cache"]["path"]).parent == root / "timing" and Path(b["timing_cache"]["path"]).exists()
    )
    assert b["timing_cache"]["hit"] is False  # first build; and RTX timing caches never hold timings
    assert result.plan_path.stat().st_size > 5_000_000
    # Coarse phases from our code plus TensorRT's IProgressMonitor phases in between.
    phases = [e[0] for e in events]
    assert phases[0] == "parse" and phases[-1] == "save" and "Building engine" in phases
    assert check(EngineStore(root), MODEL, fp32_settings, fp).status == "ok"


def test_second_build_does_nothing_and_force_rebuilds(store_copy, api, fp, fp32_settings, built):
    again = build(store_copy, MODEL, fp32_settings, api=api, fingerprint=fp)
    assert not again.built and "up to date; nothing to build" in again.message and again.key == built[1].key
    forced = build(store_copy, MODEL, fp32_settings, api=api, fingerprint=fp, force=True)
    assert forced.built and forced.key == built[1].key and "(forced)" in forced.message
    # Timing cache path kept and reloaded, but RTX caches are no-ops: honestly no hit.
    assert forced.manifest.build.timing_cache["hit"] is False
    assert check(store_copy, MODEL, fp32_settings, fp).ok


def test_fp16_build_and_precision_change_reason(store_copy, api, fp, fp32_settings, built):
    fp16 = BuildSettings(onnx=NANODET, precision="fp16")
    res = check(store_copy, MODEL, fp16, fp)
    assert res.status == "rebuild" and res.reasons == ["precision fp32 -> fp16"]
    out = build(store_copy, MODEL, fp16, api=api, fingerprint=fp)
    assert out.built and out.manifest.build.precision == "fp16"
    assert out.plan_path.stat().st_size < 0.75 * built[1].plan_path.stat().st_size
    assert check(store_copy, MODEL, fp16, fp).ok
    # The FP32 engine is kept: switching the config back needs no rebuild (rollback).
    assert check(store_copy, MODEL, fp32_settings, fp).ok
    assert [m.key for m in store_copy.entries(MODEL)] == [out.key, built[1].key]


def test_check_reasons(store_copy, fp, fp32_settings, built, tmp_path):
    key = built[1].key
    # ONNX changed: a copy with one weight nudged.
    model = onnx.load(str(NANODET))
    init = model.graph.initializer[0]
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.float32(1e-3), init.name))
    changed = tmp_path / "changed.onnx"
    onnx.save(model, str(changed))
    res = check(store_copy, MODEL, BuildSettings(onnx=changed), fp)
    assert (res.status, res.reasons) == ("rebuild", ["ONNX changed"])

    # Another AOT target compute capability configured.
    res = check(store_copy, MODEL, BuildSettings(onnx=NANODET, target_compute_capability="8.9"), fp)
    assert res.reasons == ["GPU none (8.6) -> none (8.9)"]

    # The manifest records another TensorRT version / compute capability.
    path = store_copy.manifest_path(MODEL, key)
    original = path.read_text()
    data = json.loads(original)
    data["fingerprint"]["trt_version"] = "1.0.0.21"
    path.write_text(json.dumps(data))
    assert check(store_copy, MODEL, fp32_settings, fp).reasons == [
        f"TensorRT-RTX 1.0.0.21 -> {fp.trt_version}"
    ]
    data = json.loads(original)
    data["fingerprint"]["compute_capability"] = "12.0"
    path.write_text(json.dumps(data))
    assert check(store_copy, MODEL, fp32_settings, fp).reasons == ["GPU none (12.0) -> none (8.6)"]
    path.write_text(original)

    # Corrupted plan: bytes flipped in the middle.
    plan = store_copy.plan_path(MODEL, key)
    with open(plan, "r+b") as f:
        f.seek(plan.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = check(store_copy, MODEL, fp32_settings, fp)
    assert (res.status, res.reasons) == ("rebuild", ["plan corrupted (sha256 mismatch)"])
    with pytest.raises(StoreError, match=r"plan .*\.plan is corrupted \(sha256 mismatch"):
        store_copy.read_plan(MODEL, key)

    # Missing.
    res = check(store_copy, "other", fp32_settings, fp)
    assert res.status == "missing" and res.manifest is None


def test_sigkill_mid_build_leaves_no_loadable_plan(store_copy, fp32_settings, fp, built, tmp_path):
    empty = EngineStore(tmp_path / "fresh")
    for store, force in ((empty, False), (store_copy, True)):
        holder: dict[str, object] = {}

        def on_event(event, holder=holder):
            if isinstance(event, Progress) and "killed" not in holder:
                holder["killed"] = True
                holder["handle"].kill()

        handle = start_fp32_job(fp32_settings.onnx, store.root, force=force, on_event=on_event)
        holder["handle"] = handle
        result = handle.wait(timeout=60)
        assert (
            not result.ok
            and result.fields["error_type"] == "Killed"
            and "killed by signal 9" in str(result.error)
        )
        plans = sorted(p.name for p in store.model_dir(MODEL).glob("*.plan"))
        if store is empty:
            assert plans == [] and check(store, MODEL, fp32_settings, fp).status == "missing"
        else:
            assert plans == [built[1].plan_path.name] and check(store, MODEL, fp32_settings, fp).ok
    # A killed writer's temp file (a dot-file, never a plan name) is cleaned by the next build.
    stale = empty.model_dir(MODEL) / f".{built[1].key}.plan.tmp-99999-abcd"
    stale.write_bytes(b"half a plan")
    res = build(empty, MODEL, fp32_settings, fingerprint=fp)
    assert res.built and not stale.exists() and check(empty, MODEL, fp32_settings, fp).ok


def test_concurrent_builds_lock(store_copy, fp32_settings, fp, built):
    started = threading.Event()
    handle = start_fp32_job(
        fp32_settings.onnx,
        store_copy.root,
        force=True,
        on_event=lambda e: started.set() if isinstance(e, Progress) else None,
    )
    assert started.wait(30), "child build never reported progress"
    with pytest.raises(
        BuildLockedError, match=rf"another build of model 'det' is running \(pid {handle.pid},"
    ):
        build(store_copy, MODEL, fp32_settings, fingerprint=fp, lock_wait_s=0)
    waited = build(store_copy, MODEL, fp32_settings, fingerprint=fp, lock_wait_s=60)
    result = handle.wait(timeout=60)
    assert result.ok and result.fields["built"] and result.fields["key"] == built[1].key
    assert not waited.built and "nothing to build" in waited.message  # the child's engine is the one


def test_failed_builds_keep_previous_engine(store_copy, fp32_settings, fp, built, tmp_path):
    before = sha256_file(built[1].plan_path)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(NANODET.read_bytes()[: NANODET.stat().st_size // 2])
    with pytest.raises(BuildError, match=rf"{truncated}.*not a valid ONNX file \(truncated\?\)"):
        build(store_copy, MODEL, BuildSettings(onnx=truncated), fingerprint=fp)

    # An op TensorRT has no importer or plugin for, built through the child process.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu0"),
            helper.make_node("FancyOp", ["r"], ["y"], name="fancy_node", domain="com.example"),
        ],
        "custom",
        [x],
        [y],
    )
    custom = tmp_path / "custom.onnx"
    onnx.save(
        helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
        ),
        str(custom),
    )
    result = start_fp32_job(custom, store_copy.root).wait(timeout=60)
    assert not result.ok and result.fields["error_type"] == "BuildError"
    assert str(custom) in result.fields["error"] and "node fancy_node (op FancyOp)" in result.fields["error"]

    assert sha256_file(store_copy.plan_path(MODEL, built[1].key)) == before
    assert check(store_copy, MODEL, fp32_settings, fp).ok
    assert not list(store_copy.model_dir(MODEL).glob(".*tmp-*"))
