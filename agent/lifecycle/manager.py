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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.lifecycle.calibration import (
    CalibrationError,
    FrameTap,
    capture_calibration_set,
    capture_from_frames,
    frames_to_capture,
)
from agent.lifecycle.job import JobRequest, JobResult, job_command, resolved_settings, start_job
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget, OrtOnly, engine_target, open_ort, warm_up
from engines.buildproc import ChildProcess
from engines.compat import check, refusal_record, refusals
from engines.errors import BuildLockedError, EngineError
from engines.lock import BuildLock
from engines.manifest import Manifest
from engines.plan import check_precision, needs_calibration_frames, needs_gate, plan_steps
from engines.runtimes.base import Backend, BackendError, PlanRefusedError
from engines.runtimes.tensorrt import TensorRTBackend
from engines.store import EngineStore

log = logging.getLogger(__name__)

# Seconds to wait for the model's build lock to record a refused plan in its manifest.
REFUSAL_LOCK_WAIT_S = 5.0

StatePublisher = Callable[[str, dict[str, Any]], None]
Swapper = Callable[[str, Backend], None]
Delegate = Callable[[str, bool, "str | None", "list[str] | None"], bool]  # rebuild(name, force, prec, why)

# Allowed moves of the engine state; anything else is a bug (logged, still published).
TRANSITIONS: dict[str | None, frozenset[str]] = {
    None: frozenset({"checking"}),
    "checking": frozenset({"ready", "fallback", "failed"}),  # failed: its plan was refused in a row
    "fallback": frozenset({"building"}),
    "building": frozenset({"building", "ready", "failed"}),
    "ready": frozenset({"building", "ready"}),
    "failed": frozenset({"building", "ready"}),
}


@dataclass
class ModelEngine:
    """One model's engine lifecycle; every field is read and written under `lock`."""

    ctx: ModelContext
    target: EngineTarget
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: dict[str, Any] = field(default_factory=dict)
    job: ChildProcess | None = None
    busy: bool = False  # a job (capture, child, adoption) is under way
    seen: tuple = ()  # engine dir listing at the last check, to notice builds made by other processes
    last_progress_pub: float = 0.0
    phases_logged: set = field(default_factory=set)  # progress phases of the job under way, said once
    retired: bool = False  # replaced or removed by a reload: its job's late news is dropped
    refusals: int = 0  # plans TensorRT refused at load in a row (one that loads: 0); 2+: no auto rebuild
    requested: str | None = None  # precision of the last job: a refused plan is rebuilt as it was asked

    @property
    def name(self) -> str:
        return self.ctx.name


