"""Rollouts (issue 38): the pure parts: waves, options, the retained state document (read back from junk),
one device's next move, and the table."""

from __future__ import annotations

import io
import json
import random

import pytest

from agent.fleet.rollout_plan import (
    Batch,
    PlanError,
    RolloutOptions,
    failures_exceeded,
    parse_batch,
    plan_waves,
    split_devices,
)
from agent.fleet.rollout_state import (
    DEPLOYING,
    FAILED,
    PENDING,
    SKIPPED,
    SOAKING,
    SUCCEEDED,
    DeviceRecord,
    Rollout,
    RolloutStateError,
    check_id,
    new_id,
)
from agent.fleet.rollout_step import SEND, Goal, Observation, step
from agent.fleet.rollout_table import LiveTable, render_detail, render_list

DEVICES = [f"d{i:02d}" for i in range(10)]


# ---- waves ------------------------------------------------------------------------------------------------
def test_canary_then_batches_of_n() -> None:
    assert plan_waves(DEVICES, 1, Batch(count=3)) == [
        ["d00"],
        ["d01", "d02", "d03"],
        ["d04", "d05", "d06"],
        ["d07", "d08", "d09"],
    ]


def test_batches_of_a_share_of_the_rest_round_up() -> None:
    # 9 after the canary; 25 % of 9 = 2.25 -> 3 per wave
    assert [len(w) for w in plan_waves(DEVICES, 1, parse_batch("25%"))] == [1, 3, 3, 3]
    assert [len(w) for w in plan_waves(DEVICES[:3], 1, parse_batch("1%"))] == [1, 1, 1]
    assert [len(w) for w in plan_waves(DEVICES, 0, parse_batch("100%"))] == [10]


def test_every_device_once_in_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        targets = [f"x{i}" for i in range(n)]
        canary = rng.randint(0, n)
        batch = Batch(count=rng.randint(1, 12)) if rng.random() < 0.5 else Batch(percent=rng.randint(1, 100))
        waves = plan_waves(targets, canary, batch)
        assert [d for w in waves for d in w] == targets
        assert all(waves)
        if canary:
            assert len(waves[0]) == canary


def test_bad_waves_and_batches() -> None:
    with pytest.raises(PlanError, match="--canary 5: more than the 4"):
        plan_waves(DEVICES[:4], 5, Batch(count=1))
    with pytest.raises(PlanError, match="empty"):
        plan_waves([], 0, Batch(count=1))
    for bad in ("0", "0%", "101%", "-1", "3.5", "x", "", "25 %", "1" * 9):
        with pytest.raises(PlanError, match="--batch"):
            parse_batch(bad)
    assert parse_batch(" 3 ") == Batch(count=3) and str(parse_batch("30%")) == "30%"


def test_options_are_checked_naming_the_flag() -> None:
    RolloutOptions().check()
    for kw, flag in (
        ({"canary": -1}, "--canary"),
        ({"max_failures": -2}, "--max-failures"),
        ({"soak_s": float("nan")}, "--soak"),
        ({"offline_timeout_s": -1.0}, "--offline-timeout"),
        ({"device_timeout_s": 0.0}, "--device-timeout"),
    ):
        with pytest.raises(PlanError, match=flag):
            RolloutOptions(**kw).check()


def test_device_lists() -> None:
    assert split_devices("b, a,b") == ["a", "b"]
    for bad in ("", "a,,b", "a,_all", "a,b/c", "a,+"):
        with pytest.raises(PlanError, match="--devices"):
            split_devices(bad)


def test_more_than_k_failures_halt() -> None:
    assert not failures_exceeded(0, 0) and failures_exceeded(1, 0)
    assert not failures_exceeded(2, 2) and failures_exceeded(3, 2)


# ---- the state document -----------------------------------------------------------------------------------
class _Doc:
    model, version, request_id = "det", "v2", "deploy-v2"


def _rollout() -> Rollout:
    opts = RolloutOptions(canary=1, batch=Batch(count=2), soak_s=2.0, rollback_on_halt=True)
    r = Rollout.create(new_id(), _Doc(), "a" * 64, plan_waves(DEVICES[:4], 1, opts.batch), opts)
    r.devices["d00"].move(SUCCEEDED, None, 10.0)
    r.devices["d01"].stage, r.devices["d01"].deployment, r.devices["d01"].progress = (
        DEPLOYING,
        "building",
        0.4,
    )
    return r


def test_state_round_trips() -> None:
    r = _rollout()
    back = Rollout.from_payload(r.payload())
    assert back.fields() == r.fields()
    assert back.waves == [["d00"], ["d01", "d02"], ["d03"]]
    assert json.loads(r.payload())["schema"] == "edge-agent/rollout/1"
    check_id(r.id)


