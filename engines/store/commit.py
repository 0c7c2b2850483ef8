"""The engine store: one directory per model holding manifests and the plans they point at.

    {engine_dir}/{model}/{key}.json                the manifest of engine `key`: what it was built from and
                                                   build.plan_sha256, the sha256 of its plan
    {engine_dir}/{model}/{key}-{sha256[:12]}.plan  that plan; its name carries its content hash
    {engine_dir}/{model}/{key}-{sha256[:12]}.prev  the manifest of the previous good plan of `key` (the one
                                                   the last rebuild replaced), kept with its plan for
                                                   rollback until pruned
    {engine_dir}/{model}/{key}.plan                a plan written before plans were named by hash; still
                                                   read when its manifest's hashed plan file does not exist
    {engine_dir}/{model}/{key}.calib[.meta]        INT8 calibration cache of `key` (engines.build.calibrator)
    {engine_dir}/{model}/.build.lock               the model's build lock (engines.store.lock)
    {engine_dir}/timing/*.cache                    TensorRT timing caches, shared by all models

    store = EngineStore("/var/lib/edge-agent/engines")   # StoreError now if the dir is not writable
    store.entries("detector")          # manifests, newest first (invalid ones skipped, see `problems`)
    store.read_plan("detector", key)   # bytes, sha256 verified against the manifest
    store.plan_path("detector", key)   # the plan file the current manifest of `key` points at
    store.previous("detector", key)    # the previous good plan of `key` (a Previous), or None
    with store.lock("detector", wait_s=0): store.clean_stale("detector"); store.write(...)
    with store.lock("detector"): store.rollback("detector", key)      # the previous plan is current again
    with store.lock("detector"): store.prune_previous("detector")     # previous plans and stale files go

Guarantee: the manifest is the commit point, and an engine is current only once its plan and its
manifest are both complete on disk. `write` puts the new plan under its own hashed name (temp file,
fsync, rename, fsync of the directory), records the manifest it replaces as `{key}-{sha[:12]}.prev` the
same way, then renames the new manifest over `{key}.json`, and only then deletes what neither points
at (an older previous plan of the key). So a failure at any point - ENOSPC/EFBIG, SIGKILL, power loss,
an exception - leaves the previous engine of the key listed, intact (its sha256 verifies) and loadable,
or the new one complete; never a manifest whose plan is missing. A failed manifest write removes the
new plan at once and raises StoreError naming the path and the OS reason. What a killed writer can
leave behind - temp files (".*.tmp-*"), a plan that no manifest or previous record points at, a
previous record whose plan is gone or that duplicates the current one - is never listed, and
`clean_stale` (called by the builder under the model lock at the start of every build) deletes it. A
plan a manifest points at is never deleted, nor any plan of a key whose manifest cannot be read (it may
be a newer schema's). Calibration caches are per key, not per plan: they stay for the next build of
that key and go with its prune.

Rollback swaps the two plans of a key with the same care: the current manifest is recorded as previous
first, then the previous manifest is renamed over `{key}.json` (the commit point, which the daemon's
engine watcher notices), then the record of the plan that became current is deleted. Killed between
any two steps, the key serves one of its two plans and keeps the other as previous.

Older keys stay for rollback (a config or TensorRT revert finds its engine again), pruned to `keep`
per model; a pruned key's previous plan goes with it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engines.errors import ManifestError, StoreError
from engines.manifest import Manifest, load_manifest
from engines.store.fsutil import TMP_MARK, atomic_write_bytes, fsync_dir, remove_stale_temps, temp_path_for
from engines.store.lock import BuildLock

log = logging.getLogger("engines.store")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LOCK_NAME = ".build.lock"
PLAN_HASH_LEN = 12
# `{key}-{hash}.plan` or a legacy `{key}.plan` (never a dot-file: temp files start with ".").
_PLAN_RE = re.compile(rf"^(?P<key>[^.].*?)(?:-(?P<hash>[0-9a-f]{{{PLAN_HASH_LEN}}}))?\.plan$")
PREVIOUS_SUFFIX = ".prev"
# `{key}-{hash}.prev`: the manifest of a kept previous plan of `key`.
_PREV_RE = re.compile(rf"^(?P<key>[^.].*?)-(?P<hash>[0-9a-f]{{{PLAN_HASH_LEN}}})\.prev$")


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


def previous_file_name(key: str, plan_sha256: str) -> str:
    """The file name of the record (manifest) of a kept previous plan of engine `key`."""
    return f"{key}-{plan_sha256[:PLAN_HASH_LEN]}{PREVIOUS_SUFFIX}"


@dataclass(frozen=True)
class Previous:
    """The previous good plan of an engine key: its manifest (as it was when it served), where that
    record lies, and the plan file it points at."""

    key: str
    manifest: Manifest  # .path is the record; .key is not the engine key here (use `key`)
    record: Path
    plan: Path


@dataclass(frozen=True)
class _Record:
    path: Path
    key: str
    hash: str  # plan sha256[:12] from the name
    manifest: Manifest | None  # None: unreadable (a newer schema?): its plan is kept by name


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
        return self._plan_for(model, key, manifest)

    def _plan_for(self, model: str, key: str, manifest: Manifest) -> Path:
        d = self.model_dir(model)
        hashed = d / plan_file_name(key, manifest.build["plan_sha256"])
        if not hashed.exists():
            legacy = d / f"{key}.plan"
            if legacy.exists():
                return legacy
        return hashed

    def manifest_path(self, model: str, key: str) -> Path:
        return self.model_dir(model) / f"{key}.json"

    def previous_path(self, model: str, key: str, plan_sha256: str) -> Path:
        """Where the record of the kept previous plan `plan_sha256` of `key` lies."""
        return self.model_dir(model) / previous_file_name(key, plan_sha256)

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

    def models(self) -> list[str]:
        """Model directories of the store that hold a manifest or a plan (sorted)."""
        if not self.root.is_dir():
            return []
        found = []
        for d in sorted(self.root.iterdir()):
            if d.name == "timing" or not d.is_dir() or not _NAME_RE.match(d.name):
                continue
            if any(p.suffix in (".json", ".plan") and not p.name.startswith(".") for p in d.iterdir()):
                found.append(d.name)
        return found

    def keys(self, model: str) -> list[str]:
        """Keys with a manifest file in the model dir (readable or not), sorted."""
        d = self.model_dir(model)
        if not d.is_dir():
            return []
        return sorted(p.stem for p in d.glob("*.json") if not p.name.startswith("."))

    def _records(self, model: str, key: str | None = None) -> list[_Record]:
        """Every previous record of the model (or of `key`), read."""
        d = self.model_dir(model)
        found = []
        if d.is_dir():
            for p in sorted(d.glob(f"*{PREVIOUS_SUFFIX}")):
                match = _PREV_RE.match(p.name)
                if not match or (key is not None and match["key"] != key):
                    continue
                try:
                    m: Manifest | None = load_manifest(p)
                except ManifestError:
                    m = None
                found.append(_Record(p, match["key"], match["hash"], m))
        return found

    def _current_sha(self, model: str, key: str) -> tuple[bool, str | None]:
        """(a manifest file exists, its plan sha256 or None when unreadable)."""
        path = self.manifest_path(model, key)
        if not path.exists():
            return False, None
        try:
            return True, load_manifest(path).build["plan_sha256"]
        except ManifestError:
            return True, None

    def _live_records(self, model: str, key: str | None = None) -> tuple[list[_Record], list[_Record]]:
        """(records that keep a previous plan, dangling records). Dangling: its key has no manifest any
        more, it duplicates the current plan, its plan file is gone, or a newer record of the same key
        supersedes it (one previous per key; a killed write or rollback can leave two)."""
        live: list[_Record] = []
        dangling: list[_Record] = []
        by_key: dict[str, list[_Record]] = {}
        for r in self._records(model, key):
            by_key.setdefault(r.key, []).append(r)
        for k, records in by_key.items():
            exists, current = self._current_sha(model, k)
            if not exists:
                dangling += records
                continue
            candidates = []
            for r in records:
                if r.manifest is None:
                    live.append(r)  # unreadable (newer schema?): kept, with its plan, until pruned
                elif r.manifest.build["plan_sha256"] == current or (
                    not self._plan_for(model, k, r.manifest).is_file()
                ):
                    dangling.append(r)
                else:
                    candidates.append(r)

            def newest(r: _Record) -> tuple[str, float]:
                assert r.manifest is not None
                try:
                    mtime = r.path.stat().st_mtime
                except OSError:
                    mtime = 0.0
                return (r.manifest.build["built_at"], mtime)

            candidates.sort(key=newest, reverse=True)
            live += candidates[:1]
            dangling += candidates[1:]
        return live, dangling

    def previous(self, model: str, key: str) -> Previous | None:
        """The previous good plan of engine `key` (what the last rebuild replaced), or None."""
        for r in self._live_records(model, key)[0]:
            if r.manifest is not None:
                return Previous(key, r.manifest, r.path, self._plan_for(model, key, r.manifest))
        return None

    def verify_plan(self, model: str, manifest: Manifest, plan: Path | None = None) -> str | None:
        """None when the plan (default: the one `manifest` points at) matches the manifest's sha256,
        else the reason it cannot be used."""
        plan = plan if plan is not None else self.plan_path_for(model, manifest)
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
        if mine is not None and mine.build.get("plan_sha256") == m.build.get("plan_sha256"):
            return key, False
        plan = source.read_plan(src_model, key)  # verified against its manifest's sha256
        with self.lock(model, wait_s=30.0, command="import engine_file"):
            self.write(model, key, plan, Manifest(m.fingerprint, m.build, m.validation, None))
        return key, True

    # --- writing (hold the model's lock) --------------------------------------------------
    def lock(
        self,
        model: str,
        wait_s: float | None = 0.0,
        command: str | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> BuildLock:
        """The model's build lock (engines.store.lock): `command` says what the holder does, for the message
        of whoever is refused or waits (default: this process's command line)."""
        d = self.model_dir(model)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create {d}: {_reason(e)}") from e
        return BuildLock(d / LOCK_NAME, model, wait_s, command, on_wait)

    def inherited_lock(self, model: str, fd: int) -> BuildLock:
        """The model's build lock a parent holds and handed down as descriptor `fd` (a job child)."""
        return BuildLock.inherited(self.model_dir(model) / LOCK_NAME, model, fd)

    def clean_stale(self, model: str) -> list[Path]:
        """Delete what killed or failed writes left: temp files, dangling previous records, and plans
        neither a manifest nor a previous record points at."""
        dangling = self._remove_dangling(model)
        return (
            remove_stale_temps(self.model_dir(model))
            + remove_stale_temps(self.timing_dir)
            + dangling
            + self.remove_orphan_plans(model)
        )

    def stale_files(self, model: str) -> list[Path]:
        """What clean_stale would delete now (nothing is deleted)."""
        d = self.model_dir(model)
        temps = [
            p
            for directory in (d, self.timing_dir)
            if directory.is_dir()
            for p in directory.iterdir()
            if p.name.startswith(".") and TMP_MARK in p.name and p.is_file()
        ]
        dangling = self._live_records(model)[1]
        plans, unreadable = self._referenced(model)
        orphans = [p for p, key in self._plan_files(model) if p not in plans and key not in unreadable]
        return temps + [r.path for r in dangling] + orphans

    def _remove_dangling(self, model: str) -> list[Path]:
        removed = []
        for r in self._live_records(model)[1]:
            with contextlib.suppress(FileNotFoundError):
                r.path.unlink()
                removed.append(r.path)
        return removed

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
        """Plan files the valid manifests and the live previous records point at, and keys whose manifest
        cannot be read (their plans are kept: what a manifest we cannot read points at is unknown)."""
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
            for r in self._live_records(model)[0]:
                if r.manifest is None:
                    plans.add(d / f"{r.key}-{r.hash}.plan")
                else:
                    plans.add(self._plan_for(model, r.key, r.manifest))
        return plans, unreadable

    def remove_orphan_plans(self, model: str, only: list[Path] | None = None) -> list[Path]:
        """Delete plan files neither a manifest nor a previous record points at (all of them, or those in
        `only`). Hold the lock."""
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
            old: Manifest | None = self.manifest(model, key)
        except ManifestError:
            old = None  # unreadable: nothing to keep as previous (its plans stay, see _referenced)
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
        record: Path | None = None
        try:
            # 2. The manifest being replaced is kept as the previous plan's record (rollback): a good plan
            #    only (intact, not refused by TensorRT at load); otherwise an older previous stays.
            if old is not None and old.build["plan_sha256"] != sha and self._good(model, old):
                record = self.previous_path(model, key, old.build["plan_sha256"])
                try:
                    atomic_write_bytes(record, old.to_json().encode())
                except OSError as e:  # the new engine matters more; its previous is not kept
                    log.warning(
                        "cannot keep the previous plan of engine %s (%s): %s", key, record, _reason(e)
                    )
                    record = None
        except BaseException:
            self._drop_uncommitted(model, key, plan_path, sha)
            raise
        try:
            # 3. The commit point: the new manifest replaces `{key}.json` in one rename.
            atomic_write_bytes(json_path, manifest.to_json().encode())
        except BaseException as e:
            self._drop_uncommitted(model, key, plan_path, sha, record)
            if isinstance(e, OSError):
                raise StoreError(
                    f"cannot write manifest {json_path} of engine plan {plan_path}: {_reason(e)}; "
                    "the previous engine stays current"
                ) from e
            raise
        # 4. Only now what of this key neither the new manifest nor the previous record points at (an older
        #    previous plan, a record superseded by the one just written).
        with contextlib.suppress(OSError):  # the new engine is current; clean_stale retries at the next build
            for r in self._live_records(model, key)[1]:
                r.path.unlink(missing_ok=True)
            self.remove_orphan_plans(model, only=[p for p, k in self._plan_files(model) if k == key])
        self.prune(model, protect=key)
        return Manifest(manifest.fingerprint, manifest.build, manifest.validation, json_path)

    def _good(self, model: str, manifest: Manifest) -> bool:
        """A plan worth keeping for rollback: it verifies and TensorRT never refused it at load."""
        if manifest.build.get("refused_at_load"):
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
        if current is not None and current.build["plan_sha256"] == sha:
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
        engines.build.compat.refusal_record; None clears it), by an atomic rewrite of its manifest; hold the
        lock.
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
            # Previous records, then the manifest: without them the plans are invisible, whatever happens
            # next.
            for r in self._records(model, m.key):
                r.path.unlink(missing_ok=True)
            self.manifest_path(model, m.key).unlink(missing_ok=True)
            self.remove_orphan_plans(model, only=[p for p, k in self._plan_files(model) if k == m.key])
            calib = self.calib_path(model, m.key)
            calib.with_name(calib.name + ".meta").unlink(missing_ok=True)
            calib.unlink(missing_ok=True)
            removed.append(m.key)
        if removed:
            fsync_dir(self.model_dir(model))
        return removed

    # --- previous plans: rollback and prune (hold the lock) -------------------------------------
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
                self.previous_path(model, key, current.build["plan_sha256"]), current.to_json().encode()
            )
            atomic_write_bytes(path, prev.manifest.to_json().encode())
        except OSError as e:
            raise StoreError(
                f"cannot roll engine {key} of model {model!r} back ({path}): {_reason(e)}"
            ) from e
        # 3. The record of the plan that is current now duplicates `{key}.json`.
        with contextlib.suppress(OSError):
            prev.record.unlink(missing_ok=True)
            fsync_dir(d)
        now = Manifest(prev.manifest.fingerprint, prev.manifest.build, prev.manifest.validation, path)
        return now, self.previous(model, key)

    def previous_files(self, model: str, key: str | None = None) -> list[Path]:
        """The previous records and plans of the model (or of `key`) that prune_previous deletes."""
        files = []
        d = self.model_dir(model)
        for r in self._live_records(model, key)[0]:
            files.append(r.path)
            plan = (
                d / f"{r.key}-{r.hash}.plan"
                if r.manifest is None
                else self._plan_for(model, r.key, r.manifest)
            )
            if plan.is_file():
                files.append(plan)
        return files

    def prune_previous(self, model: str, key: str | None = None, dry_run: bool = False) -> list[Path]:
        """Delete the previous plans (and their records) of the model or of `key`, with what killed
        writes left (stale_files). Returns what was deleted (or would be, with dry_run)."""
        doomed = self.previous_files(model, key) + self.stale_files(model)
        if dry_run:
            return doomed
        for r in self._live_records(model, key)[0]:  # records first: then their plans are orphans
            r.path.unlink(missing_ok=True)
        removed = [p for p in doomed if not p.exists()]
        removed += self.clean_stale(model)
        if self.model_dir(model).is_dir():
            fsync_dir(self.model_dir(model))
        return sorted(set(removed), key=lambda p: (p.parent, p.name))
