"""Where the store's files lie and what they are called (the layout: engines.store), and the base of
EngineStore that knows it."""

from __future__ import annotations

import errno
import hashlib
import re
from pathlib import Path

from engines.errors import ManifestError, StoreError
from engines.manifest import Manifest, load_manifest
from engines.store.fsutil import temp_path_for

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LOCK_NAME = ".build.lock"
PLAN_HASH_LEN = 12
# `{key}-{hash}.plan` or a legacy `{key}.plan` (never a dot-file: temp files start with ".").
PLAN_RE = re.compile(rf"^(?P<key>[^.].*?)(?:-(?P<hash>[0-9a-f]{{{PLAN_HASH_LEN}}}))?\.plan$")
# The keys the builder names engines by (engines.build.compat: sha256 hex[:KEY_LEN]): a plan without a
# manifest is the store's to delete only when its key is one of these, has a manifest or record, or its
# name carries its own content hash (engines.store.cleanup).
FINGERPRINT_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
PREVIOUS_SUFFIX = ".prev"
# `{key}-{hash}.prev`: the manifest of a kept previous plan of `key`.
PREVIOUS_RE = re.compile(rf"^(?P<key>[^.].*?)-(?P<hash>[0-9a-f]{{{PLAN_HASH_LEN}}})\.prev$")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def os_reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, str(e))


def plan_file_name(key: str, plan_sha256: str) -> str:
    """The file name of the plan of engine `key` with content hash `plan_sha256`."""
    return f"{key}-{plan_sha256[:PLAN_HASH_LEN]}.plan"


def previous_file_name(key: str, plan_sha256: str) -> str:
    """The file name of the record (manifest) of a kept previous plan of engine `key`."""
    return f"{key}-{plan_sha256[:PLAN_HASH_LEN]}{PREVIOUS_SUFFIX}"


class StorePaths:
    """The store's root and the path of everything in it."""

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
            raise StoreError(f"engine_dir {directory} cannot be created: {os_reason(e)}") from e
        probe = temp_path_for(directory / "write-probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
        except OSError as e:
            raise StoreError(f"engine_dir {directory} is not writable: {os_reason(e)}") from e
        finally:
            probe.unlink(missing_ok=True)

    # --- paths ----------------------------------------------------------------------------
    def model_dir(self, model: str) -> Path:
        if not MODEL_NAME_RE.match(model):
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
        hashed = d / plan_file_name(key, manifest.build.plan_sha256)
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

    def manifest(self, model: str, key: str) -> Manifest | None:
        path = self.manifest_path(model, key)
        return load_manifest(path) if path.exists() else None
