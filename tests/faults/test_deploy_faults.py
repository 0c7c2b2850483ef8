"""Deployments under faults and bad input, against the real agent on mosquitto (issue 37, "Faults and bad
input"): artifacts from nginx (HTTPS with a test CA) and from the fault server (tests/fixtures_http.py),
documents through cmd/deploy, kill -9 / SIGHUP of the agent process, a full disk (a tmpfs state_dir).

Every case checks the same things:
  - a clear reason on `deployments/detector` and in the cmd/deploy result (its field where one applies); no
    URL credentials anywhere (every artifact URL carries user:password@ and ?token=): states, answers, log;
  - the serving model never stops: frames processed during the deployment (telemetry cameras.C.frames_out)
    >= 99 % of the rate before it, less one frame per camera at each end of the window (the counters'
    granularity: a stop of half a second fails it), and no camera leaves `streaming`;
  - nothing left behind: no file under staging/, no folder of a refused version, no .part (but the one a
    killed download resumes from).
A deployment refused at once (a bad document) takes less than a telemetry period: those cases share one
window, checked after them (test_refusals_at_the_door_never_stopped_the_model).

One agent serves the whole module (cases run in file order; the kill cases restart it); its state_dir is a
tmpfs where mount works (the disk-full cases are skipped elsewhere).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fixtures_agent import AgentProcess
from fixtures_deploy import (
    BASE,
    KEY_ID,
    MODEL,
    DeployKit,
    agent_config,
    deploy_kit,  # noqa: F401  (the module's artifact store, a fixture)
    states,
)
from fixtures_http import FaultServer, FaultState, running_faults
from fixtures_mqtt import MOSQUITTO, Broker, Subscriber

from agent.deploy.signing import generate_keys, sign_document

pytestmark = pytest.mark.slow

USER, PASSWORD, TOKEN = "fetcher", "Pa55-in-url", "tok-7f3e9a"  # must never show
SECRETS = (PASSWORD, TOKEN, f"{USER}:")
CAMERAS = 2
FINAL = ("serving", "rejected", "rolled_back", "failed")
STATE_MB = 128  # the tmpfs: two kept versions (15 MB each), a staged one and the download reserve (16 MB)


# ---- the module's agent ----
@dataclass
class Live:
    """The agent every case of the module talks to, its broker, subscriber and state folder."""

    tmp: Path
    kit: DeployKit
    broker: Broker
    sub: Subscriber
    config: Path
    state_dir: Path
    no_tmpfs: str | None  # why the state folder is no tmpfs (None: it is one)
    agent: AgentProcess | None = None
    since: float = 0.0  # wall clock when the running agent was started (its counters count from there)
    runs: int = 0
    base_rate: float = 0.0  # frames/s processed before any deployment (a lower bound, see rate())
    door: list[float] = field(default_factory=list)  # the refusals' window: [first start, last end]
    seq: int = 0

    # -- process ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.runs += 1
        self.since = time.time()
        self.agent = AgentProcess(self.config, self.tmp / f"agent-{self.runs}.log")
        self.wait_streaming()

    def wait_streaming(self, timeout: float = 90.0) -> None:
        """Until two telemetry messages of this agent show every camera streaming and processing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"agent exited: {self.text()[-3000:]}"
            good = [
                t
                for t in self.telemetry()
                if len(t["cameras"]) == CAMERAS
                and all(c.get("state") == "streaming" and c.get("frames_out") for c in t["cameras"].values())
            ]
            if len(good) >= 2:
                return
            time.sleep(0.2)
        pytest.fail(f"agent not streaming within {timeout} s: {self.text()[-3000:]}")

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.agent is not None
        return self.agent.proc

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def text(self) -> str:
        return self.agent.text() if self.agent is not None else ""

    # -- what it publishes -----------------------------------------------------------------------------
    def telemetry(self) -> list[dict[str, Any]]:
        """The running agent's telemetry (ts, cameras), oldest first."""
        out = []
        for topic, body, _ in self.sub.snapshot():
            if topic == f"{BASE}/telemetry" and body:
                t = json.loads(body)
                if float(t.get("ts") or 0) >= self.since:
                    out.append(t)
        return out

    def frames(self) -> list[tuple[float, int]]:
        return [
            (float(t["ts"]), sum(int(c.get("frames_out") or 0) for c in (t.get("cameras") or {}).values()))
            for t in self.telemetry()
        ]

    def rid(self, what: str) -> str:
        self.seq += 1
        return f"faults-{what}-{self.seq}"


