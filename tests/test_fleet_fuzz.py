"""Fuzzing the fleet's outside inputs (issue 38) with seeded generators: the `engines` config section through
`edge-agent check-config`, build-claim topics and retained rollouts on a real broker, `fleet deploy`'s
options, oci:// artifact URLs and a registry answering junk. Each case must end as the contract says (one
line naming the file and key, exit 2; CacheUnavailable / CacheRejected; no crash), never with a traceback or
a secret. Deterministic (fixed seeds) and bounded in count."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fixtures_deploy import deploy_kit  # noqa: F401  (the fixture: nginx and the signing keys)

from agent.cli.main import main
from agent.deploy.signing import generate_keys
from engines.cache import artifact
from engines.cache.client import EngineCache
from engines.cache.errors import CacheRejected, CacheUnavailable
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
LABELS = REPO / "agent" / "assets" / "coco.names"
MARK = "SECRETMARK9"
BASE = (
    f"models:\n  det: {{onnx: {MODEL}, format: nanodet, backend: onnxruntime, labels: {LABELS}}}\n"
    "cameras: {}\nmqtt: {enabled: false}\n"
)


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse
            code = int(stop.code or 0)
    return code, out.getvalue(), err.getvalue()


def check_config(tmp_path: Path, engines: dict[str, str]) -> tuple[int, str]:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE + "engines:\n" + "".join(f"  {k}: {v}\n" for k, v in engines.items()))
    code, out, err = cli(["check-config", "-c", str(path)])
    assert "internal error" not in err and "Traceback" not in err, err
    return code, out + err


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keys(tmp_path / "keys", "dev1")


def valid_section(keys: tuple[Path, Path]) -> dict[str, str]:
    private, public = keys
    return {
        "cache": '"oci://127.0.0.1:5000/site/engines"',
        "signing_key": json.dumps(str(private)),
        "signing_key_id": "dev1",
        "trusted_keys": json.dumps({"dev1": str(public)}),
    }


@pytest.mark.parametrize("url", ["oci://h\n/x", "oci://h/x\n", "oci://h:5000/x\t", "oci://h:٥٠٠٠/x", "oci://h:５０００/x"])
def test_a_cache_url_with_a_control_character_or_non_ascii_port_is_refused(url: str) -> None:
    # Before: urlsplit dropped the newline and int() read the Arabic-Indic digits: the config kept (and
    # logged) a URL that was never the one checked.
    with pytest.raises(ValueError):
        parse_cache_url(url)


def test_the_engines_cache_url_fuzzed_through_check_config(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    rng = random.Random(38)
    parts = ["oci://", "127.0.0.1", ":5000", "[::1]", "/site", "/engines", "?plain-http=true", "@", MARK, ":",
             "\n", " ", "é", "٥", "#", "%00", "//", "..", "A", "?", "&", "=", "http://", "x" * 300]
    for _ in range(60):
        url = "".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))
        code, text = check_config(tmp_path, {**valid_section(keys), "cache": json.dumps(url)})
        assert code in (0, 2), text
        assert MARK not in text, text
        if code == 2:
            assert text.count("\n") == 1 and "engines.cache: " in text, text


# -- a registry answering junk: EngineCache.pull/push end in CacheUnavailable or CacheRejected only ------
class _JunkHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    script: ClassVar[dict[Any, tuple[int, dict[str, str], bytes]]] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        kind = ("upload" if "/uploads/" in self.path else "token" if self.path.startswith("/token")
                else "blob" if "/blobs/" in self.path else "manifest")
        answer = self.script.get((self.command, kind)) or self.script.get(kind)
        status, headers, body = answer or (404, {}, b"")
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value.replace("{port}", str(self.server.server_address[1])))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = _answer


@pytest.fixture
def fake_registry() -> Iterator[tuple[int, dict[Any, tuple[int, dict[str, str], bytes]]]]:
    """A registry that answers what the test scripts, for each kind of request (manifest, blob, upload,
    token): the faults docker-registry never produces."""
    script: dict[Any, tuple[int, dict[str, str], bytes]] = {}
    handler = type("H", (_JunkHandler,), {"script": script})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], script
    finally:
        server.shutdown()
        server.server_close()


def _oci(layers: Any, **fields: Any) -> bytes:
    doc = {"schemaVersion": 2, "mediaType": artifact.OCI_MANIFEST, "layers": layers,
           "config": {"mediaType": artifact.CONFIG, "digest": "sha256:" + "0" * 64, "size": 2}}
    return json.dumps({**doc, **fields}).encode()


def _layer(media_type: str, data: bytes = b"x") -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _signed_manifest(signature: bytes) -> bytes:
    return _oci([_layer(artifact.PLAN), _layer(artifact.MANIFEST), _layer(artifact.SIGNATURE, signature)])


INSERTS = [b"[", b"{", b'"', b"null", b"-1", b"1e999", b"[" * 3000, b"9" * 4400, b"\\u0000"]


def _mutations(rng: random.Random, good: bytes, n: int) -> list[bytes]:
    """Junk near a valid document: bytes flipped or cut, deep nesting, numbers beyond int()'s 4300 digits."""
    out = [b"[" * 60000, b'{"a":' * 10000, b"1" * 5000, b'{"v": ' + b"9" * 5000 + b"}", b"\xff\xfe",
           good.replace(b'"size": 1', b'"size": 1' + b"0" * 5000), good.replace(b'"size": 1', b'"size": NaN')]
    for _ in range(n):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(data))
            op = rng.random()
            if op < 0.4:
                data[i] = rng.randrange(256)
            elif op < 0.6:
                del data[i : i + rng.randint(1, 40)]
            else:
                data[i:i] = rng.choice(INSERTS)
        out.append(bytes(data))
    return out


