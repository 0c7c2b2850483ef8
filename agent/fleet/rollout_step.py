"""One device of a rollout wave, one step at a time (pure: the runner observes, this decides).

    action = step(rec, obs, goal, opts, now)   # rec (a DeviceRecord) is moved in place; "send" or None

The device's `deployments/{model}` state counts only when it is this document's (version and request_id)
and newer than the rollout's command (`Observation.state_new`): a state the broker kept from an earlier
deployment of the same version says nothing about this one. A device is offline while its retained status
says `offline` (its graceful stop or its last will) or while it has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.fleet.rollout_plan import RolloutOptions
from agent.fleet.rollout_state import DEPLOYING, FAILED, PENDING, SKIPPED, SOAKING, SUCCEEDED, DeviceRecord

ANSWER_TIMEOUT_S = 30.0  # cmd/deploy unanswered (and no state of it) this long while online: a failure
SERVING, WATCHING = "serving", "watching"
ENDED_BAD = frozenset({"rejected", "rolled_back", "failed"})
SEND = "send"


@dataclass(frozen=True)
class Goal:
    """What the devices are to serve."""

    model: str
    version: str
    request_id: str | int | None

    def ours(self, state: dict[str, Any] | None) -> bool:
        """The state is of this document's deployment (request_id where the document has one)."""
        if state is None or state.get("version") != self.version:
            return False
        return self.request_id is None or state.get("request_id") == self.request_id


@dataclass(frozen=True)
class Observation:
    online: bool
    offline_for: float  # seconds offline (or without a status) so far; 0 while online
    state: dict[str, Any] | None  # the latest deployments/{model} of the device
    state_new: bool  # it arrived after the rollout's command (or after serving, while soaking)
    answer: dict[str, Any] | None  # cmd/deploy/result to the rollout's command


def _why(state: dict[str, Any]) -> str:
    reason = state.get("reason")
    return f"{state.get('stage')}: {reason}" if reason else str(state.get("stage"))


def step(rec: DeviceRecord, obs: Observation, goal: Goal, opts: RolloutOptions, now: float) -> str | None:
    """Advance `rec` (a device of the wave under way); "send" when cmd/deploy is to be sent now."""
    if rec.stage == PENDING:
        return _pending(rec, obs, opts, now)
    if rec.stage in (DEPLOYING, SOAKING) and not obs.online and obs.offline_for >= opts.offline_timeout_s:
        said = f"offline for {obs.offline_for:.0f} s while {rec.stage}"
        rec.move(SKIPPED if opts.skip_offline else FAILED, said, now)
        return None
    if rec.stage == DEPLOYING:
        _deploying(rec, obs, goal, opts, now)
    elif rec.stage == SOAKING:
        _soaking(rec, obs, goal, opts, now)
    return None


def _pending(rec: DeviceRecord, obs: Observation, opts: RolloutOptions, now: float) -> str | None:
    if obs.online:
        return SEND
    if opts.skip_offline:
        rec.move(SKIPPED, "offline at its wave: skipped (--skip-offline)", now)
    elif obs.offline_for >= opts.offline_timeout_s:
        rec.move(FAILED, f"offline for {obs.offline_for:.0f} s: nothing sent", now)
    else:
        rec.reason = f"offline: waiting up to {opts.offline_timeout_s:g} s"
    return None


def _deploying(rec: DeviceRecord, obs: Observation, goal: Goal, opts: RolloutOptions, now: float) -> None:
    answer, state = obs.answer, obs.state if obs.state_new and goal.ours(obs.state) else None
    if answer is not None and not answer.get("ok"):
        rec.move(FAILED, f"refused: {answer.get('error') or answer.get('reason')}", now)
        return
    if state is None and answer is not None and answer.get("stage") == SERVING:
        # This document's own deployment (its request_id) got there before (a resumed rollout whose
        # command went out twice): promoted by it. Another deployment of the version: not changed by us.
        kept = obs.state or {}
        mine = goal.request_id is not None and goal.ours(kept) and kept.get("stage") == SERVING
        rec.promoted, rec.already = rec.promoted or mine, not mine
        rec.serving_at, rec.deployment, rec.progress = now, SERVING, 0.0
        rec.move(SOAKING, "already serving", now)
        return
    if state is not None:
        stage = state.get("stage")
        rec.deployment = str(stage)[:32]
        progress = state.get("progress")
        if isinstance(progress, float) or (type(progress) is int and abs(progress) < 1 << 53):
            # a 309-digit int would not convert; NaN falls to 0 through max()
            rec.progress = min(1.0, max(0.0, float(progress)))
        if isinstance(state.get("previous"), str) or state.get("previous") is None:
            rec.previous = state.get("previous")
        if stage in (WATCHING, SERVING):
            rec.promoted = True
        if stage in ENDED_BAD:
            rec.move(FAILED, _why(state), now)
            return
        if stage == SERVING:
            rec.serving_at, rec.progress = now, 0.0
            rec.move(SOAKING, None, now)
            return
        rec.reason = None
    sent = rec.sent_at if rec.sent_at is not None else now
    if now - sent >= opts.device_timeout_s:
        rec.move(
            FAILED,
            f"not serving within {opts.device_timeout_s:g} s (last: {rec.deployment or 'no state'})",
            now,
        )
    elif (
        obs.online
        and state is None
        and answer is None
        and rec.deployment is None
        and now - sent >= ANSWER_TIMEOUT_S
    ):
        rec.move(FAILED, f"no answer to cmd/deploy within {ANSWER_TIMEOUT_S:g} s", now)


def _soaking(rec: DeviceRecord, obs: Observation, goal: Goal, opts: RolloutOptions, now: float) -> None:
    state = obs.state
    # Serving this version still: this deployment's state, or (it served the version already) any.
    holds = (
        state is not None
        and state.get("stage") == SERVING
        and (goal.ours(state) or (rec.already and state.get("version") == goal.version))
    )
    if obs.state_new and state is not None and not holds:
        rec.deployment = str(state.get("stage"))[:32]
        rec.move(FAILED, f"left serving during the soak: {_why(state)}", now)
        return
    since = rec.serving_at if rec.serving_at is not None else now
    rec.progress = 1.0 if opts.soak_s <= 0 else min(1.0, (now - since) / opts.soak_s)
    if now - since >= opts.soak_s:
        rec.move(SUCCEEDED, "already serving" if rec.already else None, now)