def frames_between(live: Live, t0: float, t1: float, timeout: float = 10.0) -> tuple[int, float]:
    """Frames processed from the last telemetry at or before `t0` to the first at or after `t1` (waited
    for), and that span in seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pts = live.frames()
        before = [p for p in pts if p[0] <= t0]
        after = [p for p in pts if p[0] >= t1]
        if before and after:
            (ts0, f0), (ts1, f1) = before[-1], after[0]
            return f1 - f0, ts1 - ts0
        if time.monotonic() > deadline:
            pytest.fail(f"no telemetry around [{t0}, {t1}] (have {len(pts)} of this agent)")
        time.sleep(0.2)


def assert_served(live: Live, t0: float, t1: float, what: str) -> None:
    """The serving model did not stop between t0 and t1 (wall clock) and no camera left streaming."""
    frames, span = frames_between(live, t0, t1)
    expected = 0.99 * live.base_rate * span
    assert frames + 2 * CAMERAS >= expected, (
        f"{what}: {frames} frames in {span:.1f} s, {live.base_rate:.2f}/s before: >= {expected:.0f} expected"
    )
    for topic, body, _ in live.sub.snapshot():
        if topic.startswith(f"{BASE}/cameras/") and topic.endswith("/state") and body:
            st = json.loads(body)
            if t0 <= float(st.get("ts") or 0) <= t1:
                assert st["state"] == "streaming", f"{what}: {topic} {st['state']} during the deployment"


def assert_clear(text: str | None, *words: str) -> None:
    """A reason: one line, says each of `words` (any case), holds no URL credential."""
    assert isinstance(text, str) and text.strip(), f"no reason: {text!r}"
    assert "\n" not in text and len(text) <= 600, text
    for secret in SECRETS:
        assert secret not in text, f"credential in {text!r}"
    low = text.lower()
    for word in words:
        assert word.lower() in low, f"{word!r} not in {text!r}"


def assert_no_secrets(live: Live) -> None:
    for topic, body, _ in live.sub.snapshot():
        if "/deployments/" in topic or topic.endswith("/cmd/deploy/result"):
            for secret in SECRETS:
                assert secret.encode() not in body, (topic, body[:300])
    log = live.text()
    for secret in SECRETS:
        assert secret not in log, f"credential in the agent log: {secret}"


def leftovers(live: Live, version: str | None, part_ok: bool = False) -> list[str]:
    """What a refused deployment left: files under staging/, the refused version's folder, .part files."""
    root = live.state_dir
    left = [
        str(p.relative_to(root))
        for p in (root / "staging").rglob("*")
        if p.is_file() and not (part_ok and p.name.endswith(".part"))
    ]
    if version is not None and (root / "models" / MODEL / version).exists():
        left.append(f"models/{MODEL}/{version}")
    if not part_ok:
        left += [str(p.relative_to(root)) for p in root.rglob("*.part")]
    return left


def serving_version(live: Live) -> str | None:
    path = live.state_dir / "models" / MODEL / "serving.json"
    return json.loads(path.read_text()).get("serving") if path.exists() else None


# ---- documents ----
def secret_url(url: str) -> str:
    """`url` with user:password@ and ?token= (servers here ignore both; the agent must never show them)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{USER}:{PASSWORD}@{rest}?token={TOKEN}"


def art(data: bytes, url: str) -> dict[str, Any]:
    return {"url": secret_url(url), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


_SUMS: dict[Path, tuple[str, int]] = {}  # the store's files do not change: hashed once (the CPU is shared)


def store_art(kit: DeployKit, name: str) -> dict[str, Any]:
    """An artifact of the nginx store over HTTPS (the test CA is deploy.ca_file)."""
    path = kit.www / name
    if path not in _SUMS:
        data = path.read_bytes()
        _SUMS[path] = hashlib.sha256(data).hexdigest(), len(data)
    sha, size = _SUMS[path]
    return {"url": secret_url(kit.nginx.url(name, tls=True)), "sha256": sha, "size": size}


def document(
    live: Live,
    version: str,
    *,
    onnx: dict | None = None,
    labels: dict | None = None,
    sign: bool = True,
    **more: Any,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": MODEL,
        "version": version,
        "format": "nanodet",
        "artifacts": {
            "onnx": onnx or store_art(live.kit, "v2.onnx"),
            "labels": labels or store_art(live.kit, "coco.names"),
        },
        "gate": {"frames": 10},
        "shadow": {"frames": 8, "max_latency_ratio": 10.0},  # the shared 2-core machine, not the model
        "watch_s": 0,
        "request_id": live.rid(version),
        **more,
    }
    return sign_document(doc, live.kit.private_key, KEY_ID) if sign else doc


def resign(live: Live, doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k != "signature"}
    return sign_document(body, live.kit.private_key, KEY_ID)


def send(live: Live, doc: dict[str, Any] | bytes, timeout: float = 30.0) -> dict[str, Any]:
    """Publish cmd/deploy; the first cmd/deploy/result after it (cases run one at a time)."""
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    start = len(live.sub.snapshot())
    live.sub.publish(f"{BASE}/cmd/deploy", raw)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for topic, body, _ in live.sub.snapshot()[start:]:
            if topic == f"{BASE}/cmd/deploy/result":
                return dict(json.loads(body))
        time.sleep(0.05)
    pytest.fail(f"no cmd/deploy/result within {timeout} s: {live.text()[-3000:]}")


def reason_of(answer: dict[str, Any]) -> str | None:
    return answer.get("reason") or answer.get("error")


def final(live: Live, version: str, after: int, timeout: float = 180.0) -> dict[str, Any]:
    """The first final state of `version` among the states from the `after`-th on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for st in states(live.sub)[after:]:
            if st.get("version") == version and st.get("stage") in FINAL:
                return st
        if live.agent is not None and live.proc.poll() is not None:
            pytest.fail(f"agent exited: {live.text()[-3000:]}")
        time.sleep(0.1)
    seen = [(s.get("version"), s.get("stage"), s.get("reason")) for s in states(live.sub)[after:]]
    pytest.fail(f"{version}: no final state within {timeout} s; seen {seen}\n{live.text()[-3000:]}")