def _outcome(call: Callable[..., object], *args: Any) -> str:
    try:
        call(*args)
    except (CacheUnavailable, CacheRejected) as e:
        assert MARK not in e.reason
        return type(e).__name__
    return "ok"


def test_pull_from_a_registry_answering_junk_ends_unavailable_or_rejected(
    tmp_path: Path, fake_registry: tuple[int, dict[Any, Any]]
) -> None:
    # Before: a manifest or signature nested too deep (RecursionError), an integer of 4300+ digits
    # (ValueError), a token answer nested too deep, a redirect to "http://[::1/x" (ValueError) escaped.
    port, script = fake_registry
    private = Ed25519PrivateKey.generate()
    trust = PlanTrust({"dev1": private.public_key()})
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps({"username": "u", "password": MARK}))
    rng = random.Random(3838)
    good = _oci([_layer(artifact.PLAN), _layer(artifact.MANIFEST), _layer(artifact.SIGNATURE)])
    signature = json.dumps({"schema": artifact.SIGNATURE_SCHEMA, "key_id": "dev1", "ed25519": "AA==",
                            "statement": {"schema": artifact.STATEMENT_SCHEMA, "key": "k" * 16}}).encode()
    bearer = {"WWW-Authenticate": 'Bearer realm="http://127.0.0.1:{port}/token",service="s"'}
    scripts: list[dict[Any, Any]] = [{"manifest": (200, {}, m), "blob": (200, {}, b"{}")}
                                      for m in _mutations(rng, good, 60)]
    scripts += [{"manifest": (200, {}, _signed_manifest(s)), "blob": (200, {}, s)}
                for s in _mutations(rng, signature, 30)]
    scripts += [{"manifest": (401, bearer, b""), "token": (200, {}, t)}
                for t in [*_mutations(rng, b'{"token": "t"}', 15), b'{"token": ["a"]}', b'{"token": " "}']]
    scripts += [
        {"manifest": (401, bearer, b""), "token": (200, {}, '{"token": "中"}'.encode())},  # no header value
        {"manifest": (302, {"Location": "http://[::1/x"}, b"")},
        {"manifest": (302, {"Location": "/v2/site/engines/manifests/" + "k" * 16}, b"")},  # a loop
        {"manifest": (401, {}, b"")},  # no challenge
        {"manifest": (401, {"WWW-Authenticate": "Negotiate"}, b"")},
        {"manifest": (401, {"WWW-Authenticate": 'Bearer realm="ftp://x"'}, b"")},
        {"manifest": (200, {}, _oci("x"))},
        {"manifest": (200, {}, _oci([[]]))},
        {"manifest": (200, {}, _oci([_layer("text/plain")]))},
        {"manifest": (200, {}, b"x" * (1 << 20))},
        {"manifest": (200, {}, good), "blob": (302, {"Location": "http://[::1/x"}, b"")},
    ]
    seen: dict[str, int] = {}
    for i, answers in enumerate(scripts):
        script.clear()
        script.update(answers)
        for login in (None, creds):
            cache = EngineCache(parse_cache_url(f"oci://127.0.0.1:{port}/site/engines"),
                                credentials_file=login, timeout_s=3)
            outcome = _outcome(cache.pull, "k" * 16, tmp_path / f"pulled{i}", trust)
            seen[outcome] = seen.get(outcome, 0) + 1
    assert set(seen) <= {"CacheUnavailable", "CacheRejected"}, seen


