"""`edge-agent models deploy|list|show|rollback`: the model versions of a device (issue 37).

    models deploy FILE [-c CONFIG] [--wait [S]]  publish cmd/deploy FILE to the device of CONFIG; --wait
                                                 prints the stages of deployments/{model} until the last one
    models list [-c CONFIG] [--json]             per model: the versions kept and the one serving (the
                                                 state folder), with the broker's retained state if it answers
    models show MODEL [-c CONFIG] [--json]       one model: versions, their sha256, the last deployment
    models rollback MODEL [--to V] [-c CONFIG]   publish cmd/rollback {model, to?} and print the answer

The broker, credentials, TLS, prefix and device id come from CONFIG's `mqtt` section and `device_id` (as
`fleet status`); `--device` sends to another device of the same broker. Exit codes: 0 done (deploy: serving,
or accepted without --wait), 1 refused or ended rejected / failed / rolled_back (or --wait ran out), 2 bad
input or the broker cannot be reached (one line why).
"""

from __future__ import annotations

import argparse
import json
import queue
import secrets
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent.cli.argtypes import seconds

SERVICE_CONFIG = "/etc/edge-agent/agent.yaml"
CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 30.0
FINAL = ("serving", "rejected", "rolled_back", "failed")


class CliError(Exception):
    """Bad input or no broker: exit 2 with this line."""


# ---- parsers ----------------------------------------------------------------------------------------------
def _common(p: Any, device: bool = True) -> None:
    p.add_argument(
        "-c", "--config", default=SERVICE_CONFIG, help=f"the agent's config (default {SERVICE_CONFIG})"
    )
    if device:
        p.add_argument("--device", metavar="D", help="the device id to address (default: the config's)")


def add_parsers(m_sub: Any) -> None:
    d = m_sub.add_parser("deploy", help="deploy a model version: publish a signed document on cmd/deploy")
    d.add_argument("file", metavar="FILE", help="the deployment document (JSON, signed: models sign)")
    d.add_argument(
        "--wait",
        nargs="?",
        const=900.0,
        type=seconds(86_400),
        metavar="S",
        help="print the stages until the deployment ends (at most S seconds, default 900)",
    )
    _common(d)
    d.set_defaults(func=cmd_models_deploy)

    ls = m_sub.add_parser("list", help="the versions kept and serving, per model of the config")
    _common(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_models_list)

    sh = m_sub.add_parser("show", help="one model: its versions, their files' sha256, the last deployment")
    sh.add_argument("model", metavar="MODEL")
    _common(sh)
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_models_show)

    rb = m_sub.add_parser("rollback", help="serve the previous version (or --to V) now: cmd/rollback")
    rb.add_argument("model", metavar="MODEL")
    rb.add_argument("--to", metavar="V", help="this kept version (default: the previous one)")
    _common(rb)
    rb.set_defaults(func=cmd_models_rollback)


