"""The stages of one deployment, in order (the Deployer runs `run_job` on the job's own thread):

    downloading  each artifact fetched into the store's staging folder (resumable; progress in the state)
    verifying    the ONNX and labels against the format adapter; installed as models/{model}/{version}
                 (the calibration archive unpacked into its calibration/ folder)
    building     the candidate's backend through the host (the engine lifecycle) beside the serving one
    gating       agreement with the serving model on the last live frames (agent.deploy.gate)
    shadow       both on live frames, nothing published (agent.deploy.shadow)
    watching     promoted (serving.json + the host's hot swap); health watched (agent.deploy.watch)
    serving      kept; older versions pruned to keep_versions

A refusal (the candidate is not good enough: its bytes, its model, a check) ends `rejected`; a fault
(network, build, promotion, an interruption) ends `failed`; the watch's verdict ends `rolled_back`. Either
way nothing of a refused version stays and the serving model never stopped.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import ModelConfig
from agent.deploy.download import DownloadCancelled, FetchPolicy, fetch
from agent.deploy.errors import DeployError, DeviceFault, DownloadError
from agent.deploy.gate import Side, run_gate
from agent.deploy.job import Env, Job
from agent.deploy.oci_ref import is_oci
from agent.deploy.shadow import run_shadow
from agent.deploy.state import (
    BUILDING,
    DOWNLOADING,
    FAILED,
    GATING,
    REJECTED,
    ROLLED_BACK,
    SERVING,
    SHADOW,
    VERIFYING,
    WATCHING,
)
from agent.deploy.verify import verify_model
from agent.deploy.version_files import effective_model, sha256_of
from agent.deploy.watch import watch
from agent.lifecycle.model import resolve_spec
from pipelines.urls import scrubber

log = logging.getLogger("agent.deploy")

FILES = {"onnx": "model.onnx", "labels": "labels.txt", "calibration": "calibration.tar"}


class Cancelled(Exception):
    """The job's cancel event was set (superseded, or the agent stops)."""


class Failed(DeviceFault):
    """A fault, not a verdict on the candidate: the deployment ends `failed`."""


def serving_config(env: Env, model: str, own: ModelConfig) -> ModelConfig:
    """The model config serving `model` now: its serving version's, or the config's own."""
    version = env.store.serving(model)
    if version is None:
        return own
    return effective_model(own, env.store.version_dir(model, version))


