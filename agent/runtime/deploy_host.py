"""The pipeline of this process as the deployment orchestrator's host (agent.deploy.host.DeployHost).

    host = LocalDeployHost(runtime, own=lambda: device.cfg, publish=device.publish_deployment)

- the config's own model sections come from `own()` (the file as loaded or reloaded, no version overlaid);
- live frames: the model's FrameTap (agent.lifecycle.calibration), the frames its pipeline decodes anyway:
  the next `n` it delivers, consecutive ones, never a second camera session;
- the candidate's backend: where the model has a TensorRT target, its engine is built first through the
  lifecycle's job (build lock, timing cache, the precision plan and its gate on frames of the running
  pipeline) into the engine store: a failed build rejects the version, and promote finds the engine
  there. The gate and shadow run on ONNX Runtime sessions of the candidate's ONNX (one thread) all the
  same: an engine runs only once it serves (TensorRT-RTX without a GPU: built, never run; ONNX Runtime
  serves it after promotion, `ready, loaded: false`, as at start);
- the serving backend: a session of its own on what serves now (the running one is not slowed);
- promote: the model is reopened through the engine lifecycle (EngineManager.open with the new section)
  and its worker takes the backend and adapter at the top of its next batch (pipelines.serving): cameras,
  readers and slots stay as they are; a labels file with other names re-routes the cameras' class masks;
- camera health: the runtime's counters (frames out, detections, delivery ages, the worker's errors).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent.config import AgentConfig, ModelConfig
from agent.deploy.errors import DeployError
from agent.deploy.host import CameraHealth, Frame
from agent.lifecycle.builds import PipelineFrames
from agent.lifecycle.calibration import CalibrationError, FrameTap
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.model import DEFAULT_SCORE_THRESHOLD, ModelContext
from agent.lifecycle.runner import JobRunner, LockUnavailable
from agent.lifecycle.serving import EngineTarget, OrtOnly, engine_runs_here, engine_target
from agent.runtime.cameras import CameraRuntime
from engines.runtimes.base import Backend
from engines.runtimes.ort import OrtBackend
from pipelines.models import check_outputs, probe_input
from pipelines.scheduler import ModelWorker

log = logging.getLogger("agent.deploy")
WINDOW_S = 10.0  # camera health: frames and detections per frame over this window
AGES = 16  # camera health: the age p95 of this many last results
DEPLOY_NICE = 19



class ServingRuntime(Protocol):
    """What the host reads and calls of agent.runtime.local.LocalRuntime."""

    cfg: AgentConfig

    @property
    def taps(self) -> dict[str, FrameTap]: ...

    @property
    def workers(self) -> dict[str, ModelWorker]: ...

    @property
    def cameras(self) -> dict[str, CameraRuntime]: ...

    @property
    def engines(self) -> EngineManager: ...

    def serve_model(self, name: str, mcfg: ModelConfig) -> None: ...


def _p95(values: list[float]) -> float | None:
    return round(float(np.percentile(values, 95)), 1) if values else None


class LocalDeployHost:
    def __init__(
        self,
        runtime: ServingRuntime,
        own: Callable[[], AgentConfig],
        publish: Callable[[str, bytes], None],
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.runtime, self._own, self._publish = runtime, own, publish
        self._lock = lock or contextlib.nullcontext()  # the device's reload lock: a swap is not a reload
        self._history: dict[str, deque[tuple[float, int, int]]] = {}  # camera -> (t, frames, detections)

    # ---- the config ----------------------------------------------------------------------------------
    def model_config(self, model: str) -> ModelConfig | None:
        return self._own().models.get(model)

    def score_threshold(self, model: str) -> float:
        cams = self._own().cameras.values()
        scores = [c.min_score for c in cams if c.model == model and c.enabled]
        return min(scores, default=DEFAULT_SCORE_THRESHOLD)

    def engine_dir(self) -> Path | None:
        return Path(self._own().engine_dir)

    def _context(self, model: str, model_cfg: ModelConfig) -> tuple[AgentConfig, ModelContext]:
        """The runtime's config with `model_cfg` in `model`'s place, and the model's context in it."""
        cfg = self.runtime.cfg
        new = cfg.model_copy(update={"models": {**cfg.models, model: model_cfg}})
        return new, ModelContext.from_config(new, model)

    # ---- frames and backends -------------------------------------------------------------------------
    def live_frames(self, model: str, n: int, timeout_s: float) -> list[Frame]:
        tap = self.runtime.taps.get(model)
        if tap is None:
            return []
        out: list[Frame] = []
        try:
            for image, origin in tap.frames(n, interval_s=0.01, timeout_s=timeout_s):
                camera = origin.removeprefix("camera:").rsplit("#", 1)[0]
                out.append((camera, image))
        except CalibrationError as exc:  # a calibration capture holds the tap: no frames now
            log.warning("deployment %s: live frames: %s", model, exc)
        return out

    @contextlib.contextmanager
    def _ort(self, ctx: ModelContext) -> Iterator[Backend]:
        """A check's session: one thread, on the (niced) deployment thread itself."""
        backend = OrtBackend(str(ctx.cfg.onnx), intra_threads=1, inter_threads=1)
        backend.load()
        try:
            yield backend
        finally:
            backend.close()

    def candidate_backend(
        self, model: str, model_cfg: ModelConfig
    ) -> contextlib.AbstractContextManager[Backend]:
        yield_cpu()
        _, ctx = self._context(model, model_cfg)
        target = engine_target(ctx)
        if not isinstance(target, OrtOnly):
            self._build(ctx, target)
        return self._ort(ctx)

    def _build(self, ctx: ModelContext, target: EngineTarget) -> None:
        """The candidate's engine, built now through the lifecycle's job (build lock, timing cache, the
        precision plan and its gate on frames of the running pipeline) into the engine store, where the
        promotion finds it. Checked on ONNX Runtime all the same: an engine runs only once it serves."""
        rt = self.runtime
        frames = PipelineFrames(lambda: rt.cfg, rt.taps.get, threading.Event())
        engines = rt.engines
        runner = JobRunner(lambda: engines.store, frames, lock_wait_s=None, shared=engines.shared_cache)
        runner.origins = engines.origins  # the promotion's reopen says where the engine came from

        def on_event(ev: Any) -> None:
            log.debug("deployment %s: build: %s", ctx.name, ev)

        try:
            result = runner.run(ctx, target.api, ctx.cfg.precision, False, on_event, None, target.fingerprint)
        except (LockUnavailable, CalibrationError) as exc:
            raise DeployError(f"building: {exc}"[:400]) from None
        if not result.ok:
            raise DeployError(f"building: the engine build failed: {result.error}"[:400])
        log.info(
            "deployment %s: engine %s %s; the candidate is checked on ONNX Runtime (%s)",
            ctx.name,
            result.key,
            "pulled from the engine cache" if result.origin == "cache" else "built",
            "it runs here once promoted" if engine_runs_here(target.fingerprint) else "it cannot run here",
        )

    def serving_backend(self, model: str) -> contextlib.AbstractContextManager[Backend]:
        yield_cpu()
        serving = self.runtime.cfg.models.get(model)
        if serving is None:
            raise DeployError(f"model {model} is not served by this process")
        return self._ort(self._context(model, serving)[1])

    # ---- the swap ------------------------------------------------------------------------------------
    def promote(self, model: str, model_cfg: ModelConfig) -> None:
        with self._lock:
            self.runtime.serve_model(model, model_cfg)

    # ---- health and state ----------------------------------------------------------------------------
    def camera_health(self, model: str) -> dict[str, CameraHealth]:
        """Per camera: frames and detections per frame over the last WINDOW_S (since start until samples
        that old exist: a second after a swap is no window), the p95 of the last results' ages at delivery
        (and of the newest one's age now: it grows while a camera stalls), the state ("running" while
        streaming), the worker's errors since start."""
        rt = self.runtime
        worker = rt.workers.get(model)
        errors = worker.errors if worker is not None else 0
        now = time.monotonic()
        out: dict[str, CameraHealth] = {}
        for name, cam in list(rt.cameras.items()):
            if cam.cfg.model != model:
                continue
            total, dets = cam.fps_out.total, cam.detections_out
            # The baseline: the newest sample at least WINDOW_S old, else the start (counts from 0).
            history = self._history.setdefault(name, deque([(-math.inf, 0, 0)]))
            history.append((now, total, dets))
            while len(history) > 1 and now - history[1][0] >= WINDOW_S:
                history.popleft()
            _, total0, dets0 = history[0]
            frames = total - total0
            ages = list(cam.ages_ms)[-AGES:]
            if cam.last_capture_ts is not None:
                ages.append((time.time() - cam.last_capture_ts) * 1000.0)
            out[name] = CameraHealth(
                frames=frames,
                age_p95_ms=_p95(ages),
                detections_per_frame=round((dets - dets0) / frames, 3) if frames else 0.0,
                state="running" if cam.state == "streaming" else cam.state,
                errors=errors,
            )
        return out

    def publish_state(self, model: str, payload: bytes) -> None:
        # A deployment's worker (agent.deploy.manager names it deploy-MODEL) publishes its first stage before
        # it downloads, hashes and verifies: from there on it yields the CPU to the serving pipeline.
        if threading.current_thread().name.startswith("deploy-"):
            yield_cpu()
        self._publish(model, payload)


def yield_cpu() -> None:
    """The calling thread (a deployment's: its gate and shadow inferences run on it, ONNX Runtime's
    intra-op work included with one thread) at the lowest CPU priority: on a busy machine the serving
    model's worker gets the cores first, and the cameras' frames are not dropped for a check."""
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DEPLOY_NICE)


def check_backend(model: str, model_cfg: ModelConfig, ctx: ModelContext, backend: Backend) -> None:
    """One inference through the model's adapter, as a model is opened (agent.runtime.wiring)."""
    adapter = ctx.spec.adapter()
    image = probe_input(backend.input_spec)
    probe = np.zeros((backend.warmup_shape[0], *image.shape[1:]), dtype=backend.input_spec.dtype)
    try:
        check_outputs(model_cfg.format, adapter, backend.infer(probe))
    except ValueError as exc:
        raise DeployError(f"models.{model}.format: {model_cfg.format}: {exc}"[:400]) from None