def _mutations(body: dict) -> list[object]:
    junk: list[object] = [None, True, -1, 1e308, float("nan"), "", "x" * 5000, [], {}, [1], {"a": 1}]
    out: list[object] = []
    for key in body:
        for value in junk:
            out.append({**body, key: value})
        out.append({k: v for k, v in body.items() if k != key})
    dev = body["devices"]["d01"]
    for key in dev:
        for value in junk:
            out.append({**body, "devices": {**body["devices"], "d01": {**dev, key: value}}})
    for key in ("batch", "canary", "soak_s", "skip_offline"):
        for value in junk:
            out.append({**body, "options": {**body["options"], key: value}})
    return out


def test_malformed_states_are_refused_never_crash() -> None:
    body = _rollout().fields()
    for raw in (b"", b"\xff\xfe", b"[]", b"null", b"{" * 100_000, b'{"schema": 1}', b"1" * (5 << 20)):
        with pytest.raises(RolloutStateError):
            Rollout.from_payload(raw)
    accepted = 0
    for mutated in _mutations(body):
        try:
            raw = json.dumps(mutated).encode()
        except ValueError:
            continue
        try:
            back = Rollout.from_payload(raw)
            accepted += 1  # a value that is still valid (a reason of None, a number for a number)
            render_detail(back), render_list({back.id: back}), json.dumps(back.fields())  # shown, no crash
        except RolloutStateError as exc:
            assert str(exc) and "\n" not in str(exc)
    assert accepted < len(_mutations(body)) // 2


def test_escapes_from_the_network_never_reach_the_terminal() -> None:
    body = _rollout().fields()
    body["devices"]["d01"]["reason"] = "gate\x1b[2J\x07 failed\nnext"
    r = Rollout.from_payload(json.dumps(body).encode())
    text = render_detail(r)
    assert "\x1b" not in text and "\x07" not in text and "gate" in text


# ---- one device's next move -------------------------------------------------------------------------------
GOAL = Goal("det", "v2", "deploy-v2")
OPTS = RolloutOptions(soak_s=10.0, offline_timeout_s=30.0, device_timeout_s=600.0)


def _obs(
    online: bool = True,
    offline_for: float = 0.0,
    state: dict | None = None,
    new: bool = True,
    answer: dict | None = None,
) -> Observation:
    return Observation(online, offline_for, state, new, answer)


def _state(stage: str, version: str = "v2", rid: str | None = "deploy-v2", **more: object) -> dict:
    return {"stage": stage, "version": version, "request_id": rid, "previous": "v1", **more}


def _sent(t: float = 100.0) -> DeviceRecord:
    rec = DeviceRecord("d", 0, DEPLOYING)
    rec.sent_at = t
    return rec


def test_pending_online_is_sent_offline_waits_then_fails_or_skips() -> None:
    rec = DeviceRecord("d", 0)
    assert step(rec, _obs(), GOAL, OPTS, 0.0) == SEND
    assert step(rec, _obs(online=False, offline_for=5), GOAL, OPTS, 0.0) is None
    assert rec.stage == PENDING and "waiting" in (rec.reason or "")
    step(rec, _obs(online=False, offline_for=30), GOAL, OPTS, 0.0)
    assert rec.stage == FAILED and "offline" in (rec.reason or "")
    rec = DeviceRecord("d", 0)
    step(rec, _obs(online=False), GOAL, RolloutOptions(skip_offline=True), 0.0)
    assert rec.stage == SKIPPED


def test_serving_then_soak_then_done() -> None:
    rec = _sent()
    step(rec, _obs(state=_state("building", progress=0.5)), GOAL, OPTS, 110.0)
    assert (rec.stage, rec.deployment, rec.progress) == (DEPLOYING, "building", 0.5)
    step(rec, _obs(state=_state("serving")), GOAL, OPTS, 120.0)
    assert rec.stage == SOAKING and rec.promoted and rec.previous == "v1" and rec.serving_at == 120.0
    step(rec, _obs(state=_state("serving"), new=False), GOAL, OPTS, 125.0)
    assert rec.stage == SOAKING and rec.progress == pytest.approx(0.5)
    step(rec, _obs(state=_state("serving"), new=False), GOAL, OPTS, 130.0)
    assert rec.stage == SUCCEEDED