def test_push_to_a_registry_answering_junk_ends_unavailable(
    tmp_path: Path, fake_registry: tuple[int, dict[Any, Any]]
) -> None:
    # Before: an error answer nested too deep to the blob upload escaped oras as a RecursionError.
    pytest.importorskip("tensorrt_rtx")
    from engine_cache_fixtures import build_tiny, tiny_onnx

    from engines.fingerprint import probe_fingerprint
    from engines.trt import import_trt

    e = build_tiny(tmp_path / "store", tiny_onnx(tmp_path / "tiny.onnx"),
                   probe_fingerprint(import_trt("tensorrt_rtx")), "8.6")
    signer = PlanSigner(Ed25519PrivateKey.generate(), "dev1")
    port, script = fake_registry
    absent = ("HEAD", "manifest"), (404, {}, b"")
    upload = {"Location": "/v2/site/engines/blobs/uploads/u1?x=1"}
    scripts: list[dict[Any, Any]] = [
        {"upload": (404, {}, b"[" * 50000)},
        {"upload": (400, {}, b'{"errors": ' + b"1" * 5000 + b"}")},
        {"upload": (202, {}, b"")},  # no Location
        {"upload": (202, {"Location": "http://[::1/x"}, b"")},
        {"upload": (202, {"Location": "/v2/x?" + "a" * 70000}, b"")},
        {("POST", "upload"): (202, upload, b""), ("PUT", "upload"): (400, {}, b"{" * 40000)},
        {("HEAD", "blob"): (200, {}, b""), ("PUT", "manifest"): (400, {}, b"junk")},
        {("HEAD", "blob"): (200, {}, b""), ("PUT", "manifest"): (302, {"Location": "/v2/x/manifests/"}, b"")},
        {("HEAD", "blob"): (500, {}, b"")},
    ]
    for answers in scripts:
        script.clear()
        script.update([absent, *answers.items()])
        cache = EngineCache(parse_cache_url(f"oci://127.0.0.1:{port}/site/engines"), timeout_s=3)
        outcome = _outcome(cache.push, e.key, e.plan, e.manifest, e.timing_cache, signer, "dev-1")
        assert outcome == "CacheUnavailable", answers


@pytest.mark.parametrize("data", [b"\xff\xfe{}", b"[" * 60000, b'{"build": ' + b"1" * 5000 + b"}"])
def test_an_engine_manifest_not_utf8_too_deep_or_with_a_huge_number_is_a_manifest_error(
    tmp_path: Path, data: bytes
) -> None:
    # Before: UnicodeDecodeError, RecursionError and ValueError escaped load_manifest (its callers, the
    # cache's pull among them, catch ManifestError).
    from engines.errors import ManifestError
    from engines.manifest import load_manifest

    path = tmp_path / "m.json"
    path.write_bytes(data)
    with pytest.raises(ManifestError):
        load_manifest(path)