class Run:
    def __init__(self, env: Env, job: Job) -> None:
        self.env, self.job = env, job
        self.cfg = env.config()
        self.model, self.version = job.model, job.version
        self.staged: dict[str, Path] = {}
        arts = job.doc.artifacts
        # oci:// URLs hold no credentials (refused there) and their `host:port/repo@` looks like a password.
        urls = " ".join(a.url for a in (arts.onnx, arts.labels, arts.calibration)
                        if a is not None and not is_oci(a.url))
        self.scrub = scrubber(urls)  # every reason passes it: no URL credentials in a state or a line
        self._shown, self._shown_stage = -1.0, ""

    # ---- the whole flow ----------------------------------------------------------------------------------
    def __call__(self) -> None:
        job, env = self.job, self.env
        try:
            self.download()
            self.verify()
            own = env.host.model_config(self.model)
            if own is None:
                raise DeployError(f"model {self.model} is no longer in the config")
            cand_cfg = effective_model(
                own, env.store.version_dir(self.model, self.version), job.doc.precision
            )
            self.check(own, cand_cfg)
            self.promote_and_watch(own, cand_cfg)
        except Cancelled:
            self.cancelled()
        except DeviceFault as exc:  # Failed, or the record that could not be written
            self.end(FAILED, exc.reason)
        except DownloadError as exc:
            self.end(FAILED if exc.retryable else REJECTED, exc.reason)
        except DeployError as exc:
            self.end(REJECTED, exc.reason)
        except Exception as exc:
            # No traceback in the journal: an exception's text may quote an artifact URL (scrubbed here).
            log.error("deployment %s %s: unexpected %s", self.model, self.version, type(exc).__name__)
            self.end(FAILED, f"{job.state.stage}: {type(exc).__name__}: {str(exc)[:300]}")

    def stop_if_cancelled(self) -> None:
        if self.job.cancel.is_set():
            raise Cancelled

    # ---- download and verify -----------------------------------------------------------------------------
    def download(self) -> None:
        doc, env = self.job.doc, self.env
        self.env.move(self.job, DOWNLOADING, "resumed after a restart" if self.job.resumed else None)
        arts = [(k, getattr(doc.artifacts, k)) for k in FILES if getattr(doc.artifacts, k) is not None]
        total = sum(a.size for _, a in arts)
        policy = FetchPolicy.from_config(self.cfg)
        folder = env.store.stage_dir(self.model, self.version)
        done = 0
        for key, art in arts:
            base = done

            def progress(n: int, _size: int, base: int = base) -> None:
                self.progress((base + n) / total)

            try:
                self.staged[key] = fetch(
                    art,
                    folder / FILES[key],
                    policy,
                    progress=progress,
                    cancel=self.job.cancel,
                    field=f"artifacts.{key}",
                )
            except DownloadCancelled:
                raise Cancelled from None
            done += art.size
        self.progress(1.0)

    def progress(self, value: float) -> None:
        """Published when it moved by 5 % or more (a 1 GB download is not 100 retained messages)."""
        state = self.job.state
        if state.stage != self._shown_stage:  # a new stage counts from 0
            self._shown, self._shown_stage = -1.0, state.stage
        state.progress = value
        if value - self._shown >= 0.05 or value >= 1.0 > self._shown:
            self._shown = value
            self.env.publish(state)

    def verify(self) -> None:
        self.stop_if_cancelled()
        self.env.move(self.job, VERIFYING)
        verify_model(self.staged["onnx"], self.staged["labels"], self.job.doc.format)
        # Recorded before the install: an agent killed during it leaves a version a restart must remove.
        self.job.installed_here = not self.env.store.version_dir(self.model, self.version).exists()
        self.env.save(self.job)
        self.env.store.install(
            self.model, self.version, self.staged, self.job.raw, calib_max_bytes=self.cfg.max_artifact_bytes
        )

    # ---- build, gate, shadow -----------------------------------------------------------------------------
    def frames(self, n: int) -> list[np.ndarray]:
        frames = self.env.host.live_frames(self.model, n, self.env.frames_timeout_s)
        if not frames:
            raise Failed(f"{self.job.state.stage}: no live frames from the cameras of {self.model}")
        return [image for _, image in frames]

    def check(self, own: ModelConfig, cand_cfg: ModelConfig) -> None:
        env, doc, host = self.env, self.job.doc, self.env.host
        self.stop_if_cancelled()
        env.move(self.job, BUILDING)
        engine_dir = host.engine_dir()
        serving_cfg = serving_config(env, self.model, own)
        score, iou = host.score_threshold(self.model), cand_cfg.iou_threshold
        with ExitStack() as stack:
            try:
                cand_backend = stack.enter_context(host.candidate_backend(self.model, cand_cfg))
            except DeployError:
                raise
            except OSError as exc:  # the device (a full disk, a lost file), not the candidate
                raise Failed(f"building: {exc.strerror or exc}") from None
            except Exception as exc:
                raise DeployError(f"building: {type(exc).__name__}: {str(exc)[:300]}") from None
            serving = Side(
                stack.enter_context(host.serving_backend(self.model)),
                resolve_spec(self.model, serving_cfg, engine_dir),
            )
            candidate = Side(cand_backend, resolve_spec(self.model, cand_cfg, engine_dir))
            self.stop_if_cancelled()
            env.move(self.job, GATING)
            gate_cfg = self.cfg.gate
            min_agreement = (
                doc.gate.min_agreement if doc.gate.min_agreement is not None else gate_cfg.min_agreement
            )
            result = run_gate(
                serving, candidate, self.frames(doc.gate.frames or gate_cfg.frames), score, iou, min_agreement
            )
            self.job.state.checks["gate"] = result.checks()
            reason = result.reason()
            if reason is not None:
                raise DeployError(reason)
            self.stop_if_cancelled()
            env.move(self.job, SHADOW)
            shadow = run_shadow(
                serving, candidate, self.frames(doc.shadow.frames or self.cfg.shadow.frames), score, iou
            )
            self.job.state.checks["shadow"] = shadow.checks()
            reason = shadow.judge(self.cfg.shadow, doc.shadow.max_latency_ratio)
            if reason is not None:
                raise DeployError(reason)

    # ---- promote, watch ----------------------------------------------------------------------------------
    def promote_and_watch(self, own: ModelConfig, cand_cfg: ModelConfig) -> None:
        env, job, host, store = self.env, self.job, self.env.host, self.env.store
        self.stop_if_cancelled()
        before = host.camera_health(self.model)
        previous = store.serving(self.model)
        prev_cfg = serving_config(env, self.model, own)
        job.state.previous = previous
        store.set_serving(self.model, self.version)
        try:
            host.promote(self.model, cand_cfg)
        except Exception as exc:
            store.set_serving(self.model, previous)
            raise Failed(
                f"promote: {type(exc).__name__}: {str(exc)[:300]}; {previous or 'the config model'} "
                "still serves"
            ) from None
        job.promoted = True
        watch_s = job.doc.watch_s if job.doc.watch_s is not None else self.cfg.watch_s
        env.move(job, WATCHING)

        def on_sample(progress: float, figures: dict[str, Any]) -> None:
            job.state.checks["watch"] = figures
            self.progress(progress)

        try:
            reason, figures = watch(
                lambda: host.camera_health(self.model),
                before,
                self.cfg.watch,
                watch_s,
                job.cancel,
                env.watch_interval_s,
                on_sample,
            )
        except Exception as exc:
            reason, figures = (
                f"watch: {type(exc).__name__}: {str(exc)[:200]}",
                job.state.checks.get("watch", {}),
            )
        job.state.checks["watch"] = figures
        if job.cancel.is_set() and job.cancel_reason is None:
            raise Cancelled  # the agent stops mid-watch: a restart puts the previous version back
        if reason is not None:
            store.set_serving(self.model, previous)
            host.promote(self.model, prev_cfg)
            self.end(ROLLED_BACK, f"{reason}; {previous or 'the config model'} serves again")
            return
        cut = " (watch cut short by a newer deployment)" if job.cancel.is_set() else ""
        notes: list[str] = []
        keep_sha = [sha256_of(Path(own.onnx))] if own.onnx and Path(own.onnx).is_file() else []
        store.prune(
            self.model, self.cfg.keep_versions, host.engine_dir(), keep_onnx_sha256=keep_sha, notes=notes
        )
        self.end(SERVING, ("; ".join(notes) + cut).strip("; ") or None)

    # ---- endings -----------------------------------------------------------------------------------------
    def cancelled(self) -> None:
        if self.job.cancel_reason is None:  # the agent stops: the record stays, a restart decides
            log.info("deployment %s %s: stopped at %s", self.model, self.version, self.job.state.stage)
            return
        self.end(FAILED, f"cancelled: {self.job.cancel_reason}")

    def end(self, stage: str, reason: str | None) -> None:
        job, env = self.job, self.env
        reason = None if reason is None else self.scrub(reason)
        job.state.progress = 1.0 if stage == SERVING else job.state.progress
        installed = env.store.version_dir(self.model, self.version).exists()
        if stage in (REJECTED, FAILED) and job.installed_here and installed and not job.promoted:
            notes: list[str] = []
            try:
                env.store.remove(self.model, self.version, env.host.engine_dir(), notes)
            except DeployError as exc:
                notes.append(exc.reason)
            job.installed_here = False
            for n in notes:
                log.info("deployment %s %s: %s", self.model, self.version, n)
        env.store.discard_staging(self.model, self.version)
        env.move(job, stage, reason, job.state.progress)
