"""The runner of a rollout: its waves over MQTT, the halt, the rollback, the retained state at each change.

    final = Runner(bus, rollout, body).run(deadline=None)

Each wave: cmd/deploy to each online device (agent.fleet.rollout_step decides per device), until every
device of the wave is done, failed or skipped. More than `max_failures` failures halt the rollout: nothing
more is sent, the devices in flight are waited for, and with `rollback_on_halt` each device on which this
rollout's version was promoted (and still serves) gets cmd/rollback to the version it served before.
The state is saved (retained) at every change, so a driver killed at any point leaves a document that
`--resume` goes on from: a device mid-deployment is waited for (its retained state shows this document's
deployment), one whose state shows nothing of it is sent the document again.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from agent.fleet.rollout_bus import Bus
from agent.fleet.rollout_plan import failures_exceeded
from agent.fleet.rollout_state import (
    DEPLOYING,
    DONE,
    FAILED,
    HALTED,
    PENDING,
    ROLLBACK_FAILED,
    ROLLED_BACK,
    ROLLED_BACK_D,
    ROLLING_BACK,
    RUNNING,
    SOAKING,
    WAVE_OVER,
    DeviceRecord,
    Rollout,
)
from agent.fleet.rollout_step import SEND, SERVING, WATCHING, Goal, Observation, step

ROLLBACK_ANSWER_S = 60.0  # a rollback is a hot swap: answered within seconds
SAVE_PROGRESS_S = 1.0  # progress alone is saved at most this often

OnChange = Callable[[Rollout, "DeviceRecord | None"], object]  # what it returns is not used


class Runner:
    def __init__(
        self,
        bus: Bus,
        rollout: Rollout,
        body: bytes,
        *,
        on_change: OnChange | None = None,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.2,
    ) -> None:
        self.bus, self.r, self.body = bus, rollout, body
        self.goal = Goal(rollout.model, rollout.version, rollout.request_id)
        self.on_change = on_change or (lambda _r, _d: None)
        self.clock, self.poll_s = clock, poll_s
        self._marks: dict[str, int | None] = {}  # device -> states/answers count after this seq (None: any)
        self._saved = 0.0
        self._wave_start = clock()

    # ---- the whole rollout ---------------------------------------------------------------------------
    def run(self, deadline: float | None = None) -> Rollout:
        """Drive the rollout to its end (or until `deadline`, wall clock: then it stays `running`)."""
        r = self.r
        r.driver = f"{socket.gethostname()}:{os.getpid()}"[:128]
        self._resume()
        self._save(None)
        while r.wave < len(r.waves):
            if not self._wave(r.waves[r.wave], deadline):
                return r  # out of time: still running, resumable
            if r.halted_reason is not None:
                break
            r.wave += 1
            self._save(None)
        if r.halted_reason is None:
            r.status = DONE
        else:
            for rec in r.devices.values():
                if rec.stage == PENDING:
                    rec.reason = "not sent: the rollout halted"
            if r.options.rollback_on_halt:
                self._rollback()  # still `running` meanwhile: a driver killed here is resumed into it
            if r.status == RUNNING:
                r.status = HALTED
        self._save(None)
        return r

    def _resume(self) -> None:
        """Devices the document says were sent to: waited for if their state shows this deployment, sent
        again (pending) if it shows nothing of it."""
        for rec in self.r.devices.values():
            if rec.stage == DEPLOYING:
                seen = self.bus.deployment(rec.device)
                if seen is None or not self.goal.ours(seen.body):
                    rec.stage, rec.reason = PENDING, "resumed: no state of this deployment: sent again"
            if rec.stage in (DEPLOYING, SOAKING, ROLLING_BACK):
                self._marks[rec.device] = None  # what the broker kept counts (it is newer than the send)

    # ---- one wave ------------------------------------------------------------------------------------
    def _wave(self, devices: list[str], deadline: float | None) -> bool:
        """Until every device of the wave is over (after a halt: those in flight); False at `deadline`."""
        r = self.r
        self._wave_start = self.clock()
        while True:
            now = self.clock()
            for device in devices:
                rec = r.devices[device]
                if rec.stage in WAVE_OVER or (rec.stage == PENDING and r.halted_reason is not None):
                    continue
                self._step(rec, now)
            if r.halted_reason is None and failures_exceeded(r.failures(), r.options.max_failures):
                r.halted_reason = self._halt_reason()
                self._save(None)
            active = [d for d in devices if r.devices[d].stage in (DEPLOYING, SOAKING)]
            pending = [d for d in devices if r.devices[d].stage == PENDING]
            if not active and (not pending or r.halted_reason is not None):
                return True
            if deadline is not None and now >= deadline:
                return False
            time.sleep(self.poll_s)

    def _step(self, rec: DeviceRecord, now: float) -> None:
        before = asdict(rec)
        mark = self._marks.get(rec.device, 0)
        online, since = self.bus.online(rec.device)
        seen = self.bus.deployment(rec.device)
        answer = self.bus.answer(rec.device, "deploy", self.r.request_id, mark) if mark is not None else None
        # Offline time counts from its wave's start (pending) or from the command (sent), not from before.
        start = self._wave_start if rec.stage == PENDING else (rec.sent_at or self._wave_start)
        obs = Observation(
            online=online,
            offline_for=0.0 if online else max(0.0, now - max(since, start)),
            state=None if seen is None else seen.body,
            state_new=seen is not None and (mark is None or seen.seq > mark),
            answer=None if answer is None else answer.body,
        )
        if step(rec, obs, self.goal, self.r.options, now) == SEND:
            rec.stage, rec.sent_at, rec.deployment, rec.reason, rec.progress = DEPLOYING, now, None, None, 0.0
            self._changed(rec, before)  # saved first: a driver killed before the send sends it on resume
            self._marks[rec.device] = self.bus.send(rec.device, "deploy", self.body)
            return
        if rec.stage == SOAKING and before["stage"] != SOAKING:
            self._marks[rec.device] = seen.seq if seen is not None and obs.state_new else self.bus.seq
        self._changed(rec, before)

    def _halt_reason(self) -> str:
        failed = [rec for rec in self.r.devices.values() if rec.stage == FAILED]
        said = "; ".join(f"{rec.device}: {rec.reason}" for rec in failed[:3])
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        k = self.r.options.max_failures
        return f"{len(failed)} failed, more than --max-failures {k}: {said}{more}"[:500]

    # ---- rollback ------------------------------------------------------------------------------------
    def _rollback(self) -> None:
        """cmd/rollback to each device this rollout changed that still serves its version; waits for the
        answers (none within the offline timeout + 60 s: rollback_failed). Resumed mid-rollback, a device
        whose rollback was sent is sent it again only while it still serves this version."""
        r, opts = self.r, self.r.options
        for rec in r.devices.values():
            if rec.stage == ROLLING_BACK and self._marks.get(rec.device, 0) is None:  # sent before a resume
                if self._serves_ours(rec):
                    self._send_rollback(rec)
                else:
                    before = asdict(rec)
                    rec.move(ROLLED_BACK_D, "rolled back (seen after the resume)", self.clock())
                    self._changed(rec, before)
            elif rec.stage not in (ROLLING_BACK, ROLLED_BACK_D, ROLLBACK_FAILED) and self._serves_ours(rec):
                self._send_rollback(rec)
        limit = self.clock() + opts.offline_timeout_s + ROLLBACK_ANSWER_S
        while any(rec.stage == ROLLING_BACK for rec in r.devices.values()):
            now = self.clock()
            for rec in r.devices.values():
                if rec.stage == ROLLING_BACK:
                    self._rollback_step(rec, now, now >= limit)
            time.sleep(self.poll_s)
        failed = [rec.device for rec in r.devices.values() if rec.stage == ROLLBACK_FAILED]
        if failed:
            r.halted_reason = f"{r.halted_reason}; rollback failed on {', '.join(failed[:5])}"[:600]
        else:
            r.status = ROLLED_BACK

    def _serves_ours(self, rec: DeviceRecord) -> bool:
        """This rollout promoted its version on the device (not one that served it already) and it still
        serves it (not rolled back by its own watch, not replaced since)."""
        seen = self.bus.deployment(rec.device)
        state = None if seen is None else seen.body
        ours = state is not None and self.goal.ours(state) and state.get("stage") in (SERVING, WATCHING)
        return rec.promoted and not rec.already and ours

    def _send_rollback(self, rec: DeviceRecord) -> None:
        body: dict[str, Any] = {"model": self.r.model, "request_id": f"{self.r.id}.rollback"}
        if rec.previous is not None:
            body["to"] = rec.previous  # exactly what served before (none: the config's own model)
        before = asdict(rec)
        rec.stage, rec.reason = ROLLING_BACK, f"to {rec.previous or 'the config model'}"
        self._marks[rec.device] = self.bus.send(rec.device, "rollback", json.dumps(body).encode())
        self._changed(rec, before)

    def _rollback_step(self, rec: DeviceRecord, now: float, late: bool) -> None:
        before = asdict(rec)
        answer = self.bus.answer(
            rec.device, "rollback", f"{self.r.id}.rollback", self._marks.get(rec.device) or 0
        )
        if answer is not None:
            a = answer.body
            if a.get("ok"):
                rec.move(ROLLED_BACK_D, f"serves {a.get('version') or 'the config model'} again", now)
            elif "already" in str(a.get("error")):  # it serves what it served before: nothing to do
                rec.move(ROLLED_BACK_D, str(a.get("error")), now)
            else:
                rec.move(ROLLBACK_FAILED, f"refused: {a.get('error')}", now)
        elif late:
            rec.move(ROLLBACK_FAILED, "no answer to cmd/rollback (offline?)", now)
        self._changed(rec, before)

    # ---- state ---------------------------------------------------------------------------------------
    def _changed(self, rec: DeviceRecord, before: dict[str, Any]) -> None:
        after = asdict(rec)
        if after == before:
            return
        shown = {k: v for k, v in after.items() if k != "progress"} != {
            k: v for k, v in before.items() if k != "progress"
        }
        if shown or self.clock() - self._saved >= SAVE_PROGRESS_S:
            self._save(rec if shown else None)

    def _save(self, rec: DeviceRecord | None) -> None:
        self.r.updated_at = self._saved = self.clock()
        self.bus.save(self.r)
        self.on_change(self.r, rec)


def resumable(rollout: Rollout) -> str | None:
    """Why `rollout` cannot be resumed, or None."""
    if rollout.status != RUNNING:
        return f"rollout {rollout.id} is {rollout.status}: nothing to resume"
    return None
