"""The engine store: one directory per model holding manifests and the plans they point at.

    {engine_dir}/{model}/{key}.json                the manifest of engine `key`: what it was built from and
                                                   build.plan_sha256, the sha256 of its plan
    {engine_dir}/{model}/{key}-{sha256[:12]}.plan  that plan; its name carries its content hash
    {engine_dir}/{model}/{key}.plan                a plan written before plans were named by hash; still
                                                   read when its manifest's hashed plan file does not exist
    {engine_dir}/{model}/{key}.calib[.meta]        INT8 calibration cache of `key` (engines.calibrator)
    {engine_dir}/{model}/.build.lock               the model's build lock (engines.lock)
    {engine_dir}/timing/*.cache                    TensorRT timing caches, shared by all models

    store = EngineStore("/var/lib/edge-agent/engines")   # StoreError now if the dir is not writable
    store.entries("detector")          # manifests, newest first (invalid ones skipped, see `problems`)
    store.read_plan("detector", key)   # bytes, sha256 verified against the manifest
    store.plan_path("detector", key)   # the plan file the current manifest of `key` points at
    with store.lock("detector", wait_s=0): store.clean_stale("detector"); store.write(...)

Guarantee: the manifest is the commit point, and an engine is current only once its plan and its
manifest are both complete on disk. `write` puts the new plan under its own hashed name (temp file,
fsync, rename, fsync of the directory), then renames the new manifest over `{key}.json` the same
way, and only then deletes the plan the previous manifest pointed at. So a failure at any point -
ENOSPC/EFBIG, SIGKILL, power loss, an exception - leaves the previous engine of the key listed,
intact (its sha256 verifies) and loadable, or the new one complete; never a manifest whose plan is
missing. A failed manifest write removes the new plan at once and raises StoreError naming the path
and the OS reason. What a killed writer can leave behind - temp files (".*.tmp-*"), a plan that no
manifest points at - is never listed, and `clean_stale` (called by the builder under the model lock
at the start of every build) deletes it. A plan a manifest points at is never deleted, nor any plan of
a key whose manifest cannot be read (it may be a newer schema's). Calibration caches are per key, not
per plan: they stay for the next build of that key and go with its prune.

Older keys stay for rollback (a config or TensorRT revert finds its engine again), pruned to `keep`
per model.
"""

from __future__ import annotations

import contextlib
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
PLAN_HASH_LEN = 12
# `{key}-{hash}.plan` or a legacy `{key}.plan` (never a dot-file: temp files start with ".").
_PLAN_RE = re.compile(rf"^(?P<key>[^.].*?)(?:-(?P<hash>[0-9a-f]{{{PLAN_HASH_LEN}}}))?\.plan$")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, str(e))


