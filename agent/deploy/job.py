"""One deployment in flight (a Job) and what it shares with the Deployer that runs it (an Env), plus its
resumable record `state_dir/deployments/{model}.json`: the document as received (signature included: a
restart checks it again against the trusted keys of that time) and the last state."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config.deploy import DeployConfig
from agent.deploy.document import DeploymentDoc
from agent.deploy.errors import DeployError, DeviceFault
from agent.deploy.host import DeployHost
from agent.deploy.staging import atomic_write_json, check_name, read_json
from agent.deploy.state import FINAL, DeploymentState
from agent.deploy.versions import VersionStore

log = logging.getLogger("agent.deploy")
RECORD_SCHEMA = "edge-agent/deployment-record/1"


@dataclass
class Job:
    doc: DeploymentDoc
    raw: dict[str, Any]
    digest: str
    state: DeploymentState
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None  # None with cancel set: the agent stops (the record stays to resume)
    installed_here: bool = False  # this deployment installed the version folder (removed if refused)
    promoted: bool = False
    resumed: bool = False  # taken up again from its record after a restart
    thread: threading.Thread | None = None

    @property
    def model(self) -> str:
        return self.doc.model

    @property
    def version(self) -> str:
        return self.doc.version

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class Env:
    """What every Job of a Deployer uses: the live `deploy` config, the version store, the host."""

    config: Callable[[], DeployConfig]
    store: VersionStore
    host: DeployHost
    frames_timeout_s: float = 30.0  # waiting for the live frames of a check
    watch_interval_s: float = 1.0

    def record_path(self, model: str) -> Path:
        return self.store.root / "deployments" / f"{check_name('model', model)}.json"

    def publish(self, state: DeploymentState) -> None:
        try:
            state.versions = [v.version for v in self.store.versions(state.model)]
        except (DeployError, OSError) as exc:  # a listing problem must not hide the state itself
            log.warning("versions of %s: %s", state.model, exc)
        self.host.publish_state(state.model, state.payload())

    def save(self, job: Job) -> None:
        """The job's record (atomic); every stage change writes it."""
        body = {
            "schema": RECORD_SCHEMA,
            "document": job.raw,
            "digest": job.digest,
            "installed_here": job.installed_here,
            "promoted": job.promoted,
            "state": job.state.fields(),
        }
        path = self.record_path(job.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, body)

    def save_state(self, state: DeploymentState) -> None:
        """A record of a state without a document (a rollback by hand, a note at start)."""
        path = self.record_path(state.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"schema": RECORD_SCHEMA, "document": None, "state": state.fields()})

    def load(self, model: str) -> dict[str, Any] | None:
        path = self.record_path(model)
        if not path.exists():
            return None
        data = read_json(path)
        return data if isinstance(data, dict) and data.get("schema") == RECORD_SCHEMA else None

    def move(self, job: Job, stage: str, reason: str | None = None, progress: float = 0.0) -> None:
        """A stage change: state, journal line, record, retained state."""
        job.state.move(stage, reason, progress)
        try:
            self.save(job)
        except DeployError as exc:  # a full disk, say: the device's fault, said on the state topic anyway
            if stage not in FINAL:
                raise DeviceFault(exc.reason) from None
            log.warning("deployment %s %s: %s", job.model, job.version, exc.reason)
        self.publish(job.state)
