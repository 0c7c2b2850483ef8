"""The `artifacts.calibration` archive (issue 37 point 4: INT8 from the artifact's calibration set): a tar of
images unpacked safely into the installed version's calibration/ folder, which
effective_model makes the model's calibration source and the calibration code reads; every hostile or
useless archive refused at install naming the field, nothing left in models/."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.config import ModelConfig
from agent.deploy.calib_archive import unpack_calibration
from agent.deploy.errors import VerifyError
from agent.deploy.version_files import effective_model
from agent.deploy.versions import VersionStore
from agent.lifecycle.calib_folder import calibration_data

ROOT = Path(__file__).resolve().parents[1]
NANODET = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"
LABELS = ROOT / "agent" / "assets" / "coco.names"
FIELD = "artifacts.calibration"


def _jpeg(seed: int) -> bytes:
    img = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", img)
    assert ok
    return buf.tobytes()


def _tar(path: Path, members: Sequence[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    return path


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _install(tmp_path: Path, archive: Path, **kw: int) -> Path:
    store = VersionStore(tmp_path / "state")
    d = store.stage_dir("det", "v1")
    files = {"onnx": NANODET, "labels": LABELS, "calibration": archive}
    doc = {
        "model": "det",
        "version": "v1",
        "format": "nanodet",
        "artifacts": {
            k: {
                "url": f"https://x/{k}",
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                "size": p.stat().st_size,
            }
            for k, p in files.items()
        },
    }
    assert d.is_dir()
    return store.install("det", "v1", files, doc, **kw)


def _refused(tmp_path: Path, archive: Path, words: str, **kw: int) -> None:
    with pytest.raises(VerifyError) as err:
        _install(tmp_path, archive, **kw)
    assert err.value.field == FIELD and FIELD in err.value.reason, err.value.reason
    assert words in err.value.reason, err.value.reason
    models = tmp_path / "state" / "models"
    if models.exists():  # nothing of the refused version, not even a half-unpacked .incoming-* folder
        assert [p.name for p in models.rglob("*")] == ["det"], list(models.rglob("*"))


def _own() -> ModelConfig:
    return ModelConfig(onnx=NANODET, labels=LABELS, format="nanodet", precision="int8")


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:xz"])
def test_an_archive_of_images_becomes_the_versions_calibration_source(tmp_path: Path, mode: str) -> None:
    names = [f"frames/cam{i}.jpg" for i in range(5)]  # a folder inside the archive: flattened
    archive = _tar(tmp_path / "calib.bin", [(n, _jpeg(i)) for i, n in enumerate(names)], mode)
    folder = _install(tmp_path, archive)
    calib = folder / "calibration"
    assert sorted(p.name for p in calib.iterdir()) == [f"cam{i}.jpg" for i in range(5)]
    eff = effective_model(_own(), folder)
    assert (eff.calibration.source, eff.calibration.folder) == ("folder", calib)
    data = calibration_data(Path(eff.calibration.folder), eff.format, Path(eff.onnx))
    assert (data.kind, data.samples) == ("images", 5)
    first = next(iter(data.batches()))
    assert first.shape[-2:] == (416, 416)  # preprocessed as inference does


def test_an_archive_of_npy_tensors_is_refused_the_agent_calibrates_from_images(tmp_path: Path) -> None:
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 3, 416, 416), np.float32))
    archive = _tar(tmp_path / "c.tar", [("t0.npy", buf.getvalue())])
    _refused(tmp_path, archive, ".npy tensors cannot calibrate")


@pytest.mark.parametrize(
    ("members", "words"),
    [
        ([("../escape.jpg", b"x")], "leaves the folder"),
        ([("a/../../escape.jpg", b"x")], "leaves the folder"),
        ([("/etc/evil.jpg", b"x")], "absolute path"),
        ([("ok.jpg", b"x"), _link("l.jpg", "/etc/passwd")], "not a regular file"),
        ([("ok.jpg", b"x"), _link("h.jpg", "ok.jpg", tarfile.LNKTYPE)], "not a regular file"),
        ([_link("dev.jpg", "", tarfile.CHRTYPE)], "not a regular file"),
        ([("notes.txt", b"hello"), ("more.txt", b"world")], "is not an image"),
        ([(".hidden.jpg", b"x")], "a name is"),
        ([("a/x.jpg", b"1"), ("b/x.jpg", b"2")], "two members are named"),
        ([("x.jpg", b"1"), ("t.npy", b"2")], ".npy tensors cannot"),
        ([], "holds no files"),
    ],
)
def test_a_hostile_or_useless_archive_is_refused_naming_the_field(
    tmp_path: Path, members: list, words: str
) -> None:
    _refused(tmp_path, _tar(tmp_path / "c.tar", members), words)
    assert not (tmp_path / "escape.jpg").exists() and not (tmp_path / "state" / "escape.jpg").exists()


def test_too_many_files_are_refused(tmp_path: Path) -> None:
    members = [(f"f{i}.jpg", b"x") for i in range(30)]
    with pytest.raises(VerifyError, match="more than 20 entries"):
        unpack_calibration(_tar(tmp_path / "c.tar", members), tmp_path / "out", 1 << 20, max_files=20)


def test_an_archive_that_unpacks_too_large_is_refused(tmp_path: Path) -> None:
    # 2 MB of zeros compress to almost nothing: the bound is on what it unpacks to, not what was downloaded
    archive = _tar(tmp_path / "c.tar.xz", [("big.jpg", bytes(2 << 20))], "w:xz")
    assert archive.stat().st_size < 10_000
    _refused(tmp_path, archive, "more than 1048576 bytes", calib_max_bytes=1 << 20)


@pytest.mark.parametrize("data", [b"not a tar at all\n" * 100, b"\x1f\x8b\x08\x00garbage"])
def test_something_that_is_not_a_tar_is_refused(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "c.bin").write_bytes(data)
    _refused(tmp_path, tmp_path / "c.bin", "not a readable tar archive")


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    whole = _tar(tmp_path / "c.tar.gz", [(f"f{i}.jpg", _jpeg(i)) for i in range(4)], "w:gz").read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(whole[: len(whole) // 2])
    _refused(tmp_path, tmp_path / "cut.tar.gz", FIELD)
