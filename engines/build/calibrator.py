"""INT8 calibration for weakly typed TensorRT (<= 10): batches in, device pointers out, a reusable cache.

    cache = CalibrationCache(store.calib_path(model, key), identity={"method": "entropy", "samples": 500,
                                                                    "onnx_sha256": ...})
    feeder = BatchFeeder(batches, shape=(1, 3, 416, 416), samples=500, allocator=None)  # None: CUDA
    calibrator = make_calibrator(api, "entropy", feeder, cache)   # an IInt8EntropyCalibrator2
    config.int8_calibrator = calibrator                            # (TrtApi.set_int8 does this)
    ... build ...; calibrator.close(); calibrator.error -> raise if set

Batches: an iterable (or a callable returning one) of float32 NCHW numpy arrays, any batch size: the agent
preprocesses frames with its own code; this package never sees images. They are re-cut into batches of
the calibration shape (TensorRT calibrates dynamic shapes at the calibration profile's kOPT shape).
A last partial batch is DROPPED (and logged): TensorRT needs full batches, and padding with repeated or
blank frames would skew the activation histograms the scales come from. At most `samples` samples are
used; a source that ends before `samples` is an error (the manifest would otherwise claim more).

Errors inside get_batch cannot cross TensorRT's C++ boundary usefully: they are kept in `.error`,
get_batch returns None (ends calibration), nothing is written to the cache, and the builder raises.

Cache: `{engine_dir}/{model}/{key}.calib` holds TensorRT's bytes unchanged (usable with trtexec), and
`{key}.calib.meta` the identity it was made for (method, samples, extra keys, ONNX sha256) plus its
sha256. read_calibration_cache returns the bytes only when identity and sha256 match; otherwise None and
TensorRT calibrates again. Both files are written atomically, cache first, so a torn pair never matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.cuda.buffers import Allocator, DeviceBufferLike
from engines.errors import BuildError
from engines.store.fsutil import atomic_write_bytes
from engines.trt import TrtApi

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    class Calibrator(trt.IInt8Calibrator):
        """What make_calibrator returns (its class, EngineCalibrator, is made at run time on the TensorRT
        calibrator class of the method)."""

        feeder: BatchFeeder
        cache: CalibrationCache
        cache_bytes: bytes | None
        cache_sha256: str | None
        cache_read: bool

        @property
        def error(self) -> BaseException | None: ...

        def close(self) -> None: ...


log = logging.getLogger("engines.calibrator")

DEFAULT_QUANTILE = 0.9999  # percentile method: clip activations at their 99.99th percentile
DEFAULT_REGRESSION_CUTOFF = 1.0  # legacy calibrator: 1.0 = use the quantile alone, no regression

BatchSource = Iterable[np.ndarray] | Callable[[], Iterable[np.ndarray]]


def npy_batches(path: Path) -> Iterator[np.ndarray]:
    """Batches from a .npy file (memory-mapped) or a directory of .npy files, in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.npy"))
        if not files:
            raise BuildError(f"calibration_data {path} holds no .npy files")
    elif path.is_file():
        files = [path]
    else:
        raise BuildError(f"calibration_data {path} does not exist")
    for f in files:
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise BuildError(f"calibration_data {f} is not a readable .npy array: {e}") from e
        yield arr if arr.ndim == 4 else arr[None]  # one CHW sample per file is fine too


class CalibrationCache:
    def __init__(self, path: Path, identity: dict[str, Any]) -> None:
        self.path = Path(path)
        self.meta_path = self.path.with_name(self.path.name + ".meta")
        self.identity = identity

    def load(self) -> bytes | None:
        """The cached bytes if they were made for this identity and are intact, else None."""
        if not self.path.is_file() or not self.meta_path.is_file():
            return None
        try:
            meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
            data = self.path.read_bytes()
        except (OSError, ValueError) as e:
            log.warning("ignoring calibration cache %s: unreadable (%s)", self.path, e)
            return None
        if not isinstance(meta, dict) or meta.get("identity") != self.identity:
            was = meta.get("identity") if isinstance(meta, dict) else None
            log.info("ignoring calibration cache %s: made for %s, not %s", self.path, was, self.identity)
            return None
        if meta.get("sha256") != hashlib.sha256(data).hexdigest():
            log.warning("ignoring calibration cache %s: sha256 mismatch (torn or edited)", self.path)
            return None
        return data

    def save(self, data: bytes) -> str:
        """Write the cache and its identity atomically; returns the sha256 of the cache bytes."""
        sha = hashlib.sha256(data).hexdigest()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, data)
        meta = {"identity": self.identity, "sha256": sha}
        atomic_write_bytes(self.meta_path, (json.dumps(meta, sort_keys=True) + "\n").encode())
        return sha