# -- build claims: payloads and topic shapes on {prefix}/_fleet/builds/# of a real mosquitto -------------
PREFIX = "edge-agent"


def _claim_body(device: str, key: str, claimed_at: Any, expires: Any) -> bytes:
    return json.dumps({"device": device, "key": key, "claimed_at": claimed_at, "expires": expires}).encode()


def test_a_claim_with_a_309_digit_number_is_no_claim_and_parse_claim_never_raises() -> None:
    # Before: float() of the integer raised OverflowError out of parse_claim ("never raises"): in the
    # claims' network thread the message was dropped, so a device's earlier claim stayed in force.
    from agent.fleet.claim_record import parse_claim

    rng = random.Random(9)
    huge = 10**400
    assert parse_claim("k1", "d1", _claim_body("d1", "k1", huge, 5)) is None
    assert parse_claim("k1", "d1", _claim_body("d1", "k1", 1, huge)) is None
    values: list[Any] = [huge, -huge, 1e308, -1.5, 0, None, "1", [], {}, True, 2**63, 10**18, 0.5]
    for _ in range(400):
        body = _claim_body("d1", "k1", rng.choice(values), rng.choice(values))
        if rng.random() < 0.3:
            i = rng.randrange(len(body))
            body = body[:i] + rng.choice([b"[" * 200, b"9" * 400, b"\xff", b"NaN", b"-Infinity"]) + body[i:]
        parse_claim("k1", "d1", body)  # None or a Claim, never an exception


def test_junk_claims_of_every_topic_shape_never_win_and_a_garbled_claim_frees_the_key(
    mqtt_broker: Any,
) -> None:
    from fixtures_mqtt import publish, retain

    from agent.config.mqtt import MqttConfig
    from agent.fleet.claims import BuildClaims

    key = "trt10-orin-sm87-fuzz"
    port = mqtt_broker.port
    early, later = 1_000.0, 4_000_000_000.0  # claimed long ago, expiring far in the future
    head = f"{PREFIX}/_fleet/builds"
    rng = random.Random(21)
    junk: list[tuple[str, bytes]] = [
        (f"{head}/{key}/x/extra", _claim_body("x", key, early, later)),  # an extra level
        (f"{head}/{key}/", _claim_body("", key, early, later)),  # an empty device level
        (f"{head}//{key}", _claim_body(key, "", early, later)),  # an empty key level
        (f"{head}/{key}", _claim_body(key, key, early, later)),  # no device level
        (f"{head}/not a tag!/d1", _claim_body("d1", "not a tag!", early, later)),
        (f"{head}/{'k' * 129}/d1", _claim_body("d1", "k" * 129, early, later)),
        (f"{head}/{key}/d2", _claim_body("d3", key, early, later)),  # another device's name
        (f"{head}/{key}/d4", _claim_body("d4", key + "x", early, later)),  # another key
        (f"{head}/{key}/d5", _claim_body("d5", key, 10**400, later)),
        (f"{head}/{key}/d6", _claim_body("d6", key, early, 10**400)),
        (f"{head}/{key}/d7", _claim_body("d7", key, early, early + 3 * 86_400)),  # an absurd lifetime
        (f"{head}/{key}/d8", b"[" * 900),
        (f"{head}/{key}/d9", _claim_body("d9", key, early, later).replace(b"1000.0", b"NaN")),
        (f"{head}/{key}/d10", _claim_body("d10", key, early, later) + b" " * 2000),  # too large
    ]
    for i in range(20):
        device = f"r{i}"
        body = bytearray(_claim_body(device, key, early, later))
        spot = rng.randrange(len(body))
        body[spot : spot + 1] = rng.choice([b"", b"\x00", b"\xff", b'"', b"}", b"9" * 400])
        junk.append((f"{head}/{key}/{device}", bytes(body)))
    retain(port, junk)
    cfg = MqttConfig(host="127.0.0.1", port=port, reconnect_min_s=0.2, reconnect_max_s=1.0)
    rival = BuildClaims(cfg, PREFIX, "orin-a", ttl_s=60, settle_s=0.3, timeout_s=10).open()
    me = BuildClaims(cfg, PREFIX, "orin-b", ttl_s=60, settle_s=0.3, timeout_s=10).open()
    try:
        # Mutated claims may still be well formed (a digit changed): only those can hold the key.
        standing = {me.holder(key)}
        assert standing <= {None} | {f"r{i}" for i in range(20)}, standing
        for topic, _ in junk:  # clear the junk: what stays is what the two devices do
            publish(port, topic, b"", retain=True)
        assert rival.claim(key) is True
        assert me.claim(key) is False and me.holder(key) == "orin-a"
        # The rival's own topic now carries a garbled claim (a 309-digit time): no claim, the key is free
        # (the rival renews only every ttl_s / 3).
        publish(port, f"{head}/{key}/orin-a", _claim_body("orin-a", key, 10**400, later), retain=True)
        deadline = time.monotonic() + 10
        while me.holder(key) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert me.holder(key) is None
    finally:
        me.close()
        rival.close()


