"""The store's housekeeping under the model's build lock: what killed writes left, orphan plans, keys
beyond `keep`, and previous plans on request."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from engines.errors import StoreError
from engines.store.fsutil import TMP_MARK, fsync_dir, remove_stale_temps
from engines.store.lock import BuildLock
from engines.store.paths import FINGERPRINT_KEY_RE, LOCK_NAME, PLAN_RE, os_reason, sha256_file
from engines.store.reading import StoreReader


def _named_by_content(plan: Path) -> bool:
    """`{key}-{sha256[:12]}.plan` whose bytes hash to that name: written by EngineStore.write."""
    match = PLAN_RE.match(plan.name)
    if not match or not match["hash"]:
        return False
    try:
        return sha256_file(plan).startswith(match["hash"])
    except OSError:
        return False


class StoreCleanup(StoreReader):
    """The build lock, and deleting what nothing points at (hold the lock)."""

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
            raise StoreError(f"cannot create {d}: {os_reason(e)}") from e
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
        orphans = [p for p, key in self._orphan_candidates(model) if p not in plans and key not in unreadable]
        return temps + [r.path for r in dangling] + orphans

    def _orphan_candidates(self, model: str) -> list[tuple[Path, str]]:
        """Plan files the store owns: of a key with a manifest or previous record, named by a fingerprint
        key, or named `{key}-{hash}.plan` by their own content's sha256. Anything else (someone's
        `important.plan`) is never the store's to delete."""
        known = set(self.keys(model)) | {r.key for r in self._records(model)}
        return [
            (p, key)
            for p, key in self._plan_files(model)
            if key in known or FINGERPRINT_KEY_RE.match(key) or _named_by_content(p)
        ]

    def _remove_dangling(self, model: str) -> list[Path]:
        removed = []
        for r in self._live_records(model)[1]:
            with contextlib.suppress(FileNotFoundError):
                r.path.unlink()
                removed.append(r.path)
        return removed

    def remove_orphan_plans(self, model: str, only: list[Path] | None = None) -> list[Path]:
        """Delete plan files neither a manifest nor a previous record points at (all of them, or those in
        `only`). Hold the lock."""
        plans, unreadable = self._referenced(model)
        removed = []
        # `only`: the caller names plans of a key whose manifest it owns (prune, write); else the store's.
        candidates = self._plan_files(model) if only is not None else self._orphan_candidates(model)
        for p, key in candidates:
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
