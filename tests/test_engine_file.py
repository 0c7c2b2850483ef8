"""models.M.engine_file: a prebuilt engine (the manifest of another store, e.g. `edge-agent build --out DIR`)
is imported into engine_dir with its plan verified, then checked as any engine is; the config's errors name
the key. The engine is a `fake_tensorrt` plan in a real store (no builder here for TensorRT <= 10)."""

from __future__ import annotations

from pathlib import Path

import fake_tensorrt
import pytest
import yaml
from engine_fixtures import gpu_fp, store_engine

from agent.config import load_config
from agent.preflight import preflight
from engines.build.compat import check
from engines.errors import EngineError
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
NANODET = ASSETS / "nanodet-m-416.onnx"


def _prebuilt(tmp_path: Path, gpu: str = "Orin") -> tuple[Path, BuildSettings, TrtApi]:
    api = TrtApi(fake_tensorrt.make("10.3.0"))
    settings = BuildSettings(onnx=NANODET)
    source = EngineStore(tmp_path / "built")
    m = store_engine(
        source, "nanodet", settings, gpu_fp(api, gpu), plan=fake_tensorrt.PLAN_MAGIC + b"prebuilt"
    )
    assert m.path is not None
    return m.path, settings, api


def test_an_engine_file_is_imported_verified_and_checked(tmp_path: Path) -> None:
    manifest, settings, api = _prebuilt(tmp_path)
    store = EngineStore(tmp_path / "engines")
    key, written = store.import_engine("det", manifest)
    assert written and key == manifest.stem
    assert store.read_plan("det", key) == fake_tensorrt.PLAN_MAGIC + b"prebuilt"
    assert check(store, "det", settings, gpu_fp(api)).ok  # fits this device and these settings: served
    assert store.import_engine("det", manifest) == (key, False)  # the same plan again: nothing written
    # On another GPU the same file is refused by the usual check, with the reason (then rebuilt from ONNX).
    other = check(store, "det", settings, gpu_fp(api, "Thor", "10.1"))
    assert not other.ok and any("Thor" in r or "Orin" in r for r in other.reasons), other.reasons


def test_a_corrupted_or_foreign_engine_file_is_refused_naming_it(tmp_path: Path) -> None:
    manifest, _, _ = _prebuilt(tmp_path)
    store = EngineStore(tmp_path / "engines")
    plan = next(p for p in manifest.parent.iterdir() if p.suffix == ".plan")
    plan.write_bytes(plan.read_bytes() + b"tampered")
    with pytest.raises(EngineError, match="corrupted"):
        store.import_engine("det", manifest)
    stray = tmp_path / "stray" / "m" / "nokey.json"
    stray.parent.mkdir(parents=True)
    stray.write_text("{}")
    with pytest.raises(EngineError, match=r"nokey\.json"):
        store.import_engine("det", stray)
    assert not store.keys("det")  # nothing half-imported


def test_engine_file_resolves_against_the_config_and_is_checked_by_preflight(tmp_path: Path) -> None:
    cfg = {
        "engine_dir": "engines",
        "models": {
            "det": {
                "onnx": str(NANODET),
                "labels": str(ASSETS / "coco.names"),
                "format": "nanodet",
                "engine_file": "prebuilt/det/abc.json",
            }
        },
        "cameras": {"a": {"url": str(ASSETS / "bikes.mp4"), "model": "det"}},
        "mqtt": {"enabled": False},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config(path)
    assert loaded.models["det"].engine_file == tmp_path / "prebuilt" / "det" / "abc.json"
    problems = preflight(loaded, str(path))
    assert any("models.det.engine_file" in p and "abc.json" in p for p in problems), problems
    (tmp_path / "prebuilt" / "det").mkdir(parents=True)
    (tmp_path / "prebuilt" / "det" / "abc.plan").write_bytes(b"x")
    cfg["models"]["det"]["engine_file"] = "prebuilt/det/abc.plan"
    path.write_text(yaml.safe_dump(cfg))
    problems = preflight(load_config(path), str(path))
    assert any("models.det.engine_file" in p and "not an engine manifest" in p for p in problems), problems


def test_the_engine_manager_serves_an_engine_file_or_says_why_not(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """At start the manager imports models.M.engine_file and checks it: `ready` with its key where it fits;
    on another GPU `fallback` with the check's reasons (a job then rebuilds from the ONNX)."""
    from agent.lifecycle.job import resolved_settings
    from agent.lifecycle.manager import EngineManager
    from agent.lifecycle.model import ModelContext
    from agent.lifecycle.roles import SupervisorRole
    from agent.lifecycle.serving import EngineTarget

    api = TrtApi(fake_tensorrt.make("10.3.0"))
    det = {"onnx": str(NANODET), "format": "nanodet", "precision": "fp32"}
    cam = {"a": {"url": str(ASSETS / "bikes.mp4"), "model": "det"}}

    def config(name: str, **extra: object) -> Path:
        path = tmp_path / f"{name}.yaml"
        data = {"engine_dir": str(tmp_path / name), "models": {"det": {**det, **extra}}, "cameras": cam}
        path.write_text(yaml.safe_dump({**data, "mqtt": {"enabled": False}}))
        return path

    # The prebuilt engine: what `edge-agent build` makes for these settings on an Orin.
    settings, _, _ = resolved_settings(ModelContext.from_config(load_config(config("src")), "det"), api)
    assert settings is not None
    m = store_engine(EngineStore(tmp_path / "built"), "det", settings, gpu_fp(api, "Orin"))
    assert m.path is not None
    states: list[dict] = []
    for gpu, want in (("Orin", "ready"), ("Thor", "fallback")):
        target = EngineTarget(api, gpu_fp(api, gpu, "8.7" if gpu == "Orin" else "10.1"))
        monkeypatch.setattr("agent.lifecycle.manager.engine_target", lambda _ctx, target=target: target)
        cfg = load_config(config(gpu, engine_file=str(m.path)))
        role = SupervisorRole()
        mgr = EngineManager(cfg, lambda _m, f: states.append(dict(f)), lambda *_: None, "t", role=role)
        mgr.check("det")
        assert states[-1]["state"] == want, states[-1]
        if want == "ready":
            assert states[-1]["key"] == m.path.stem
        else:
            assert states[-1]["reasons"], states[-1]
        mgr.close()