# -- retained rollouts and `fleet deploy` options ------------------------------------------------------
def _rollout_body() -> dict[str, Any]:
    from agent.fleet.rollout_plan import RolloutOptions
    from agent.fleet.rollout_state import Rollout

    class Doc:
        model, version, request_id = "detector", "v9", "r9"

    r = Rollout.create("r-fuzz", Doc, "a" * 64, [["cam-a"], ["cam-b", "cam-c"]], RolloutOptions().check())
    r.devices["cam-a"].move("done", "ok")
    body: dict[str, Any] = json.loads(r.payload())
    return body


def _paths(o: Any, p: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if p:
        yield p
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else []
    for k, v in items:
        yield from _paths(v, (*p, k))


def _set(o: Any, p: tuple[Any, ...], v: Any) -> None:
    for k in p[:-1]:
        o = o[k]
    o[p[-1]] = v


ESCAPES = "\x1b[2J\x07\u202e"
CONTROLS = "\x1b\x07\u202e"  # what ESCAPES must not bring to a terminal
ROLLOUT_VALUES: list[Any] = [
    None, True, 0, -1, 1.5, 1e308, float("inf"), float("-inf"), float("nan"), 10**400, -(10**400), 2**70,
    "", "x", "é" + ESCAPES, "a" * 5000, [], [1], {}, {"a": 1}, [[[[]]]], "running", "done",
]


def _shown_cleanly(r: Any) -> None:
    from agent.fleet.rollout_table import as_json, render_detail, render_list

    shown = render_detail(r) + render_list({r.id: r})
    assert not any(c in shown for c in CONTROLS), shown
    json.dumps(as_json(r), allow_nan=False)  # --json prints JSON, not Infinity


def test_mutated_retained_rollouts_read_back_or_are_refused_and_render_cleanly() -> None:
    # Before: a 309-digit integer at any number raised OverflowError out of from_payload; Infinity was
    # taken as a time (`--json` printed `Infinity`, not JSON); a model or halted_reason with terminal
    # escapes was printed as it came.
    from agent.fleet.rollout_state import Rollout, RolloutStateError

    good = _rollout_body()
    rng = random.Random(383)
    cases: list[dict[str, Any]] = []
    for p in list(_paths(good)):
        for v in ROLLOUT_VALUES:
            body = json.loads(json.dumps(good))
            _set(body, p, copy.deepcopy(v))
            cases.append(body)
    for _ in range(600):
        body = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 4)):
            _set(body, rng.choice(list(_paths(body))), copy.deepcopy(rng.choice(ROLLOUT_VALUES)))
        cases.append(body)
    read = 0
    for body in cases:
        try:
            r = Rollout.from_payload(json.dumps(body).encode())
        except RolloutStateError:
            continue
        read += 1
        _shown_cleanly(r)
    assert read > 50  # the mutations that keep a usable rollout are rendered too


