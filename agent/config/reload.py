"""What a configuration reload (SIGHUP) changes, worked out before anything is touched.

Every config key declares what a change of it needs (agent.config.impact: README's table "What a reload
changes" is written from those declarations); `plan_reload` sorts the differences by them:
- cameras: added, removed (or enabled, disabled); restarted (CAMERA: url, pipeline, fps, loop, timeouts,
  decoder, decoder_latency; or a move to another or a reopened model); rerouted (ROUTE: classes,
  min_score) and analytics (ANALYTICS: tracking, zones, lines, events, publish, frame_size) in place while
  the reader keeps streaming (zones and lines that did not change keep their state and counts; removed ones
  have their retained states deleted); LIVE (snapshot) handed to the running camera; PLACEMENT (shard)
  left to the shard supervisor;
- models (MODEL): added, removed, or reopened when their section changed (ONNX Runtime serves at once, an
  engine builds in the background as at start);
- CONNECTION (mqtt, device_id, which names the topics): a new connection, the old one closed gracefully;
- LIVE (log_level, telemetry.interval_s, console, homeassistant): at once;
- AGENT (engine_dir, telemetry.prometheus_port, pipeline): need a restart; reported, and
  `keep_until_restart` puts the old values back into the config that is applied.
The daemon applies a plan in place (agent.runtime.transaction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from agent.config.camera import CameraConfig
from agent.config.impact import Change, Impact, changes, declared
from agent.config.schema import AgentConfig

# The classes the planner applies, by where the key is: a key declared with another class there would be
# a change nobody applies (tests/test_reload_impact.py checks the schema against these).
APPLIED = {
    "agent": frozenset({Impact.AGENT, Impact.CONNECTION, Impact.LIVE}),
    "models": frozenset({Impact.MODEL, Impact.AGENT}),
    "cameras": frozenset({Impact.CAMERA, Impact.ROUTE, Impact.ANALYTICS, Impact.LIVE, Impact.PLACEMENT}),
}


@dataclass
class ReloadPlan:
    cameras_added: list[str] = field(default_factory=list)
    cameras_removed: list[str] = field(default_factory=list)
    cameras_restarted: list[str] = field(default_factory=list)
    cameras_rerouted: list[str] = field(default_factory=list)  # route settings only; reader untouched
    cameras_analytics: list[str] = field(default_factory=list)  # tracking/zones/lines...; reader untouched
    cameras_live: list[str] = field(default_factory=list)  # LIVE keys (snapshot): the running camera's cfg
    models_added: list[str] = field(default_factory=list)
    models_removed: list[str] = field(default_factory=list)
    models_changed: list[str] = field(default_factory=list)
    mqtt: bool = False
    log_level: bool = False
    telemetry: bool = False
    console: bool = False
    live: list[str] = field(default_factory=list)  # LIVE keys outside cameras (log_level, homeassistant...)
    needs_restart: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # every difference found, with its class

    @property
    def empty(self) -> bool:
        return not any(
            (
                self.cameras_added,
                self.cameras_removed,
                self.cameras_restarted,
                self.cameras_rerouted,
                self.cameras_analytics,
                self.cameras_live,
                self.models_added,
                self.models_removed,
                self.models_changed,
                self.mqtt,
                self.live,
            )
        )

    def summary(self) -> str:
        parts = []
        for label, names in (
            ("cameras added", self.cameras_added),
            ("cameras removed", self.cameras_removed),
            ("cameras restarted", self.cameras_restarted),
            ("camera settings", self.cameras_rerouted),
            ("camera analytics", self.cameras_analytics),
            ("camera live settings", self.cameras_live),
            ("models added", self.models_added),
            ("models removed", self.models_removed),
            ("models reopened", self.models_changed),
        ):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        flags = (("mqtt", self.mqtt), ("log level", self.log_level), ("telemetry", self.telemetry))
        for label, flag in flags:
            if flag:
                parts.append(f"{label} changed")
        parts += [f"{key} changed" for key in self.live if key not in ("log_level", "telemetry.interval_s")]
        if self.needs_restart:
            parts.append(f"needs a restart (kept): {', '.join(self.needs_restart)}")
        return "; ".join(parts) or "no changes"


def _enabled(cfg: AgentConfig) -> dict[str, CameraConfig]:
    return {name: cam for name, cam in cfg.cameras.items() if cam.enabled}


def _applied(where: str, found: list[Change]) -> set[Impact]:
    wrong = [c for c in found if c.impact not in APPLIED[where]]
    if wrong:  # a schema declaration the planner has no way to apply: a bug, not a config error
        raise TypeError(f"{wrong[0].name}: a reload cannot apply {wrong[0].impact} to {where}")
    return {c.impact for c in found}


def plan_reload(old: AgentConfig, new: AgentConfig) -> ReloadPlan:
    plan = ReloadPlan()
    # models, cameras: entry by entry, below; camera_defaults is merged into the cameras (planned there).
    top = changes(old, new, skip=("models", "cameras", "camera_defaults"))
    _applied("agent", top)
    plan.changes += top

    models = declared(AgentConfig.model_fields["models"])
    for name in new.models:
        if name not in old.models:
            plan.models_added.append(name)
            continue
        key = ("models", name)
        found = changes(old.models[name], new.models[name], key, None if models is None else (key, models))
        plan.changes += found
        if Impact.MODEL in _applied("models", found):
            plan.models_changed.append(name)
    plan.models_removed = [name for name in old.models if name not in new.models]
    reopened = set(plan.models_changed)

    for change in plan.changes:  # the agent's keys and the models'
        plan.mqtt |= change.impact is Impact.CONNECTION
        bucket = {Impact.AGENT: plan.needs_restart, Impact.LIVE: plan.live}.get(change.impact)
        if bucket is not None and change.name not in bucket:
            bucket.append(change.name)
    plan.log_level = "log_level" in plan.live
    plan.console = "console" in plan.live
    plan.telemetry = "telemetry.interval_s" in plan.live

    was, now = _enabled(old), _enabled(new)
    plan.cameras_removed = [name for name in was if name not in now]
    for name, cam in now.items():
        prev = was.get(name)
        if prev is None:
            plan.cameras_added.append(name)
            continue
        found = changes(prev, cam, ("cameras", name))
        plan.changes += found
        kinds = _applied("cameras", found)
        if Impact.CAMERA in kinds or cam.model in reopened:
            plan.cameras_restarted.append(name)
            continue
        for kind, names in (
            (Impact.ROUTE, plan.cameras_rerouted),
            (Impact.ANALYTICS, plan.cameras_analytics),
            (Impact.LIVE, plan.cameras_live),
        ):
            if kind in kinds:
                names.append(name)
    return plan


def keep_until_restart(old: AgentConfig, new: AgentConfig, plan: ReloadPlan) -> AgentConfig:
    """`new` with the old values of the keys that need a restart (AGENT), so the config in effect says
    what runs: the reload reports them (plan.needs_restart) and they apply at the next start."""
    for change in plan.changes:
        if change.impact is Impact.AGENT:
            new = _put(new, old, change.declared_at)
    return new


def _put(new: Any, old: Any, key: tuple[str, ...]) -> Any:
    """`new` with `old`'s value at `key` (a path of fields and dict names present in both)."""
    if not key:
        return old
    head, rest = key[0], key[1:]
    if isinstance(new, BaseModel):
        return new.model_copy(update={head: _put(getattr(new, head), getattr(old, head), rest)})
    return {**new, head: _put(new[head], old[head], rest)}
