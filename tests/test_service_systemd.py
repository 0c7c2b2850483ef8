"""The service under real systemd: booted as PID 1 over an overlay of / (tests/fixtures_systemd.py), installed
with `edge-agent install-service` as a user would, watched through systemctl, journalctl and MQTT.

The service venv is made inside the booted system from the distribution's python3, as the README says;
instead of downloading packages it reaches this venv's (same CPython minor version, so the same cp3XX
wheels) through a .pth file. The agent runs the bundled NanoDet over the bundled clip and publishes to a
mosquitto the test starts on the host (the booted system shares the host's network). A test drop-in
shortens WatchdogSec and RestartSec and names the flag file of tests/systemd_stall_hook.py, which hangs
ONNX Runtime inference on demand: the one thing not from a real install.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_mqtt import Broker, Subscriber
from fixtures_systemd import BootedSystem, boot_problem, booted

from agent.service.install import HIDDEN_BY_PROTECT_HOME

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
VENV = "/opt/edge-agent/.venv"  # README: Running as a service
EXE = f"{VENV}/bin/edge-agent"
CONFIG = "/etc/edge-agent/agent.yaml"
STALL_FLAG = "/run/edge-agent-test/stall"
WATCHDOG_S = 6  # stall after 3 s without a result, systemd acts 6 s after the last ping
DROP_IN = f"""\
# tests/test_service_systemd.py: a watchdog short enough to watch it fire, quick restarts, and the flag
# file that makes tests/systemd_stall_hook.py hang inference.
[Service]
WatchdogSec={WATCHDOG_S}
RestartSec=1
Environment=EDGE_AGENT_TEST_STALL={STALL_FLAG}
"""
SIDE_CAMERA = f"""\
  side:
    url: {REPO}/agent/assets/bikes.mp4
    model: detector
    fps: 2
