"""The state of one model's deployment: its stage, what it checked and why it stopped.

Published retained on `{prefix}/{device}/deployments/{model}` (schema `edge-agent/deployment/1`):

    {"schema", "ts", "model", "stage", "version", "previous", "progress", "reason", "checks": {"gate": {...},
     "shadow": {...}, "watch": {...}}, "versions": [...], "request_id", "superseded"?}

and kept (with the document) in `state_dir/deployments/{model}.json`, the record a restart resumes from.
Every stage change is also one journal line on the "agent.deploy" logger. A reason is a DeployError's
(one line, no URL credentials); nothing of the document but names and numbers is ever shown.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from agent.deploy.errors import one_line
from agent.mqtt.topics import payload

journal = logging.getLogger("agent.deploy")

ACCEPTED, DOWNLOADING, VERIFYING, BUILDING = "accepted", "downloading", "verifying", "building"
GATING, SHADOW, WATCHING, SERVING = "gating", "shadow", "watching", "serving"
REJECTED, ROLLED_BACK, FAILED = "rejected", "rolled_back", "failed"
STAGES = (
    ACCEPTED,
    DOWNLOADING,
    VERIFYING,
    BUILDING,
    GATING,
    SHADOW,
    WATCHING,
    SERVING,
    REJECTED,
    ROLLED_BACK,
    FAILED,
)
FINAL = frozenset({SERVING, REJECTED, ROLLED_BACK, FAILED})  # the deployment is over
# Interrupted in these, a deployment resumes after a restart (its download continues from the .part).
RESUMABLE = frozenset({ACCEPTED, DOWNLOADING})


@dataclass
class DeploymentState:
    """What `deployments/{model}` says now. `previous`: the version serving before (None: the config's
    own model); `versions`: the installed ones, newest first."""

    model: str
    version: str | None
    stage: str = ACCEPTED
    previous: str | None = None
    progress: float = 0.0
    reason: str | None = None
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)
    request_id: str | int | None = None
    superseded: str | None = None  # the version whose pending deployment this one cancelled
    # Seconds spent in each stage left so far (the share of each stage in command-to-serving).
    stage_s: dict[str, float] = field(default_factory=dict)
    _entered: float | None = field(default=None, repr=False, compare=False)

    def move(self, stage: str, reason: str | None = None, progress: float = 0.0) -> None:
        """Enter `stage` (one journal line)."""
        if stage not in STAGES:
            raise ValueError(f"stage: unknown {stage!r}")
        now = time.monotonic()
        if self._entered is not None and stage != self.stage:
            self.stage_s[self.stage] = round(self.stage_s.get(self.stage, 0.0) + now - self._entered, 3)
        if stage != self.stage or self._entered is None:
            self._entered = now
        self.stage, self.progress = stage, progress
        self.reason = None if reason is None else one_line(reason)
        self.log()

    def log(self) -> None:
        level = logging.WARNING if self.stage in (REJECTED, ROLLED_BACK, FAILED) else logging.INFO
        why = f": {self.reason}" if self.reason else ""
        journal.log(level, "deployment %s %s: %s%s", self.model, self.version or "(config)", self.stage, why)

    def fields(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "stage": self.stage,
            "version": self.version,
            "previous": self.previous,
            "progress": round(min(1.0, max(0.0, self.progress)), 3),
            "reason": self.reason,
            "checks": self.checks,
            "versions": list(self.versions),
            "request_id": self.request_id,
        }
        if self.superseded is not None:
            body["superseded"] = self.superseded
        if self.stage_s:
            body["stage_s"] = dict(self.stage_s)
        return body

    def payload(self) -> bytes:
        """The retained state message (topics.payload's envelope)."""
        return payload("deployment", **self.fields())

    @classmethod
    def from_fields(cls, d: dict[str, Any]) -> DeploymentState:
        """The state of a record written by fields() (a restart); unknown stages read as failed."""
        stage = d.get("stage") if d.get("stage") in STAGES else FAILED
        checks = d.get("checks") if isinstance(d.get("checks"), dict) else {}
        versions = [v for v in d.get("versions") or [] if isinstance(v, str)]
        rid = d.get("request_id")
        return cls(
            model=str(d.get("model")),
            version=d.get("version") if isinstance(d.get("version"), str) else None,
            stage=str(stage),
            previous=d.get("previous") if isinstance(d.get("previous"), str) else None,
            reason=d.get("reason") if isinstance(d.get("reason"), str) else None,
            checks=dict(checks or {}),
            versions=versions,
            request_id=rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None,
        )
