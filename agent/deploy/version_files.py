"""What an installed version folder holds and how it is checked: its files (model.onnx, labels.txt,
calibration/), document.json, and record.json with the sha256 and size of every file; the folder assembled for
install (agent.deploy.versions renames it into place); and the model config that serves it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.config import ModelConfig
from agent.deploy.calib_archive import unpack_calibration
from agent.deploy.errors import DeployError, VerifyError
from agent.deploy.staging import atomic_write_json, files_under, fsync_tree, os_reason, place_file, read_json

RECORD_SCHEMA = "edge-agent/model-version/1"
ONNX_FILE, LABELS_FILE, CALIBRATION_DIR = "model.onnx", "labels.txt", "calibration"
DOCUMENT_FILE, RECORD_FILE, SERVING_FILE = "document.json", "record.json", "serving.json"
DEFAULT_CALIB_MAX_BYTES = 1 << 30  # deploy.max_artifact_mb's default; the flow passes the config's


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(
    incoming: Path,
    model: str,
    version: str,
    files: dict[str, Path],
    document: Mapping[str, Any],
    calib_max_bytes: int = DEFAULT_CALIB_MAX_BYTES,
) -> dict[str, Any]:
    """Write the complete version folder `incoming` (not yet in its place): the staged files linked in (a
    staged calibration file is the artifact's tar of images: unpacked, at most `calib_max_bytes`), their
    sha256 and size checked against the document, document.json and record.json; all fsynced.
    Returns the record."""
    incoming.mkdir(mode=0o755)
    for name, src in files.items():
        if name == CALIBRATION_DIR and not src.is_symlink() and src.is_file():
            unpack_calibration(src, incoming / name, calib_max_bytes)
        elif name == CALIBRATION_DIR:
            (incoming / name).mkdir()
            tree = list(files_under(src)) if src.is_dir() else [(src.name, src)]
            for rel, p in tree:
                (incoming / name / rel).parent.mkdir(parents=True, exist_ok=True)
                place_file(p, incoming / name / rel)
        else:
            if src.is_symlink() or not src.is_file():
                raise DeployError(f"staged artifact {src} is not a regular file")
            place_file(src, incoming / name)
    sums = {rel: (sha256_of(p), p.stat().st_size) for rel, p in files_under(incoming)}
    check_document_sums(document, sums)
    record = {
        "schema": RECORD_SCHEMA,
        "model": model,
        "version": version,
        "format": document.get("format"),
        "installed": time.time(),
        "files": {rel: {"sha256": s, "size": n} for rel, (s, n) in sums.items()},
    }
    atomic_write_json(incoming / DOCUMENT_FILE, dict(document))
    atomic_write_json(incoming / RECORD_FILE, record)
    fsync_tree(incoming)
    return record


def check_version(folder: Path) -> str | None:
    """Why the installed version in `folder` cannot serve (a file missing, changed, or its record
    unreadable), or None when every file has its recorded sha256 and size."""
    try:
        files = read_json(folder / RECORD_FILE)["files"]
        expected = {str(rel): (str(v["sha256"]), int(v["size"])) for rel, v in files.items()}
    except DeployError as exc:
        return exc.reason
    except (KeyError, TypeError, ValueError, AttributeError):
        return f"{folder / RECORD_FILE} is not a version record"
    for required in (ONNX_FILE, LABELS_FILE):
        if required not in expected:
            return f"{folder / RECORD_FILE} lists no {required}"
    for rel, (sha, size) in expected.items():
        p = folder / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{folder / RECORD_FILE} names a file outside the version: {rel!r}"
        try:
            if p.is_symlink() or not p.is_file():
                return f"{p} is missing"
            if p.stat().st_size != size:
                return f"{p} has {p.stat().st_size} bytes, its record says {size}"
            if sha256_of(p) != sha:
                return f"{p}: sha256 differs from its record"
        except OSError as exc:
            return f"{p}: {os_reason(exc)}"
    return None


def effective_model(cfg_model: ModelConfig, version_dir: Path, precision: str | None = None) -> ModelConfig:
    """The config's model section serving the installed version in `version_dir`: its ONNX, labels and
    format; a calibration folder of the version becomes the INT8 calibration set. Every other setting is
    the config's (precision unless `precision` is given); a prebuilt `engine_file` was made for the
    config's ONNX, so it is dropped."""
    record = read_json(version_dir / RECORD_FILE)
    update: dict[str, Any] = {
        "onnx": str(version_dir / ONNX_FILE),
        "labels": str(version_dir / LABELS_FILE),
        "engine_file": None,
    }
    fmt = record.get("format") if isinstance(record, dict) else None
    if isinstance(fmt, str):
        update["format"] = fmt
    if precision is not None:
        update["precision"] = precision
    calib = version_dir / CALIBRATION_DIR
    if calib.is_dir() and any(calib.iterdir()):
        update["calibration"] = {
            **cfg_model.calibration.model_dump(),
            "source": "folder",
            "folder": str(calib),
        }
    data = {**cfg_model.model_dump(exclude_unset=False), **update}
    try:
        return ModelConfig.model_validate(data)
    except ValueError as exc:
        raise VerifyError(f"{version_dir}: the config's model cannot serve it: {exc}"[:400]) from None


def check_document_sums(document: Mapping[str, Any], sums: Mapping[str, tuple[str, int]]) -> None:
    """The installed files are the ones the document names (its sha256 and size, where it gives them)."""
    artifacts = document.get("artifacts")
    if not isinstance(artifacts, Mapping):
        return
    for key, name in (("onnx", ONNX_FILE), ("labels", LABELS_FILE)):
        art = artifacts.get(key)
        if not isinstance(art, Mapping) or name not in sums:
            continue
        sha, size = sums[name]
        if "sha256" in art and art["sha256"] != sha:
            raise VerifyError(
                f"{key}: sha256 {sha} is not the document's {art['sha256']}", f"artifacts.{key}.sha256"
            )
        if "size" in art and art["size"] != size:
            raise VerifyError(
                f"{key}: {size} bytes, the document says {art['size']}", f"artifacts.{key}.size"
            )