class EngineManager:
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
    def open(self, name: str, cfg: AgentConfig | None = None) -> Backend:
        """The backend to serve `name` with now; a job starts in the background (start_pending) when one
        is needed. `cfg`: a reloaded configuration not yet in effect (see detach/retire)."""
        ctx = ModelContext.from_config(cfg or self.cfg, name)
        target = engine_target(ctx) if self._gpu is None else engine_target(ctx, self._gpu)
        if isinstance(target, OrtOnly):
            backend = open_ort(ctx) if self._serve else None
            self._publish(
                name,
                {
                    "state": "ready",
                    "backend": "onnxruntime" if backend is None else backend.name,
                    "precision": "fp32" if backend is None else backend.precision,
                    "reasons": [] if target.note.startswith("backend onnxruntime") else [target.note],
                },
            )
            return backend  # type: ignore[return-value]  # None only where nothing is served
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
        if not self._serve:
            self._set(me, state="ready", backend="tensorrt", key=result.key, reasons=[])
            return None  # type: ignore[return-value]
        try:
            engine = self._load(me, result.key)
        except PlanRefusedError as exc:  # recorded; its rebuild starts with the pipeline
            return self._fallback(me, [_refused_reason(exc)])
        if engine is not None:
            self._set(
                me,
                state="ready",
                backend=engine.name,
                precision=engine.precision,
                key=result.key,
                loaded=True,
                reasons=[],
                nvtx_verbosity=engine.nvtx_verbosity,
            )
            return engine
        return open_ort(ctx)  # a fitting engine this device cannot run: _load published why

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
        error = _refused_error(str(m.key), refused, m.build["refused_at_load"].get("error") or "no reason")
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
                state = dict(me.state)
            if state:
                self._publish(me.name, state)

    def summary(self, name: str) -> str:
        """Engine news for the service status line: "building 40%", "fallback", "failed"."""
        me = self._models.get(name)
        if me is None:
            return ""
        with me.lock:
            state, progress = me.state.get("state"), me.state.get("progress")
        if state == "building" and isinstance(progress, dict) and progress.get("total"):
            return f"building engine: {progress.get('phase')} {progress.get('step')}/{progress.get('total')}"
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

    # ---- jobs ----------------------------------------------------------------------------------
    def rebuild(
        self, name: str, force: bool = False, precision: str | None = None, reasons: list[str] | None = None
    ) -> bool:
        """Start a job for `name` in the background; False when one is already under way. `reasons`: why,
        for the published state (kept from before when None)."""
        if self._delegate is not None:  # a shard: the supervisor's manager builds (once, for every shard)
            return self._delegate(name, force, precision, reasons)
        me = self._models[name]
        if me.retired:
            return False
        requested = check_precision(precision or me.ctx.cfg.precision, "precision")
        with me.lock:
            if me.busy or self._stop.is_set():
                return False
            me.busy = True
            me.requested = requested
            me.phases_logged = set()
        why = {} if reasons is None else {"reasons": reasons}
        self._set(me, state="building", progress=None, error=None, **why)
        request = JobRequest(me.ctx, requested, force, 0.0, self._version)
        threading.Thread(target=self._run_job, args=(me, request), name=f"job-{name}", daemon=True).start()
        return True

    def _run_job(self, me: ModelEngine, request: JobRequest) -> None:
        try:
            result = self._job(me, request)
        except Exception as exc:  # never leave the model `building` forever
            log.exception("model %s: engine job failed", me.name)
            result = JobResult.failed(request.precision, str(exc), type(exc).__name__)
        finally:
            with me.lock:
                me.job, me.busy = None, False
                me.seen = self._listing(me.name)
        if self._stop.is_set() or me.retired:
            return
        if not result.ok:
            log.error(
                "model %s: engine job failed: %s (still serving %s)",
                me.name,
                result.error,
                me.state.get("backend"),
            )
            self._set(me, state="failed", error=result.error or "job failed", progress=None)
            return
        log.info("model %s: %s", me.name, result.message)
        self._set(
            me,
            build_s=result.build_s if result.built else me.state.get("build_s"),
            reasons=result.reasons or me.state.get("reasons", []),
            validation=result.state_validation or me.state.get("validation"),
            tried=result.tried,
            progress=None,
            error=None,
        )
        if result.key is not None:
            self._adopt(me, result.key)

    def _job(self, me: ModelEngine, request: JobRequest) -> JobResult:
        """The whole job under the model's build lock: frames, gate and build (the child inherits it). A
        lock held by another process (`edge-agent rebuild`) fails the job at once, naming the holder; one
        held by this process (the manager of another GPU model building the same model) is waited for."""
        try:
            lock = self._lock(me, request.precision)
        except EngineError as exc:
            return JobResult.failed(request.precision, f"model {me.name!r}: {exc}", type(exc).__name__)
        with lock:
            steps = plan_steps(request.precision, me.target.api)
            if needs_gate(steps):
                self._ensure_frames(me, calibration=needs_calibration_frames(steps))
            if self._stop.is_set():
                return JobResult.failed(request.precision, "stopped", "Stopped")
            request = replace(request, lock_fd=lock.fd)
            if self._build_gate is None:
                return self._run_child(me, request)
            with self._build_gate:  # another GPU model's build first (builds run one at a time)
                return self._run_child(me, request)

    def _lock(self, me: ModelEngine, precision: str) -> BuildLock:
        command = job_command(me.name, precision)
        try:
            lock = self.store.lock(me.name, wait_s=0, command=command)
            lock.acquire()
        except BuildLockedError as exc:
            if exc.pid != os.getpid():
                raise
            lock = self.store.lock(me.name, wait_s=None, command=command)  # a sibling manager's job
            lock.acquire()
        return lock

    def _run_child(self, me: ModelEngine, request: JobRequest) -> JobResult:
        on_event = lambda ev: self._on_event(me, ev)  # noqa: E731
        if self._gpu is None:
            job = start_job(request, on_event)
        else:
            job = start_job(
                request, on_event, {"CUDA_VISIBLE_DEVICES": str(self._gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            )
        with me.lock:
            me.job = job
        return JobResult.from_event(job.wait())

    def _ensure_frames(self, me: ModelEngine, calibration: bool) -> None:
        """The frames the gate (and INT8) need when missing: from the model's running pipeline (its
        cameras are never opened a second time), or from its configured folder."""
        counts = frames_to_capture(me.ctx, calibration)
        if counts is None:
            return
        samples, held_out = counts
        cal = me.ctx.cfg.calibration
        if cal.source == "folder":
            capture_calibration_set(self.cfg, me.name, samples=samples, held_out=held_out, progress=False)
            return
        tap = self._frames_for(me.name)
        if tap is None:
            raise CalibrationError(
                f"model {me.name}: no calibration set; run edge-agent calibrate --model {me.name}"
            )
        total = samples + held_out
        cams = max(1, sum(1 for c in self.cfg.cameras.values() if c.model == me.name and c.enabled))
        timeout = 60.0 + 3.0 * total / cams * cal.interval_s
        log.info(
            "model %s: capturing %d frames from its pipeline (%d held out for the gate)",
            me.name,
            total,
            held_out,
        )
        t0 = time.monotonic()
        frames = tap.frames(total, cal.interval_s, timeout, self._stop)
        cset = capture_from_frames(me.ctx, self._counted(me, frames, total), samples, held_out)
        log.info(
            "model %s: captured %d of %d frames from its pipeline in %.0f s (%d held out for the gate)",
            me.name,
            cset.manifest["samples"] + cset.manifest["held_out_count"],
            total,
            time.monotonic() - t0,
            cset.manifest["held_out_count"],
        )

    def _counted(self, me: ModelEngine, frames: Iterator[Any], total: int) -> Iterator[Any]:
        for n, item in enumerate(frames, 1):
            self._on_event(me, {"event": "progress", "phase": "capture frames", "step": n, "total": total})
            yield item

    def _on_event(self, me: ModelEngine, ev: dict[str, Any]) -> None:
        if ev.get("event") != "progress":
            return
        now = time.monotonic()
        phase = ev.get("phase")
        with me.lock:
            first = phase not in me.phases_logged
            me.phases_logged.add(phase)
            publish = now - me.last_progress_pub >= 0.5  # a progress state at most twice a second
            if publish:
                me.last_progress_pub = now
        progress = {"phase": phase, "step": ev.get("step"), "total": ev.get("total")}
        # The log gets each phase of a job once, as it starts (frame captures: a line before and one after,
        # in _ensure_frames); every step is in the published state, and in the log at DEBUG.
        if first and not str(phase).startswith("capture"):
            log.info("model %s: %s %s/%s", me.name, phase, progress["step"], progress["total"])
        elif publish:
            log.debug("model %s: %s %s/%s", me.name, phase, progress["step"], progress["total"])
        if publish:
            self._set(me, state="building", progress=progress)

    # ---- serving an engine ---------------------------------------------------------------------
    def _adopt(self, me: ModelEngine, key: str) -> None:
        """Load engine `key`, warm it up and hand it to the worker; on failure the current backend stays.
        A plan TensorRT refuses is rebuilt (once in a row: _load)."""
        if not self._serve:  # the supervisor of shards: each shard's watcher loads and swaps it
            manifest = self.store.manifest(me.name, key)
            sha = manifest.build.get("plan_sha256") if manifest else None
            precision = manifest.build.get("precision") if manifest else None
            self._set(me, state="ready", backend="tensorrt", key=key, plan_sha256=sha, precision=precision)
            return
        try:
            engine = self._load(me, key)
        except PlanRefusedError as exc:
            if not me.retired and not self.rebuild(
                me.name, force=True, precision=me.requested, reasons=[_refused_reason(exc)]
            ):
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
        self._set(
            me,
            state="ready",
            backend=engine.name,
            precision=engine.precision,
            key=key,
            loaded=True,
            nvtx_verbosity=engine.nvtx_verbosity,
        )

    def _load(self, me: ModelEngine, key: str) -> TensorRTBackend | None:
        """Engine `key` loaded and warmed up. None where it cannot run here (published: `ready`, `loaded:
        false` and why) or where TensorRT refused its plan again after a rebuild (published: `failed`).
        PlanRefusedError when TensorRT refused the plan and a rebuild is due (recorded in its manifest)."""
        manifest = self.store.manifest(me.name, key)
        plan_sha = manifest.build.get("plan_sha256") if manifest else None
        engine = TensorRTBackend(
            self.store,
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
        with me.lock:
            me.refusals = 0
        self._set(me, plan_sha256=plan_sha, load_error=None)
        return engine

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
        error = _refused_error(key, n, exc.reason)
        log.error("model %s: %s", me.name, error)
        self._set(
            me,
            state="failed",
            plan_sha256=plan_sha,
            load_error=str(exc),
            reasons=[_refused_reason(exc)],
            error=error,
            progress=None,
        )
        return False

    def _record_refusal(self, me: ModelEngine, key: str, plan_sha: str, record: dict[str, Any]) -> None:
        try:
            with self.store.lock(me.name, wait_s=REFUSAL_LOCK_WAIT_S):
                written = self.store.set_refused_at_load(me.name, key, plan_sha, record)
        except EngineError as exc:  # the lock held by a build, a read-only disk: the rebuild still happens
            log.warning("model %s: the refused plan of engine %s is not recorded: %s", me.name, key, exc)
            return
        if written is None:
            log.info("model %s: engine %s was rebuilt meanwhile; the refusal is not recorded", me.name, key)

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
        with me.lock:
            if me.busy:
                return
            listing = self._listing(me.name)
            if listing == me.seen:
                return
            me.seen = listing
            known_sha = me.state.get("plan_sha256")
        settings, report, _ = resolved_settings(me.ctx, me.target.api)
        if settings is None:
            return
        result = check(self.store, me.name, settings, me.target.fingerprint)
        manifest = result.manifest
        if not result.ok or manifest is None or manifest.build.get("plan_sha256") == known_sha:
            return
        log.info("model %s: new engine %s found (built by another process)", me.name, result.key)
        self._set(
            me,
            build_s=manifest.build.get("build_s"),
            reasons=[],
            validation=report.state() if report else me.state.get("validation"),
        )
        self._adopt(me, result.key)

    # ---- state -----------------------------------------------------------------------------------
    def _set(self, me: ModelEngine, **fields: Any) -> None:
        """Update and publish under the model's lock, so retained states reach MQTT in order."""
        with me.lock:
            new = fields.get("state")
            old = me.state.get("state")
            if new is not None and new != old and new not in TRANSITIONS[old]:
                log.error("model %s: engine state %s -> %s is not a planned transition", me.name, old, new)
            me.state.update(fields)
            me.state.setdefault("fingerprint", me.target.fingerprint.manifest_dict())
            if not me.retired:
                self._publish(me.name, dict(me.state))


def _refused_reason(exc: PlanRefusedError) -> str:
    return f"TensorRT refused this plan at load: {exc.reason}"


def _refused_error(key: str, refusals: int, reason: str) -> str:
    times = "twice" if refusals == 2 else f"{refusals} times in a row"
    return (
        f"TensorRT refused the plan of engine {key} at load {times}, the last one just rebuilt ({reason}); "
        "ONNX Runtime serves, and no more rebuilds start by themselves: send the rebuild command or run "
        "`edge-agent rebuild` once TensorRT is fixed"
    )
