"""Engines built by other processes (`edge-agent rebuild`, the supervisor of shards): noticed and adopted.

    watcher = StoreWatcher(store, board, adopt, models, interval_s=2.0, stop=stop)
    threading.Thread(target=watcher.run).start()        # until `stop` is set

Every `interval_s` each model's engine folder listing is compared with the one seen last (after a start,
a job or a previous look); a model with a job under way is skipped (the job adopts its own engine). A
new engine that fits and differs from the plan served is adopted like a job's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.lifecycle.job import resolved_settings
from agent.lifecycle.state import ModelEngine, StateBoard
from engines.build.compat import check
from engines.store import EngineStore

# The daemon's log names the engine manager for every line of its lifecycle.
log = logging.getLogger("agent.lifecycle.manager")


def listing(store: EngineStore, name: str) -> tuple:
    """The model's manifests and their mtimes: what changes when an engine is written."""
    d = store.model_dir(name)
    try:
        return tuple(sorted((p.name, p.stat().st_mtime_ns) for p in d.glob("*.json")))
    except OSError:
        return ()


class StoreWatcher:
    def __init__(
        self,
        store: Callable[[], EngineStore],
        board: StateBoard,
        adopt: Callable[[ModelEngine, str], None],
        models: Callable[[], list[ModelEngine]],
        interval_s: float,
        stop: threading.Event,
        origins: dict[tuple[str, str], str] | None = None,
    ) -> None:
        self._store, self._board, self._adopt, self._models = store, board, adopt, models
        self._interval, self._stop = interval_s, stop
        # (model, key) -> built | cache of this process's jobs: a deployment's engine found here before its
        # promotion reopened the model keeps the origin its job recorded.
        self._origins = origins if origins is not None else {}

    def run(self) -> None:
        while not self._stop.wait(self._interval):
            for me in self._models():
                try:
                    self.look(me)
                except Exception:
                    log.exception("model %s: engine watch failed", me.name)

    def look(self, me: ModelEngine) -> None:
        store = self._store()
        with me.lock:
            if me.busy:
                return
            seen = listing(store, me.name)
            if seen == me.seen:
                return
            me.seen = seen
            known_sha = me.state.plan_sha256
        settings, report, _ = resolved_settings(me.ctx, me.target.api)
        if settings is None:
            return
        result = check(store, me.name, settings, me.target.fingerprint)
        manifest = result.manifest
        if not result.ok or manifest is None or manifest.build.plan_sha256 == known_sha:
            return
        log.info("model %s: new engine %s found (built by another process)", me.name, result.key)
        self._board.set(
            me,
            build_s=manifest.build.build_s,
            reasons=[],
            validation=report.state() if report else me.state.validation,
            origin=self._origins.get((me.name, str(result.key)), "store"),
        )
        self._adopt(me, result.key)