def reach(
    live: Live,
    version: str,
    stage: str,
    after: int,
    timeout: float = 120.0,
    cond: Callable[[dict[str, Any]], bool] = lambda s: True,
) -> dict[str, Any]:
    """The first state of `version` in `stage` (meeting `cond`) from the `after`-th on; a final one fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for st in states(live.sub)[after:]:
            if st.get("version") != version:
                continue
            if st.get("stage") == stage and cond(st):
                return st
            if st.get("stage") in FINAL:
                pytest.fail(f"{version} ended {st['stage']} ({st.get('reason')}) before {stage}")
        time.sleep(0.02)
    pytest.fail(f"{version} not in {stage} within {timeout} s\n{live.text()[-3000:]}")


def deployed(
    live: Live,
    doc: dict[str, Any],
    expect: str,
    *words: str,
    during: Callable[[dict[str, Any]], None] | None = None,
    timeout: float = 180.0,
) -> dict[str, Any]:
    """Send `doc`, wait for its end, check the end's stage and reason, the serving model's frames and what
    is left; `during(answer)` runs while it is in flight. Returns the final state."""
    after = len(states(live.sub))
    t0 = time.time()
    answer = send(live, doc)
    assert answer.get("ok") is True, answer
    if during is not None:
        during(answer)
    end = final(live, doc["version"], after, timeout)
    t1 = time.time()
    assert end["stage"] == expect, end
    if expect != "serving":
        assert_clear(end.get("reason"), *words)
        assert leftovers(live, doc["version"]) == []
    assert_served(live, t0, t1, f"{doc['version']} ({expect})")
    assert_no_secrets(live)
    return end


# ---- fixtures ----
@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[str | None]:
    """`path` as a tmpfs of STATE_MB (None), or a plain folder and why not."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={STATE_MB}m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        yield f"mount refused: {(res.stderr or res.stdout).strip()[:200]}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, deploy_kit: DeployKit) -> Iterator[Live]:  # noqa: F811
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    tmp = tmp_path_factory.mktemp("deploy-faults")
    broker = Broker(tmp)
    state_dir = tmp / "deploy-state"
    with small_disk(state_dir) as no_tmpfs:
        broker.start()
        sub = Subscriber(broker.port, f"{BASE}/#")
        config = agent_config(
            tmp,
            broker.port,
            deploy_kit,
            state_dir=state_dir,
            deploy={"allow_http": False, "connect_timeout_s": 2, "read_timeout_s": 2, "keep_versions": 1},
        )
        lv = Live(tmp, deploy_kit, broker, sub, config, state_dir, no_tmpfs)
        try:
            lv.start()
            time.sleep(8)  # the rate before any deployment, over 8 s or more
            pts = lv.frames()
            (ts0, f0), (ts1, f1) = pts[0], pts[-1]
            lv.base_rate = (f1 - f0 - 2 * CAMERAS) / (ts1 - ts0)  # a lower bound (granularity)
            assert lv.base_rate > 1, pts
            yield lv
        finally:
            if lv.agent is not None:
                lv.agent.kill()
            sub.close()
            broker.kill()


@pytest.fixture
def agent_up(live: Live) -> Live:
    """The module's agent, started again if an earlier case left it dead."""
    if live.agent is None or live.proc.poll() is not None:
        live.start()
    return live


