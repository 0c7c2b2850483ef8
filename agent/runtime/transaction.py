"""A reload applied in place (agent.config.reload plans it): all or nothing.

``prepare`` does everything that can fail while nothing has changed yet: it opens the models to add or
reopen (ONNX Runtime serves at once; engines build in the background as at start) and checks the class
masks, zones and lines of new and changed cameras against the labels they will use. A failure closes what
was opened, puts back what was detached (``rollback``, also the owner's when it cannot follow), and
re-raises. ``close`` and ``open`` then cannot fail: leaving cameras and models go, the new ones start.
The owner switches its MQTT client and config in between.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.config import AgentConfig, ModelConfig
from agent.config.reload import ReloadPlan
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.manager import EngineManager, ModelEngine
from agent.runtime.sinks import ResultSinks
from agent.runtime.wiring import Pipeline

OpenModel = Callable[[str, ModelConfig, AgentConfig], None]


class ReloadTransaction:
    def __init__(
        self,
        pipeline: Pipeline,
        sinks: ResultSinks,
        engines: EngineManager,
        new: AgentConfig,
        plan: ReloadPlan,
    ) -> None:
        self.pipeline, self.sinks, self.engines = pipeline, sinks, engines
        self.new, self.plan = new, plan
        self._reopen = plan.models_added + plan.models_changed
        self._old_workers = {n: pipeline.workers[n] for n in plan.models_changed}
        self._detached: dict[str, ModelEngine | None] = {}
        self._old_labels: dict[str, list[str]] = {}
        self._old_taps: dict[str, FrameTap] = {}
        self._opened: list[str] = []

    def prepare(self, open_model: OpenModel) -> None:
        """Open the models and check the cameras; on failure, undo (rollback) and re-raise."""
        plan, new, pipeline = self.plan, self.new, self.pipeline
        self._old_labels = {n: pipeline.labels[n] for n in plan.models_changed}
        self._old_taps = {n: self.sinks.taps[n] for n in plan.models_changed}
        self._detached = {n: self.engines.detach(n) for n in plan.models_changed}
        try:
            for name in self._reopen:
                open_model(name, new.models[name], new)
                self._opened.append(name)
            changed = (
                plan.cameras_added + plan.cameras_restarted + plan.cameras_rerouted + plan.cameras_analytics
            )
            for name in dict.fromkeys(changed):
                pipeline.check_camera(name, new.cameras[name], new)
        except Exception:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Close what prepare opened and put back what it detached: as if it never ran."""
        pipeline = self.pipeline
        for name in self._opened:
            pipeline.workers.pop(name).close_backends()
            self.engines.retire(self.engines.detach(name))
        self._opened = []
        pipeline.workers.update(self._old_workers)
        pipeline.labels.update(self._old_labels)
        self.sinks.taps.update(self._old_taps)
        for name, me in self._detached.items():
            self.engines.attach(name, me)
        self._detached = {}

    def close(self, on_removed: Callable[[str], None]) -> None:
        """Close what leaves. Every leaving camera is asked to stop first, so slow ones (a read or an open in
        progress) end in parallel, not one after another. `on_removed(camera)`: after a removed one."""
        plan, pipeline = self.plan, self.pipeline
        leaving = plan.cameras_removed + plan.cameras_restarted
        for name in leaving:
            pipeline.cameras[name].reader.request_stop()
        for name in leaving:
            removed = name in plan.cameras_removed
            pipeline.close_camera(name, clear_state=removed)
            if removed:
                self.sinks.forget_camera(name)
                on_removed(name)
        for name in plan.models_removed:
            pipeline.close_model(pipeline.workers.pop(name), name)
            self.engines.retire(self.engines.detach(name))
            pipeline.labels.pop(name, None)
            self.sinks.forget_model(name)
        for name, worker in self._old_workers.items():
            pipeline.close_model(worker, name)
            self.engines.retire(self._detached[name])

    def open(self) -> None:
        """Start what the new config adds or changed (once it is the owner's config)."""
        plan, new, pipeline = self.plan, self.new, self.pipeline
        self.engines.reconfigure(new)
        for name in self._reopen:
            pipeline.workers[name].start()
        self.engines.start_pending()
        for name in dict.fromkeys(plan.cameras_rerouted + plan.cameras_analytics):
            pipeline.reroute(name, new.cameras[name], new)
        for name in plan.cameras_live:  # snapshot settings: read from the section at each use
            pipeline.cameras[name].cfg = new.cameras[name]
        for name in plan.cameras_added + plan.cameras_restarted:
            pipeline.open_camera(name, new.cameras[name], new)
            pipeline.cameras[name].reader.start()
