"""The deployment folder's file handling: names checked before they become paths, the staging area where
downloads land, and the crash-safe writes every deploy file goes through.

    state_dir/staging/{model}/{version}/...    downloads in progress (agent.deploy.download), then the
                                               install's `.incoming-*` folder (agent.deploy.versions)

Every write is temp file + fsync + rename + fsync of the folder; a folder is written completely under a
dot-name, fsynced, then renamed into place. Dot-names (`.incoming-*`, `.trash-*`, `.*.tmp-*`) are never a
version; what a killed writer left of them is removed by `remove_leftovers`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent.deploy.errors import DeployError
from engines.store.fsutil import TMP_MARK, fsync_dir, temp_path_for

# A model or version name becomes one path component: letters, digits, ".", "_", "-"; starting with a
# letter or digit, so never ".", ".." or one of this module's dot-names.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
INCOMING = ".incoming-"
TRASH = ".trash-"


def check_name(kind: str, name: object) -> str:
    """`name` if it is a safe model/version name; DeployError naming `kind` (the document field) otherwise."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        shown = repr(name)[:80]
        raise DeployError(
            f"{kind} {shown} is not a name: 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
            kind,
        )
    return name


def os_reason(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync `path` (a new temp file). The one place deploy files get their bytes: tests replace
    it with a fake_* writer to act out a full disk."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: temp file, fsync, rename, fsync of the folder.
    DeployError naming the path and the OS reason."""
    tmp = temp_path_for(path)
    try:
        write_file(tmp, data)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DeployError(f"cannot write {path}: {os_reason(exc)}") from None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path, max_bytes: int = 1 << 20) -> Any:
    """The JSON in `path`; DeployError naming it when it is missing, too large or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise DeployError(f"cannot read {path}: {os_reason(exc)}") from None
    if len(raw) > max_bytes:
        raise DeployError(f"{path} is larger than {max_bytes} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DeployError(f"{path} is not JSON ({exc})"[:300]) from None


def place_file(src: Path, dest: Path) -> None:
    """`src`'s bytes at the new path `dest`, fsynced: a hard link (same filesystem, no copy, and `src` stays
    for a retry until the staging folder is discarded), else a copy through write_file."""
    try:
        os.link(src, dest)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        _copy(src, dest)
        return
    with open(dest, "rb") as f:  # the download fsynced it; cheap if so, and the contract either way
        os.fsync(f.fileno())


def _copy(src: Path, dest: Path) -> None:
    tmp = temp_path_for(dest)
    try:
        with open(src, "rb") as f:
            write_file(tmp, f.read())  # artifacts are bounded (deploy.max_artifact_mb)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def files_under(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative POSIX path, path) of every regular file under `root`, sorted; symlinks refused (a staged
    tree comes from an archive the agent unpacked: a link there is an attack, not an artifact)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                raise DeployError(f"{p} is not a regular file")
            yield p.relative_to(root).as_posix(), p


def fsync_tree(root: Path) -> None:
    """fsync every folder of `root`, deepest first (the files were fsynced as they were written)."""
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    for d in reversed(dirs):
        fsync_dir(d)


def remove_tree(path: Path) -> None:
    """Delete the folder `path`: renamed to a dot-name first, so a kill half-way leaves a `.trash-*` folder
    (removed by remove_leftovers), never a half-deleted version under its own name."""
    if not path.exists():
        return
    doomed = path.with_name(f"{TRASH}{path.name}-{secrets.token_hex(4)}")
    try:
        os.replace(path, doomed)
        fsync_dir(path.parent)
        shutil.rmtree(doomed)
    except OSError as exc:
        raise DeployError(f"cannot delete {path}: {os_reason(exc)}") from None


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete what killed writers left in `directory`: `.incoming-*` and `.trash-*` folders, temp files."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for p in sorted(directory.iterdir()):
        if p.name.startswith((INCOMING, TRASH)) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(".") and TMP_MARK in p.name and p.is_file():
            p.unlink(missing_ok=True)
        else:
            continue
        removed.append(p)
    if removed:
        fsync_dir(directory)
    return removed


class Staging:
    """The staging area: `root/{model}/{version}/` per deployment in progress."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def dir(self, model: str, version: str) -> Path:
        """The version's staging folder, created (0700: unverified artifacts are nobody else's business)."""
        d = self.root / check_name("model", model) / check_name("version", version)
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise DeployError(f"cannot create {d}: {os_reason(exc)}") from None
        return d

    def discard(self, model: str, version: str | None = None) -> None:
        """Delete the staging folder of one version, or of every version of `model`."""
        d = self.root / check_name("model", model)
        if version is not None:
            d = d / check_name("version", version)
        remove_tree(d)


def staged_files(staged: Mapping[str, Path]) -> dict[str, Path]:
    """The artifacts named by `staged` ({"onnx", "labels", optional "calibration"}) -> their file names in a
    version folder (`model.onnx`, `labels.txt`, `calibration`: a file or a folder)."""
    names = {"onnx": "model.onnx", "labels": "labels.txt", "calibration": "calibration"}
    unknown = sorted(set(staged) - set(names))
    if unknown:
        raise DeployError(f"unknown artifacts {unknown}; known: {sorted(names)}", "artifacts")
    for required in ("onnx", "labels"):
        if required not in staged:
            raise DeployError(f"artifact {required!r} is missing", f"artifacts.{required}")
    return {names[k]: Path(v) for k, v in staged.items()}
