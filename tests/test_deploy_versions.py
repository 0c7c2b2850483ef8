"""The version store of deployments (agent.deploy.versions): install, serving, resolve at start, prune with
engines, names, crashes and a full disk."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest

import agent.deploy.staging as staging
from agent.config import ModelConfig
from agent.deploy.errors import DeployError, VerifyError
from agent.deploy.version_files import effective_model
from agent.deploy.versions import VersionStore
from engines.manifest import Manifest, manifest_from_dict
from engines.store import EngineStore

LABELS = b"person\ncar\n"


def _stage(store: VersionStore, model: str, version: str, onnx: bytes | None = None) -> dict[str, Path]:
    d = store.stage_dir(model, version)
    (d / "m.onnx").write_bytes(onnx if onnx is not None else f"onnx of {version}".encode())
    (d / "labels.txt").write_bytes(LABELS)
    return {"onnx": d / "m.onnx", "labels": d / "labels.txt"}


def _doc(model: str, version: str, files: dict[str, Path] | None = None) -> dict:
    doc: dict = {"model": model, "version": version, "format": "nanodet"}
    if files:
        doc["artifacts"] = {
            k: {
                "url": "https://x/" + k,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                "size": p.stat().st_size,
            }
            for k, p in files.items()
        }
    return doc


def _install(store: VersionStore, model: str, version: str, onnx: bytes | None = None) -> Path:
    files = _stage(store, model, version, onnx)
    path = store.install(model, version, files, _doc(model, version, files))
    store.discard_staging(model, version)
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_install_serving_and_resolve_cycle(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    v1 = _install(store, "det", "v1")
    assert sorted(p.name for p in v1.iterdir()) == [
        "document.json",
        "labels.txt",
        "model.onnx",
        "record.json",
    ]
    record = json.loads((v1 / "record.json").read_text())
    assert record["files"]["model.onnx"]["sha256"] == hashlib.sha256(b"onnx of v1").hexdigest()
    assert not (tmp_path / "staging" / "det" / "v1").exists()
    assert store.serving("det") is None
    assert store.resolve_at_start("det").version is None  # nothing promoted: the config's own model

    store.set_serving("det", "v1")
    _install(store, "det", "v2")
    store.set_serving("det", "v2")
    assert store.serving("det") == "v2" and store.previous("det") == ["v1"]
    assert [(v.version, v.state) for v in store.versions("det")] == [("v2", "serving"), ("v1", "previous")]

    resolved = VersionStore(tmp_path).resolve_at_start("det")  # a restart
    assert (resolved.version, resolved.path, resolved.note) == ("v2", store.version_dir("det", "v2"), None)

    store.set_serving("det", "v1")  # a rollback
    assert store.serving("det") == "v1" and store.previous("det") == ["v2"]
    store.set_serving("det", None)  # back to the config's model
    assert store.serving("det") is None and store.previous("det") == ["v1", "v2"]


def test_install_checks_the_document_sums_and_leaves_nothing(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    files = _stage(store, "det", "v1")
    doc = _doc("det", "v1", files)
    doc["artifacts"]["onnx"]["sha256"] = "0" * 64
    with pytest.raises(VerifyError, match="sha256") as err:
        store.install("det", "v1", files, doc)
    assert err.value.field == "artifacts.onnx.sha256"
    assert list((tmp_path / "models" / "det").iterdir()) == []
    store.discard_staging("det")
    assert list((tmp_path / "staging").iterdir()) == []


def test_same_version_again_is_the_same_folder_other_bytes_refused(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    first = _install(store, "det", "v1")
    assert _install(store, "det", "v1") == first
    with pytest.raises(DeployError, match="installed already with other files"):
        _install(store, "det", "v1", onnx=b"other bytes")
    assert (first / "model.onnx").read_bytes() == b"onnx of v1"
    assert [p.name for p in first.parent.iterdir()] == ["v1"]
    (first / "labels.txt").write_bytes(b"damaged\n")  # a broken install is replaced by a good one
    assert _install(store, "det", "v1") == first
    assert (first / "labels.txt").read_bytes() == LABELS
    assert [p.name for p in first.parent.iterdir()] == ["v1"]


def test_corrupted_version_falls_back_to_previous_then_config(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for v in ("v1", "v2", "v3"):
        _install(store, "det", v)
        store.set_serving("det", v)
    assert store.previous("det") == ["v2", "v1"]

    (store.version_dir("det", "v3") / "model.onnx").write_bytes(b"onnx of v9")  # same size, other bytes
    resolved = VersionStore(tmp_path).resolve_at_start("det")
    assert resolved.version == "v2" and resolved.path == store.version_dir("det", "v2")
    assert resolved.note is not None
    assert "v3 is broken" in resolved.note and "serving the previous version v2" in resolved.note
    assert "sha256" in resolved.broken["v3"]
    assert store.serving("det") == "v2"  # the fallback is recorded
    assert {v.version: v.state for v in store.versions("det")} == {
        "v3": "broken",
        "v2": "serving",
        "v1": "previous",
    }

    (store.version_dir("det", "v2") / "labels.txt").unlink()
    (store.version_dir("det", "v1") / "model.onnx").write_bytes(b"truncated")
    resolved = store.resolve_at_start("det")
    assert resolved.version is None and resolved.path is None
    assert resolved.note is not None and "config's own model" in resolved.note
    assert set(resolved.broken) == {"v2", "v1"}
    assert store.serving("det") is None
    # a broken version is never promoted again by accident, nor resolved at the next start
    assert store.resolve_at_start("det").version is None


def test_garbage_serving_record_serves_the_config_model(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    _install(store, "det", "v1")
    store.set_serving("det", "v1")
    (store.model_dir("det") / "serving.json").write_bytes(b"\x00garbage")
    resolved = store.resolve_at_start("det")
    assert resolved.version is None and resolved.note is not None and "not JSON" in resolved.note
    store.set_serving("det", "v1")  # a good record replaces it
    assert store.resolve_at_start("det").version == "v1"


def test_crash_leftovers_are_cleaned_at_start(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    _install(store, "det", "v1")
    store.set_serving("det", "v1")
    # what a kill -9 during an install, a prune and a serving write leaves
    half = store.model_dir("det") / ".incoming-v2-123-abcd"
    half.mkdir()
    (half / "model.onnx").write_bytes(b"half")
    (store.model_dir("det") / ".trash-v0-beef").mkdir()
    (store.model_dir("det") / ".serving.json.tmp-1-ab").write_bytes(b"{")
    staged = _stage(store, "det", "v2")
    resolved = store.resolve_at_start("det")
    assert resolved.version == "v1" and resolved.note is None
    assert sorted(p.name for p in store.model_dir("det").iterdir()) == ["serving.json", "v1"]
    assert [v.version for v in store.versions("det")] == ["v1"]
    assert staged["onnx"].exists()  # a download may resume: staging goes only with discard_staging
    store.discard_staging("det", "v2")
    assert list((tmp_path / "staging" / "det").iterdir()) == []


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "a\x00b", "", ".hidden", "x" * 129, "a b", "é"])
def test_names_with_traversal_are_refused(tmp_path: Path, name: str) -> None:
    store = VersionStore(tmp_path)
    with pytest.raises(DeployError, match="is not a name") as err:
        store.stage_dir("det", name)
    assert err.value.field == "version"
    with pytest.raises(DeployError, match="is not a name"):
        store.install(name, "v1", {}, {})
    with pytest.raises(DeployError, match="is not a name"):
        store.discard_staging("det", name)
    with pytest.raises(DeployError, match="is not a name"):
        store.set_serving(name, None)
    assert not (tmp_path / "models").exists() and not (tmp_path.parent / "x").exists()


def test_serving_record_with_traversal_names_is_refused(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    store.model_dir("det").mkdir(parents=True)
    (store.model_dir("det") / "serving.json").write_text(json.dumps({"serving": "../../etc", "previous": []}))
    resolved = store.resolve_at_start("det")
    assert resolved.version is None and resolved.note is not None and "bad names" in resolved.note


def test_full_disk_during_install_leaves_the_old_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = VersionStore(tmp_path)
    _install(store, "det", "v1")
    store.set_serving("det", "v1")
    files = _stage(store, "det", "v2")
    before = _tree(tmp_path / "models")

    def fake_full_disk_writer(path: Path, data: bytes) -> None:
        with open(path, "xb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging, "write_file", fake_full_disk_writer)
    with pytest.raises(DeployError, match="No space left on device") as err:
        store.install("det", "v2", files, _doc("det", "v2", files))
    assert "models/det" in err.value.reason
    assert _tree(tmp_path / "models") == before  # no v2, no temp file, serving.json as it was
    assert store.resolve_at_start("det").version == "v1"
    monkeypatch.undo()
    assert files["onnx"].exists()  # staging kept: the install can be tried again
    store.install("det", "v2", files, _doc("det", "v2", files))
    assert [v.version for v in store.versions("det")] == ["v2", "v1"]


def test_full_disk_writing_serving_record_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = VersionStore(tmp_path)
    _install(store, "det", "v1")
    _install(store, "det", "v2")
    store.set_serving("det", "v1")

    def fake_full_disk_writer(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging, "write_file", fake_full_disk_writer)
    with pytest.raises(DeployError, match=r"serving\.json: No space left"):
        store.set_serving("det", "v2")
    assert store.serving("det") == "v1"
    assert sorted(p.name for p in store.model_dir("det").iterdir()) == ["serving.json", "v1", "v2"]


def _engine(store: EngineStore, key: str, onnx_sha: str, built_at: str) -> Manifest:
    plan = f"plan {key}".encode()
    manifest = manifest_from_dict(
        {
            "schema": "edge-agent/engine-manifest/1",
            "fingerprint": {
                "trt_flavor": "tensorrt",
                "trt_version": "10.0",
                "gpu_name": None,
                "compute_capability": None,
                "cuda_driver": None,
                "cuda_runtime": None,
                "l4t": None,
                "dla_core": None,
                "platform": "x86_64",
            },
            "build": {
                "onnx_sha256": onnx_sha,
                "precision": "fp16",
                "profiles": [],
                "workspace_bytes": None,
                "optimization_level": None,
                "calibration": None,
                "timing_cache": None,
                "built_at": built_at,
                "build_s": 1.0,
                "agent_version": "0",
                "plan_sha256": hashlib.sha256(plan).hexdigest(),
            },
            "validation": None,
        }
    )
    with store.lock("det"):
        return store.write("det", key, plan, manifest)


def test_prune_keeps_serving_and_previous_and_deletes_engines(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "state")
    engines = EngineStore(tmp_path / "engines", keep=10)
    shas = {}
    for i, v in enumerate(("v1", "v2", "v3", "v4")):
        _install(store, "det", v)
        shas[v] = hashlib.sha256(f"onnx of {v}".encode()).hexdigest()
        _engine(engines, f"key{v}", shas[v], f"2026-01-0{i + 1}T00:00:00Z")
    (engines.model_dir("det") / "keyv1.calib").write_bytes(b"calibration cache")
    graft = engines.model_dir("det") / "graft"
    graft.mkdir()
    (graft / f"{shas['v1'][:16]}-s0.25-i0.5-k300.onnx").write_bytes(b"grafted v1")
    _engine(engines, "keygraft", hashlib.sha256(b"grafted v1").hexdigest(), "2026-01-05T00:00:00Z")
    _engine(engines, "keyconfig", "c" * 64, "2026-01-06T00:00:00Z")  # the config's own model
    store.set_serving("det", "v1")
    store.set_serving("det", "v4")  # v1 is the rollback target, v2 and v3 the oldest others

    notes: list[str] = []
    removed = store.prune("det", keep=1, engine_dir=tmp_path / "engines", notes=notes)
    assert sorted(removed) == ["v2", "v3"]
    assert [v.version for v in store.versions("det")] == ["v4", "v1"]
    assert sorted(engines.keys("det")) == ["keyconfig", "keygraft", "keyv1", "keyv4"]
    plans = sorted(p.name.split("-")[0] for p in engines.model_dir("det").glob("*.plan"))
    assert plans == ["keyconfig", "keygraft", "keyv1", "keyv4"]
    assert "deleted: keyv2" in " ".join(notes) and "deleted: keyv3" in " ".join(notes)

    store.set_serving("det", None)  # the config's model serves; v4 is the previous one now
    removed = store.prune("det", keep=1, engine_dir=tmp_path / "engines", notes=notes)
    assert removed == ["v1"]
    assert sorted(engines.keys("det")) == ["keyconfig", "keyv4"]
    assert not (engines.model_dir("det") / "keyv1.calib").exists() and not list(graft.iterdir())
    assert store.previous("det") == ["v4"]
    assert not list(engines.model_dir("det").glob(".*tmp*"))


def test_prune_leaves_engines_it_cannot_identify_and_shared_onnx(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "state")
    engines = EngineStore(tmp_path / "engines")
    _install(store, "det", "v1", onnx=b"same")
    _install(store, "det", "v2", onnx=b"same")  # a re-tag of the same bytes
    _install(store, "det", "v3")
    store.set_serving("det", "v2")
    store.set_serving("det", "v3")
    _engine(engines, "keysame", hashlib.sha256(b"same").hexdigest(), "2026-01-01T00:00:00Z")
    (engines.model_dir("det") / "keyunknown.json").write_text("{not a manifest")
    notes: list[str] = []
    assert store.prune("det", keep=1, engine_dir=tmp_path / "engines", notes=notes) == ["v1"]
    assert "keysame" in engines.keys("det") and "keyunknown" in engines.keys("det")
    assert any("serves another version" in n for n in notes)
    (store.model_dir("det") / "v3" / "record.json").unlink()  # a version whose engines cannot be told
    store.set_serving("det", "v2")
    store.set_serving("det", None)  # v2 previous; v3 not protected, unreadable
    notes.clear()
    assert store.prune("det", keep=1, engine_dir=tmp_path / "engines", notes=notes) == ["v3"]
    assert any("no readable record" in n for n in notes)


def test_remove_refuses_the_serving_and_previous_versions(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for v in ("v1", "v2", "v3"):
        _install(store, "det", v)
    store.set_serving("det", "v1")
    store.set_serving("det", "v2")
    for v in ("v1", "v2"):
        with pytest.raises(DeployError, match="not removed"):
            store.remove("det", v)
    store.remove("det", "v3")  # a candidate refused at the gate
    assert [v.version for v in store.versions("det")] == ["v2", "v1"]


def test_effective_model_points_at_the_version(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    d = store.stage_dir("det", "v1")
    (d / "m.onnx").write_bytes(b"onnx")
    (d / "labels.txt").write_bytes(LABELS)
    calib = d / "calib"
    (calib / "sub").mkdir(parents=True)
    (calib / "sub" / "a.jpg").write_bytes(b"jpeg")
    folder = store.install(
        "det",
        "v1",
        {"onnx": d / "m.onnx", "labels": d / "labels.txt", "calibration": calib},
        {"format": "nanodet"},
    )
    assert (folder / "calibration" / "sub" / "a.jpg").read_bytes() == b"jpeg"
    cfg = ModelConfig.model_validate(
        {
            "onnx": "/opt/m.onnx",
            "labels": "/opt/l.txt",
            "format": "yolov8",
            "precision": "int8",
            "engine_file": "/opt/e.json",
            "streams": 3,
            "calibration": {"samples": 64},
        }
    )
    eff = effective_model(cfg, folder)
    assert (eff.onnx, eff.labels, eff.format) == (folder / "model.onnx", folder / "labels.txt", "nanodet")
    assert (eff.precision, eff.streams, eff.engine_file) == ("int8", 3, None)
    assert (eff.calibration.source, eff.calibration.folder, eff.calibration.samples) == (
        "folder",
        folder / "calibration",
        64,
    )
    assert effective_model(cfg, folder, precision="fp16").precision == "fp16"
    assert cfg.onnx == Path("/opt/m.onnx")  # the config itself is not changed
