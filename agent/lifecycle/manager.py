"""Agent side of the engine lifecycle: which runtime serves each model, builds in a child process, hot swap.

Rules (README "Engines"):
- backend `onnxruntime`: ONNX Runtime, no engine.
- backend `auto`: TensorRT when a TensorRT flavour is importable *and* a GPU is visible, else ONNX Runtime.
- backend `tensorrt` / `tensorrt_rtx`: that flavour. Without a usable engine the model is served by ONNX
  Runtime (engine state `fallback`) while a child process builds one; then the new engine is loaded
  and swapped in between two batches, cameras untouched. A failed build keeps whatever serves.
- Engines built by `edge-agent rebuild` in another process are picked up by a watcher.

The engine state `state` is the engine's (checking, building, ready, failed, fallback); `backend` names
the runtime serving detections now. On a machine that can build but not run the engine (TensorRT-RTX
without a supported GPU) the state becomes `ready` with `loaded: false` and the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import AgentConfig, ConfigError, ModelConfig
from agent.engine_settings import build_settings, trt_flavor
from engines.buildproc import BuildProcess, start_build_process
from engines.compat import check
from engines.errors import EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.runtimes.base import Backend, BackendError
from engines.runtimes.ort import OrtBackend
from engines.runtimes.tensorrt import TensorRTBackend
from engines.store import EngineStore
from engines.trt_api import TrtApi, import_trt

log = logging.getLogger(__name__)

StatePublisher = Callable[[str, dict[str, Any]], None]
Swapper = Callable[[str, Backend], None]


def open_ort(name: str, cfg: ModelConfig) -> Backend:
    backend = OrtBackend(str(cfg.onnx), intra_threads=cfg.threads.intra, inter_threads=cfg.threads.inter)
    backend.load()
    return backend


@dataclass
class ModelEngine:
    name: str
    cfg: ModelConfig
    api: TrtApi
    fingerprint: Fingerprint
    state: dict[str, Any] = field(default_factory=dict)
    build: BuildProcess | None = None
    loaded_key: str | None = None
    seen: tuple = ()  # engine dir listing at the last check, to notice builds made by other processes
    last_progress_pub: float = 0.0


class EngineManager:
    def __init__(
        self,
        cfg: AgentConfig,
        publish: StatePublisher,
        swap: Swapper,
        agent_version: str,
        watch_interval_s: float = 2.0,
        config_path: Path | None = None,
    ) -> None:
        self._config_path = config_path
        self.cfg = cfg
        self._publish = publish
        self._swap = swap
        self._version = agent_version
        self._watch_interval = watch_interval_s
        self._store: EngineStore | None = None
        self._models: dict[str, ModelEngine] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start-up ------------------------------------------------------------------------------
    @property
    def store(self) -> EngineStore:
        if self._store is None:
            # Raises StoreError naming engine_dir and the OS reason: a start-up error, by design.
            self._store = EngineStore(self.cfg.engine_dir)
        return self._store

    def open(self, name: str, cfg: ModelConfig) -> Backend:
        """The backend to serve `name` with now; starts a build in the background when one is needed."""
        if cfg.backend == "onnxruntime":
            return self._ort_only(name, cfg, [])
        try:
            api = import_trt(trt_flavor(cfg))
            fp = probe_fingerprint(api, target_compute_capability=cfg.engine.target_compute_capability)
        except EngineError as exc:
            if cfg.backend != "auto":
                raise ConfigError(f"models.{name}.backend: {cfg.backend} requested, but {exc}") from None
            return self._ort_only(name, cfg, [f"no TensorRT here ({exc}): ONNX Runtime serves"])
        if cfg.backend == "auto" and not fp.has_gpu:
            return self._ort_only(name, cfg, ["no CUDA GPU visible: ONNX Runtime serves"])
        store = self.store
        me = ModelEngine(name, cfg, api, fp)
        with self._lock:
            self._models[name] = me
        self._set(me, state="checking", backend="onnxruntime")
        settings, report, why = self._settings(me)
        if settings is None:
            return self._fallback(me, [why], "the gate runs")
        if report is not None:
            self._set(me, validation=_state_validation(report))
        result = check(store, name, settings, fp)
        me.seen = self._listing(name)
        if result.ok:
            trt = self._try_load(me, result.key)
            if trt is not None:
                self._set(
                    me,
                    state="ready",
                    backend=trt.name,
                    precision=trt.precision,
                    key=result.key,
                    loaded=True,
                    reasons=[],
                )
                return trt
        if result.ok:
            return open_ort(name, cfg)  # fitting engine that this device cannot run: see _try_load
        return self._fallback(me, result.reasons, "one is built")

    def _fallback(self, me: ModelEngine, reasons: list[str], meanwhile: str) -> Backend:
        """ONNX Runtime serves while a build (and gate) runs in a child process."""
        backend = open_ort(me.name, me.cfg)
        log.warning(
            "model %s: %s; ONNX Runtime serves (fallback) while %s", me.name, "; ".join(reasons), meanwhile
        )
        self._set(
            me,
            state="fallback",
            backend=backend.name,
            precision=backend.precision,
            reasons=reasons,
            key=None,
            loaded=False,
        )
        self.rebuild(me.name)
        return backend

    def _ort_only(self, name: str, cfg: ModelConfig, reasons: list[str]) -> Backend:
        """A model that ONNX Runtime serves by design (no engine involved)."""
        backend = open_ort(name, cfg)
        state = {
            "state": "ready",
            "backend": backend.name,
            "precision": backend.precision,
            "reasons": reasons,
        }
        self._publish(name, state)
        return backend

    def start(self) -> None:
        if self._models:
            self._thread = threading.Thread(target=self._watch, name="engine-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            builds = [m.build for m in self._models.values() if m.build is not None]
        for b in builds:
            b.kill()  # temp files of a killed build are never loaded, and are cleaned by the next build
        if self._thread is not None:
            self._thread.join(2.0)

    @property
    def models(self) -> list[str]:
        return list(self._models)

    # ---- builds --------------------------------------------------------------------------------
    def rebuild(self, name: str, force: bool = False, precision: str | None = None) -> bool:
        """Start a child-process build of `name`; False when one is already running.

        fp32 goes straight to engines.buildproc; fp16/int8/best go through the precision job (gate, then
        build), which needs the config file."""
        with self._lock:
            me = self._models[name]
            if me.build is not None:
                return False
            requested = precision or me.cfg.precision
            on_event = lambda ev: self._on_build_event(me, ev)  # noqa: E731
            if requested == "fp32":
                me.build = start_build_process(
                    name,
                    build_settings(me.cfg, "fp32"),
                    self.cfg.engine_dir,
                    force=force,
                    on_event=on_event,
                    agent_version=self._version,
                    trt_flavor=me.api.flavor,
                )
            elif self._config_path is None:
                self._set(me, state="failed", error=f"precision {requested} needs the daemon's config file")
                return False
            else:
                from agent.precision_job import start_precision_job

                me.build = start_precision_job(self._config_path, name, requested, force, on_event)
        self._set(me, state="building", progress=None, error=None)
        threading.Thread(target=self._finish_build, args=(me,), name=f"build-{name}", daemon=True).start()
        return True

    def _on_build_event(self, me: ModelEngine, ev: dict[str, Any]) -> None:
        if ev.get("event") != "progress":
            return
        now = time.monotonic()
        if now - me.last_progress_pub < 0.5:  # a progress state at most twice a second
            return
        me.last_progress_pub = now
        progress = {"phase": ev.get("phase"), "step": ev.get("step"), "total": ev.get("total")}
        log.info(
            "model %s: building: %s %s/%s", me.name, progress["phase"], progress["step"], progress["total"]
        )
        self._set(me, state="building", progress=progress)

    def _finish_build(self, me: ModelEngine) -> None:
        build = me.build
        assert build is not None
        result = build.wait()
        with self._lock:
            me.build = None
            me.seen = self._listing(me.name)
        if self._stop.is_set():
            return
        if not result.get("ok"):
            error = result.get("error") or "build failed"
            log.error(
                "model %s: engine build failed: %s (still serving %s)",
                me.name,
                error,
                me.state.get("backend"),
            )
            self._set(me, state="failed", error=error, progress=None)
            return
        log.info("model %s: %s", me.name, result.get("message"))
        if result.get("validation"):
            self._set(me, validation=_state_validation(result["validation"]), tried=result.get("tried", []))
        key = result.get("key")
        build_s = result.get("build_s") if result.get("built") else me.state.get("build_s")
        self._set(
            me,
            build_s=build_s,
            reasons=result.get("reasons") or me.state.get("reasons", []),
            progress=None,
            error=None,
        )
        if key is not None:
            self._adopt(me, key)

    def _adopt(self, me: ModelEngine, key: str) -> None:
        """Load engine `key` and swap it in; on failure the current backend keeps serving."""
        trt = self._try_load(me, key)
        if trt is None:
            return
        self._swap(me.name, trt)
        me.loaded_key = key
        self._set(me, state="ready", backend=trt.name, precision=trt.precision, key=key, loaded=True)

    def _try_load(self, me: ModelEngine, key: str) -> Backend | None:
        manifest = self.store.manifest(me.name, key)
        plan_sha = manifest.build.get("plan_sha256") if manifest else None
        trt = TensorRTBackend(self.store, me.name, key, api=me.api, fingerprint=me.fingerprint)
        try:
            trt.load()
            _warm_up(trt)  # an engine that cannot execute is never swapped in
        except (BackendError, NotImplementedError) as exc:
            trt.close()
            log.warning("model %s: engine %s is built but cannot be loaded here: %s", me.name, key, exc)
            precision = manifest.build.get("precision") if manifest else None
            self._set(
                me,
                state="ready",
                key=key,
                plan_sha256=plan_sha,
                loaded=False,
                load_error=str(exc),
                precision=precision,
            )
            return None
        me.loaded_key = key
        me.state["plan_sha256"] = plan_sha
        return trt

    # ---- watcher -------------------------------------------------------------------------------
    def _listing(self, name: str) -> tuple:
        d = self.store.model_dir(name)
        try:
            return tuple(sorted((p.name, p.stat().st_mtime_ns) for p in d.glob("*.json")))
        except OSError:
            return ()

    def _watch(self) -> None:
        while not self._stop.wait(self._watch_interval):
            for me in list(self._models.values()):
                try:
                    self._watch_one(me)
                except Exception:
                    log.exception("model %s: engine watch failed", me.name)

    def _watch_one(self, me: ModelEngine) -> None:
        with self._lock:
            if me.build is not None:
                return
            listing = self._listing(me.name)
            if listing == me.seen:
                return
            me.seen = listing
        settings, _, _ = self._settings(me)
        if settings is None:
            return
        result = check(self.store, me.name, settings, me.fingerprint)
        manifest = result.manifest
        if not result.ok or manifest is None:
            return
        if manifest.build.get("plan_sha256") != me.state.get("plan_sha256"):
            log.info("model %s: new engine %s found (built by another process)", me.name, result.key)
            self._set(me, build_s=manifest.build.get("build_s"), reasons=[])
            self._adopt(me, result.key)

    def _settings(self, me: ModelEngine) -> tuple[Any, dict[str, Any] | None, str]:
        from agent.precision_job import resolved_settings

        return resolved_settings(self.cfg, me.name, None, me.api.weakly_typed)

    # ---- state -----------------------------------------------------------------------------------
    def _set(self, me: ModelEngine, **fields: Any) -> None:
        with self._lock:
            me.state.update(fields)
            me.state.setdefault("fingerprint", me.fingerprint.manifest_dict())
            snapshot = dict(me.state)
        self._publish(me.name, snapshot)

    def state_of(self, name: str) -> dict[str, Any]:
        me = self._models.get(name)
        return dict(me.state) if me else {}


def _state_validation(report: dict[str, Any]) -> dict[str, Any]:
    """The engine state's `validation` (DESIGN.md: metric, value, threshold, passed) and its precision."""
    return {k: report.get(k) for k in ("metric", "value", "threshold", "passed", "precision", "requested")}


def _warm_up(backend: Backend) -> None:
    """One inference on zeros at the smallest profile shape: proves the engine executes here."""
    spec = backend.input_spec
    shape = tuple(1 if d is None else d for d in spec.shape)
    backend.infer(np.zeros(shape, dtype=spec.dtype))