@pytest.fixture(scope="module")
def faults(live: Live) -> Iterator[FaultServer]:
    """The fault server over HTTPS (the test CA's certificate for 127.0.0.1); its payload is a labels file
    of 2.6 kB (every mode fails before it would be verified)."""
    state = FaultState(
        payload=(live.kit.www / "coco.names").read_bytes() + b"\n" * 2000,
        fail_times=10**6,
        drip_s=0.5,
        drip_for_s=4.0,
    )
    with running_faults(state, live.kit.pki.server_context()) as server:
        yield server


@pytest.fixture(scope="module")
def misnamed(live: Live) -> Iterator[FaultServer]:
    """The fault server with a certificate of the test CA for another name (other.invalid)."""
    state = FaultState(payload=(live.kit.www / "coco.names").read_bytes())
    with running_faults(state, live.kit.pki.server_context(other_name=True)) as server:
        yield server


@pytest.fixture(scope="module")
def slow(live: Live) -> Iterator[FaultServer]:
    """The fault server's /slow serving v3.onnx (15 MB) at 3 MB/s over HTTPS: a download that lasts."""
    state = FaultState(payload=(live.kit.www / "v3.onnx").read_bytes(), slow_bps=3 << 20)
    with running_faults(state, live.kit.pki.server_context()) as server:
        yield server


def slow_art(server: FaultServer) -> dict[str, Any]:
    return art(server.state.payload, server.url("slow"))


# ---- refused at the door: signature, model, the document field by field ----
def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return out


MB = "x" * (1 << 20)
# (document field, bad value, the field the refusal must name)
FUZZ: list[tuple[str, Any, str]] = [
    ("model", 5, "model"),
    ("model", "../etc", "model"),
    ("model", None, "model"),
    ("version", "", "version"),
    ("version", "v" * 129, "version"),
    ("version", ["v9"], "version"),
    ("version", "a/b", "version"),
    ("format", "yolo99", "format"),
    ("format", {"name": "nanodet"}, "format"),
    ("artifacts", "everything", "artifacts"),
    ("artifacts.onnx", None, "artifacts.onnx"),
    ("artifacts.onnx.url", 7, "artifacts.onnx.url"),
    ("artifacts.onnx.url", "ftp://127.0.0.1/m.onnx", "artifacts.onnx.url"),
    ("artifacts.onnx.url", "https://127.0.0.1/" + "a" * 5000, "artifacts.onnx.url"),
    ("artifacts.onnx.url", "https://127.0.0.1/a b", "artifacts.onnx.url"),
    ("artifacts.onnx.sha256", "ABC", "artifacts.onnx.sha256"),
    ("artifacts.onnx.sha256", "A" * 64, "artifacts.onnx.sha256"),
    ("artifacts.onnx.size", "15176183", "artifacts.onnx.size"),
    ("artifacts.onnx.size", 0, "artifacts.onnx.size"),
    ("artifacts.onnx.size", -1, "artifacts.onnx.size"),
    ("artifacts.onnx.size", 1 << 41, "artifacts.onnx.size"),
    ("artifacts.onnx.size", 1.5, "artifacts.onnx.size"),
    ("artifacts.onnx.size", True, "artifacts.onnx.size"),
    ("artifacts.labels.mirror", "https://127.0.0.1/x", "artifacts.labels.mirror"),
    ("artifacts.weights", {"url": "https://127.0.0.1/w"}, "artifacts.weights"),
    ("precision", "int4", "precision"),
    ("precision", 16, "precision"),
    ("gate.min_agreement", 2, "gate.min_agreement"),
    ("gate.min_agreement", "high", "gate.min_agreement"),
    ("gate.frames", -1, "gate.frames"),
    ("gate.extra", 1, "gate.extra"),
    ("shadow.max_latency_ratio", 0.5, "shadow.max_latency_ratio"),
    ("shadow.frames", 10**7, "shadow.frames"),
    ("watch_s", 1e9, "watch_s"),
    ("watch_s", "300", "watch_s"),
    ("request_id", {"id": 1}, "request_id"),
    ("request_id", "r" * 129, "request_id"),
    ("surprise", True, "surprise"),
    ("signature.key_id", 5, "signature.key_id"),
    ("signature.extra", "x", "signature.extra"),
]
# 1 MB strings: the MQTT command limit (or the document's own bound) answers them, never quoting them.
HUGE: list[tuple[str, Any, str]] = [
    ("version", MB, "version"),
    ("artifacts.onnx.url", "https://127.0.0.1/" + MB, "artifacts.onnx.url"),
    ("request_id", MB, "request_id"),
    (MB, 1, "<a key of"),
]


