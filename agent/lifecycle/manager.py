"""The daemon's side of the engine lifecycle: what serves each model, jobs in a child, hot swap.

Per model, one state machine (the retained MQTT engine state, DESIGN.md):

    checking --fits, loads--> ready
    checking --no fitting engine / not validated / plan refused--> fallback --job starts--> building
    checking --plan refused in a row before (on record)--> failed
    ready | failed | fallback --rebuild--> building --job ok--> ready   (--job failed--> failed)
    building | ready | failed --plan refused at load--> building (rebuild)   (--refused again--> failed)

`state` is the engine's; `backend` names the runtime serving detections now. While no engine serves,
ONNX Runtime does. A job (agent.lifecycle.job) runs in a child process; before it starts, the frames
the gate (and INT8) needs are taken from the model's running pipeline (FrameTap), never from a second
camera session. A finished engine is loaded and warmed up here; only then is it handed to the model's
worker, which switches at the top of its next batch. On a machine that can build but not run the engine
(TensorRT-RTX without a supported GPU) the state is `ready` with `loaded: false` and the reason.
A plan TensorRT itself refuses at load (PlanRefusedError: a TensorRT patch the fingerprint missed) is
recorded as such in its manifest (build.refused_at_load: `edge-agent check` and the next start say
"rebuild") and rebuilt once, forced; a rebuilt plan refused again leaves the model `failed`, on ONNX
Runtime, until an operator asks for a rebuild. Serving engines run at a low NVTX verbosity
(`nvtx_verbosity` in the state; engines.runtimes.tensorrt).
Engines built by `edge-agent rebuild` in another process are noticed by a watcher and adopted alike.

By job: agent.lifecycle.state (the published state), .builds (jobs), .swap (load, hot swap, refused
plans, the watcher); this module opens models, reloads them and publishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.lifecycle.builds import Delegate, Jobs
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.job import resolved_settings
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import OrtOnly, engine_target, open_ort
from agent.lifecycle.state import TRANSITIONS, ModelEngine, StatePublisher, payload_of
from agent.lifecycle.swap import HotSwap, refused_error, refused_reason
from engines.build.compat import check, refusals
from engines.errors import EngineError
from engines.manifest import Manifest
from engines.runtimes.base import Backend, PlanRefusedError
from engines.store import EngineStore

log = logging.getLogger(__name__)

Swapper = Callable[[str, Backend], None]


class EngineManager(Jobs, HotSwap):
    def __init__(
        self,
        cfg: AgentConfig,
        publish: StatePublisher,
        swap: Swapper,
        agent_version: str,
        frames_for: Callable[[str], FrameTap | None] = lambda _m: None,
        watch_interval_s: float = 2.0,
        delegate: Delegate | None = None,
        serve: bool = True,
        gpu: int | None = None,
        build_gate: threading.Lock | None = None,
    ) -> None:
        self.cfg = cfg
        # Pipeline shards (agent.shards): a shard serves plans and hands every rebuild to the supervisor
        # (`delegate`); the supervisor builds and gates but serves nothing (`serve` False: it loads no plan
        # and opens no ONNX Runtime session; each shard's watcher swaps in what it built).
        self._delegate = delegate
        self._serve = serve
        # One manager per GPU model of a box with several (agent.shards): fingerprints of GPU `gpu` (NVML /
        # nvidia-smi numbering), builds on it; `build_gate` makes the managers' jobs run one at a time.
        self._gpu = gpu
        self._build_gate = build_gate
        self._publish = publish
        self._swap = swap
        self._frames_for = frames_for
        self._version = agent_version
        self._watch_interval = watch_interval_s
        self._store: EngineStore | None = None
        self._models: dict[str, ModelEngine] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_start: list[str] = []  # models in fallback: their jobs start with the pipeline

    @property
    def store(self) -> EngineStore:
        if self._store is None:
            # Raises StoreError naming engine_dir and the OS reason: a start-up error, by design.
            self._store = EngineStore(self.cfg.engine_dir)
        return self._store

    @property
    def models(self) -> list[str]:
        return list(self._models)

    # ---- start-up ------------------------------------------------------------------------------
    def open(self, name: str, cfg: AgentConfig | None = None, ctx: ModelContext | None = None) -> Backend:
        """The backend to serve `name` with now; a job starts in the background (start_pending) when one
        is needed. `cfg`: a reloaded configuration not yet in effect (see detach/retire); `ctx`: the model
        as the caller resolved it from that configuration (its labels are not read again)."""
        ctx = ctx or ModelContext.from_config(cfg or self.cfg, name)
        target = engine_target(ctx) if self._gpu is None else engine_target(ctx, self._gpu)
        if isinstance(target, OrtOnly):
            return self._ort_only(ctx, target)
        store = self.store
        me = ModelEngine(ctx, target)
        self._models[name] = me
        self._set(me, state="checking", backend="onnxruntime")
        settings, report, why = resolved_settings(ctx, target.api)
        if settings is None:
            return self._fallback(me, [why])
        if ctx.cfg.engine_file is not None:  # then checked like any engine: refused (with why) if unfit
            problem = self._import(name, ctx.cfg.engine_file)
            if problem:
                return self._fallback(me, [problem])
        if report is not None:
            self._set(me, validation=report.state())
        result = check(store, name, settings, target.fingerprint)
        with me.lock:
            me.seen = self._listing(name)
        if not result.ok:
            m = result.manifest
            refused = refusals(m, result.spec.fingerprint) if m and result.spec and m.key == result.key else 0
            with me.lock:
                me.refusals = refused
            if refused >= 2 and m is not None:  # refused again after its rebuild, before this start
                return self._refused_on_record(me, m, refused, result.reasons)
            return self._fallback(me, result.reasons)
        return self._serve_fitting(me, result.key)

    def _ort_only(self, ctx: ModelContext, target: OrtOnly) -> Backend:
        """A model no engine is made for: ONNX Runtime serves (where this process serves at all)."""
        backend = open_ort(ctx) if self._serve else None
        self._publish(
            ctx.name,
            payload_of(
                state="ready",
                backend="onnxruntime" if backend is None else backend.name,
                precision="fp32" if backend is None else backend.precision,
                reasons=[] if target.note.startswith("backend onnxruntime") else [target.note],
            ),
        )
        return backend  # type: ignore[return-value]  # None only where nothing is served

    def _serve_fitting(self, me: ModelEngine, key: str) -> Backend:
        """The stored engine `key` fits: loaded and served (the supervisor of shards only says so)."""
        if not self._serve:
            self._set(me, state="ready", backend="tensorrt", key=key, reasons=[])
            return None  # type: ignore[return-value]
        try:
            engine = self._load(me, key)
        except PlanRefusedError as exc:  # recorded; its rebuild starts with the pipeline
            return self._fallback(me, [refused_reason(exc)])
        if engine is not None:
            self._set_loaded(me, engine, key, reasons=[])
            return engine
        return open_ort(me.ctx)  # a fitting engine this device cannot run: _load published why

    def _import(self, name: str, engine_file: Path) -> str | None:
        """models.M.engine_file into the store; why it could not be, or None."""
        try:
            key, written = self.store.import_engine(name, engine_file)
        except EngineError as exc:
            return f"engine_file {engine_file}: {exc}"
        if written:
            log.info("model %s: engine %s imported from %s", name, key, engine_file)
        return None

    def _fallback(self, me: ModelEngine, reasons: list[str]) -> Backend:
        """ONNX Runtime serves while a job makes an engine."""
        if not self._serve:
            self._set(me, state="fallback", backend="onnxruntime", reasons=reasons, key=None, loaded=False)
            self._pending_start.append(me.name)
            return None  # type: ignore[return-value]
        backend = open_ort(me.ctx)
        log.warning(
            "model %s: %s; ONNX Runtime serves (fallback) while an engine is made",
            me.name,
            "; ".join(reasons),
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
        self._pending_start.append(me.name)
        return backend

    def _refused_on_record(self, me: ModelEngine, m: Manifest, refused: int, reasons: list[str]) -> Backend:
        """Start-up with an engine whose plans TensorRT refused `refused` times in a row (its manifest says
        so): ONNX Runtime serves, state `failed`, no job until an operator asks for a rebuild."""
        backend = open_ort(me.ctx) if self._serve else None
        record = m.build.refused_at_load or {}
        error = refused_error(str(m.key), refused, record.get("error") or "no reason")
        log.error("model %s: %s", me.name, error)
        self._set(
            me,
            state="failed",
            backend="onnxruntime" if backend is None else backend.name,
            precision="fp32" if backend is None else backend.precision,
            reasons=reasons,
            key=None,
            loaded=False,
            error=error,
        )
        return backend  # type: ignore[return-value]

    def start(self) -> None:
        """Jobs for models in fallback start now (their pipelines run: frames can be tapped)."""
        self.start_pending()
        self._thread = threading.Thread(target=self._watch, name="engine-watch", daemon=True)
        self._thread.start()

    def start_pending(self) -> None:
        pending, self._pending_start = self._pending_start, []
        for name in pending:
            if name in self._models:
                # A refused plan is rebuilt under the same key: forced.
                self.rebuild(name, force=self._models[name].refusals > 0)

    # ---- reload ----------------------------------------------------------------------------------
    def detach(self, name: str) -> ModelEngine | None:
        """Take a model's lifecycle out (its job keeps running) before reopening it with a new config;
        give it back with attach() if the reopen fails, or end it with retire()."""
        self._pending_start = [n for n in self._pending_start if n != name]
        return self._models.pop(name, None)

    def attach(self, name: str, me: ModelEngine | None) -> None:
        if me is not None:
            self._models[name] = me

    def retire(self, me: ModelEngine | None) -> None:
        """A detached lifecycle that is not coming back: its job is killed, its late news dropped."""
        if me is None:
            return
        with me.lock:
            me.retired = True
            job = me.job
        if job is not None:
            job.kill()

    def reconfigure(self, cfg: AgentConfig) -> None:
        """The reloaded configuration is now in effect (after every model in it was opened)."""
        self.cfg = cfg

    def republish(self) -> None:
        """Every model's engine state again (after the MQTT connection was replaced)."""
        for me in list(self._models.values()):
            with me.lock:
                state = me.state.to_payload()
            if state:
                self._publish(me.name, state)

    def summary(self, name: str) -> str:
        """Engine news for the service status line: "building 40%", "fallback", "failed"."""
        me = self._models.get(name)
        if me is None:
            return ""
        with me.lock:
            state, progress = me.state.state, me.state.progress
        if state == "building" and progress is not None and progress.total:
            return f"building engine: {progress.phase} {progress.step}/{progress.total}"
        return "building engine" if state == "building" else ("engine failed" if state == "failed" else "")

    def close(self) -> None:
        self._stop.set()
        for me in list(self._models.values()):
            with me.lock:
                job = me.job
            if job is not None:
                job.kill()  # the store keeps the previous engine intact; temp files go at the next build
        if self._thread is not None:
            self._thread.join(2.0)

    # ---- state -----------------------------------------------------------------------------------
    def _set(self, me: ModelEngine, **fields: Any) -> None:
        """Update and publish under the model's lock, so retained states reach MQTT in order."""
        with me.lock:
            new = fields.get("state")
            old = me.state.state
            if new is not None and new != old and new not in TRANSITIONS[old]:
                log.error("model %s: engine state %s -> %s is not a planned transition", me.name, old, new)
            me.state.update(**fields)
            if me.state.fingerprint is None:
                me.state.update(fingerprint=me.target.fingerprint.manifest_dict())
            if not me.retired:
                self._publish(me.name, me.state.to_payload())
