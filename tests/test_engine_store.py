"""Engine store, manifest, lock, fingerprint: fast tests without building an engine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines.errors import BuildLockedError, ManifestError, StoreError
from engines.fingerprint import DEFAULT_TARGET_CC, parse_nv_tegra_release, probe_fingerprint, probe_l4t
from engines.manifest import SCHEMA, BuildInfo, Manifest, load_manifest
from engines.settings import BuildSettings, Shapes, onnx_input_shapes, resolve_profiles
from engines.store import EngineStore
from engines.store.fsutil import atomic_write_bytes, remove_stale_temps

NANODET = Path(__file__).resolve().parent.parent / "agent" / "assets" / "nanodet-m-416.onnx"
TEGRA = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)


def sample_manifest(**build_overrides: object) -> Manifest:
    fp = {
        "trt_flavor": "tensorrt",
        "trt_version": "10.3.0",
        "gpu_name": "Orin",
        "compute_capability": "8.7",
        "cuda_driver": "12.6",
        "cuda_runtime": "12.6",
        "l4t": "R36.4.0",
        "dla_core": None,
        "platform": "linux-aarch64",
    }
    build = {
        "onnx_sha256": "ab" * 32,
        "precision": "fp16",
        "profiles": [{"images": {"min": [1, 3, 640, 640], "opt": [4, 3, 640, 640], "max": [8, 3, 640, 640]}}],
        "workspace_bytes": 1 << 30,
        "optimization_level": 3,
        "calibration": None,
        "timing_cache": {"path": "/x/timing/a.cache", "hit": True},
        "built_at": "2026-01-01T00:00:00.000+00:00",
        "build_s": 12.5,
        "agent_version": "0.1.0",
        "plan_sha256": "cd" * 32,
    }
    build.update(build_overrides)
    return Manifest(fp, BuildInfo.from_dict(build), None)


# --- fingerprint ----------------------------------------------------------------------------
def test_l4t_from_nv_tegra_release(tmp_path):
    assert parse_nv_tegra_release(TEGRA) == "R35.4.1"
    release = tmp_path / "nv_tegra_release"
    release.write_text(TEGRA)
    assert probe_l4t(release, dpkg_version=lambda: None) == "R35.4.1"
    # No file: the nvidia-l4t-core package version, then nothing.
    assert probe_l4t(tmp_path / "absent", dpkg_version=lambda: "36.4.0-20240912212859") == "R36.4.0"
    assert probe_l4t(tmp_path / "absent", dpkg_version=lambda: None) is None


def test_fingerprint_on_this_machine(tmp_path):
    pytest.importorskip("tensorrt_rtx")
    from engines.trt import import_trt

    api = import_trt("tensorrt_rtx")
    fp = probe_fingerprint(api, tegra_release=tmp_path / "absent")
    assert fp.trt_flavor == "tensorrt_rtx" and fp.trt_version.startswith("1.")
    assert fp.gpu_name is None and not fp.has_gpu and fp.compute_capability == DEFAULT_TARGET_CC
    assert fp.l4t is None and fp.platform.startswith("linux-")
    assert "no GPU (target 8.6)" in fp.describe()
    fp89 = probe_fingerprint(api, target_compute_capability="8.9", tegra_release=tmp_path / "absent")
    assert fp89.compute_capability == "8.9"
    assert set(fp.manifest_dict()) == {
        "trt_flavor",
        "trt_version",
        "gpu_name",
        "compute_capability",
        "cuda_driver",
        "cuda_runtime",
        "l4t",
        "dla_core",
        "platform",
        "sm_count",
        "memory_gib",
        "dla_cores",
    }
    assert (fp.sm_count, fp.memory_gib, fp.dla_cores) == (None, None, 0)  # no GPU: nothing to count


# --- manifest --------------------------------------------------------------------------------
def test_manifest_roundtrip_and_errors_name_path_and_field(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(sample_manifest().to_json())
    m = load_manifest(path)
    assert m.key == "k" and m.build.precision == "fp16" and json.loads(path.read_text())["schema"] == SCHEMA

    data = json.loads(path.read_text())
    data["schema"] = "edge-agent/engine-manifest/0"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=rf"manifest {path}: field 'schema' is"):
        load_manifest(path)
    data["schema"] = SCHEMA
    data["build"]["build_s"] = "slow"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=rf"manifest {path}: field 'build.build_s' must be int/float"):
        load_manifest(path)
    del data["fingerprint"]["trt_version"]
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"field 'fingerprint\.trt_version' is missing"):
        load_manifest(path)
    path.write_text("{not json")
    with pytest.raises(ManifestError, match=rf"manifest {path}: not valid JSON"):
        load_manifest(path)


# --- store -----------------------------------------------------------------------------------
def test_engine_dir_not_writable_is_a_clear_error(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(StoreError, match=rf"engine_dir {regular}/sub cannot be created: Not a directory"):
        EngineStore(regular / "sub")
    with pytest.raises(StoreError, match=rf"engine_dir {regular} is not a directory"):
        EngineStore(regular)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_engine_dir_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(StoreError, match=rf"engine_dir {ro} is not writable: Permission denied"):
        EngineStore(ro)


def test_write_read_prune_and_rollback_order(tmp_path):
    store = EngineStore(tmp_path / "e", keep=2)
    for i in range(4):
        plan = f"plan-{i}".encode()
        m = sample_manifest(
            built_at=f"2026-01-0{i + 1}T00:00:00.000+00:00", plan_sha256=hashlib.sha256(plan).hexdigest()
        )
        store.write("det", f"key{i}", plan, m)
    assert [m.key for m in store.entries("det")] == ["key3", "key2"]  # older keys pruned to `keep`
    assert store.read_plan("det", "key3") == b"plan-3"
    sha = {i: hashlib.sha256(f"plan-{i}".encode()).hexdigest()[:12] for i in range(4)}
    assert not (store.model_dir("det") / f"key0-{sha[0]}.plan").exists()
    # Each plan is named by its key and content hash; the manifest of the key points at it.
    assert sorted(p.name for p in store.model_dir("det").iterdir()) == [
        f"key2-{sha[2]}.plan",
        "key2.json",
        f"key3-{sha[3]}.plan",
        "key3.json",
    ]
    assert store.plan_path("det", "key3") == store.model_dir("det") / f"key3-{sha[3]}.plan"
    # A plan without manifest is invisible; a bad manifest is reported, not listed.
    (store.model_dir("det") / "orphan.plan").write_bytes(b"x")
    (store.model_dir("det") / "bad.json").write_text("{}")
    assert [m.key for m in store.entries("det")] == ["key3", "key2"]
    assert any("bad.json" in p and "'schema'" in p for p in store.problems("det"))
    with pytest.raises(StoreError, match=r"model name '\.\./x'"):
        store.model_dir("../x")


def test_atomic_write_and_stale_temp_cleanup(tmp_path):
    target = tmp_path / "k.plan"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir()] == ["k.plan"]
    stale = tmp_path / ".k.plan.tmp-123-abcd"
    stale.write_bytes(b"half")
    assert remove_stale_temps(tmp_path) == [stale] and target.exists()


def test_build_lock_names_holder_pid_and_waits(tmp_path):
    store = EngineStore(tmp_path)
    lock_path = store.model_dir("det") / ".build.lock"
    # Another process holds the lock for 1.5 s.
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from engines.store.lock import BuildLock
        with BuildLock(__import__('pathlib').Path({str(lock_path)!r}), 'det'):
            print('locked', flush=True)
            time.sleep(1.5)
    """)
    store.model_dir("det").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            BuildLockedError, match=rf"another build of model 'det' is running \(pid {holder.pid}"
        ):
            store.lock("det", wait_s=0).acquire()
        with pytest.raises(BuildLockedError) as info:
            store.lock("det", wait_s=0.2).acquire()
        assert info.value.pid == holder.pid and "waited 0.2 s" in str(info.value)
        with store.lock("det", wait_s=30) as lock:  # waits for the holder to finish
            assert lock.holder_pid() == os.getpid()
    finally:
        holder.wait(10)