def _check_refused(
    live: Live, answer: dict[str, Any], after: int, field_: str | None, *words: str, state: bool = True
) -> None:
    assert answer.get("ok") is False, answer
    reason = reason_of(answer)
    assert_clear(reason, *words)
    if field_ is not None:
        assert answer.get("field") == field_ or field_ in str(reason), answer
    if state:  # a refusal of a document for a model of the config shows on that model's state
        deadline = time.monotonic() + 5
        while not states(live.sub)[after:] and time.monotonic() < deadline:
            time.sleep(0.05)
        got = states(live.sub)[after:]
        assert got and got[-1]["stage"] == "rejected", f"no rejected state: {got}"
        assert got[-1]["reason"] == reason or reason in got[-1]["reason"], (got[-1], answer)
    assert leftovers(live, None) == []


def _door(live: Live) -> Callable[[], None]:
    t0 = time.time()

    def done() -> None:
        live.door[:] = [min([t0, *live.door[:1]]), time.time()]

    return done


@pytest.mark.parametrize(("path", "value", "field_"), FUZZ, ids=[f"{p}={str(v)[:12]}" for p, v, _ in FUZZ])
def test_a_fuzzed_document_is_refused_naming_the_field(
    agent_up: Live, path: str, value: Any, field_: str
) -> None:
    live, done = agent_up, _door(agent_up)
    doc = document(live, "fz1", sign=False)
    doc = (
        resign(live, _set(doc, path, value))
        if not path.startswith("signature")
        else _set(resign(live, doc), path, value)
    )
    after = len(states(live.sub))
    answer = send(live, doc)
    # A document whose model is one of the config's has its refusal on that model's state topic; a bad
    # request_id is the command envelope's, refused by the MQTT command layer before any document is read.
    on_topic = not path.startswith(("model", "request_id"))
    _check_refused(live, answer, after, field_, state=on_topic)
    if not on_topic:
        assert states(live.sub)[after:] == []  # no topic for a model that is none of the config's
    done()


@pytest.mark.parametrize(("path", "value", "field_"), HUGE, ids=["version", "url", "request_id", "key"])
def test_a_1mb_field_is_refused_without_being_quoted(
    agent_up: Live, path: str, value: Any, field_: str
) -> None:
    live, done = agent_up, _door(agent_up)
    doc = resign(live, _set(document(live, "fz2", sign=False), path, value))
    after = len(states(live.sub))
    answer = send(live, doc)
    assert answer.get("ok") is False, answer
    reason = reason_of(answer)
    assert_clear(reason)
    assert "x" * 100 not in json.dumps(answer)  # never quoted back
    limit = any(w in str(reason).lower() for w in ("too large", "larger than", "at most", "too long"))
    assert answer.get("field") == field_ or field_ in str(reason) or limit, answer
    for st in states(live.sub)[after:]:
        assert "x" * 100 not in json.dumps(st) and st["stage"] == "rejected", st
    assert leftovers(live, None) == []
    done()


def _unsigned(live: Live) -> dict[str, Any]:
    return document(live, "sg1", sign=False)


def _wrong(live: Live) -> dict[str, Any]:
    import base64

    doc = document(live, "sg1")
    doc["signature"]["ed25519"] = base64.b64encode(bytes(64)).decode()
    return doc


def _unknown_key(live: Live) -> dict[str, Any]:
    rogue = live.tmp / "rogue"
    if not (rogue / "rogue.key").exists():
        generate_keys(rogue, "rogue")
    return sign_document(document(live, "sg1", sign=False), rogue / "rogue.key", "rogue")


def _forged_as_ops(live: Live) -> dict[str, Any]:
    """Signed by a key that is not trusted, claiming the trusted key id."""
    rogue = live.tmp / "rogue2"
    if not (rogue / "ops.key").exists():
        generate_keys(rogue, "ops")
    return sign_document(document(live, "sg1", sign=False), rogue / "ops.key", "ops")


def _modified(live: Live) -> dict[str, Any]:
    doc = document(live, "sg1")
    doc["artifacts"]["onnx"]["url"] = secret_url(live.kit.nginx.url("v3.onnx", tls=True))
    return doc


def _modified_setting(live: Live) -> dict[str, Any]:
    doc = document(live, "sg1")
    doc["gate"]["min_agreement"] = 0.0  # an attacker lowering the floor
    return doc


SIGNATURES = {
    "missing": (_unsigned, ("not signed",)),
    "wrong": (_wrong, ("does not match",)),
    "unknown-key": (_unknown_key, ("rogue", "ops")),
    "forged-key-id": (_forged_as_ops, ("does not match",)),
    "modified-url": (_modified, ("does not match",)),
    "modified-gate": (_modified_setting, ("does not match",)),
}


@pytest.mark.parametrize("case", list(SIGNATURES))
def test_a_bad_signature_is_refused_before_anything_is_fetched(agent_up: Live, case: str) -> None:
    live, done = agent_up, _door(agent_up)
    make, words = SIGNATURES[case]
    marks = len(live.kit.nginx.requests())
    after = len(states(live.sub))
    answer = send(live, make(live))
    _check_refused(live, answer, after, "signature", *words)
    fetched = [r for r in live.kit.nginx.requests()[marks:] if ".onnx" in r or ".names" in r]
    assert fetched == [], fetched
    done()


