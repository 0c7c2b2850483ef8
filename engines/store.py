"""The engine store: `{engine_dir}/{model}/{key}.plan` + `{key}.json`, timing caches in `timing/`.

    store = EngineStore("/var/lib/edge-agent/engines")   # StoreError now if the dir is not writable
    store.entries("detector")          # manifests, newest first (invalid ones skipped, see `problems`)
    store.read_plan("detector", key)   # bytes, sha256 verified against the manifest
    with store.lock("detector", wait_s=0): store.write(...)

The plan is written before its manifest, each atomically, so a manifest always points at a complete
plan; a plan without a manifest is never listed. Older keys stay for rollback (a config or TensorRT
revert finds its engine again), pruned to `keep` per model.
"""

from __future__ import annotations

import errno
import hashlib
import re
from pathlib import Path

from engines.errors import ManifestError, StoreError
from engines.fsutil import atomic_write_bytes, fsync_dir, remove_stale_temps, temp_path_for
from engines.lock import BuildLock
from engines.manifest import Manifest, load_manifest

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LOCK_NAME = ".build.lock"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, str(e))


class EngineStore:
    def __init__(self, engine_dir: str | Path, keep: int = 3, check_writable: bool = True) -> None:
        self.root = Path(engine_dir)
        self.keep = max(1, keep)
        if check_writable:
            self.ensure_writable(self.root)

    @staticmethod
    def ensure_writable(directory: Path) -> None:
        """Create `directory` and prove it writable by writing a file (os.access lies for root)."""
        if directory.exists() and not directory.is_dir():
            raise StoreError(f"engine_dir {directory} is not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"engine_dir {directory} cannot be created: {_reason(e)}") from e
        probe = temp_path_for(directory / "write-probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
        except OSError as e:
            raise StoreError(f"engine_dir {directory} is not writable: {_reason(e)}") from e
        finally:
            probe.unlink(missing_ok=True)

    # --- paths ----------------------------------------------------------------------------
    def model_dir(self, model: str) -> Path:
        if not _NAME_RE.match(model):
            raise StoreError(f"model name {model!r} cannot be a directory name in {self.root}")
        return self.root / model

    def plan_path(self, model: str, key: str) -> Path:
        return self.model_dir(model) / f"{key}.plan"

    def manifest_path(self, model: str, key: str) -> Path:
        return self.model_dir(model) / f"{key}.json"

    def calib_path(self, model: str, key: str) -> Path:
        """INT8 calibration cache of engine `key` (its identity sits in `{key}.calib.meta`)."""
        return self.model_dir(model) / f"{key}.calib"

    @property
    def timing_dir(self) -> Path:
        return self.root / "timing"

    # --- reading --------------------------------------------------------------------------
    def entries(self, model: str) -> list[Manifest]:
        """Valid manifests of `model`, newest first (built_at, then file mtime)."""
        found = []
        for m in self._scan(model)[0]:
            assert m.path is not None
            found.append((m.build["built_at"], m.path.stat().st_mtime, m))
        found.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [m for *_, m in found]

    def problems(self, model: str) -> list[str]:
        """Why manifests in the model dir were skipped (bad schema/field), one message each."""
        return self._scan(model)[1]

    def _scan(self, model: str) -> tuple[list[Manifest], list[str]]:
        d = self.model_dir(model)
        good, bad = [], []
        if d.is_dir():
            for p in sorted(d.glob("*.json")):
                if p.name.startswith("."):
                    continue
                try:
                    good.append(load_manifest(p))
                except ManifestError as e:
                    bad.append(str(e))
        return good, bad

    def manifest(self, model: str, key: str) -> Manifest | None:
        path = self.manifest_path(model, key)
        return load_manifest(path) if path.exists() else None

    def verify_plan(self, model: str, manifest: Manifest) -> str | None:
        """None when the plan matches its manifest's sha256, else the reason it cannot be used."""
        assert manifest.key is not None
        plan = self.plan_path(model, manifest.key)
        if not plan.is_file():
            return f"plan {plan} is missing"
        if sha256_file(plan) != manifest.build["plan_sha256"]:
            return "plan corrupted (sha256 mismatch)"
        return None

    def read_plan(self, model: str, key: str) -> bytes:
        """Plan bytes, verified against the manifest's sha256 (StoreError naming the plan otherwise)."""
        m = self.manifest(model, key)
        plan = self.plan_path(model, key)
        if m is None:
            raise StoreError(f"no manifest {self.manifest_path(model, key)} for plan {plan}")
        try:
            data = plan.read_bytes()
        except OSError as e:
            raise StoreError(f"cannot read plan {plan}: {_reason(e)}") from e
        # Hash what we loaded (not the file again): the bytes handed to TensorRT are the verified ones.
        if hashlib.sha256(data).hexdigest() != m.build["plan_sha256"]:
            raise StoreError(f"plan {plan} is corrupted (sha256 mismatch with {m.path})")
        return data

    # --- writing (hold the model's lock) --------------------------------------------------
    def lock(self, model: str, wait_s: float | None = 0.0) -> BuildLock:
        d = self.model_dir(model)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create {d}: {_reason(e)}") from e
        return BuildLock(d / LOCK_NAME, model, wait_s)

    def clean_stale(self, model: str) -> list[Path]:
        return remove_stale_temps(self.model_dir(model)) + remove_stale_temps(self.timing_dir)

    def write(self, model: str, key: str, plan: bytes | memoryview, manifest: Manifest) -> Manifest:
        d = self.model_dir(model)
        d.mkdir(parents=True, exist_ok=True)
        plan_path, json_path = self.plan_path(model, key), self.manifest_path(model, key)
        try:
            # Drop the old manifest first when overwriting a key (force): a crash between the two
            # renames must not leave an old manifest pointing at a new plan (it would read "corrupt").
            json_path.unlink(missing_ok=True)
            atomic_write_bytes(plan_path, plan)
            atomic_write_bytes(json_path, manifest.to_json().encode())
        except OSError as e:
            raise StoreError(f"cannot write engine {plan_path}: {_reason(e)}") from e
        self.prune(model, protect=key)
        return Manifest(manifest.fingerprint, manifest.build, manifest.validation, json_path)

    def set_validation(self, model: str, key: str, validation: dict | None) -> Manifest:
        """Record the accuracy gate's result in an engine's manifest (atomic rewrite; hold the lock)."""
        m = self.manifest(model, key)
        if m is None:
            raise StoreError(f"no manifest {self.manifest_path(model, key)} to record validation in")
        updated = Manifest(m.fingerprint, m.build, validation, m.path)
        try:
            atomic_write_bytes(self.manifest_path(model, key), updated.to_json().encode())
        except OSError as e:
            raise StoreError(f"cannot write {self.manifest_path(model, key)}: {_reason(e)}") from e
        return updated

    def prune(self, model: str, protect: str | None = None) -> list[str]:
        """Keep the `keep` newest keys (and `protect`); delete the rest. Returns the removed keys."""
        removed = []
        for m in self.entries(model)[self.keep :]:
            assert m.key is not None
            if m.key == protect:
                continue
            # Manifest first: without it the plan is invisible, whatever happens next.
            self.manifest_path(model, m.key).unlink(missing_ok=True)
            self.plan_path(model, m.key).unlink(missing_ok=True)
            calib = self.calib_path(model, m.key)
            calib.with_name(calib.name + ".meta").unlink(missing_ok=True)
            calib.unlink(missing_ok=True)
            removed.append(m.key)
        if removed:
            fsync_dir(self.model_dir(model))
        return removed