# --- settings / profiles ---------------------------------------------------------------------
def test_profiles_from_onnx_and_explicit():
    inputs = onnx_input_shapes(NANODET)
    assert inputs == {"input_1:0": (1, 3, 416, 416)}
    # Fixed batch: the profile equals the fixed shape whatever batch says.
    [p] = resolve_profiles(BuildSettings(onnx=NANODET, batch=(1, 4, 8)), inputs)
    assert p["input_1:0"] == Shapes((1, 3, 416, 416), (1, 3, 416, 416), (1, 3, 416, 416))
    dyn = {"images": (None, 3, 640, 640)}
    [p] = resolve_profiles(BuildSettings(onnx=NANODET, batch=(1, 4, 8)), dyn)
    assert p["images"] == Shapes((1, 3, 640, 640), (4, 3, 640, 640), (8, 3, 640, 640))
    two = (
        {"images": Shapes((1, 3, 640, 640), (1, 3, 640, 640), (2, 3, 640, 640))},
        {"images": Shapes((4, 3, 640, 640), (8, 3, 640, 640), (16, 3, 640, 640))},
    )
    assert len(resolve_profiles(BuildSettings(onnx=NANODET, profiles=two), dyn)) == 2
    from engines.errors import BuildError

    bad = ({"images": Shapes((1, 3, 320, 320), (1, 3, 640, 640), (1, 3, 640, 640))},)
    with pytest.raises(
        BuildError, match="input 'images' min dim 2 is 320 but the ONNX model fixes it at 640"
    ):
        resolve_profiles(BuildSettings(onnx=NANODET, profiles=bad), dyn)
    with pytest.raises(BuildError, match="dynamic non-batch dims"):
        resolve_profiles(BuildSettings(onnx=NANODET), {"images": (None, 3, None, None)})
    settings = BuildSettings(
        onnx=NANODET, precision="fp16", profiles=two, dla_core=0, target_compute_capability="8.9"
    )
    assert BuildSettings.from_request(json.loads(json.dumps(settings.to_request()))) == settings
