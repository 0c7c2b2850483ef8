"""EngineStore: writing an engine, rolling it back and rewriting its manifest, each committed by one
atomic rename of `{key}.json` (the guarantee: engines.store). Hold the model's build lock."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import replace
from pathlib import Path

from engines.errors import ManifestError, StoreError
from engines.manifest import Manifest
from engines.store.cleanup import StoreCleanup
from engines.store.fsutil import atomic_write_bytes, fsync_dir
from engines.store.marker import mark
from engines.store.paths import PREVIOUS_SUFFIX, os_reason, plan_file_name
from engines.store.reading import Previous

log = logging.getLogger("engines.store")


class EngineStore(StoreCleanup):
    """One directory per model holding manifests and the plans they point at (engines.store)."""

    def __init__(self, engine_dir: str | Path, keep: int = 3, check_writable: bool = True) -> None:
        super().__init__(engine_dir, keep, check_writable)
        if check_writable:  # proven writable: mark it ours (engines.store.marker)
            mark(self.root)

    def write(self, model: str, key: str, plan: bytes | memoryview, manifest: Manifest) -> Manifest:
        """Store engine `key` of `model` (hold the model's lock); it becomes current only once its plan and
        manifest are both on disk. StoreError (path and OS reason) leaves the previous engine current."""
        d = self.model_dir(model)
        sha = hashlib.sha256(plan).hexdigest()
        if manifest.build.plan_sha256 != sha:
            raise StoreError(
                f"manifest of engine {key} of model {model!r} says plan_sha256 "
                f"{manifest.build.plan_sha256}, but the plan's is {sha}"
            )
        plan_path = d / plan_file_name(key, sha)
        try:
            old: Manifest | None = self.manifest(model, key)
        except ManifestError:
            old = None  # unreadable: nothing to keep as previous (its plans stay, see _referenced)
        self._write_plan(model, key, plan_path, plan, sha)
        mark(self.root)
        try:
            record = self._keep_previous(model, key, old, sha)
        except BaseException:
            self._drop_uncommitted(model, key, plan_path, sha)
            raise
        json_path = self._commit_manifest(model, key, manifest, plan_path, sha, record)
        # 4. Only now what of this key neither the new manifest nor the previous record points at (an older
        #    previous plan, a record superseded by the one just written).
        with contextlib.suppress(OSError):  # the new engine is current; clean_stale retries at the next build
            for r in self._live_records(model, key)[1]:
                r.path.unlink(missing_ok=True)
            self.remove_orphan_plans(model, only=[p for p, k in self._plan_files(model) if k == key])
        self.prune(model, protect=key)
        return Manifest(manifest.fingerprint, manifest.build, manifest.validation, json_path)

    def _write_plan(self, model: str, key: str, plan_path: Path, plan: bytes | memoryview, sha: str) -> None:
        """Step 1: the plan under its own name; the previous engine's plan and manifest stay untouched.
        (Same bytes as the current plan: same name, replaced atomically by identical bytes.)"""
        try:
            plan_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(plan_path, plan)
        except BaseException as e:
            self._drop_uncommitted(model, key, plan_path, sha)
            if isinstance(e, OSError):
                raise StoreError(f"cannot write engine plan {plan_path}: {os_reason(e)}") from e
            raise

    def _keep_previous(self, model: str, key: str, old: Manifest | None, sha: str) -> Path | None:
        """Step 2: the manifest being replaced is kept as the previous plan's record (rollback): a good plan
        only (intact, not refused by TensorRT at load); otherwise an older previous stays. Its path, or None
        when none was written."""
        if old is None or old.build.plan_sha256 == sha or not self._good(model, old):
            return None
        record = self.previous_path(model, key, old.build.plan_sha256)
        try:
            atomic_write_bytes(record, old.to_json().encode())
        except OSError as e:  # the new engine matters more; its previous is not kept
            log.warning("cannot keep the previous plan of engine %s (%s): %s", key, record, os_reason(e))
            return None
        return record

    def _commit_manifest(
        self, model: str, key: str, manifest: Manifest, plan_path: Path, sha: str, record: Path | None
    ) -> Path:
        """Step 3, the commit point: the new manifest replaces `{key}.json` in one rename."""
        json_path = self.manifest_path(model, key)
        try:
            atomic_write_bytes(json_path, manifest.to_json().encode())
        except BaseException as e:
            self._drop_uncommitted(model, key, plan_path, sha, record)
            if isinstance(e, OSError):
                raise StoreError(
                    f"cannot write manifest {json_path} of engine plan {plan_path}: {os_reason(e)}; "
                    "the previous engine stays current"
                ) from e
            raise
        return json_path

    def _good(self, model: str, manifest: Manifest) -> bool:
        """A plan worth keeping for rollback: it verifies and TensorRT never refused it at load."""
        if manifest.build.refused_at_load:
            return False
        bad = self.verify_plan(model, manifest)
        if bad:
            log.info("engine %s of model %s: not kept as previous (%s)", manifest.key, model, bad)
        return bad is None

    def _drop_uncommitted(
        self, model: str, key: str, plan_path: Path, sha: str, record: Path | None = None
    ) -> None:
        """After a failed write: delete the new plan unless `{key}.json` points at it (same bytes as the
        current engine's, or the manifest rename happened and only the directory fsync failed), and the
        previous record just written (it describes the engine that stays current)."""
        try:
            current = self.manifest(model, key)
        except ManifestError:
            current = None
        if current is not None and current.build.plan_sha256 == sha:
            return
        with contextlib.suppress(OSError):  # best effort: never listed; the next clean_stale removes it
            plan_path.unlink(missing_ok=True)
            if record is not None:
                record.unlink(missing_ok=True)

    def set_validation(self, model: str, key: str, validation: dict | None) -> Manifest:
        """Record the accuracy gate's result in an engine's manifest (atomic rewrite; hold the lock)."""
        m = self.manifest(model, key)
        if m is None:
            raise StoreError(f"no manifest {self.manifest_path(model, key)} to record validation in")
        return self._rewrite_manifest(model, key, Manifest(m.fingerprint, m.build, validation, m.path))

    def set_refused_at_load(
        self, model: str, key: str, plan_sha256: str, record: dict | None
    ) -> Manifest | None:
        """Record that TensorRT refused the plan `plan_sha256` of engine `key` at load (build.refused_at_load,
        engines.build.compat.refusal_record; None clears it), by an atomic rewrite of its manifest; hold the
        lock. Returns None, writing nothing, when the manifest no longer points at that plan: a rebuild
        replaced it meanwhile, and its new plan has not been refused."""
        m = self.manifest(model, key)
        if m is None or m.build.plan_sha256 != plan_sha256:
            return None
        # Cleared first: a new record is written last in `build`, where a rebuild's manifest lacks it.
        build = m.build.without("refused_at_load")
        if record is not None:
            build = replace(build, refused_at_load=record)
        return self._rewrite_manifest(model, key, Manifest(m.fingerprint, build, m.validation, m.path))

    def _rewrite_manifest(self, model: str, key: str, updated: Manifest) -> Manifest:
        """`updated` over the manifest of `key`, atomically (the same plan: nothing else changes)."""
        try:
            atomic_write_bytes(self.manifest_path(model, key), updated.to_json().encode())
        except OSError as e:
            raise StoreError(f"cannot write {self.manifest_path(model, key)}: {os_reason(e)}") from e
        return updated

    def rollback(self, model: str, key: str) -> tuple[Manifest, Previous | None]:
        """Make the previous plan of engine `key` current again; the plan that was current becomes the
        previous one (a second rollback rolls forward). Returns (the current manifest now, the previous
        now). StoreError naming the path when there is nothing to roll back to or its plan is unusable."""
        d = self.model_dir(model)
        current = self.manifest(model, key)  # ManifestError names the file
        if current is None:
            raise StoreError(
                f"model {model!r} has no engine {key} ({self.manifest_path(model, key)} is missing)"
            )
        prev = self.previous(model, key)
        if prev is None:
            raise StoreError(
                f"engine {key} of model {model!r} has no previous plan to roll back to "
                f"(no {key}-*{PREVIOUS_SUFFIX} record with its plan in {d})"
            )
        bad = self.verify_plan(model, prev.manifest, prev.plan)
        if bad:
            raise StoreError(
                f"previous plan {prev.plan} of engine {key} of model {model!r} cannot be used: {bad}"
            )
        path = self.manifest_path(model, key)
        try:
            # 1. The current plan is recorded as previous; 2. the commit point: the previous manifest
            # replaces `{key}.json` in one rename (the engine watcher of a running daemon notices it).
            atomic_write_bytes(
                self.previous_path(model, key, current.build.plan_sha256), current.to_json().encode()
            )
            atomic_write_bytes(path, prev.manifest.to_json().encode())
        except OSError as e:
            raise StoreError(
                f"cannot roll engine {key} of model {model!r} back ({path}): {os_reason(e)}"
            ) from e
        # 3. The record of the plan that is current now duplicates `{key}.json`.
        with contextlib.suppress(OSError):
            prev.record.unlink(missing_ok=True)
            fsync_dir(d)
        now = Manifest(prev.manifest.fingerprint, prev.manifest.build, prev.manifest.validation, path)
        return now, self.previous(model, key)

    def import_engine(self, model: str, manifest_file: Path) -> tuple[str, bool]:
        """Copy the engine whose manifest is `manifest_file` (in another store: <dir>/<model>/<key>.json,
        the plan beside it) into this store as `model`'s; (its key, whether anything was written: False when
        the same plan is stored already). StoreError / ManifestError name the file at fault."""
        manifest_file = Path(manifest_file)
        source = EngineStore(manifest_file.parent.parent, check_writable=False)
        src_model, key = manifest_file.parent.name, manifest_file.stem
        m = source.manifest(src_model, key)
        if m is None:
            raise StoreError(
                f"{manifest_file}: not an engine manifest (<key>.json of a store's model folder)"
            )
        mine = self.manifest(model, key)
        if mine is not None and mine.build.plan_sha256 == m.build.plan_sha256:
            return key, False
        plan = source.read_plan(src_model, key)  # verified against its manifest's sha256
        with self.lock(model, wait_s=30.0, command="import engine_file"):
            self.write(model, key, plan, Manifest(m.fingerprint, m.build, m.validation, None))
        return key, True
