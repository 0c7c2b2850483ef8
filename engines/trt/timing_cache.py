"""The timing-cache part of TrtApi: attach a saved cache, count its entries, merge and serialise it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engines.errors import BuildError
from engines.trt.module import TrtModule, log

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt


class TimingCacheCalls(TrtModule):
    """Timing-cache calls, the same on every version (a TrtApi part)."""

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        # TensorRT-RTX warns DeprecationWarning on timing-cache calls (no-ops there); the path is kept.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield

    def attach_timing_cache(
        self, config: trt.IBuilderConfig, data: bytes
    ) -> tuple[trt.ITimingCache, int, str]:
        """Create a cache from `data` (may be empty) and attach it. Returns (cache, entries it holds, status):
        status "loaded" | "empty" | "unreadable" (TensorRT could not read `data`) | "mismatch"
        (set_timing_cache refused it: another TensorRT or device); the last two start from an empty cache,
        which is what is attached then. entries: -1 where TensorRT cannot say."""
        with self._quiet():
            status = "loaded" if data else "empty"
            cache = config.create_timing_cache(data)
            if cache is None:  # unreadable or from another version: start empty
                cache, status = config.create_timing_cache(b""), "unreadable"
            if config.set_timing_cache(cache, False) is False:
                log.warning(
                    "%s refused the saved timing cache (another version or device); starting empty",
                    self.label,
                )
                cache, status = config.create_timing_cache(b""), "mismatch"
                if config.set_timing_cache(cache, False) is False:
                    raise BuildError(
                        f"{self.label} refused even an empty timing cache (set_timing_cache -> False)"
                    )
            return (
                cache,
                (0 if status in ("unreadable", "mismatch") else self.timing_cache_entries(cache)),
                status,
            )

    def timing_cache_entries(self, cache: trt.ITimingCache) -> int:
        # queryKeys (TensorRT >= 10) says whether a cache really holds timings; RTX's holds none.
        if not hasattr(cache, "queryKeys"):
            return -1  # unknown
        with self._quiet():
            try:
                return len(cache.queryKeys())
            except Exception as e:  # the binding raises on caches it cannot enumerate: unknown, not fatal
                log.warning("%s: cannot count timing cache entries: %s", self.label, e)
                return -1

    def merged_timing_cache(
        self, config: trt.IBuilderConfig, cache: trt.ITimingCache, on_disk: bytes
    ) -> bytes:
        """Serialise `cache` merged with what another build saved meanwhile, for the same TensorRT and
        device only: combine(..., ignore_mismatch=False) refuses a cache whose header names another device
        or CUDA version (TensorRT's ITimingCache::combine), and such timings must never be merged (they
        would steer this device's tactic choice). A cache on disk that TensorRT cannot read or combine is
        overwritten with ours, with a warning: ours are the ones this build measured here."""
        with self._quiet():
            if on_disk:
                other = config.create_timing_cache(on_disk)
                if other is None or cache.combine(other, False) is False:
                    log.warning(
                        "%s: the timing cache on disk is unreadable or belongs to another device or "
                        "version; overwriting it with this build's",
                        self.label,
                    )
            return bytes(memoryview(cache.serialize()))
