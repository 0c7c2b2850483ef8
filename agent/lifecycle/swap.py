"""Serving a model's engine: a built engine is loaded, warmed up and handed to the model's worker.

    adopter = Adopter(store, board, swap, rebuild)   # a process that serves (agent.lifecycle.roles)
    adopter.adopt(me, key)     # after a job, or when the watcher sees an engine another process built

The worker switches at the top of its next batch; on any failure the current backend stays. A plan
TensorRT itself refuses at load (PlanRefusedError) is recorded in its manifest (build.refused_at_load)
and rebuilt once, forced (`rebuild`); refused again, the model is `failed` until an operator asks for a
rebuild. A plan this device cannot run (no GPU, CUDA, memory) is kept, not rebuilt; the state says what
serves instead: `fallback` with ONNX Runtime's backend and precision, `loaded: false` and the reason.
The supervisor of shards serves nothing: its Announcer only says which engine is ready.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from agent.lifecycle.model import ModelContext
from agent.lifecycle.roles import Delegate
from agent.lifecycle.serving import engine_runs_here, open_ort, warm_up
from agent.lifecycle.state import ModelEngine, StateBoard
from agent.telemetry.engine_cache import ENGINE_CACHE
from engines.build.compat import refusal_record
from engines.errors import EngineError
from engines.runtimes.base import Backend, BackendError, PlanRefusedError
from engines.runtimes.tensorrt import TensorRTBackend
from engines.store import EngineStore

# The daemon's log names the engine manager for every line of its lifecycle.
log = logging.getLogger("agent.lifecycle.manager")

# Seconds to wait for the model's build lock to record a refused plan in its manifest.
REFUSAL_LOCK_WAIT_S = 5.0

Swapper = Callable[[str, Backend], None]  # (model, backend): the worker switches at its next batch


class Serving(Protocol):
    """What a process does with a model's backends (agent.lifecycle.roles): the Adopter or the Announcer."""

    def ort(self, ctx: ModelContext) -> Backend | None:
        """ONNX Runtime, while no engine serves (None: this process serves nothing)."""

    def fitting(self, me: ModelEngine, key: str) -> Backend | None:
        """At start: the stored engine `key` fits. Raises PlanRefusedError when its rebuild is due."""

    def adopt(self, me: ModelEngine, key: str) -> None:
        """Engine `key` was built (by a job here, or by another process)."""


class Announcer:
    """The supervisor of shards: says an engine is ready; each shard's watcher loads and swaps it."""

    def __init__(self, store: Callable[[], EngineStore], board: StateBoard) -> None:
        self._store, self._board = store, board

    def ort(self, ctx: ModelContext) -> Backend | None:
        return None

    def fitting(self, me: ModelEngine, key: str) -> Backend | None:
        if not engine_runs_here(me.target.fingerprint):
            self.adopt(me, key)  # the fallback, said as adopt says it
            return None
        self._board.set(me, state="ready", backend="tensorrt", key=key, reasons=[])
        return None

    def adopt(self, me: ModelEngine, key: str) -> None:
        manifest = self._store().manifest(me.name, key)
        sha = manifest.build.plan_sha256 if manifest else None
        precision = manifest.build.precision if manifest else None
        if not engine_runs_here(me.target.fingerprint):
            # No GPU: the shards cannot load it either; ONNX Runtime serves there (issue 36.2).
            why = "no CUDA GPU is visible"
            self._board.set(me, **fallback_fields(key, precision, why), plan_sha256=sha)
            return
        self._board.set(me, state="ready", backend="tensorrt", key=key, plan_sha256=sha, precision=precision)