def test_a_model_that_is_not_in_the_config_is_refused(agent_up: Live) -> None:
    live, done = agent_up, _door(agent_up)
    after = len(states(live.sub))
    answer = send(live, document(live, "m1", model="elsewhere"))
    _check_refused(live, answer, after, "model", "elsewhere", "not a model", state=False)
    assert states(live.sub)[after:] == []
    assert not any("/deployments/elsewhere" in t for t, _, _ in live.sub.snapshot())
    done()


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"model": "detector", "model": "x"}'],
    ids=["not-json", "array", "not-utf8", "duplicate-key"],
)
def test_a_payload_that_is_no_document_is_answered(agent_up: Live, raw: bytes) -> None:
    live, done = agent_up, _door(agent_up)
    answer = send(live, raw)
    assert answer.get("ok") is False, answer
    assert_clear(reason_of(answer))
    assert leftovers(live, None) == []
    done()


def test_refusals_at_the_door_never_stopped_the_model(agent_up: Live) -> None:
    live = agent_up
    assert len(live.door) == 2, "run with the refusal cases above"
    assert_served(live, *live.door, "the refusals at the door")
    assert_no_secrets(live)
    assert "Traceback" not in live.text(), live.text()[-4000:]


# ---- the artifact server's faults ----
# (mode of the fault server, expected end, words of the reason); the onnx artifact comes from it (2.6 kB:
# every mode fails before it would be verified).
SERVER_FAULTS = [
    ("missing", "rejected", ("404",)),
    ("flaky", "failed", ("500", "gave up")),  # answers 500 every time: retried with backoff, then given up
    ("truncate", "failed", ("closed after", "gave up")),
    ("long-length", "rejected", ("announces",)),
    ("short-length", "rejected", ("announces",)),
    ("no-length-long", "rejected", ("longer than",)),
    ("drip", "failed", ("stalled", "gave up")),
    ("to-http", "rejected", ("redirect", "scheme")),
    ("to-other-host", "rejected", ("redirect", "another host")),
]


@pytest.mark.parametrize(("mode", "expect", "words"), SERVER_FAULTS, ids=[m for m, _, _ in SERVER_FAULTS])
def test_an_artifact_server_fault_ends_the_deployment_with_its_reason(
    agent_up: Live, faults: FaultServer, mode: str, expect: str, words: tuple[str, ...]
) -> None:
    onnx = art(faults.state.payload, faults.url(mode))
    end = deployed(agent_up, document(agent_up, f"srv-{mode}", onnx=onnx), expect, *words)
    assert "artifact.bin" in end["reason"]  # the URL as shown: path, no credentials, no query


def test_a_certificate_for_another_name_is_refused(agent_up: Live, misnamed: FaultServer) -> None:
    onnx = art(misnamed.state.payload, misnamed.url("ok"))
    deployed(agent_up, document(agent_up, "tls-name", onnx=onnx), "rejected", "certificate", "refused")


def test_plain_http_is_refused_where_the_config_does_not_allow_it(agent_up: Live) -> None:
    kit = agent_up.kit
    onnx = art((kit.www / "v2.onnx").read_bytes(), kit.nginx.url("v2.onnx", tls=False))
    deployed(agent_up, document(agent_up, "plain", onnx=onnx), "rejected", "http://", "allow_http")


def test_a_sha256_mismatch_is_rejected(agent_up: Live) -> None:
    onnx = store_art(agent_up.kit, "coco.names") | {"sha256": "0" * 64}  # small: fetched, then refused
    deployed(agent_up, document(agent_up, "sha", onnx=onnx), "rejected", "sha256 mismatch")


# ---- bad models ----
def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(200_000))


