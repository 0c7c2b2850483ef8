"""The `artifacts.calibration` archive unpacked into a version's calibration/ folder.

The archive is a tar (plain, gzip or xz; detected by content) of images (agent.lifecycle.capture.IMAGE_EXTS):
the agent's INT8 build captures its calibration and held-out frames from the folder as it does from
`calibration.source: folder` (agent.lifecycle.capture), which reads images and preprocesses them as
inference does. Preprocessed `.npy` tensors (what `edge-agent build --calib` also takes) are refused: the
agent could not calibrate from them, and a deployment should fail at verifying, not at building.
It comes from the network: only regular files are written, each under its
own flat name (folders in the archive are flattened), with the count and the total unpacked size bounded
before a byte is read. Links, devices, absolute paths, `..`, other file types, duplicate names: refused.
Every refusal is a VerifyError naming `artifacts.calibration`; the caller removes the half-written folder.
"""

from __future__ import annotations

import lzma
import os
import re
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from agent.deploy.errors import VerifyError

FIELD = "artifacts.calibration"
MAX_FILES = 10_000
NPY = ".npy"
# One path component, never a dot-name (capture skips those: a file written but never read is a surprise).
FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _refuse(why: str) -> VerifyError:
    return VerifyError(f"{FIELD}: {why}", FIELD)


def _file_name(member: tarfile.TarInfo) -> str:
    """The flat name `member` (a regular file) gets; refused unless its path stays inside the folder."""
    raw = member.name
    path = PurePosixPath(raw)
    if raw.startswith("/") or path.is_absolute() or ".." in path.parts or "\\" in raw or "\0" in raw:
        raise _refuse(f"member {raw[:120]!r} is an absolute path or leaves the folder")
    name = path.name
    if FILE_NAME_RE.fullmatch(name) is None:
        raise _refuse(f"member {raw[:120]!r}: a name is 1-128 of A-Z a-z 0-9 . _ -, not starting with '.'")
    return name


def _data_filter(member: tarfile.TarInfo, dest: Path) -> None:
    """tarfile's own "data" filter (Python 3.11.4+, 3.12+) as a second opinion where it exists."""
    check = getattr(tarfile, "data_filter", None)
    if check is None:
        return
    try:
        check(member, str(dest))
    except tarfile.FilterError as exc:
        raise _refuse(f"member {member.name[:120]!r}: {type(exc).__name__}") from None


def unpack_calibration(archive: Path, dest: Path, max_bytes: int, max_files: int = MAX_FILES) -> int:
    """Unpack the calibration `archive` into the new folder `dest` (created; the caller removes it on
    failure); every file fsynced. Returns the number of files. VerifyError naming artifacts.calibration
    when the archive is not a tar, holds anything but images, or exceeds the bounds."""
    from agent.lifecycle.capture import IMAGE_EXTS

    dest.mkdir(mode=0o755)
    names: set[str] = set()
    total = members = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:  # streamed: a million headers stop at max_files, never all in memory
                members += 1
                if members > max_files:
                    raise _refuse(f"more than {max_files} entries")
                if member.isdir():
                    _check_folder_entry(member)
                    continue
                if not member.isreg():
                    raise _refuse(f"member {member.name[:120]!r} is not a regular file (a link or device)")
                name = _file_name(member)
                _data_filter(member, dest)
                suffix = PurePosixPath(name).suffix.lower()
                if suffix == NPY:
                    raise _refuse(
                        f"member {member.name[:120]!r}: .npy tensors cannot calibrate the agent's build "
                        "(it preprocesses images as inference does); give images"
                    )
                if suffix not in IMAGE_EXTS:
                    raise _refuse(
                        f"member {member.name[:120]!r} is not an image ({', '.join(sorted(IMAGE_EXTS))})"
                    )
                if name in names:
                    raise _refuse(f"two members are named {name!r} (folders are flattened)")
                names.add(name)
                total += member.size
                if total > max_bytes:
                    raise _refuse(f"unpacks to more than {max_bytes} bytes (deploy.max_artifact_mb)")
                _write_member(tar, member, dest / name)
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        why = type(exc).__name__
        raise _refuse(f"not a readable tar archive (plain, .tar.gz or .tar.xz): {why}") from None
    if not names:
        raise _refuse("holds no files")
    return len(names)


def _check_folder_entry(member: tarfile.TarInfo) -> None:
    """A folder entry is never created (files are flattened), but its path must be a sane one too."""
    path = PurePosixPath(member.name)
    if member.name.startswith("/") or ".." in path.parts:
        raise _refuse(f"member {member.name[:120]!r} is an absolute path or leaves the folder")


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
    src = tar.extractfile(member)
    if src is None:
        raise _refuse(f"member {member.name[:120]!r} has no data")
    left = member.size
    with src, open(path, "xb") as f:  # "x": a name written twice would be an error, never an overwrite
        while left > 0:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                raise _refuse(f"member {member.name[:120]!r} is truncated")
            f.write(chunk)
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