class BatchFeeder:
    """Re-cuts caller batches into calibration-shaped float32 batches and copies each into one device
    buffer, allocated at the first batch (a cache hit never touches CUDA) and freed by close(). The
    default allocator (engines.cuda.buffers.cuda_allocator) copies through pinned memory, so a batch is
    on the device when get_batch returns its pointer: from pageable memory cudaMemcpy returns before the
    DMA is done, and TensorRT reads the buffer on its own stream."""

    def __init__(
        self,
        source: BatchSource | None,
        shape: tuple[int, ...],
        samples: int,
        allocator: Allocator | None,
    ) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.batch_size = self.shape[0]
        self.samples = int(samples)
        self._source = source
        self._allocator = allocator
        self._iter: Iterator[np.ndarray] | None = None
        self.buffer: DeviceBufferLike | None = None
        self.batches_fed = 0
        self.samples_taken = 0
        self.dropped = 0
        self.error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    def _batches(self) -> Iterator[np.ndarray]:
        if self._source is None:
            raise BuildError("no calibration batches were given and no reusable calibration cache exists")
        source = self._source() if callable(self._source) else self._source
        pending: list[np.ndarray] = []
        have = 0
        for i, arr in enumerate(source):
            arr = np.asarray(arr)
            if arr.dtype != np.float32 or arr.ndim != 4 or tuple(arr.shape[1:]) != self.shape[1:]:
                raise BuildError(
                    f"calibration batch {i} is {arr.dtype} {list(arr.shape)}; expected float32 "
                    f"[N, {', '.join(map(str, self.shape[1:]))}] (NCHW, preprocessed like inference input)"
                )
            take = min(len(arr), self.samples - self.samples_taken)
            if take > 0:
                pending.append(arr[:take])
                have += take
                self.samples_taken += take
            while have >= self.batch_size:
                joined = np.concatenate(pending) if len(pending) > 1 else pending[0]
                yield np.ascontiguousarray(joined[: self.batch_size])
                rest = joined[self.batch_size :]
                pending, have = ([rest] if len(rest) else []), len(rest)
            if self.samples_taken >= self.samples:
                break
        if self.samples_taken < self.samples:
            raise BuildError(
                f"the calibration set ended after {self.samples_taken} samples; calibration.samples "
                f"is {self.samples} (capture more, or lower calibration.samples)"
            )
        self.dropped = have
        if have:
            log.warning(
                "calibration: dropped the last %d samples (less than one batch of %d)", have, self.batch_size
            )

    def next_pointer(self) -> int | None:
        """Device pointer of the next full batch, or None at the end (or after an error: see .error)."""
        if self.error is not None:
            return None
        try:
            if self._iter is None:
                self._iter = self._batches()
            batch = next(self._iter, None)
            if batch is None:
                return None
            if self.buffer is None:
                alloc = self._allocator
                if alloc is None:
                    from engines.cuda.buffers import cuda_allocator

                    alloc = cuda_allocator()
                self.buffer = alloc(self.nbytes)
            self.buffer.copy_from_host(batch)
            self.batches_fed += 1
            return int(self.buffer.ptr)
        except BaseException as e:  # kept for the builder: TensorRT would only see "no more batches"
            self.error = e
            return None

    def close(self) -> None:
        if self.buffer is not None:
            buf, self.buffer = self.buffer, None
            buf.free()


class _Delegating:
    """What every calibrator made by make_calibrator does: batches from a BatchFeeder, the cache from a
    CalibrationCache. Mixed in ahead of the TensorRT calibrator class, whose abstract methods it fills."""

    def __init__(self, feeder: BatchFeeder, cache: CalibrationCache) -> None:
        self.feeder = feeder
        self.cache = cache
        self.cache_bytes: bytes | None = None  # what TensorRT used: read or written
        self.cache_sha256: str | None = None
        self.cache_read = False  # TensorRT asked for the cache and got one: scales without batches

    @property
    def error(self) -> BaseException | None:
        return self.feeder.error

    def get_batch_size(self) -> int:
        return self.feeder.batch_size

    def get_batch(self, names: list[str], *_: Any) -> list[int] | None:
        if len(names) != 1:
            self.feeder.error = BuildError(
                f"INT8 calibration feeds one image input; the network has inputs {list(names)}"
            )
            return None
        ptr = self.feeder.next_pointer()
        return None if ptr is None else [ptr]

    def read_calibration_cache(self) -> bytes | None:
        data = self.cache.load()
        if data is not None:
            log.info("reusing calibration cache %s", self.cache.path)
            self.cache_read = True
            self.cache_bytes = data
            self.cache_sha256 = hashlib.sha256(data).hexdigest()
        return data

    def write_calibration_cache(self, data: Any) -> None:
        if self.feeder.error is not None:
            return  # scales from a broken calibration run must never be reused
        blob = bytes(memoryview(data))
        self.cache_bytes = blob
        try:
            self.cache_sha256 = self.cache.save(blob)
        except OSError as e:  # the engine can still be built; the next build recalibrates
            log.warning("cannot write calibration cache %s: %s", self.cache.path, e)
            self.cache_sha256 = hashlib.sha256(blob).hexdigest()

    def close(self) -> None:
        self.feeder.close()


class _Percentile:
    """The legacy (percentile) calibrator's extra methods: the quantile cut-off and its regression."""

    quantile: float
    regression_cutoff: float

    def get_quantile(self) -> float:
        return self.quantile

    def get_regression_cutoff(self) -> float:
        return self.regression_cutoff

    def read_histogram_cache(self, length: int) -> None:
        return None  # histograms are not kept: the calibration cache already skips recalibration

    def write_histogram_cache(self, data: Any, length: int) -> None:
        return None


def make_calibrator(
    api: TrtApi,
    method: str,
    feeder: BatchFeeder,
    cache: CalibrationCache,
    *,
    quantile: float = DEFAULT_QUANTILE,
    regression_cutoff: float = DEFAULT_REGRESSION_CUTOFF,
) -> Calibrator:
    """An instance of the TensorRT calibrator class for `method`, delegating to `feeder` and `cache`."""
    base = api.calibrator_base(method)
    mixins: tuple[type, ...] = (_Delegating, _Percentile) if method == "percentile" else (_Delegating,)

    class EngineCalibrator(*mixins, base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            # pybind11 trampolines need the base initialised explicitly, or TensorRT crashes on first call.
            base.__init__(self)
            _Delegating.__init__(self, feeder, cache)
            self.quantile = quantile
            self.regression_cutoff = regression_cutoff

    return EngineCalibrator()
