"""Installed model versions: where they lie, which one serves, which one serves after a restart, and
pruning (with their engines).

    state_dir/models/{model}/{version}/{model.onnx, labels.txt, calibration/, document.json, record.json}
    state_dir/models/{model}/serving.json  {"serving": version|None, "previous": [...], "broken": {v: why},
                                            "updated": ts}

    store = VersionStore(state_dir)
    d = store.stage_dir("detector", "v2")                       # downloads land here
    store.install("detector", "v2", {"onnx": d / "m.onnx", "labels": d / "l.txt"}, document)
    store.set_serving("detector", "v2")                         # v1 becomes the previous one
    store.resolve_at_start("detector")                          # v2, its sha256s checked again
    store.prune("detector", keep=2, engine_dir=engine_dir)      # older versions and their engines go

A version folder is complete or absent: it is assembled under `.incoming-*` beside its final place (hard
links to the staged files, document.json, record.json with the sha256 and size of every file), fsynced, and
renamed into place in one os.replace. serving.json is replaced atomically. A version is never modified
after install; `record.json` is what `resolve_at_start` checks it against. What a version folder holds, its
check and the model config that serves it (`effective_model`): agent.deploy.version_files.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.deploy.errors import DeployError
from agent.deploy.staging import (
    INCOMING,
    Staging,
    atomic_write_json,
    check_name,
    os_reason,
    read_json,
    remove_leftovers,
    remove_tree,
    staged_files,
)
from agent.deploy.version_engines import delete_engines_of
from agent.deploy.version_files import (
    DEFAULT_CALIB_MAX_BYTES,
    ONNX_FILE,
    RECORD_FILE,
    SERVING_FILE,
    assemble,
    check_version,
)
from engines.store.fsutil import fsync_dir

log = logging.getLogger(__name__)

MAX_PREVIOUS = 16  # serving.json's previous list: enough for any keep_versions, bounded for a hostile file


@dataclass(frozen=True)
class VersionInfo:
    """A kept version: its files' sha256 (relative path -> hex), when it was installed, its state (serving,
    previous, kept, broken)."""

    model: str
    version: str
    path: Path
    format: str | None
    installed: float
    sha256: dict[str, str]
    state: str


@dataclass(frozen=True)
class Resolved:
    """What serves `model` after a restart: `version` (None: the config's own model) in `path`; `note` says
    why it is not the recorded serving version; `broken` the versions that failed their check and why."""

    model: str
    version: str | None
    path: Path | None
    note: str | None = None
    broken: dict[str, str] = field(default_factory=dict)


class VersionStore:
    """The installed versions of every model under `state_dir` (layout above)."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir)
        self.staging = Staging(self.root / "staging")

    # ---- paths -------------------------------------------------------------------------------------
    def model_dir(self, model: str) -> Path:
        return self.root / "models" / check_name("model", model)

    def version_dir(self, model: str, version: str) -> Path:
        return self.model_dir(model) / check_name("version", version)

    def stage_dir(self, model: str, version: str) -> Path:
        return self.staging.dir(model, version)

    def discard_staging(self, model: str, version: str | None = None) -> None:
        self.staging.discard(model, version)

    # ---- install -----------------------------------------------------------------------------------
    def install(
        self,
        model: str,
        version: str,
        staged: Mapping[str, Path],
        document: Mapping[str, Any],
        calib_max_bytes: int = DEFAULT_CALIB_MAX_BYTES,
    ) -> Path:
        """Move the staged artifacts ({"onnx", "labels", optional "calibration": its tar archive, unpacked
        (agent.deploy.calib_archive), or a folder}) into models/{model}/{version}/ in one rename, with
        document.json and record.json. The staged files stay until discard_staging. Installing a version
        again with the same files returns its folder; with other files it is refused (a version names one
        set of bytes). On any failure nothing of it is left in models/ and the serving state is untouched:
        DeployError naming the path."""
        final = self.version_dir(model, version)
        files = staged_files(staged)
        parent = final.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DeployError(f"cannot create {parent}: {os_reason(exc)}") from None
        incoming = parent / f"{INCOMING}{version}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            record = assemble(incoming, model, version, files, document, calib_max_bytes)
            if final.exists() and self._same_or_broken(final, record):
                return final
            os.replace(incoming, final)
            fsync_dir(parent)
        except OSError as exc:
            raise DeployError(f"cannot install {model} {version} into {final}: {os_reason(exc)}") from None
        finally:
            if incoming.exists():
                remove_tree(incoming)
        log.info("model %s: version %s installed in %s", model, version, final)
        return final

    def _same_or_broken(self, final: Path, record: dict[str, Any]) -> bool:
        """Installing over an installed version: the same files -> True (it stays); a broken folder (a file
        changed or lost since) -> removed, False (the new one takes its place); other files -> refused."""
        problem = check_version(final)
        if problem is not None:
            log.warning("%s is broken (%s): replaced by the new install", final, problem)
            remove_tree(final)
            return False
        if read_json(final / RECORD_FILE).get("files") != record["files"]:
            raise DeployError(
                f"{record['model']} {record['version']} is installed already with other files ({final}); "
                "a new model needs a new version",
                "version",
            )
        return True

    # ---- serving -----------------------------------------------------------------------------------
    def _serving_record(self, model: str) -> dict[str, Any]:
        path = self.model_dir(model) / SERVING_FILE
        if not path.exists():
            return {"serving": None, "previous": [], "broken": {}}
        data = read_json(path)
        if not isinstance(data, dict):
            raise DeployError(f"{path} is not a serving record")
        serving = data.get("serving")
        previous = data.get("previous") or []
        broken = data.get("broken") or {}
        names_ok = all(isinstance(v, str) and _is_name(v) for v in [*previous, *broken]) and (
            serving is None or (isinstance(serving, str) and _is_name(serving))
        )
        if not (isinstance(previous, list) and isinstance(broken, dict) and names_ok):
            raise DeployError(f"{path} is not a serving record (bad names)")
        return {"serving": serving, "previous": previous[:MAX_PREVIOUS], "broken": broken}

    def serving(self, model: str) -> str | None:
        serving: str | None = self._serving_record(model)["serving"]
        return serving

    def previous(self, model: str) -> list[str]:
        return list(self._serving_record(model)["previous"])

    def set_serving(self, model: str, version: str | None, *, forget: str | None = None) -> None:
        """`version` serves `model` from now on (None: the config's own model); the one serving so far heads
        the previous list, but `forget` (a version whose promotion is undone) is no rollback target any more.
        Atomic (temp + fsync + rename)."""
        if version is not None and not (self.version_dir(model, version) / RECORD_FILE).is_file():
            raise DeployError(f"{model} {version} is not installed", "version")
        try:
            rec = self._serving_record(model)
        except DeployError:
            rec = {"serving": None, "previous": [], "broken": {}}  # replaced by a good one now
        previous = [v for v in (rec["serving"], *rec["previous"]) if forget is None or v != forget]
        self._write_serving(model, version, previous, rec["broken"])

    def _write_serving(
        self, model: str, version: str | None, previous: list[str | None], broken: Mapping[str, str]
    ) -> None:
        kept: list[str] = []
        for v in previous:
            if v is not None and v != version and v not in kept and v not in broken:
                kept.append(v)
        rec = {
            "serving": version,
            "previous": kept[:MAX_PREVIOUS],
            "broken": {k: v for k, v in broken.items() if k != version},
            "updated": time.time(),
        }
        d = self.model_dir(model)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DeployError(f"cannot create {d}: {os_reason(exc)}") from None
        atomic_write_json(d / SERVING_FILE, rec)

    def resolve_at_start(self, model: str) -> Resolved:
        """The version to serve after a restart: the recorded serving one if every file still has the sha256
        and size of its record; else the previous ones in order; else None (the config's own model). A
        fallback is written to serving.json (broken versions listed there, kept until pruned) and said in
        `note`. Also removes what a killed install or prune left."""
        d = self.model_dir(model)
        remove_leftovers(d)
        try:
            rec = self._serving_record(model)
        except DeployError as exc:
            return Resolved(model, None, None, f"{exc.reason}: serving the config's own model")
        wanted = rec["serving"]
        if wanted is None:
            return Resolved(model, None, None)
        broken: dict[str, str] = {}
        chosen: str | None = None
        for v in [wanted, *rec["previous"]]:
            problem = check_version(self.version_dir(model, v))
            if problem is None:
                chosen = v
                break
            broken[v] = problem
            log.warning("model %s: version %s is broken: %s", model, v, problem)
        if not broken:
            return Resolved(model, wanted, self.version_dir(model, wanted))
        first = f"{model} version {wanted} is broken ({broken[wanted]})"
        if chosen is None:
            note = f"{first}; no previous version is intact: serving the config's own model"
        else:
            skipped = [v for v in broken if v != wanted]
            also = f" (also broken: {', '.join(skipped)})" if skipped else ""
            note = f"{first}; serving the previous version {chosen}{also}"
        remaining = [v for v in rec["previous"] if v not in broken and v != chosen]
        try:
            self._write_serving(model, chosen, remaining, {**rec["broken"], **broken})
        except DeployError as exc:
            note += f"; {exc.reason}"
        log.warning("model %s: %s", model, note)
        path = None if chosen is None else self.version_dir(model, chosen)
        return Resolved(model, chosen, path, note, broken)

    # ---- listing -----------------------------------------------------------------------------------
    def versions(self, model: str) -> list[VersionInfo]:
        """Installed versions, newest install first (their files are not hashed again here)."""
        d = self.model_dir(model)
        if not d.is_dir():
            return []
        try:
            rec = self._serving_record(model)
        except DeployError:
            rec = {"serving": None, "previous": [], "broken": {}}
        found = []
        for p in d.iterdir():
            if p.name.startswith(".") or not p.is_dir() or not _is_name(p.name):
                continue
            try:
                r = read_json(p / RECORD_FILE)
                files = r["files"]
                sums = {str(k): str(v["sha256"]) for k, v in files.items()}
                installed = float(r["installed"])
                fmt = r.get("format")
            except (DeployError, KeyError, TypeError, ValueError, AttributeError):
                sums, installed, fmt = {}, p.stat().st_mtime, None
                rec["broken"].setdefault(p.name, "record.json unreadable")
            if p.name == rec["serving"]:
                state = "serving"
            elif p.name in rec["broken"]:
                state = "broken"
            elif p.name in rec["previous"]:
                state = "previous"
            else:
                state = "kept"
            found.append(
                VersionInfo(model, p.name, p, fmt if isinstance(fmt, str) else None, installed, sums, state)
            )
        found.sort(key=lambda v: (v.installed, v.version), reverse=True)
        return found

    # ---- removal -----------------------------------------------------------------------------------
    def remove(
        self, model: str, version: str, engine_dir: Path | None = None, notes: list[str] | None = None
    ) -> None:
        """Delete one installed version (a candidate refused after install) and its engines; never the
        serving or the previous one (DeployError)."""
        rec = self._serving_record(model)
        protected = [rec["serving"], *rec["previous"][:1]]
        if version in protected:
            raise DeployError(f"{model} {version} serves or is the rollback version: not removed", "version")
        kept = [v for v in self.versions(model) if v.version != version]
        self._delete(model, version, engine_dir, kept, (), notes if notes is not None else [])

    def prune(
        self,
        model: str,
        keep: int,
        engine_dir: Path | None,
        *,
        keep_onnx_sha256: Collection[str] = (),
        notes: list[str] | None = None,
    ) -> list[str]:
        """Delete the versions beyond the `keep` newest, never the serving one or the previous one (the
        rollback target), broken ones first; with them their engines in `engine_dir` (those built from their
        ONNX, or from its grafted copy), unless a kept version or `keep_onnx_sha256` (the config's own model)
        has the same ONNX. Returns the deleted versions; `notes` gets what was left and why."""
        if keep < 1:
            raise DeployError(f"keep_versions must be >= 1, got {keep}")
        notes = notes if notes is not None else []
        rec = self._serving_record(model)
        protected = {rec["serving"], *rec["previous"][:1]} - {None}
        listed = self.versions(model)
        good = [v for v in listed if v.state != "broken"]
        keep_names = protected | {v.version for v in good[:keep]}
        kept = [v for v in listed if v.version in keep_names]
        removed = []
        for v in listed:
            if v.version in keep_names:
                continue
            self._delete(model, v.version, engine_dir, kept, keep_onnx_sha256, notes)
            removed.append(v.version)
        if removed:
            previous = [p for p in rec["previous"] if p not in removed]
            broken = {k: why for k, why in rec["broken"].items() if k not in removed}
            self._write_serving(model, rec["serving"], previous, broken)
        return removed

    def _delete(
        self,
        model: str,
        version: str,
        engine_dir: Path | None,
        kept: list[VersionInfo],
        keep_onnx_sha256: Collection[str],
        notes: list[str],
    ) -> None:
        # Engines first: while the version's record exists a crash here leaves it identifiable for a retry.
        folder = self.version_dir(model, version)
        try:
            sha = read_json(folder / RECORD_FILE)["files"][ONNX_FILE]["sha256"]
        except (DeployError, KeyError, TypeError):
            sha = None
        if engine_dir is not None:
            if sha is None:
                notes.append(f"{model} {version}: no readable record, its engines (if any) are left")
            else:
                in_use = {v.sha256.get(ONNX_FILE) for v in kept} | set(keep_onnx_sha256)
                if sha in in_use:
                    notes.append(f"{model} {version}: its ONNX serves another version: engines kept")
                else:
                    notes.extend(delete_engines_of(Path(engine_dir), model, sha))
        remove_tree(folder)
        log.info("model %s: version %s deleted", model, version)


def _is_name(text: str) -> bool:
    try:
        check_name("version", text)
    except DeployError:
        return False
    return True
