"""The daemon's side of the engine lifecycle: what serves each model, jobs in a child, hot swap.

Per model, one state machine (the retained MQTT engine state, DESIGN.md):

    checking --fits, loads--> ready
    checking --no fitting engine / not validated / plan refused--> fallback --job starts--> building
    checking | building --built, cannot run on this device--> fallback (ONNX Runtime serves; no job)
    checking --plan refused in a row before (on record)--> failed
    ready | failed | fallback --rebuild--> building --job ok--> ready   (--job failed--> failed)
    building | ready | failed --plan refused at load--> building (rebuild)   (--refused again--> failed)

`state` is the engine's; `backend` names the runtime serving detections now. While no engine serves,
ONNX Runtime does. A job (agent.lifecycle.job) runs in a child process; before it starts, the frames
the gate (and INT8) needs are taken from the model's running pipeline (FrameTap), never from a second
camera session. A finished engine is loaded and warmed up here; only then is it handed to the model's
worker, which switches at the top of its next batch. On a machine that can build but not run the engine
(TensorRT-RTX without a supported GPU) the state says what serves: `fallback`, ONNX Runtime's backend and
precision, `loaded: false` and the reason (the engine is kept, not rebuilt).
A plan TensorRT itself refuses at load (PlanRefusedError: a TensorRT patch the fingerprint missed) is
recorded as such in its manifest (build.refused_at_load: `edge-agent check` and the next start say
"rebuild") and rebuilt once, forced; a rebuilt plan refused again leaves the model `failed`, on ONNX
Runtime, until an operator asks for a rebuild. Serving engines run at a low NVTX verbosity
(`nvtx_verbosity` in the state; engines.runtimes.tensorrt).
Engines built by `edge-agent rebuild` in another process are noticed by a watcher and adopted alike.

Composed, by the process's role (agent.lifecycle.roles): the state board (agent.lifecycle.state), the
jobs (agent.lifecycle.builds over agent.lifecycle.runner, or a shard's delegate), the serving side
(agent.lifecycle.swap: Adopter, or the supervisor's Announcer) and the store watcher
(agent.lifecycle.watch); this module opens models, reloads them and publishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from agent.config import AgentConfig
from agent.lifecycle.builds import Builds, PipelineFrames
from agent.lifecycle.cache_setup import CacheSetup
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.job import resolved_settings
from agent.lifecycle.model import ModelContext
from agent.lifecycle.roles import DEVICE, Delegate, DeviceRole, Role, ShardRole, SupervisorRole
from agent.lifecycle.runner import JobRunner
from agent.lifecycle.serving import OrtOnly, engine_target
from agent.lifecycle.state import TRANSITIONS, ModelEngine, StateBoard, StatePublisher, payload_of
from agent.lifecycle.swap import Adopter, Announcer, Serving, Swapper, refused_error, refused_reason
from agent.lifecycle.watch import StoreWatcher, listing
from engines.build.compat import check, refusals
from engines.errors import EngineError
from engines.manifest import Manifest
from engines.precision import Precision
from engines.runtimes.base import Backend, PlanRefusedError
from engines.store import EngineStore

__all__ = ["TRANSITIONS", "EngineManager", "ModelEngine"]

log = logging.getLogger(__name__)


class EngineManager:
    def __init__(
        self,
        cfg: AgentConfig,
        publish: StatePublisher,
        swap: Swapper,
        agent_version: str,
        frames_for: Callable[[str], FrameTap | None] = lambda _m: None,
        watch_interval_s: float = 2.0,
        role: Role = DEVICE,
    ) -> None:
        self.cfg = cfg
        self.role = role
        self._store: EngineStore | None = None
        self._models: dict[str, ModelEngine] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_start: list[str] = []  # models in fallback: their jobs start with the pipeline
        self._board = StateBoard(publish)
        self.shared_cache = CacheSetup(lambda: self.cfg)  # engines.cache, for this process's own jobs
        self.origins: dict[tuple[str, str], str] = {}  # (model, key) -> built | cache, of this process
        self._serving: Serving = (
            Announcer(self._store_now, self._board)
            if isinstance(role, SupervisorRole)
            else Adopter(self._store_now, self._board, swap, self.rebuild)
        )
        # A shard's rebuilds are its supervisor's: built once for every shard.
        self._jobs: Delegate = (
            role.delegate if isinstance(role, ShardRole) else self._own_jobs(role, agent_version, frames_for)
        )
        self._watcher = StoreWatcher(
            self._store_now, self._board, self._serving.adopt, self._watched, watch_interval_s, self._stop,
            self.origins,
        )

    def _own_jobs(
        self, role: DeviceRole | SupervisorRole, version: str, frames_for: Callable[[str], FrameTap | None]
    ) -> Delegate:
        """This process's own jobs (agent.lifecycle.builds), as rebuild(name, force, precision, reasons)."""
        frames = PipelineFrames(lambda: self.cfg, frames_for, self._stop)
        runner = JobRunner(self._store_now, frames, version, stop=self._stop, shared=self.shared_cache)
        runner.origins = self.origins
        if isinstance(role, SupervisorRole):
            runner.env, runner.build_gate = role.job_env(), role.build_gate
        builds = Builds(runner, self._board, self._serving.adopt, self._listing)

        def rebuild(name: str, force: bool, precision: Precision | None, reasons: list[str] | None) -> bool:
            return builds.rebuild(self._models[name], force, precision, reasons)

        return rebuild

    @property
    def store(self) -> EngineStore:
        if self._store is None:
            # Raises StoreError naming engine_dir and the OS reason: a start-up error, by design.
            self._store = EngineStore(self.cfg.engine_dir)
        return self._store

    def _store_now(self) -> EngineStore:
        return self.store

    def _listing(self, name: str) -> tuple:
        return listing(self.store, name)

    def _watched(self) -> list[ModelEngine]:
        return list(self._models.values())

    @property
    def models(self) -> list[str]:
        return list(self._models)

    # ---- start-up ------------------------------------------------------------------------------
    def open(self, name: str, cfg: AgentConfig | None = None, ctx: ModelContext | None = None) -> Backend:
        """The backend to serve `name` with now; a job starts in the background (start_pending) when one
        is needed. `cfg`: a reloaded configuration not yet in effect (see detach/retire); `ctx`: the model
        as the caller resolved it from that configuration (its labels are not read again)."""
        backend = self._open(name, cfg, ctx)
        if backend is None:
            raise RuntimeError(f"model {name}: the supervisor of shards serves nothing (check(), not open())")
        return backend

    def check(self, name: str, cfg: AgentConfig | None = None, ctx: ModelContext | None = None) -> None:
        """open() for a process that serves nothing (the supervisor of shards): the engine is checked,
        its state published, a job starts with start_pending when one is needed."""
        self._open(name, cfg, ctx)

    def _open(self, name: str, cfg: AgentConfig | None, ctx: ModelContext | None) -> Backend | None:
        ctx = ctx or ModelContext.from_config(cfg or self.cfg, name)
        role = self.role
        gpu = role.gpu if isinstance(role, SupervisorRole) else None
        target = engine_target(ctx) if gpu is None else engine_target(ctx, gpu)
        if isinstance(target, OrtOnly):
            return self._ort_only(ctx, target)
        store = self.store
        me = ModelEngine(ctx, target)
        self._models[name] = me
        self._board.set(me, state="checking", backend="onnxruntime")
        settings, report, why = resolved_settings(ctx, target.api)
        if settings is None:
            return self._fallback(me, [why])
        if ctx.cfg.engine_file is not None:  # then checked like any engine: refused (with why) if unfit
            problem = self._import(name, ctx.cfg.engine_file)
            if problem:
                return self._fallback(me, [problem])
        if report is not None:
            self._board.set(me, validation=report.state())
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
        with me.lock:  # published with the state fitting() sets
            me.state.update(origin=self.origins.get((name, result.key), "store"))
        try:
            return self._serving.fitting(me, result.key)
        except PlanRefusedError as exc:  # recorded; its rebuild starts with the pipeline
            return self._fallback(me, [refused_reason(exc)])

    def _ort_only(self, ctx: ModelContext, target: OrtOnly) -> Backend | None:
        """A model no engine is made for: ONNX Runtime serves (where this process serves at all)."""
        backend = self._serving.ort(ctx)
        self._board.publish(
            ctx.name,
            payload_of(
                state="ready",
                backend="onnxruntime" if backend is None else backend.name,
                precision="fp32" if backend is None else backend.precision,
                reasons=[] if target.note.startswith("backend onnxruntime") else [target.note],
            ),
        )
        return backend

    def _import(self, name: str, engine_file: Path) -> str | None:
        """models.M.engine_file into the store; why it could not be, or None."""
        try:
            key, written = self.store.import_engine(name, engine_file)
        except EngineError as exc:
            return f"engine_file {engine_file}: {exc}"
        if written:
            log.info("model %s: engine %s imported from %s", name, key, engine_file)
        return None

    def _fallback(self, me: ModelEngine, reasons: list[str]) -> Backend | None:
        """ONNX Runtime serves (where this process serves) while a job makes an engine."""
        backend = self._serving.ort(me.ctx)
        if backend is None:
            fields = {"reasons": reasons, "key": None, "loaded": False}
            self._board.set(me, state="fallback", backend="onnxruntime", **fields)
        else:
            log.warning(
                "model %s: %s; ONNX Runtime serves (fallback) while an engine is made",
                me.name,
                "; ".join(reasons),
            )
            self._board.set(
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

    def _refused_on_record(
        self, me: ModelEngine, m: Manifest, refused: int, reasons: list[str]
    ) -> Backend | None:
        """Start-up with an engine whose plans TensorRT refused `refused` times in a row (its manifest says
        so): ONNX Runtime serves, state `failed`, no job until an operator asks for a rebuild."""
        backend = self._serving.ort(me.ctx)
        record = m.build.refused_at_load or {}
        error = refused_error(str(m.key), refused, record.get("error") or "no reason")
        log.error("model %s: %s", me.name, error)
        self._board.set(
            me,
            state="failed",
            backend="onnxruntime" if backend is None else backend.name,
            precision="fp32" if backend is None else backend.precision,
            reasons=reasons,
            key=None,
            loaded=False,
            error=error,
        )
        return backend

    def start(self) -> None:
        """Jobs for models in fallback start now (their pipelines run: frames can be tapped)."""
        self.start_pending()
        self._thread = threading.Thread(target=self._watcher.run, name="engine-watch", daemon=True)
        self._thread.start()

    def start_pending(self) -> None:
        pending, self._pending_start = self._pending_start, []
        for name in pending:
            if name in self._models:
                # A refused plan is rebuilt under the same key: forced.
                self.rebuild(name, force=self._models[name].refusals > 0)

    def rebuild(
        self,
        name: str,
        force: bool = False,
        precision: Precision | None = None,
        reasons: list[str] | None = None,
    ) -> bool:
        """Start a job for `name` in the background; False when one is already under way. `reasons`: why,
        for the published state (kept from before when None). A shard's go to its supervisor (once for
        every shard)."""
        return self._jobs(name, force, precision, reasons)

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
        self.shared_cache.refresh()  # a changed engines section ends the waits under the old one

    def republish(self) -> None:
        """Every model's engine state again (after the MQTT connection was replaced)."""
        for me in list(self._models.values()):
            with me.lock:
                state = me.state.to_payload()
            if state:
                self._board.publish(me.name, state)

    def summary(self, name: str) -> str:
        """Engine news for the service status line: "building 40%", "fallback", "failed"."""
        me = self._models.get(name)
        if me is None:
            return ""
        with me.lock:
            state, progress, load_error = me.state.state, me.state.progress, me.state.load_error
        if state == "building" and progress is not None and progress.total:
            return f"building engine: {progress.phase} {progress.step}/{progress.total}"
        if state == "fallback" and load_error:  # built, but this device cannot run it
            return "engine cannot run here, ONNX Runtime serves"
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
        self.shared_cache.close()