def test_a_device_state_with_a_309_digit_progress_never_breaks_a_step() -> None:
    # Before: float() of the device's progress raised OverflowError out of step (the driver of
    # `fleet deploy` ended with an internal error on one device's junk state).
    from agent.fleet.rollout_plan import RolloutOptions
    from agent.fleet.rollout_state import DEPLOYING, DeviceRecord
    from agent.fleet.rollout_step import Goal, Observation, step

    for progress in (10**400, -(10**400), float("nan"), float("inf"), 2**63):
        rec = DeviceRecord("d", 0, DEPLOYING)
        rec.sent_at = 0.0
        obs = Observation(True, 0.0, {"stage": "building", "progress": progress, "version": "v9"}, True, None)
        step(rec, obs, Goal("detector", "v9", "r9"), RolloutOptions(soak_s=5, offline_timeout_s=5), 1.0)
        assert 0.0 <= rec.progress <= 1.0


def _signed_doc(tmp_path: Path) -> Path:
    from agent.deploy.signing import sign_document

    private, _ = generate_keys(tmp_path / "keys", "ops")
    doc = {"model": "detector", "version": "v9", "format": "nanodet", "request_id": "r9",
           "artifacts": {"onnx": {"url": "https://store.invalid/m.onnx", "sha256": "0" * 64, "size": 10},
                         "labels": {"url": "https://store.invalid/l.txt", "sha256": "0" * 64, "size": 10}}}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(sign_document(doc, private, "ops")))
    return path