"""


def state_is(state: str) -> Callable[[dict], bool]:
    return lambda status: status.get("state") == state


def reload_ok(ok: bool) -> Callable[[dict], bool]:
    return lambda status: status.get("last_reload", {}).get("ok") is ok


class Service:
    """The unit in the booted system and the agent's MQTT topics; waits that fail with systemd's view."""

    def __init__(self, system: BootedSystem, sub: Subscriber, broker: Broker, device: str) -> None:
        self.system = system
        self.sub = sub
        self.broker = broker
        self.device = device

    def report(self) -> str:
        status = self.system.systemctl("status", "--no-pager", "-n", "0", "edge-agent", check=False)
        journal = self.system.run("journalctl", "--no-pager", "-n", "40", "-u", "edge-agent", check=False)
        return f"{status}\n{journal.stdout}"

    def until(self, cond: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s waiting for {what}\n{self.report()}")
            time.sleep(0.1)

    def show(self, *props: str) -> dict[str, str]:
        return self.system.show("edge-agent", *props)

    def prop(self, name: str) -> str:
        return self.show(name)[name]

    @property
    def main_pid(self) -> int:
        return int(self.prop("MainPID"))

    def mark(self) -> int:
        """Where the messages received so far end: `published(since=mark)` looks at what came after."""
        return len(self.sub.snapshot())

    def published(self, since: int, suffix: str, cond: Callable[[dict], bool] = lambda _p: True) -> bool:
        return any(t.endswith(suffix) and cond(json.loads(p)) for t, p, _ in self.sub.snapshot()[since:])

    def wait_published(
        self, since: int, suffix: str, cond: Callable[[dict], bool], timeout: float, what: str
    ) -> None:
        self.until(lambda: self.published(since, suffix, cond), timeout, what)

    def journal(self, *matches: str) -> list[dict[str, str]]:
        return self.system.journal("-u", "edge-agent", *matches)


def make_service_venv(system: BootedSystem) -> None:
    """python3 -m venv as the README says, then what `pip install edge-agent[opencv,systemd]` would put
    there, taken from this venv: its site-packages (a .pth) and the console script."""
    system.run("/usr/bin/python3", "-m", "venv", "--without-pip", VENV)
    site = system.run(f"{VENV}/bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    site_dir = system.path(site.stdout.strip())
    ours = sysconfig.get_path("purelib")
    (site_dir / "edge_agent_test.pth").write_text(
        f"import site; site.addsitedir({ours!r})\nimport edge_agent_test_stall\n"
    )
    hook = (Path(__file__).with_name("systemd_stall_hook.py")).read_text()
    (site_dir / "edge_agent_test_stall.py").write_text(hook)
    script = system.path(EXE)
    script.write_text(f"#!{VENV}/bin/python\nimport sys\nfrom agent.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)


def edit(system: BootedSystem, replacements: list[tuple[str, str]]) -> None:
    """Edit /etc/edge-agent/agent.yaml in place (mode and owner kept), as sudoedit would."""
    path = system.path(CONFIG)
    text = path.read_text()
    for old, new in replacements:
        assert old in text, f"{old!r} not in {CONFIG}:\n{text}"
        text = text.replace(old, new)
    path.write_text(text)


def environment_problem() -> str | None:
    problem = boot_problem()
    if problem:
        return problem
    ours = sysconfig.get_path("purelib")
    for path in (str(REPO), ours, sys.prefix):
        if path.startswith(HIDDEN_BY_PROTECT_HOME):
            return f"{path} is hidden from the service by ProtectHome=yes: the service venv could not use it"
        if os.path.realpath(path).startswith("/tmp/"):
            return f"{path} is under /tmp, which the booted system mounts afresh: it cannot see this checkout"
    return None


def test_the_service_under_real_systemd(tmp_path: Path, mqtt_broker: Broker, mqtt_subscribe) -> None:
    problem = environment_problem()
    if problem:
        pytest.skip(problem)
    device = f"sd{os.getpid()}"
    started = time.monotonic()
    with booted(tmp_path / "systemd") as system:
        try:
            # The host's /tmp is untouched by the boot (THE TRAP): this test's own files are still there.
            assert (tmp_path / "systemd" / "boot.log").exists()
            install_as_a_user(system, mqtt_broker.port, device)
            svc = Service(
                system, mqtt_subscribe(mqtt_broker.port, f"edge-agent/{device}/#"), mqtt_broker, device
            )
            ready_s = start(svc)
            sandbox(svc)
            reload(svc)
            hung_backend(svc)
            kill_9(svc)
            exposure = security(svc)
            shards_under_systemd(svc)
            stop_s = stop(svc)
        finally:  # for a failure's post-mortem: the booted system's whole journal, kept with the test's files
            journal = system.run("journalctl", "--no-pager", "-o", "short-monotonic", check=False).stdout
            (tmp_path / "journal.txt").write_text(journal)
    print(
        f"real systemd: READY {ready_s:.1f} s after enable --now, stop {stop_s:.2f} s, exposure {exposure}, "
        f"test {time.monotonic() - started:.0f} s (boot and power-off included)"
    )


def install_as_a_user(system: BootedSystem, port: int, device: str) -> None:
    """The README's steps: venv, install-service, edit the config, check it as the service user."""
    version = system.run("/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])").stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(
            f"the distribution's python3 is {version}, this venv's packages are for {sys.version_info[:2]}"
        )
    make_service_venv(system)

    # A venv whose python resolves under /root (pyenv) is refused, with the reason (203/EXEC otherwise).
    ours = os.path.realpath(sys.executable)
    if ours.startswith(HIDDEN_BY_PROTECT_HOME):
        refused = system.run(str(Path(sys.prefix) / "bin" / "edge-agent"), "install-service", check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"resolves to {ours}" in refused.stderr and "ProtectHome=yes" in refused.stderr
        assert "203/EXEC" in refused.stderr and not system.path("/etc/edge-agent").exists()

    installed = system.run(EXE, "install-service")
    assert "user edge-agent: useradd --system" in installed.stdout, installed.stdout
    if ours.startswith(HIDDEN_BY_PROTECT_HOME):  # ... and rightly: as the unit's user, it cannot start
        run = ["systemd-run", "--wait", "--quiet", "-p", "User=edge-agent", "-p", "ProtectHome=yes"]
        failed = system.run(*run, str(Path(sys.prefix) / "bin" / "edge-agent"), "--help", check=False)
        assert failed.returncode == 203, failed  # systemd's EXIT_EXEC: status=203/EXEC
    assert (
        f"ExecStart={EXE} run -c {CONFIG}"
        in system.path("/etc/systemd/system/edge-agent.service").read_text()
    )
    hostname = system.run("hostname").stdout.strip()
    edit(
        system,
        [
            (f"device_id: {hostname}", f"device_id: {device}"),
            ("mqtt: {host: localhost, port: 1883}", f"mqtt: {{host: 127.0.0.1, port: {port}}}"),
            # TensorRT-RTX builds an engine on the CPU in the background (the sandbox must let it write it
            # under /var/lib/edge-agent); it cannot load without a GPU, so ONNX Runtime keeps serving.
            ("backend: auto ", "backend: tensorrt_rtx "),
            ("precision: fp16", "precision: fp32"),
        ],
    )
    # The README's check, as the service user: it can import everything and read the config.
    system.run("runuser", "-u", "edge-agent", "--", EXE, "run", "-c", CONFIG, "--check-config")
    system.path("/etc/systemd/system/edge-agent.service.d").mkdir()
    system.path("/etc/systemd/system/edge-agent.service.d/test.conf").write_text(DROP_IN)
    system.path(STALL_FLAG).parent.mkdir()
    system.systemctl("daemon-reload")


def start(svc: Service) -> float:
    """enable --now returns with READY=1 (Type=notify: every camera tried, a result through every sink)."""
    t0 = time.monotonic()
    svc.system.run("systemctl", "enable", "--now", "edge-agent", timeout=150)
    ready_s = time.monotonic() - t0
    s = svc.show("ActiveState", "SubState", "StatusText", "NRestarts", "WatchdogUSec")
    assert (s["ActiveState"], s["SubState"]) == ("active", "running"), svc.report()
    assert re.match(r"1/1 cameras streaming, \d+ fps, detector onnxruntime fp32", s["StatusText"]), s
    assert s["WatchdogUSec"] == f"{WATCHDOG_S}s" and s["NRestarts"] == "0"
    svc.wait_published(0, "/status", state_is("online"), 10, "online")
    svc.wait_published(0, "/cameras/demo/detections", lambda _p: True, 10, "detections of demo")

    # journald: the agent's records carry CAMERA= / MODEL= and their PRIORITY.
    camera = svc.journal("CAMERA=demo")
    assert any("camera demo: streaming" in r["MESSAGE"] and r["PRIORITY"] == "6" for r in camera), camera
    model = svc.journal("MODEL=detector")
    assert any("served by onnxruntime" in r["MESSAGE"] and r["PRIORITY"] == "6" for r in model), model
    assert any("ready: 1/1 cameras streaming" in r["MESSAGE"] for r in svc.journal())
    return ready_s


def sandbox(svc: Service) -> None:
    """The engine build writes under /var/lib/edge-agent (StateDirectory=) as the service user; elsewhere
    the service's file system is read-only, /root hidden, no privileges, a syscall filter, devices closed."""
    system, main = svc.system, svc.main_pid
    plans = system.path("/var/lib/edge-agent/engines/detector")
    svc.until(lambda: any(plans.glob("*.plan")), 90, "an engine plan under /var/lib/edge-agent")
    state = system.path("/var/lib/edge-agent").stat()
    uid, gid = state.st_uid, state.st_gid
    assert uid != 0 and all(p.stat().st_uid == uid for p in plans.glob("*.plan"))

    # Into the running service's mount namespace (and root), as its user. A directory it owns outside its
    # state directories: writable as such, read-only in the sandbox.
    owned = system.path("/srv/edge-agent-probe")
    owned.mkdir()
    os.chown(owned, uid, gid)
    system.run("runuser", "-u", "edge-agent", "--", "touch", "/srv/edge-agent-probe/outside-the-service")
    as_service = [
        "nsenter",
        "-t",
        str(main),
        "-m",
        "-r",
        "-w",
        "-S",
        str(uid),
        "-G",
        str(gid),
        "--",
        "sh",
        "-c",
    ]
    system.run(*as_service, "echo x > /var/lib/edge-agent/probe")
    refused = system.run(*as_service, "echo x > /srv/edge-agent-probe/in-the-service", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    for elsewhere in ("/etc/edge-agent/probe", f"{VENV}/probe", "/usr/local/probe", "/probe"):
        assert system.run(*as_service, f"echo x > {elsewhere}", check=False).returncode != 0, elsewhere
    hidden = system.run(*as_service, "ls /root", check=False)
    assert hidden.returncode != 0 and "Permission denied" in hidden.stderr  # ProtectHome=yes

    status = system.path(f"/proc/{main}/status").read_text()
    for field, value in (("NoNewPrivs", "1"), ("Seccomp", "2"), ("CapEff", "0000000000000000")):
        assert re.search(rf"^{field}:\s+{value}$", status, re.M), (field, status)
    # DevicePolicy=closed: on cgroup v1 the devices controller lists what the service may open.
    devices = system.path("/sys/fs/cgroup/devices/system.slice/edge-agent.service/devices.list")
    if devices.exists():
        allowed = devices.read_text().split("\n")
        assert "a *:* rwm" not in allowed and "c 1:3 rwm" in allowed, allowed  # /dev/null only, and the like


def reload(svc: Service) -> None:
    """systemctl reload applies a config change in place, refuses a broken one and keeps the old."""
    main = svc.main_pid
    mark = svc.mark()
    edit(svc.system, [("  # gate:", SIDE_CAMERA + "  # gate:")])
    svc.system.systemctl("reload", "edge-agent")
    svc.wait_published(
        mark, "/cameras/side/detections", lambda _p: True, 30, "detections of the added camera"
    )
    svc.wait_published(mark, "/status", reload_ok(True), 10, "last_reload ok")

    mark = svc.mark()
    edit(svc.system, [("    fps: 2\n", "    fps: [2\n")])  # a YAML typo
    svc.system.systemctl("reload", "edge-agent")
    svc.wait_published(mark, "/status", reload_ok(False), 20, "last_reload refused")
    svc.until(lambda: "last reload failed" in svc.prop("StatusText"), 10, "the refusal in STATUS")
    mark = svc.mark()
    svc.wait_published(mark, "/cameras/side/detections", lambda _p: True, 20, "the old config still serving")

    edit(svc.system, [("    fps: [2\n", "    fps: 2\n")])
    svc.system.systemctl("reload", "edge-agent")
    svc.until(lambda: "last reload failed" not in svc.prop("StatusText"), 20, "the good config reloaded")
    assert svc.show("MainPID", "NRestarts") == {"MainPID": str(main), "NRestarts": "0"}


def hung_backend(svc: Service) -> None:
    """Frames arrive, no result comes out: the watchdog pings stop and systemd restarts the service."""
    pinged = svc.prop("WatchdogTimestampMonotonic")
    svc.until(lambda: svc.prop("WatchdogTimestampMonotonic") != pinged, 5, "watchdog pings while healthy")
    mark = svc.mark()
    svc.system.path(STALL_FLAG).touch()
    svc.until(lambda: svc.prop("NRestarts") == "1", 4 * WATCHDOG_S, "the watchdog's restart")
    svc.system.path(STALL_FLAG).unlink()
    unit_log = [r["MESSAGE"] for r in svc.journal()]
    assert f"edge-agent.service: Watchdog timeout (limit {WATCHDOG_S}s)!" in unit_log
    assert "edge-agent.service: Failed with result 'watchdog'." in unit_log
    stalled = svc.journal("MODEL=detector", "PRIORITY=3")
    assert any("withholding watchdog pings" in r["MESSAGE"] for r in stalled), stalled
    svc.until(lambda: svc.prop("ActiveState") == "active", 60, "active after the watchdog's restart")
    svc.wait_published(mark, "/status", state_is("online"), 10, "online after the watchdog's restart")


def kill_9(svc: Service) -> None:
    """kill -9 of the main process: Restart=on-failure, online again."""
    main = svc.main_pid
    mark = svc.mark()
    svc.system.run("kill", "-9", str(main))
    svc.until(lambda: svc.prop("NRestarts") == "2", 20, "the restart after kill -9")
    svc.until(lambda: svc.prop("ActiveState") == "active", 60, "active after kill -9")
    svc.wait_published(mark, "/status", state_is("online"), 10, "online after kill -9")
    assert svc.main_pid != main


def security(svc: Service) -> str:
    """systemd-analyze security of the loaded unit (the test drop-in changes nothing it rates)."""
    out = svc.system.run("systemd-analyze", "security", "--no-pager", "edge-agent.service").stdout
    exposure = re.search(r"Overall exposure level for edge-agent\.service: (\d+\.\d+)", out)
    assert exposure and float(exposure.group(1)) <= 2.0, out[-3000:]
    return exposure.group(1)


def shards_under_systemd(svc: Service) -> None:
    """pipeline.shards: 2 (a restart): READY from the supervisor, journald records with SHARD=, a shard
    killed with -9 restarted by the supervisor while the service (its MainPID) stays as it is."""
    path = svc.system.path(CONFIG)
    path.write_text(path.read_text() + "\npipeline:\n  shards: 2\n")
    mark = svc.mark()
    svc.system.systemctl("restart", "edge-agent")
    two = lambda p: p.get("state") == "online" and (p.get("shards") or {}).get("running") == 2  # noqa: E731
    svc.wait_published(mark, "/status", two, 60, "online with two shards")
    svc.until(lambda: svc.prop("ActiveState") == "active", 30, "active (READY) with shards")
    main, restarts = svc.main_pid, svc.prop("NRestarts")
    for k in ("0", "1"):
        svc.until(lambda k=k: svc.journal(f"SHARD={k}"), 20, f"journal records with SHARD={k}")
    children = svc.system.run("pgrep", "-P", str(main)).stdout.split()
    assert len(children) >= 2, children
    mark = svc.mark()
    svc.system.run("kill", "-9", children[0])
    restarted = lambda p: (p.get("shards") or {}).get("restarts", 0) >= 1  # noqa: E731
    svc.wait_published(mark, "/status", restarted, 30, "a shard restart in the status")
    svc.wait_published(mark, "/status", two, 60, "both shards running again")
    assert svc.show("MainPID", "NRestarts", "ActiveState") == {
        "MainPID": str(main),
        "NRestarts": restarts,
        "ActiveState": "active",
    }


def stop(svc: Service) -> float:
    """systemctl stop: offline published (retained), the process gone within 5 s, exit status 0."""
    mark = svc.mark()
    t0 = time.monotonic()
    svc.system.systemctl("stop", "edge-agent")
    stop_s = time.monotonic() - t0
    assert stop_s < 5, stop_s
    s = svc.show("ActiveState", "Result", "ExecMainStatus")
    assert s == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, s
    svc.wait_published(mark, "/status", state_is("offline"), 5, "offline")
    retained = Subscriber(svc.broker.port, f"edge-agent/{svc.device}/status")
    try:
        msgs = retained.wait_for(bool, 5)
        assert msgs[-1][2] and json.loads(msgs[-1][1])["state"] == "offline", msgs
    finally:
        retained.close()
    return stop_s
