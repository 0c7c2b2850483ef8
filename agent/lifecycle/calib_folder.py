"""`edge-agent build --calib DIR`: the folder as calibration batches, and the bad command-line value error.

`.npy` files of preprocessed float32 NCHW (or CHW) tensors are fed as they are; images are preprocessed as
inference does, with the adapter of `--format`. The data id (sha256 of the names and bytes) is part of the
engine key (agent.lifecycle.standalone).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.errors import BuildError, EngineError
from engines.runtimes.base import TensorSpec
from engines.settings import onnx_input_shapes
from engines.store import sha256_file
from pipelines.models import ModelAdapter, ModelSpec, formats


class UsageError(EngineError):
    """A bad command-line value; the message names the option and the path or value."""



@dataclass(frozen=True)
class CalibData:
    directory: Path
    batches: Callable[[], Iterator[np.ndarray]]  # re-iterable: a fresh pass per call
    samples: int
    data_id: str  # sha256[:16] of what is fed (file names and bytes)
    kind: str  # "npy" | "images"


def calibration_data(directory: Path, fmt: str | None, onnx: Path) -> CalibData:
    """The --calib folder as batches; UsageError naming the folder when it holds nothing usable."""
    from agent.lifecycle.capture import IMAGE_EXTS

    if not directory.is_dir():
        raise UsageError(f"--calib {directory}: does not exist or is not a directory")
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    npy = [p for p in files if p.suffix == ".npy"]
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTS]
    digest = hashlib.sha256()
    for p in npy or images:
        digest.update(p.name.encode() + b"\0" + sha256_file(p).encode())
    if npy:
        from engines.build.calibrator import npy_batches

        try:
            samples = sum(int(b.shape[0]) for b in npy_batches(directory))
        except BuildError as e:
            raise UsageError(f"--calib {directory}: {e}") from None
        return CalibData(directory, lambda: npy_batches(directory), samples, digest.hexdigest()[:16], "npy")
    if not images:
        raise UsageError(
            f"--calib {directory}: holds no .npy tensors and no images ({', '.join(sorted(IMAGE_EXTS))})"
        )
    if fmt is None:
        raise UsageError(
            f"--calib {directory} holds images: give --format ({', '.join(formats())}) so they are "
            "preprocessed as inference does, or give preprocessed .npy tensors"
        )
    adapter = _adapter(fmt, onnx)

    def batches() -> Iterator[np.ndarray]:
        import cv2

        for p in images:
            img = cv2.imread(str(p), cv2.IMREAD_COLOR)
            if img is None:
                raise BuildError(f"--calib: cannot read image {p}")
            yield adapter.preprocess([img])[0]

    return CalibData(directory, batches, len(images), digest.hexdigest()[:16], "images")


def _adapter(fmt: str, onnx: Path) -> ModelAdapter:
    """--format's adapter, to preprocess calibration images as inference does (ModelSpec.adapter, as the
    daemon's). No labels here, and preprocessing uses none: one class stands in (resolve_onnx wants them)."""
    inputs = onnx_input_shapes(onnx)
    if len(inputs) != 1:
        raise UsageError(f"--format {fmt}: {onnx} has inputs {list(inputs)}; images need a one-input model")
    [(name, dims)] = inputs.items()
    tensor = TensorSpec(name, dims, np.dtype(np.float32))
    try:
        return ModelSpec(onnx.stem, fmt.lower(), ("object",), tensor, onnx, onnx).adapter()
    except ValueError as e:
        raise UsageError(f"--format {fmt}: {e}") from None
