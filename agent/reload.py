"""What a configuration reload (SIGHUP) changes, worked out before anything is touched.

Applied in place by the daemon (agent.daemon.Agent.reload):
- cameras: added, removed, restarted when their source changed (url, pipeline, fps, loop, timeouts) or
  they moved to another (or a changed) model; `classes`/`min_score` change on the running route, and
  `tracking`, `zones`, `lines`, `events`, `publish`, `frame_size` on the camera's analytics
  (agent.events), while the reader keeps streaming (zones and lines that did not change keep their
  state and counts; removed ones have their retained states deleted);
- models: added, removed, or reopened when their section changed (ONNX Runtime serves at once, an engine
  builds in the background as at start);
- mqtt (and device_id, which names the topics): a new connection, the old one closed gracefully;
- log_level, telemetry.interval_s, console: at once.
engine_dir and telemetry.prometheus_port need a restart: reported, the old value stays in effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.config import AgentConfig, CameraConfig

_SOURCE_FIELDS = ("url", "pipeline", "fps", "loop", "open_timeout_s", "read_timeout_s")
_ROUTE_FIELDS = ("classes", "min_score")
_ANALYTICS_FIELDS = ("tracking", "zones", "lines", "events", "publish", "frame_size")


@dataclass
class ReloadPlan:
    cameras_added: list[str] = field(default_factory=list)
    cameras_removed: list[str] = field(default_factory=list)
    cameras_restarted: list[str] = field(default_factory=list)
    cameras_rerouted: list[str] = field(default_factory=list)  # route settings only; reader untouched
    cameras_analytics: list[str] = field(default_factory=list)  # tracking/zones/lines...; reader untouched
    models_added: list[str] = field(default_factory=list)
    models_removed: list[str] = field(default_factory=list)
    models_changed: list[str] = field(default_factory=list)
    mqtt: bool = False
    log_level: bool = False
    telemetry: bool = False
    console: bool = False
    needs_restart: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(
            (
                self.cameras_added,
                self.cameras_removed,
                self.cameras_restarted,
                self.cameras_rerouted,
                self.cameras_analytics,
                self.models_added,
                self.models_removed,
                self.models_changed,
                self.mqtt,
                self.log_level,
                self.telemetry,
                self.console,
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
        if self.needs_restart:
            parts.append(f"needs a restart (kept): {', '.join(self.needs_restart)}")
        return "; ".join(parts) or "no changes"


def _enabled(cfg: AgentConfig) -> dict[str, CameraConfig]:
    return {name: cam for name, cam in cfg.cameras.items() if cam.enabled}


def _differs(a: CameraConfig, b: CameraConfig, names: tuple[str, ...]) -> bool:
    return any(getattr(a, n) != getattr(b, n) for n in names)


def plan_reload(old: AgentConfig, new: AgentConfig) -> ReloadPlan:
    plan = ReloadPlan()
    for name in new.models:
        if name not in old.models:
            plan.models_added.append(name)
        elif new.models[name] != old.models[name]:
            plan.models_changed.append(name)
    plan.models_removed = [name for name in old.models if name not in new.models]
    reopened = set(plan.models_changed)

    was, now = _enabled(old), _enabled(new)
    plan.cameras_removed = [name for name in was if name not in now]
    for name, cam in now.items():
        prev = was.get(name)
        if prev is None:
            plan.cameras_added.append(name)
        elif prev.model != cam.model or cam.model in reopened or _differs(prev, cam, _SOURCE_FIELDS):
            plan.cameras_restarted.append(name)
        else:
            if _differs(prev, cam, _ROUTE_FIELDS):
                plan.cameras_rerouted.append(name)
            if _differs(prev, cam, _ANALYTICS_FIELDS):
                plan.cameras_analytics.append(name)

    plan.mqtt = old.mqtt != new.mqtt or old.device_id != new.device_id
    plan.log_level = old.log_level != new.log_level
    plan.telemetry = old.telemetry.interval_s != new.telemetry.interval_s
    plan.console = old.console != new.console
    if old.engine_dir != new.engine_dir:
        plan.needs_restart.append("engine_dir")
    if old.telemetry.prometheus_port != new.telemetry.prometheus_port:
        plan.needs_restart.append("telemetry.prometheus_port")
    if old.pipeline != new.pipeline:  # the number of processes and their GPUs: fixed while running
        plan.needs_restart.append("pipeline")
    return plan
