"""Reading the store: manifests (newest first), plans verified against their sha256, and the previous
plans kept for rollback (their records: `{key}-{sha256[:12]}.prev`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from engines.errors import ManifestError, StoreError
from engines.manifest import Manifest, load_manifest
from engines.store.paths import (
    MODEL_NAME_RE,
    PLAN_RE,
    PREVIOUS_RE,
    PREVIOUS_SUFFIX,
    StorePaths,
    os_reason,
    sha256_file,
)


@dataclass(frozen=True)
class Previous:
    """The previous good plan of an engine key: its manifest (as it was when it served), where that
    record lies, and the plan file it points at."""

    key: str
    manifest: Manifest  # .path is the record; .key is not the engine key here (use `key`)
    record: Path
    plan: Path


@dataclass(frozen=True)
class PreviousRecord:
    path: Path
    key: str
    hash: str  # plan sha256[:12] from the name
    manifest: Manifest | None  # None: unreadable (a newer schema?): its plan is kept by name


class StoreReader(StorePaths):
    """What is stored, read without the lock (writes are atomic: a reader never sees half a file)."""

    def entries(self, model: str) -> list[Manifest]:
        """Valid manifests of `model`, newest first (built_at, then file mtime)."""
        found = []
        for m in self._scan(model)[0]:
            assert m.path is not None
            try:
                mtime = m.path.stat().st_mtime
            except FileNotFoundError:  # pruned since the scan
                continue
            found.append((m.build.built_at, mtime, m))
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

    def models(self) -> list[str]:
        """Model directories of the store that hold a manifest or a plan (sorted)."""
        if not self.root.is_dir():
            return []
        found = []
        for d in sorted(self.root.iterdir()):
            if d.name == "timing" or not d.is_dir() or not MODEL_NAME_RE.match(d.name):
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

    def _records(self, model: str, key: str | None = None) -> list[PreviousRecord]:
        """Every previous record of the model (or of `key`), read."""
        d = self.model_dir(model)
        found = []
        if d.is_dir():
            for p in sorted(d.glob(f"*{PREVIOUS_SUFFIX}")):
                match = PREVIOUS_RE.match(p.name)
                if not match or (key is not None and match["key"] != key):
                    continue
                try:
                    m: Manifest | None = load_manifest(p)
                except ManifestError:
                    m = None
                found.append(PreviousRecord(p, match["key"], match["hash"], m))
        return found

    def _current_sha(self, model: str, key: str) -> tuple[bool, str | None]:
        """(a manifest file exists, its plan sha256 or None when unreadable)."""
        path = self.manifest_path(model, key)
        if not path.exists():
            return False, None
        try:
            return True, load_manifest(path).build.plan_sha256
        except ManifestError:
            return True, None

    def _live_records(
        self, model: str, key: str | None = None
    ) -> tuple[list[PreviousRecord], list[PreviousRecord]]:
        """(records that keep a previous plan, dangling records). Dangling: its key has no manifest any
        more, it duplicates the current plan, its plan file is gone, or a newer record of the same key
        supersedes it (one previous per key; a killed write or rollback can leave two)."""
        live: list[PreviousRecord] = []
        dangling: list[PreviousRecord] = []
        by_key: dict[str, list[PreviousRecord]] = {}
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
                elif r.manifest.build.plan_sha256 == current or (
                    not self._plan_for(model, k, r.manifest).is_file()
                ):
                    dangling.append(r)
                else:
                    candidates.append(r)

            def newest(r: PreviousRecord) -> tuple[str, float]:
                assert r.manifest is not None
                try:
                    mtime = r.path.stat().st_mtime
                except OSError:
                    mtime = 0.0
                return (r.manifest.build.built_at, mtime)

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
            if sha256_file(plan) != manifest.build.plan_sha256:
                return "plan corrupted (sha256 mismatch)"
        except FileNotFoundError:
            return f"plan {plan} is missing"
        except OSError as e:
            return f"plan {plan} cannot be read: {os_reason(e)}"
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
                if now is not None and now.build.plan_sha256 != m.build.plan_sha256:
                    m = now
                    continue
                raise StoreError(f"cannot read plan {plan}: {os_reason(e)}") from e
            except OSError as e:
                raise StoreError(f"cannot read plan {plan}: {os_reason(e)}") from e
        else:
            raise StoreError(f"plan of engine {key} of model {model!r} kept changing while being read")
        # Hash what we loaded (not the file again): the bytes handed to TensorRT are the verified ones.
        if hashlib.sha256(data).hexdigest() != m.build.plan_sha256:
            raise StoreError(f"plan {plan} is corrupted (sha256 mismatch with {m.path})")
        return data

    def _plan_files(self, model: str) -> list[tuple[Path, str]]:
        """(path, key) of every plan file in the model dir, hashed or legacy name."""
        d = self.model_dir(model)
        found = []
        if d.is_dir():
            for p in d.iterdir():
                match = PLAN_RE.match(p.name)
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