def plan_file_name(key: str, plan_sha256: str) -> str:
    """The file name of the plan of engine `key` with content hash `plan_sha256`."""
    return f"{key}-{plan_sha256[:PLAN_HASH_LEN]}.plan"


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
        """The plan file the manifest of `key` points at (see plan_path_for). Without a readable
        manifest there is no plan: the legacy name `{key}.plan` is returned, for messages."""
        try:
            m = self.manifest(model, key)
        except ManifestError:
            m = None
        if m is None:
            return self.model_dir(model) / f"{key}.plan"
        return self.plan_path_for(model, m)

    def plan_path_for(self, model: str, manifest: Manifest) -> Path:
        """The plan file `manifest` (a stored one: its path names the key) points at:
        `{key}-{plan_sha256[:12]}.plan`, or the legacy `{key}.plan` when only that one exists."""
        key = manifest.key
        if key is None:
            raise StoreError("a manifest that was never stored points at no plan file")
        d = self.model_dir(model)
        hashed = d / plan_file_name(key, manifest.build["plan_sha256"])
        if not hashed.exists():
            legacy = d / f"{key}.plan"
            if legacy.exists():
                return legacy
        return hashed

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
            try:
                mtime = m.path.stat().st_mtime
            except FileNotFoundError:  # pruned since the scan
                continue
            found.append((m.build["built_at"], mtime, m))
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
        plan = self.plan_path_for(model, manifest)
        try:
            if sha256_file(plan) != manifest.build["plan_sha256"]:
                return "plan corrupted (sha256 mismatch)"
        except FileNotFoundError:
            return f"plan {plan} is missing"
        except OSError as e:
            return f"plan {plan} cannot be read: {_reason(e)}"
        return None

    def read_plan(self, model: str, key: str) -> bytes:
        """Plan bytes, verified against the manifest's sha256 (StoreError naming the plan otherwise)."""
        m = self.manifest(model, key)
        for _ in range(3):
            if m is None:
                raise StoreError(
                    f"no manifest {self.manifest_path(model, key)} for plan {self.plan_path(model, key)}"
                )
            plan = self.plan_path_for(model, m)
            try:
                data = plan.read_bytes()
                break
            except FileNotFoundError as e:
                # A rebuild of this key may have switched the manifest and deleted the plan we were
                # about to read: follow the new manifest (a few times), else report the missing plan.
                now = self.manifest(model, key)
                if now is not None and now.build["plan_sha256"] != m.build["plan_sha256"]:
                    m = now
                    continue
                raise StoreError(f"cannot read plan {plan}: {_reason(e)}") from e
            except OSError as e:
                raise StoreError(f"cannot read plan {plan}: {_reason(e)}") from e
        else:
            raise StoreError(f"plan of engine {key} of model {model!r} kept changing while being read")
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
        """Delete what killed or failed writes left: temp files, and plans no manifest points at."""
        return (
            remove_stale_temps(self.model_dir(model))
            + remove_stale_temps(self.timing_dir)
            + self.remove_orphan_plans(model)
        )

    def _plan_files(self, model: str) -> list[tuple[Path, str]]:
        """(path, key) of every plan file in the model dir, hashed or legacy name."""
        d = self.model_dir(model)
        found = []
        if d.is_dir():
            for p in d.iterdir():
                match = _PLAN_RE.match(p.name)
                if match and p.is_file():
                    found.append((p, match["key"]))
        return found

    def _referenced(self, model: str) -> tuple[set[Path], set[str]]:
        """Plan files the valid manifests point at, and keys whose manifest cannot be read (their plans
        are kept: what a manifest we cannot read points at is unknown)."""
        plans: set[Path] = set()
        unreadable: set[str] = set()
        d = self.model_dir(model)
        if d.is_dir():
            for p in d.glob("*.json"):
                if p.name.startswith("."):
                    continue
                try:
                    plans.add(self.plan_path_for(model, load_manifest(p)))
                except ManifestError:
                    unreadable.add(p.stem)
        return plans, unreadable

    def remove_orphan_plans(self, model: str, only: list[Path] | None = None) -> list[Path]:
        """Delete plan files no manifest points at (all of them, or those in `only`). Hold the lock."""
        plans, unreadable = self._referenced(model)
        removed = []
        for p, key in self._plan_files(model):
            if p in plans or key in unreadable or (only is not None and p not in only):
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            removed.append(p)
        if removed:
            fsync_dir(self.model_dir(model))
        return removed

    def write(self, model: str, key: str, plan: bytes | memoryview, manifest: Manifest) -> Manifest:
        """Store engine `key` of `model` (hold the model's lock); it becomes current only once its plan and
        manifest are both on disk. StoreError (path and OS reason) leaves the previous engine current."""
        d = self.model_dir(model)
        json_path = self.manifest_path(model, key)
        sha = hashlib.sha256(plan).hexdigest()
        if manifest.build["plan_sha256"] != sha:
            raise StoreError(
                f"manifest of engine {key} of model {model!r} says plan_sha256 "
                f"{manifest.build['plan_sha256']}, but the plan's is {sha}"
            )
        plan_path = d / plan_file_name(key, sha)
        try:
            d.mkdir(parents=True, exist_ok=True)
            # 1. The plan under its own name: the previous engine's plan and manifest stay untouched.
            #    (Same bytes as the current plan: same name, replaced atomically by identical bytes.)
            atomic_write_bytes(plan_path, plan)
        except BaseException as e:
            self._drop_uncommitted(model, key, plan_path, sha)
            if isinstance(e, OSError):
                raise StoreError(f"cannot write engine plan {plan_path}: {_reason(e)}") from e
            raise
        try:
            # 2. The commit point: the new manifest replaces `{key}.json` in one rename.
            atomic_write_bytes(json_path, manifest.to_json().encode())
        except BaseException as e:
            self._drop_uncommitted(model, key, plan_path, sha)
            if isinstance(e, OSError):
                raise StoreError(
                    f"cannot write manifest {json_path} of engine plan {plan_path}: {_reason(e)}; "
                    "the previous engine stays current"
                ) from e
            raise
        # 3. Only now the plans of this key the new manifest does not point at (the previous one).
        with contextlib.suppress(OSError):  # the new engine is current; clean_stale retries at the next build
            self.remove_orphan_plans(model, only=[p for p, k in self._plan_files(model) if k == key])
        self.prune(model, protect=key)
        return Manifest(manifest.fingerprint, manifest.build, manifest.validation, json_path)

    def _drop_uncommitted(self, model: str, key: str, plan_path: Path, sha: str) -> None:
        """After a failed write: delete the new plan unless `{key}.json` points at it (same bytes as the
        current engine's, or the manifest rename happened and only the directory fsync failed)."""
        try:
            current = self.manifest(model, key)
        except ManifestError:
            current = None
        if current is not None and current.build["plan_sha256"] == sha:
            return
        with contextlib.suppress(OSError):  # best effort: never listed; the next clean_stale removes it
            plan_path.unlink(missing_ok=True)

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

    def set_refused_at_load(
        self, model: str, key: str, plan_sha256: str, record: dict | None
    ) -> Manifest | None:
        """Record that TensorRT refused the plan `plan_sha256` of engine `key` at load (build.refused_at_load,
        engines.compat.refusal_record; None clears it), by an atomic rewrite of its manifest; hold the lock.
        Returns None, writing nothing, when the manifest no longer points at that plan: a rebuild replaced
        it meanwhile, and its new plan has not been refused."""
        m = self.manifest(model, key)
        if m is None or m.build["plan_sha256"] != plan_sha256:
            return None
        build = {k: v for k, v in m.build.items() if k != "refused_at_load"}
        if record is not None:
            build["refused_at_load"] = record
        updated = Manifest(m.fingerprint, build, m.validation, m.path)
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
            self.remove_orphan_plans(model, only=[p for p, k in self._plan_files(model) if k == m.key])
            calib = self.calib_path(model, m.key)
            calib.with_name(calib.name + ".meta").unlink(missing_ok=True)
            calib.unlink(missing_ok=True)
            removed.append(m.key)
        if removed:
            fsync_dir(self.model_dir(model))
        return removed