# ---- the broker -------------------------------------------------------------------------------------------
class Session:
    """A paho client on the config's broker, subscribed to `filters`; messages (topic, payload, retained)
    in a queue."""

    def __init__(self, cfg: Any, device: str | None, filters: list[str]) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        from agent.mqtt.fleet import client_id
        from agent.mqtt.tls import client_context

        m = cfg.mqtt
        self.base = f"{m.prefix}/{device or cfg.device_id}"
        self.messages: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self._subscribed: queue.Queue[bool] = queue.Queue()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id(), clean_session=True)
        if m.username is not None:
            self.client.username_pw_set(m.username, m.read_password())
        if m.tls is not None:
            tls = m.tls.options()
            self.client.tls_set_context(client_context(tls))
            if tls.insecure:
                self.client.tls_insecure_set(True)
        self.client.on_message = lambda _c, _u, msg: self.messages.put(
            (msg.topic, bytes(msg.payload), bool(msg.retain))
        )
        self.client.on_subscribe = lambda *_: self._subscribed.put(True)
        where = f"broker {m.host}:{m.port}"
        try:
            self.client.connect(m.host, m.port, keepalive=30)
        except (OSError, ValueError) as exc:
            raise CliError(f"{where}: not reachable ({getattr(exc, 'strerror', None) or exc})") from None
        self.client.loop_start()
        for f in filters:
            self.client.subscribe(f"{self.base}/{f}", qos=1)
            try:
                self._subscribed.get(timeout=CONNECT_TIMEOUT_S)
            except queue.Empty:
                self.close()
                why = f"no answer to a subscription within {CONNECT_TIMEOUT_S:g} s"
                raise CliError(f"{where}: {why}") from None

    def publish(self, action: str, body: bytes) -> None:
        self.client.publish(f"{self.base}/cmd/{action}", body, qos=1).wait_for_publish(CONNECT_TIMEOUT_S)

    def next(self, deadline: float) -> tuple[str, bytes, bool] | None:
        try:
            return self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def answer(self, action: str, request_id: Any, timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        """The device's cmd/{action}/result (request_id matched where given)."""
        deadline = time.monotonic() + timeout_s
        while (msg := self.next(deadline)) is not None:
            topic, body, _ = msg
            if topic == f"{self.base}/cmd/{action}/result" and body:
                answer = json.loads(body)
                if request_id is None or answer.get("request_id") == request_id:
                    return dict(answer)
        where = f"{self.base}/cmd/{action}/result"
        raise CliError(f"no answer on {where} within {timeout_s:g} s (is the agent up?)")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _config(path: str) -> Any:
    from agent.config import load_config

    return load_config(path)  # ConfigError: main() says it, exit 2


def _retained_states(cfg: Any, device: str | None, quiet_s: float = 0.5) -> dict[str, dict[str, Any]] | None:
    """Model -> its retained deployment state, or None when the broker does not answer."""
    try:
        s = Session(cfg, device, ["deployments/+"])
    except (CliError, OSError):
        return None
    out: dict[str, dict[str, Any]] = {}
    try:
        while (msg := s.next(time.monotonic() + quiet_s)) is not None:
            topic, body, _ = msg
            if body:
                out[topic.rsplit("/", 1)[-1]] = json.loads(body)
    finally:
        s.close()
    return out


# ---- deploy -----------------------------------------------------------------------------------------------
def cmd_models_deploy(args: argparse.Namespace) -> int:
    from agent.deploy.document import MAX_DOCUMENT_BYTES, parse_document
    from agent.deploy.errors import DeployError

    try:
        try:
            with open(args.file, "rb") as f:
                raw = f.read(MAX_DOCUMENT_BYTES + 1)  # parse_document refuses what is larger
        except OSError as exc:
            raise CliError(f"{args.file}: cannot read ({exc.strerror or exc})") from None
        doc, _ = parse_document(raw, args.file)
        cfg = _config(args.config)
        s = Session(cfg, args.device, ["cmd/deploy/result", f"deployments/{doc.model}"])
    except (DeployError, CliError) as exc:
        print(f"edge-agent models deploy: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 2
    try:
        s.publish("deploy", raw)
        answer = s.answer("deploy", doc.request_id)
        if not answer.get("ok"):
            field = f" (field {answer['field']})" if answer.get("field") else ""
            print(f"refused: {answer.get('error')}{field}")
            return 1
        reason = f": {answer['reason']}" if answer.get("reason") else ""
        print(f"{answer.get('stage')}: {doc.model} {doc.version}{reason}")
        if answer.get("stage") == "serving" or args.wait is None:
            return 0
        return _follow(s, doc.model, doc.version, args.wait)
    except CliError as exc:
        print(f"edge-agent models deploy: {exc}", file=sys.stderr)
        return 2
    finally:
        s.close()


def _follow(s: Session, model: str, version: str, wait_s: float) -> int:
    """Print each stage change of `model`'s deployment of `version` until a final one."""
    deadline = time.monotonic() + wait_s
    shown = None
    while (msg := s.next(deadline)) is not None:
        topic, body, retained = msg
        if topic != f"{s.base}/deployments/{model}" or not body or retained:
            continue  # a retained state is an earlier deployment's
        st = json.loads(body)
        if st.get("version") != version:
            continue
        line = f"{st.get('stage')}" + (f": {st['reason']}" if st.get("reason") else "")
        if line != shown:
            print(line, flush=True)
            shown = line
        if st.get("stage") in FINAL:
            return 0 if st["stage"] == "serving" else 1
    print(f"still {shown or 'accepted'} after {wait_s:g} s (the deployment goes on)")
    return 1


# ---- rollback ---------------------------------------------------------------------------------------------
def cmd_models_rollback(args: argparse.Namespace) -> int:
    rid = f"cli-{secrets.token_hex(4)}"
    body: dict[str, Any] = {"model": args.model, "request_id": rid}
    if args.to is not None:
        body["to"] = args.to
    try:
        cfg = _config(args.config)
        s = Session(cfg, args.device, ["cmd/rollback/result"])
    except CliError as exc:
        print(f"edge-agent models rollback: {exc}", file=sys.stderr)
        return 2
    try:
        s.publish("rollback", json.dumps(body).encode())
        answer = s.answer("rollback", rid)
    except CliError as exc:
        print(f"edge-agent models rollback: {exc}", file=sys.stderr)
        return 2
    finally:
        s.close()
    if not answer.get("ok"):
        print(f"refused: {answer.get('error')}")
        return 1
    print(
        f"rolled back: {args.model} serves {answer.get('version') or 'the config model'} "
        f"(was {answer.get('previous') or 'the config model'})"
    )
    return 0


# ---- list and show ----------------------------------------------------------------------------------------
def _local(cfg: Any, model: str) -> dict[str, Any]:
    """A model's versions from the state folder (nothing there: no version)."""
    from agent.deploy.errors import DeployError
    from agent.deploy.versions import VersionStore

    store = VersionStore(cfg.deploy.state_dir)
    try:
        versions = store.versions(model)
        serving, previous = store.serving(model), store.previous(model)
    except (DeployError, OSError) as exc:
        return {"model": model, "serving": None, "previous": [], "versions": [], "error": str(exc)}
    rows = [{**asdict(v), "path": str(v.path)} for v in versions]
    return {"model": model, "serving": serving, "previous": previous, "versions": rows}


def cmd_models_list(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    retained = _retained_states(cfg, args.device)
    out = []
    for model in cfg.models:
        row = _local(cfg, model)
        row["state"] = None if retained is None else retained.get(model)
        out.append(row)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'MODEL':<20} {'SERVING':<20} {'STAGE':<12} VERSIONS")
    for row in out:
        stage = (row["state"] or {}).get("stage") or "-"
        kept = ", ".join(f"{v['version']} ({v['state']})" for v in row["versions"]) or "-"
        print(f"{row['model']:<20} {row['serving'] or '(config)':<20} {stage:<12} {kept}")
    if retained is None:
        print("(the broker did not answer: stages not shown)")
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    from agent.deploy.staging import read_json

    cfg = _config(args.config)
    if args.model not in cfg.models:
        print(f"edge-agent models show: {args.model}: not a model of {args.config}", file=sys.stderr)
        return 2
    row = _local(cfg, args.model)
    record = Path(cfg.deploy.state_dir) / "deployments" / f"{args.model}.json"
    try:
        rec = read_json(record) if record.is_file() else None
    except Exception:
        rec = None
    retained = _retained_states(cfg, args.device)
    live = None if retained is None else retained.get(args.model)
    row["state"] = live or (rec.get("state") if isinstance(rec, dict) else None)
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(f"model {args.model}: serving {row['serving'] or 'the config model'}")
    for v in row["versions"]:
        print(f"  {v['version']:<24} {v['state']:<9} {v.get('format') or ''}")
        for name, sha in sorted(v["sha256"].items()):
            print(f"      {name}: {sha}")
    st = row["state"] or {}
    if st:
        why = f": {st['reason']}" if st.get("reason") else ""
        print(f"last deployment: {st.get('version')} {st.get('stage')}{why}")
    return 0