def test_leaving_serving_during_the_soak_fails() -> None:
    rec = _sent()
    step(rec, _obs(state=_state("serving")), GOAL, OPTS, 120.0)
    step(
        rec,
        _obs(state=_state("rolled_back", version="v1", rid=None, reason="watch: camera failed")),
        GOAL,
        OPTS,
        121.0,
    )
    assert rec.stage == FAILED and "left serving during the soak" in (rec.reason or "")


def test_a_state_from_before_the_command_does_not_count() -> None:
    rec = _sent()
    step(rec, _obs(state=_state("rejected", reason="gating: old"), new=False), GOAL, OPTS, 101.0)
    assert rec.stage == DEPLOYING
    step(rec, _obs(state=_state("rejected", rid="other")), GOAL, OPTS, 101.0)  # another deployment's
    assert rec.stage == DEPLOYING


def test_rejected_refused_silent_and_slow_devices_fail() -> None:
    rec = _sent()
    step(rec, _obs(state=_state("rejected", reason="gating: agreement 0.00 < 0.6")), GOAL, OPTS, 101.0)
    assert rec.stage == FAILED and rec.reason == "rejected: gating: agreement 0.00 < 0.6" and not rec.promoted
    rec = _sent()
    step(rec, _obs(answer={"ok": False, "error": "deployments are off"}), GOAL, OPTS, 101.0)
    assert rec.stage == FAILED and "deployments are off" in (rec.reason or "")
    rec = _sent()
    step(rec, _obs(), GOAL, OPTS, 129.0)
    assert rec.stage == DEPLOYING
    step(rec, _obs(), GOAL, OPTS, 131.0)
    assert rec.stage == FAILED and "no answer" in (rec.reason or "")
    rec = _sent()
    step(rec, _obs(state=_state("building")), GOAL, OPTS, 699.0)
    step(rec, _obs(state=_state("building"), new=False), GOAL, OPTS, 701.0)
    assert rec.stage == FAILED and "not serving within 600 s (last: building)" in (rec.reason or "")


def test_offline_while_deploying_fails_after_the_timeout_or_is_skipped() -> None:
    rec = _sent()
    step(rec, _obs(online=False, offline_for=29), GOAL, OPTS, 140.0)
    assert rec.stage == DEPLOYING
    step(rec, _obs(online=False, offline_for=31), GOAL, OPTS, 141.0)
    assert rec.stage == FAILED and "offline for 31 s while deploying" in (rec.reason or "")
    rec = _sent()
    step(
        rec,
        _obs(online=False, offline_for=31),
        GOAL,
        RolloutOptions(skip_offline=True, offline_timeout_s=30),
        141.0,
    )
    assert rec.stage == SKIPPED


def test_already_serving_soaks_without_a_new_state() -> None:
    rec = _sent()
    step(
        rec,
        _obs(state=_state("rejected", version="v3"), new=False, answer={"ok": True, "stage": "serving"}),
        GOAL,
        OPTS,
        101.0,
    )
    assert rec.stage == SOAKING and rec.already and not rec.promoted
    step(rec, _obs(state=_state("serving", rid="an-earlier-one")), GOAL, OPTS, 105.0)
    assert rec.stage == SOAKING
    step(rec, _obs(state=_state("serving", rid="an-earlier-one"), new=False), GOAL, OPTS, 111.0)
    assert rec.stage == SUCCEEDED


# ---- the table --------------------------------------------------------------------------------------------
def test_table_lines_per_change_and_list() -> None:
    r = _rollout()
    out = io.StringIO()
    live = LiveTable(out, tty=False)
    live(r, None)
    live(r, r.devices["d01"])
    lines = out.getvalue().splitlines()
    assert f"rollout {r.id}: det v2 to 4 devices, running, wave 1/3" in lines[0]
    assert lines[1].endswith("wave 2 d01: deploying building 40%")
    detail = render_detail(r)
    assert "WAVE  DEVICE  STAGE" in detail and "d00     done" in detail
    listing = render_list({r.id: r, "junk": RolloutStateError("not JSON (UTF-8)")})
    assert r.id in listing and "junk" in listing and "unreadable" in listing
    tty = io.StringIO()
    LiveTable(tty, tty=True)(r, r.devices["d01"])
    assert tty.getvalue().startswith("\x1b[H\x1b[2J")


def test_already_serving_this_documents_own_deployment_counts_as_promoted() -> None:
    """A resumed rollout whose command went out twice: the device finished the first (same request_id)."""
    rec = _sent()
    step(
        rec,
        _obs(state=_state("serving"), new=False, answer={"ok": True, "stage": "serving"}),
        GOAL,
        OPTS,
        101.0,
    )
    assert rec.stage == SOAKING and rec.promoted and not rec.already