class Adopter:
    """Load, warm-up, swap and the refusal record, for a process that serves."""

    def __init__(
        self, store: Callable[[], EngineStore], board: StateBoard, swap: Swapper, rebuild: Delegate
    ) -> None:
        self._store, self._board, self._swap, self._rebuild = store, board, swap, rebuild

    def ort(self, ctx: ModelContext) -> Backend | None:
        return open_ort(ctx)

    def fitting(self, me: ModelEngine, key: str) -> Backend | None:
        engine = self.load(me, key)
        if engine is not None:
            self.set_loaded(me, engine, key, reasons=[])
            return engine
        # A fitting engine this device cannot run (load() published `fallback` and why): the state names
        # the ONNX Runtime backend that serves instead, and its precision.
        ort = open_ort(me.ctx)
        self._board.set(me, backend=ort.name, precision=ort.precision)
        return ort

    def adopt(self, me: ModelEngine, key: str) -> None:
        """Load engine `key`, warm it up and hand it to the worker; on failure the current backend stays.
        A plan TensorRT refuses is rebuilt (once in a row: load)."""
        try:
            engine = self.load(me, key)
        except PlanRefusedError as exc:
            with me.lock:
                pulled = me.state.origin == "cache"
            if pulled:  # rebuilt forced: it never pulls, and a push never overwrites the cache's copy
                ENGINE_CACHE.count(rejected=1)
                log.warning("model %s: engine %s of the engine cache refused by TensorRT", me.name, key)
            if not me.retired and not self._rebuild(me.name, True, me.requested, [refused_reason(exc)]):
                log.warning(
                    "model %s: engine %s refused; no rebuild started (one is under way)", me.name, key
                )
            return
        if engine is None:
            return
        if me.retired:  # reloaded away while it loaded: nobody serves this model with it any more
            engine.close()
            return
        self._swap(me.name, engine)
        self.set_loaded(me, engine, key)

    def set_loaded(self, me: ModelEngine, engine: TensorRTBackend, key: str, **extra: Any) -> None:
        """State `ready` for engine `key`, loaded and serving."""
        self._board.set(
            me,
            state="ready",
            backend=engine.name,
            precision=engine.precision,
            key=key,
            loaded=True,
            **extra,
            nvtx_verbosity=engine.nvtx_verbosity,
        )

    def load(self, me: ModelEngine, key: str) -> TensorRTBackend | None:
        """Engine `key` loaded and warmed up. None where it cannot run here (published: `ready`, `loaded:
        false` and why) or where TensorRT refused its plan again after a rebuild (published: `failed`).
        PlanRefusedError when TensorRT refused the plan and a rebuild is due (recorded in its manifest)."""
        manifest = self._store().manifest(me.name, key)
        plan_sha = manifest.build.plan_sha256 if manifest else None
        engine = TensorRTBackend(
            self._store(),
            me.name,
            key,
            api=me.target.api,
            fingerprint=me.target.fingerprint,
            contexts=me.ctx.cfg.streams,
        )
        try:
            engine.load()
            warm_up(engine)  # an engine that cannot execute is never swapped in
        except PlanRefusedError as exc:
            engine.close()
            if self._plan_refused(me, key, plan_sha, manifest.fingerprint if manifest else None, exc):
                raise
            return None
        except BackendError as exc:  # this device, not the plan (no GPU, CUDA, memory): kept, not rebuilt
            engine.close()
            with me.lock:
                me.refusals = 0  # the row of refused plans is broken
            log.warning("model %s: engine %s is built but cannot be loaded here: %s", me.name, key, exc)
            self._cannot_run(me, key, plan_sha, manifest.build.precision if manifest else None, exc)
            return None
        with me.lock:
            me.refusals = 0
        self._board.set(me, plan_sha256=plan_sha, load_error=None)
        return engine

    def _cannot_run(
        self, me: ModelEngine, key: str, plan_sha: str | None, built: str | None, exc: BackendError
    ) -> None:
        """Engine ``key`` (``built``: its precision) is kept but cannot run here. The state says what serves
        instead (issue 36.2): an engine loaded before stays `ready` with its own key and precision;
        otherwise ONNX Runtime serves, `fallback`, with its backend and precision (the caller's, or those
        the state already names) and the reason."""
        with me.lock:
            engine_serves = me.state.loaded is True  # the engine loaded before (a rebuild's ends here)
        if engine_serves:
            self._board.set(me, state="ready", load_error=str(exc), progress=None)
            return
        fields = fallback_fields(key, built, str(exc), me.state.backend, me.state.precision)
        self._board.set(me, **fields, plan_sha256=plan_sha)

    def _plan_refused(
        self,
        me: ModelEngine,
        key: str,
        plan_sha: str | None,
        built_for: dict[str, Any] | None,
        exc: PlanRefusedError,
    ) -> bool:
        """Record the refusal in the engine's manifest, so `check` and the next start know it; True when a
        rebuild is due (the first refusal in a row), else publish `failed` (no rebuild loop)."""
        with me.lock:
            me.refusals += 1
            n = me.refusals
        if plan_sha is not None and built_for is not None:
            # The device that refused it: the live fingerprint with the engine's DLA core, as check()'s.
            fp = me.target.fingerprint.for_build(built_for.get("dla_core"), None)
            self._record_refusal(me, key, plan_sha, refusal_record(fp, exc.reason, plan_sha, n))
        if n < 2:
            log.error("model %s: %s; rebuilding engine %s", me.name, exc, key)
            return True
        error = refused_error(key, n, exc.reason)
        log.error("model %s: %s", me.name, error)
        self._board.set(
            me,
            state="failed",
            plan_sha256=plan_sha,
            load_error=str(exc),
            reasons=[refused_reason(exc)],
            error=error,
            progress=None,
        )
        return False

    def _record_refusal(self, me: ModelEngine, key: str, plan_sha: str, record: dict[str, Any]) -> None:
        try:
            with self._store().lock(me.name, wait_s=REFUSAL_LOCK_WAIT_S):
                written = self._store().set_refused_at_load(me.name, key, plan_sha, record)
        except EngineError as exc:  # the lock held by a build, a read-only disk: the rebuild still happens
            log.warning("model %s: the refused plan of engine %s is not recorded: %s", me.name, key, exc)
            return
        if written is None:
            log.info("model %s: engine %s was rebuilt meanwhile; the refusal is not recorded", me.name, key)


def fallback_fields(
    key: str, built: str | None, error: str, backend: str | None = None, precision: str | None = None
) -> dict[str, Any]:
    """The engine state of a built engine ``key`` (``built``: its precision) that cannot run on this
    device: `fallback`, what serves instead (``backend``, ``precision``: ONNX Runtime's by default), not
    loaded, and why."""
    what = f"engine {key}" + (f" ({built})" if built else "")
    return {
        "state": "fallback",
        "backend": backend or "onnxruntime",
        "precision": precision or "fp32",
        "reasons": [f"{what} is built but cannot run on this device: {error}"],
        "key": key,
        "loaded": False,
        "load_error": error,
    }


def refused_reason(exc: PlanRefusedError) -> str:
    return f"TensorRT refused this plan at load: {exc.reason}"


def refused_error(key: str, refusals: int, reason: str) -> str:
    times = "twice" if refusals == 2 else f"{refusals} times in a row"
    return (
        f"TensorRT refused the plan of engine {key} at load {times}, the last one just rebuilt ({reason}); "
        "ONNX Runtime serves, and no more rebuilds start by themselves: send the rebuild command or run "
        "`edge-agent rebuild` once TensorRT is fixed"
    )