def test_fleet_rollouts_and_resume_over_junk_retained_rollouts(mqtt_broker: Any, tmp_path: Path) -> None:
    from fixtures_mqtt import retain

    good = _rollout_body()
    raw = json.dumps(good, separators=(",", ":"))
    junk: dict[str, bytes] = {
        "j-inf": raw.replace('"created_at":', '"created_at":Infinity,"x":').encode(),
        "j-huge": raw.replace('"updated_at":', '"updated_at":' + "9" * 400 + ',"x":').encode(),
        "j-esc": json.dumps({**good, "model": "m" + ESCAPES, "halted_reason": ESCAPES}).encode(),
        "j-nan": raw.replace('"progress":0.0', '"progress":NaN').encode(),
        "j-deep": b"[" * 100_000,
        "j-wide": json.dumps({**good, "waves": [[f"d{i}" for i in range(30_000)]]}).encode(),
        "j-types": json.dumps({**good, "devices": [1, 2], "options": "x"}).encode(),
        "j-utf": b"\xff\xfe" + raw.encode(),
        "j-ok": raw.encode(),
    }
    junk = {rid: body.replace(b'"r-fuzz"', f'"{rid}"'.encode()) for rid, body in junk.items()}
    retain(mqtt_broker.port, [(f"{PREFIX}/_fleet/rollouts/{rid}", body) for rid, body in junk.items()])
    flags = ["--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port), "--prefix", PREFIX]
    doc_path = _signed_doc(tmp_path)

    def ok(code: int, out: str, err: str) -> None:
        assert "internal error" not in err and "Traceback" not in err, err
        assert not any(c in out + err for c in CONTROLS), out + err
        if code == 2:
            assert len(err.strip().splitlines()) == 1, err

    code, out, err = cli(["fleet", "rollouts", *flags])
    ok(code, out, err)
    assert code == 0 and all(rid in out for rid in junk), out
    code, out, err = cli(["fleet", "rollouts", "--json", *flags])
    ok(code, out, err)
    listed = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert listed["j-ok"]["id"] == "j-ok" and listed["j-esc"]["id"] == "j-esc"
    assert all(listed[rid]["status"] == "unreadable" for rid in junk if rid not in ("j-ok", "j-esc"))
    for rid in junk:
        code, out, err = cli(["fleet", "rollouts", rid, *flags])
        ok(code, out, err)
        assert code == (0 if rid in ("j-ok", "j-esc") else 1), (rid, code, out, err)
        code, out, err = cli(["fleet", "deploy", str(doc_path), "--resume", rid, "--wait", "1", *flags])
        ok(code, out, err)
        assert code == 2 and f"--resume {rid}" in err, (rid, code, err)  # unusable, or another document


def test_fleet_deploy_options_with_bad_values_exit_2_naming_the_option(
    mqtt_broker: Any, tmp_path: Path
) -> None:
    from fixtures_mqtt import retain

    flags = ["--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port), "--prefix", PREFIX]
    doc = str(_signed_doc(tmp_path))
    status = {"schema": "edge-agent/status/1", "ts": 1.0, "state": "online", "groups": []}
    retain(mqtt_broker.port, [(f"{PREFIX}/{d}/status", json.dumps(status).encode()) for d in ("x", "y")])
    bad = {
        "--canary": ["-1", "1e309", "x", "", "1.5"],
        "--batch": ["0", "-1", "0%", "101%", "1e309", "x", "", "%", "50.5%", "-5%"],
        "--max-failures": ["-1", "1e309", "x", "", "1.5"],
        "--soak": ["-1", "1e309", "nan", "inf", "x", "", "604801", "0x10"],
        "--offline-timeout": ["-1", "nan", "inf", "", "1e309"],
        "--device-timeout": ["0", "-1", "nan", "inf", "", "1e309"],
        "--wait": ["0", "-1", "nan", "inf", "1e309"],
        "--devices": ["", ",", "x,,y", "a/b", "+", "#"],
        "--resume": ["", "a/b", "+", "#", "x" * 100, "é"],
        "--trust": ["", "=", "a=", "=b"],
        "--mqtt-port": ["0", "-1", "65536", "x", ""],
    }
    n = 0
    for option, values in bad.items():
        for value in values:
            targets = [] if option in ("--devices", "--resume") else ["--all"]
            code, _, err = cli(["fleet", "deploy", doc, *targets, *flags, option, value])
            n += 1
            assert code == 2 and "internal error" not in err, (option, value, err)
            assert err.strip().splitlines()[-1].count(option) >= 1, (option, value, err)
    assert n == sum(map(len, bad.values()))


# -- cmd/deploy documents with oci:// artifact URLs of odd shapes, against the real agent --------------
DIGEST = "sha256:" + "a" * 64


def _odd_oci_urls(rng: random.Random, n: int) -> list[str]:
    hosts = ["127.0.0.1:5000", "[::1]", "[::1", "h:99999", "u:" + MARK + "@h", "", "h:٥٠٠٠", "é", "h h",
             "h\n"]
    repos = ["site/models", "Site", "", "a//b", "a@b", "x" * 300, "a/../b"]
    digests = [DIGEST, "sha256:" + "A" * 64, "sha256:", "sha512:" + "a" * 128, "latest", DIGEST + "\n"]
    tails = ["", "?plain-http=maybe", "?x=1", "#frag", "?%ff=1"]
    fixed = ["oci://h/x:latest", "oci://", "OCI://h/x@" + DIGEST, f"oci://h/x:t@{DIGEST}",
             "oci:/h/x@" + DIGEST]
    out = fixed[:]
    while len(out) < n:
        url = (f"oci://{rng.choice(hosts)}/{rng.choice(repos)}{rng.choice(['@', ':', '@@'])}"
               f"{rng.choice(digests)}{rng.choice(tails)}")
        if url.startswith(f"oci://127.0.0.1:5000/site/models@{DIGEST}") and url.endswith(DIGEST):
            continue  # a valid one
        out.append(url)
    return out


def test_deploy_documents_with_odd_oci_urls_are_answered_naming_the_field_and_the_agent_serves_on(
    deploy_kit: Any,  # noqa: F811
    mqtt_broker: Any,
    mqtt_subscribe: Any,
    start_agent: Any,
    tmp_path: Path,
) -> None:
    from fixtures_agent import wait_until
    from fixtures_deploy import BASE, KEY_ID, agent_config, deploy, telemetry

    from agent.deploy.signing import sign_document

    cfg = agent_config(tmp_path, mqtt_broker.port, deploy_kit, cameras=1)
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(cfg)

    def streaming() -> bool:
        cams = [json.loads(p) for t, p, _ in sub.snapshot()
                if t.startswith(f"{BASE}/cameras/") and t.endswith("/state") and p]
        return bool(cams) and cams[-1]["state"] == "streaming"

    assert wait_until(streaming, 90), agent.text()[-3000:]
    rng = random.Random(505)
    for i, url in enumerate(_odd_oci_urls(rng, 24)):
        doc = deploy_kit.make_document(f"v{i + 10}", sign=False)
        which = rng.choice(["onnx", "labels"])
        doc["artifacts"][which] = {**doc["artifacts"][which], "url": url}
        answer = deploy(sub, sign_document(doc, deploy_kit.private_key, KEY_ID), agent=agent)
        assert not answer["ok"] and answer.get("field") == f"artifacts.{which}.url", (url, answer)
        assert MARK not in json.dumps(answer), answer
    assert agent.proc.poll() is None and "Traceback" not in agent.text()
    before = len(telemetry(sub))
    assert wait_until(lambda: len(telemetry(sub)) > before + 1, 20)  # still publishing
    assert streaming()


def _odd_files(tmp_path: Path) -> dict[str, Path]:
    import os

    d = tmp_path / "odd"
    d.mkdir()
    files = {
        "deep": b"[" * 60000, "bignum": b'{"username": "u", "password": ' + b"9" * 5000 + b"}",
        "garbage": os.urandom(200) + MARK.encode(), "notutf8": b'{"username": "\xff' + MARK.encode() + b'"}',
        "empty": b"", "list": json.dumps([MARK]).encode(),
        "colon": json.dumps({"username": "a:" + MARK, "password": MARK}).encode(),
        "pem": f"-----BEGIN PUBLIC KEY-----\n{MARK}\n-----END PUBLIC KEY-----\n".encode(),
        "huge": b"A" * (3 << 20) + MARK.encode(),
    }
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    (d / "link").symlink_to(d / "nowhere")
    out.update(dir=d / "dir", fifo=d / "fifo", link=d / "link", missing=d / "nowhere")
    return out


def test_the_engines_files_of_every_odd_shape_through_check_config(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    # Before: a credentials file nested too deep (RecursionError) or holding a 4300+ digit number
    # (ValueError) ended check-config with an internal error.
    files = _odd_files(tmp_path)
    n = 0
    for key in ("credentials_file", "ca_file", "signing_key", "trusted_keys"):
        for name, path in files.items():
            section = valid_section(keys)
            value = json.dumps({"dev1": str(path)}) if key == "trusted_keys" else json.dumps(str(path))
            code, text = check_config(tmp_path, {**section, key: value})
            n += 1
            assert code == 2 and MARK not in text, (key, name, text)
            shown = f"engines.{key}.dev1: " if key == "trusted_keys" else f"engines.{key}: "
            assert text.count("\n") == 1 and shown in text and str(path) in text, (key, name, text)
    assert n == 4 * len(files)


@pytest.mark.parametrize("key", ["credentials_file", "ca_file", "signing_key", "trusted_keys"])
def test_a_path_with_a_nul_is_one_line(tmp_path: Path, keys: tuple[Path, Path], key: str) -> None:
    # Before: "must not contain a NUL character" and then the file check's "not a valid path": two lines.
    value = json.dumps({"dev1": "a\x00b"}) if key == "trusted_keys" else json.dumps("a\x00b")
    code, text = check_config(tmp_path, {**valid_section(keys), key: value})
    assert code == 2 and text.count("\n") == 1 and "NUL" in text, text