def _wrong_outputs(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 416, 416])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 1, 1])
    graph = helper.make_graph([helper.make_node("GlobalAveragePool", ["data"], ["out"])], "wrong", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _short_labels(path: Path) -> None:
    lines = (Path(__file__).resolve().parents[2] / "agent" / "assets" / "coco.names").read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # 79 labels for an 80-class model


BAD_MODELS = {
    "garbage-onnx": ("garbage.onnx", "coco.names", _garbage, ("onnx:", "not a valid onnx")),
    "wrong-outputs": ("wrong_outputs.onnx", "coco.names", _wrong_outputs, ("onnx:", "not nanodet outputs")),
    "labels-mismatch": ("v2.onnx", "short.names", _short_labels, ("labels:", "79 labels")),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_model_that_cannot_serve_is_rejected_at_verify(agent_up: Live, case: str) -> None:
    onnx_name, labels_name, maker, words = BAD_MODELS[case]
    kit = agent_up.kit
    kit.add(onnx_name if maker is not _short_labels else labels_name, maker)
    doc = document(
        agent_up, f"bad-{case}", onnx=store_art(kit, onnx_name), labels=store_art(kit, labels_name)
    )
    after = len(states(agent_up.sub))
    deployed(agent_up, doc, "rejected", *words)
    stages = [s["stage"] for s in states(agent_up.sub)[after:] if s.get("version") == doc["version"]]
    assert "verifying" in stages and "building" not in stages, stages


# ---- versions that serve, races, SIGHUP ----
def test_a_good_version_serves_while_the_model_keeps_serving(agent_up: Live) -> None:
    end = deployed(agent_up, document(agent_up, "good-1"), "serving")
    assert serving_version(agent_up) == "good-1" and end["versions"][0] == "good-1"
    assert leftovers(agent_up, None) == []


def test_two_deployments_racing_the_newer_supersedes(agent_up: Live, slow: FaultServer) -> None:
    live = agent_up
    older = document(live, "race-old", onnx=slow_art(slow))
    newer = document(live, "race-new", onnx=store_art(live.kit, "v3.onnx"))
    after = len(states(live.sub))
    t0 = time.time()
    assert send(live, older)["ok"]
    reach(live, "race-old", "downloading", after, cond=lambda s: s["progress"] > 0)
    answer = send(live, newer)
    assert answer["ok"] and answer["stage"] == "accepted", answer
    assert_clear(reason_of(answer), "supersedes version race-old", "cancelled")
    end_old = final(live, "race-old", after)
    assert end_old["stage"] == "failed" and end_old["reason"] == "cancelled: superseded by version race-new"
    end_new = final(live, "race-new", after)
    assert end_new["stage"] == "serving", end_new
    accepted = next(s for s in states(live.sub)[after:] if s.get("version") == "race-new")
    assert accepted["stage"] == "accepted" and accepted.get("superseded") == "race-old", accepted
    assert_served(live, t0, time.time(), "the race")
    assert leftovers(live, "race-old") == [] and serving_version(live) == "race-new"
    assert_no_secrets(live)


@pytest.mark.parametrize("stage", ["downloading", "shadow"])
def test_sighup_during_a_deployment_neither_stops_it_nor_the_model(
    agent_up: Live, slow: FaultServer, stage: str
) -> None:
    """A reload (same config) while the artifacts download, and while the candidate runs beside the
    serving model: the deployment goes on to serving, the model and the cameras never stop."""
    live, version = agent_up, f"hup-{stage}"
    reloads = live.text().lower().count("reload")

    def hup(answer: dict[str, Any]) -> None:
        reach(live, version, stage, 0, cond=lambda s: s["progress"] > 0 or stage != "downloading")
        live.proc.send_signal(signal.SIGHUP)

    if stage == "downloading":
        doc = document(live, version, onnx=slow_art(slow))
    else:
        doc = document(live, version, shadow={"frames": 40, "max_latency_ratio": 10.0})
    end = deployed(live, doc, "serving", during=hup)
    assert end["version"] == version and serving_version(live) == version
    assert live.proc.poll() is None and live.text().lower().count("reload") > reloads


# ---- a full disk ----
def fill(directory: Path) -> Path:
    """Fill the filesystem of `directory` to the last byte (a file, removed by the caller)."""
    path = directory / "filler.bin"
    with open(path, "ab", buffering=0) as f:
        for block in (1 << 20, 4096, 1):
            data = b"\0" * block
            with contextlib.suppress(OSError):
                while True:
                    f.write(data)
    assert os.statvfs(directory).f_bavail == 0, os.statvfs(directory)
    return path


@pytest.fixture
def tmpfs(agent_up: Live) -> Live:
    if agent_up.no_tmpfs is not None:
        pytest.skip(f"needs a small tmpfs as state_dir: {agent_up.no_tmpfs}")
    return agent_up


def test_a_disk_full_during_the_download_ends_it_and_leaves_nothing(tmpfs: Live, slow: FaultServer) -> None:
    live, filler = tmpfs, []

    def fill_now(answer: dict[str, Any]) -> None:
        reach(live, "full-dl", "downloading", 0, cond=lambda s: s["progress"] >= 0.1)
        filler.append(fill(live.state_dir))

    before = serving_version(live)
    try:
        deployed(
            live, document(live, "full-dl", onnx=slow_art(slow)), "rejected", "disk full", during=fill_now
        )
    finally:
        for p in filler:
            p.unlink()
    assert serving_version(live) == before


def test_a_disk_full_during_the_build_fails_it_and_leaves_nothing(tmpfs: Live) -> None:
    live, filler = tmpfs, []

    def fill_now(answer: dict[str, Any]) -> None:
        reach(live, "full-build", "building", 0)
        filler.append(fill(live.state_dir))

    before = serving_version(live)
    doc = document(live, "full-build", onnx=store_art(live.kit, "v2.onnx"), shadow={"frames": 40})
    try:
        deployed(live, doc, "failed", "no space", during=fill_now)
    finally:
        for p in filler:
            p.unlink()
    assert serving_version(live) == before
    assert "Traceback" not in live.text(), live.text()[-4000:]


@pytest.mark.parametrize(
    ("leave_mb", "expect", "words"),
    [(0, "failed", ("no space",)), (20, "rejected", ("not enough space", "needed"))],
    ids=["full", "short"],
)
def test_a_disk_already_full_ends_the_deployment_at_once(
    tmpfs: Live, leave_mb: int, expect: str, words: tuple[str, ...]
) -> None:
    """Full: not even the record of `accepted` can be written; short: less than the artifacts and the
    download reserve (the free-space check before any byte is fetched)."""
    live = tmpfs
    if leave_mb:
        filler = live.state_dir / "filler.bin"
        with open(filler, "wb") as f:
            for _ in range((shutil.disk_usage(live.state_dir).free >> 20) - leave_mb):
                f.write(bytes(1 << 20))
    else:
        filler = fill(live.state_dir)
    before = serving_version(live)
    try:
        doc = document(live, f"full-{leave_mb}", onnx=store_art(live.kit, "v2.onnx"))
        deployed(live, doc, expect, *words, timeout=30)
    finally:
        filler.unlink()
    assert serving_version(live) == before
    assert "Traceback" not in live.text(), live.text()[-4000:]


# ---- kill -9 ----
def _record_stage(live: Live) -> str | None:
    path = live.state_dir / "deployments" / f"{MODEL}.json"
    return json.loads(path.read_text())["state"]["stage"] if path.exists() else None


def _after_restart(live: Live, what: str) -> None:
    """Frames flow at the rate from before on the restarted agent (over a few telemetry periods)."""
    t0 = time.time()
    time.sleep(4)
    assert_served(live, t0, time.time(), f"after the restart ({what})")


def test_kill9_during_the_download_resumes_it_after_a_restart(agent_up: Live, slow: FaultServer) -> None:
    live = agent_up
    doc = document(live, "kill-dl", onnx=slow_art(slow))
    after = len(states(live.sub))
    assert send(live, doc)["ok"]
    reach(live, "kill-dl", "downloading", after, cond=lambda s: s["progress"] >= 0.2)
    live.kill9()
    parts = list((live.state_dir / "staging").rglob("*.part"))
    assert parts and parts[0].stat().st_size > 0, "no partial download kept to resume from"
    had = parts[0].stat().st_size
    seen = len(slow.state.seen)
    live.start()
    resumed = reach(live, "kill-dl", "downloading", after, cond=lambda s: s.get("reason") is not None)
    assert_clear(resumed["reason"], "resumed after a restart")
    end = final(live, "kill-dl", after)
    assert end["stage"] == "serving", end
    ranges = [s.headers.get("Range") for s in slow.state.seen[seen:]]
    assert ranges and ranges[0] == f"bytes={had}-", (ranges, had)  # resumed where it was killed
    assert leftovers(live, None) == [] and serving_version(live) == "kill-dl"
    _after_restart(live, "download resumed")
    assert_no_secrets(live)


@pytest.mark.parametrize("stage", ["verifying", "building", "gating", "shadow", "watching"])
def test_kill9_at_a_later_stage_fails_it_and_the_old_version_serves(agent_up: Live, stage: str) -> None:
    live = agent_up
    old = serving_version(live)
    version = f"kill-{stage}"
    # The stage that is killed lasts (the kill comes as it starts; the stages before it stay short).
    more: dict[str, Any] = {
        "gating": {"gate": {"frames": 30}},
        "shadow": {"shadow": {"frames": 40, "max_latency_ratio": 10.0}},
        "watching": {"watch_s": 60},
    }.get(stage, {})
    doc = document(live, version, onnx=store_art(live.kit, "v2.onnx"), **more)
    after = len(states(live.sub))
    assert send(live, doc)["ok"]
    reach(live, version, stage, after)
    live.kill9()
    assert _record_stage(live) == stage  # the agent died in it
    live.start()
    end = final(live, version, after)
    assert end["stage"] == "failed", end
    assert_clear(
        end["reason"],
        f"interrupted (the agent stopped during {stage})",
        f"{old or 'the config model'} serves",
    )
    assert serving_version(live) == old
    assert leftovers(live, version) == []
    _after_restart(live, stage)
    assert_no_secrets(live)
