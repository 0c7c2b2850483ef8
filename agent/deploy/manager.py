"""The deployment orchestrator of a device: documents in, one worker per model, states out.

    deployer = Deployer(lambda: cfg.deploy, VersionStore(cfg.deploy.state_dir), host)
    serve = deployer.start(cfg.models)          # what each model serves after a restart; resumes downloads
    deployer.submit(payload, request_id)        # -> {"ok": True, "stage": "accepted", ...} or a refusal
    deployer.rollback("detector", to=None)      # by hand: the previous version (or the config's own model)
    deployer.close()

A document is parsed, its signature checked against the trusted keys (config `deploy`), and its model must
be one of the config before anything is fetched; the stages then run on the model's worker thread
(agent.deploy.flow). One deployment per model at a time: a newer document supersedes a pending one (it
is cancelled and says so); the same version as the one serving is answered "already serving", nothing
rebuilt. Each deployment keeps a record (agent.deploy.job) from which a restart resumes an interrupted
download; any other interrupted stage ends `failed: interrupted` and the previous version serves.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from agent.config import ModelConfig
from agent.config.deploy import DeployConfig
from agent.deploy.document import NAME_RE, document_digest, parse_document
from agent.deploy.errors import DeployError, DeviceFault
from agent.deploy.flow import Run
from agent.deploy.host import DeployHost
from agent.deploy.job import Env, Job
from agent.deploy.signing import verify_document
from agent.deploy.state import (
    ACCEPTED,
    FAILED,
    FINAL,
    RESUMABLE,
    ROLLED_BACK,
    SERVING,
    WATCHING,
    DeploymentState,
)
from agent.deploy.version_files import check_version, effective_model
from agent.deploy.versions import VersionStore

log = logging.getLogger("agent.deploy")


def refused(reason: str, field: str | None = None, **more: Any) -> dict[str, Any]:
    return {"ok": False, "reason": reason, "field": field, **more}


class Deployer:
    def __init__(
        self,
        config: DeployConfig | Callable[[], DeployConfig],
        store: VersionStore,
        host: DeployHost,
        *,
        frames_timeout_s: float = 30.0,
        watch_interval_s: float = 1.0,
    ) -> None:
        live = config if callable(config) else (lambda: config)
        self.env = Env(live, store, host, frames_timeout_s, watch_interval_s)
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    @property
    def store(self) -> VersionStore:
        return self.env.store

    @property
    def host(self) -> DeployHost:
        return self.env.host

    # ---- documents ---------------------------------------------------------------------------------------
    def submit(self, raw: bytes | dict[str, Any], request_id: str | int | None = None) -> dict[str, Any]:
        """Accept a deployment document (an MQTT payload or a file's bytes) or refuse it with a reason."""
        cfg = self.env.config()
        if not cfg.enabled:
            return refused(
                "deployments are off on this device (deploy.enabled: false)", request_id=request_id
            )
        try:
            doc, body = parse_document(raw, "deploy")
        except DeployError as exc:
            named = self._named(raw)
            if named is None:  # no model of the config to show it on: the answer alone says it
                log.warning("deployment refused: %s", exc.reason)
            else:
                self._refused_state(*named, exc.reason, request_id)
            return refused(exc.reason, exc.field, request_id=request_id)
        rid = request_id if request_id is not None else doc.request_id
        if self.host.model_config(doc.model) is None:
            reason = f"model: {doc.model} is not a model of this device's config"
            log.warning("deployment %s %s refused: %s", doc.model, doc.version, reason)
            return refused(reason, "model", request_id=rid)
        try:
            verify_document(body, cfg.trusted_keys, cfg.allow_unsigned)
        except DeployError as exc:
            self._refused_state(doc.model, doc.version, exc.reason, rid)
            return refused(exc.reason, exc.field, request_id=rid)
        with self._lock:
            return self._accept(doc, body, rid)

    def _accept(self, doc: Any, body: dict[str, Any], rid: str | int | None) -> dict[str, Any]:
        digest = document_digest(body)
        active = self.jobs.get(doc.model)
        base = {"model": doc.model, "version": doc.version, "request_id": rid}
        if active is not None and active.running():
            if active.digest == digest:
                return {"ok": True, "stage": active.state.stage, "reason": "already in progress", **base}
        elif self.store.serving(doc.model) == doc.version:
            log.info("deployment %s %s: already serving, nothing to do", doc.model, doc.version)
            return {"ok": True, "stage": SERVING, "reason": "already serving", **base}
        state = DeploymentState(
            doc.model, doc.version, previous=self.store.serving(doc.model), request_id=rid
        )
        job = Job(doc, body, digest, state)
        if active is not None and active.running():
            state.superseded = active.version
            active.cancel_reason = f"superseded by version {doc.version}"
            active.cancel.set()
        self._launch(job, wait_for=active)
        reason = f"supersedes version {state.superseded} (cancelled)" if state.superseded else None
        return {"ok": True, "stage": ACCEPTED, "reason": reason, **base}

    def _launch(self, job: Job, wait_for: Job | None = None, resumed: bool = False) -> None:
        def work() -> None:
            if wait_for is not None and wait_for.thread is not None:
                wait_for.thread.join()  # one deployment per model: the superseded one cleans up first
            if job.cancel.is_set():  # superseded in turn while it waited: it never started
                if job.cancel_reason is not None:
                    self.env.move(job, FAILED, f"cancelled: {job.cancel_reason}")
                return
            if not resumed:
                try:
                    self.env.move(
                        job,
                        ACCEPTED,
                        f"supersedes version {job.state.superseded}" if job.state.superseded else None,
                    )
                except DeviceFault as exc:  # its record cannot be written (a full disk): it ends here
                    self.env.move(job, FAILED, exc.reason)
                    return
            Run(self.env, job)()

        job.thread = threading.Thread(target=work, name=f"deploy-{job.model}", daemon=True)
        self.jobs[job.model] = job
        job.thread.start()

    def _named(self, raw: bytes | dict[str, Any]) -> tuple[str, str | None] | None:
        """(model, version or None) of a refused document whose `model` is one of the config's: its refusal
        goes on that model's state topic too (a version that is no name is not shown)."""
        try:
            data = json.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
        except (ValueError, RecursionError):
            return None
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or self.host.model_config(model) is None:
            return None
        version = data.get("version")
        return model, version if isinstance(version, str) and NAME_RE.fullmatch(version) else None

    def _refused_state(self, model: str, version: str | None, reason: str, rid: str | int | None) -> None:
        """A refused document's reason on the state topic, unless a deployment of the model runs (its state
        stays what the topic shows)."""
        log.warning("deployment %s %s refused: %s", model, version or "(no version)", reason)
        active = self.jobs.get(model)
        if active is not None and active.running():
            return
        state = DeploymentState(
            model, version, "rejected", previous=self.store.serving(model), reason=reason, request_id=rid
        )
        self.env.publish(state)

    # ---- by hand -----------------------------------------------------------------------------------------
    def rollback(self, model: str, to: str | None = None) -> dict[str, Any]:
        """Serve the previous version (or `to`; with no previous one, the config's own model) now."""
        own = self.host.model_config(model)
        if own is None:
            return refused(f"model: {model} is not a model of this device's config", "model")
        with self._lock:
            active = self.jobs.get(model)
            if active is not None and active.running():
                return refused(
                    f"a deployment of {model} ({active.version}, {active.state.stage}) is in progress"
                )
            current = self.store.serving(model)
            previous = self.store.previous(model)
            target = to if to is not None else (previous[0] if previous else None)
            if target is not None:
                problem = check_version(self.store.version_dir(model, target))
                if problem is not None:
                    return refused(f"to: {model} {target} cannot serve: {problem}", "to")
            if target == current:
                return refused(f"{model} serves {target or 'the config model'} already", "to")
            target_cfg = (
                own if target is None else effective_model(own, self.store.version_dir(model, target))
            )
            self.store.set_serving(model, target)
            try:
                self.host.promote(model, target_cfg)
            except Exception as exc:
                self.store.set_serving(model, current)
                return refused(f"rollback: {type(exc).__name__}: {str(exc)[:300]}")
            state = DeploymentState(
                model,
                target,
                ROLLED_BACK,
                previous=current,
                reason=f"rolled back by hand from {current or 'the config model'}",
            )
            state.log()
            self.env.save_state(state)
            self.env.publish(state)
        return {"ok": True, "model": model, "version": target, "previous": current, "stage": ROLLED_BACK}

    # ---- start and stop ----------------------------------------------------------------------------------
    def start(self, models: Iterable[str]) -> dict[str, ModelConfig]:
        """After a restart: settle each model's interrupted deployment, resolve the version to serve
        (sha256 checked again, a broken one falls back and says so) and resume interrupted downloads.
        Returns the model configs to serve for the models that serve a deployed version."""
        serve: dict[str, ModelConfig] = {}
        resume: list[Job] = []
        for model in models:
            own = self.host.model_config(model)
            if own is None:
                continue
            job = self._settle(model)
            if job is not None:
                resume.append(job)
            resolved = self.store.resolve_at_start(model)
            if resolved.version is not None and resolved.path is not None:
                serve[model] = effective_model(own, resolved.path)
            if resolved.note is not None:
                state = DeploymentState(model, resolved.version, FAILED, reason=resolved.note)
                state.log()
                self.env.publish(state)
        with self._lock:
            for job in resume:
                self._launch(job, resumed=True)
        return serve

    def _settle(self, model: str) -> Job | None:
        """The record of `model`'s last deployment: a job to resume, or None (settled here)."""
        try:
            rec = self.env.load(model)
        except DeployError as exc:
            log.warning("deployment record of %s unreadable: %s", model, exc.reason)
            return None
        if rec is None or not isinstance(rec.get("state"), dict):
            return None
        state = DeploymentState.from_fields(rec["state"])
        if state.stage in FINAL or not isinstance(rec.get("document"), dict):
            return None
        try:
            doc, body = parse_document(rec["document"], "record")
            if state.stage in RESUMABLE:
                cfg = self.env.config()
                verify_document(body, cfg.trusted_keys, cfg.allow_unsigned)
                return Job(doc, body, document_digest(body), state, resumed=True)
        except DeployError as exc:
            state.stage, state.reason = FAILED, f"interrupted; not resumed: {exc.reason}"
        self._interrupted(model, state, rec)
        return None

    def _interrupted(self, model: str, state: DeploymentState, rec: dict[str, Any]) -> None:
        was = state.stage
        version = state.version
        if was == WATCHING and version is not None and self.store.serving(model) == version:
            self.store.set_serving(model, state.previous, forget=version)  # then removed below
        installed = version is not None and self.store.version_dir(model, version).exists()
        if (
            rec.get("installed_here")
            and installed
            and version is not None
            and self.store.serving(model) != version
        ):
            try:
                self.store.remove(model, version, self.host.engine_dir())
            except DeployError as exc:
                log.info("deployment %s %s: %s", model, version, exc.reason)
        if version is not None:
            self.store.discard_staging(model, version)
        reason = state.reason if state.stage == FAILED else f"interrupted (the agent stopped during {was})"
        serving = self.store.serving(model)
        state.stage, state.reason = FAILED, f"{reason}; {serving or 'the config model'} serves"
        state.log()
        self.env.save_state(state)
        self.env.publish(state)

    def state(self, model: str) -> DeploymentState | None:
        job = self.jobs.get(model)
        return None if job is None else job.state

    def wait(self, model: str, timeout: float | None = None) -> DeploymentState | None:
        """The model's last deployment's state once it ended (or `timeout` passed)."""
        job = self.jobs.get(model)
        while job is not None and job.thread is not None:
            job.thread.join(timeout)
            latest = self.jobs.get(model)
            if latest is job or latest is None:
                break
            job = latest
        return None if job is None else job.state

    def close(self, timeout: float = 30.0) -> None:
        """Stop every worker (a pending deployment keeps its record: the next start resumes or settles it)."""
        with self._lock:
            jobs = list(self.jobs.values())
            for job in jobs:
                job.cancel.set()
        for job in jobs:
            if job.thread is not None:
                job.thread.join(timeout)
