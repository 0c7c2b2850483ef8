"""`edge-agent install-service`: the service user, /etc/edge-agent, the unit; then the commands to run.

Everything goes under `root` (default /), so the same code can stage an install into a directory
(`--root DIR`) for packaging or a test; the service user is then created with `useradd --prefix DIR` in
DIR/etc/passwd when that file exists, and skipped otherwise. Existing config and env files are kept
(they are the operator's); the unit is ours and is rewritten.
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from agent.service.exec_access import ServiceUser, exec_denied, group_name, interpreter_of, user_name

UNIT_NAME = "edge-agent.service"
TEMPLATE_EXEC = "/opt/edge-agent/.venv/bin/edge-agent"
CONFIG = "/etc/edge-agent/agent.yaml"
ENV_FILE = "/etc/edge-agent/edge-agent.env"
HIDDEN_BY_PROTECT_HOME = ("/home/", "/root/", "/run/user/")
MISSING_SYSTEMD_PYTHON = (
    "systemd-python is missing in this venv: the Type=notify unit could not report READY. Install it first: "
    "pip install 'edge-agent[systemd]' (it has no wheel: it builds with a C compiler, the Python headers, "
    "libsystemd-dev and pkg-config), or make the venv with --system-site-packages over the distribution's "
    "python3-systemd (README: Running as a service)"
)
FIX_VENV = (
    "install into a venv under /opt made from the distribution's python3 (README: Running as a service)"
)

ENV_TEXT = """\
# Secrets for ${VAR} references in agent.yaml, one KEY=value per line (systemd EnvironmentFile=).
# This file is 0640 root:edge-agent; keep passwords here, not in agent.yaml.
# CAM1_PASSWORD=change-me
"""


class InstallError(RuntimeError):
    pass


PLANNED = (-1, -1)  # the ids of a service user a dry run would create (only its owners are printed)


def _asset(name: str) -> Path:
    return Path(str(resources.files("agent") / "assets" / name))


def unit_template() -> str:
    """The unit shipped in systemd/ (and in the wheel, as agent/assets/edge-agent.service)."""
    return _asset(UNIT_NAME).read_text()


def render_unit(executable: Path) -> str:
    text = unit_template()
    if TEMPLATE_EXEC not in text:
        raise InstallError(f"{_asset(UNIT_NAME)}: ExecStart does not name {TEMPLATE_EXEC}")
    return text.replace(TEMPLATE_EXEC, str(executable))


def example_config() -> str:
    """Runs as shipped: the bundled NanoDet on the bundled clip; cameras to add are shown commented."""
    return f"""\
# edge-agent configuration: every key is documented in README.md ("Configuration").
# After editing: systemctl reload edge-agent (cameras and MQTT change in place).
device_id: {_hostname()}
engine_dir: /var/lib/edge-agent/engines
models:
  detector:
    onnx: {_asset("nanodet-m-416.onnx")}
    format: nanodet
    labels: {_asset("coco.names")}
    backend: auto          # TensorRT where it exists (engine built in the background), else ONNX Runtime
    precision: fp16
cameras:
  demo:                    # the bundled street clip, looped: replace with your cameras
    url: {_asset("bikes.mp4")}
    model: detector
    fps: 5
  # gate:
  #   url: rtsp://viewer:${{CAM1_PASSWORD}}@192.0.2.10:554/stream1   # password from edge-agent.env
  #   model: detector
  #   fps: 10
mqtt: {{host: localhost, port: 1883}}
telemetry: {{interval_s: 10}}
"""


def _hostname() -> str:
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in os.uname().nodename)
    return name or "edge-agent"


def agent_executable() -> Path:
    exe = Path(sys.executable).parent / "edge-agent"
    if exe.exists():
        return exe
    found = shutil.which("edge-agent")
    if found is None:
        raise InstallError("cannot find the edge-agent command next to this Python or on PATH")
    return Path(found)


def _ids_in(passwd: Path, group: Path, user: str) -> tuple[int, int] | None:
    """uid of `user` and gid of its group, read from the given files (a staged root has its own)."""
    try:
        users = {f[0]: f for f in (line.split(":") for line in passwd.read_text().splitlines()) if len(f) > 3}
        groups = {f[0]: f for f in (line.split(":") for line in group.read_text().splitlines()) if len(f) > 2}
    except OSError:
        return None
    if user not in users or user not in groups:
        return None
    return int(users[user][2]), int(groups[user][2])


class Installer:
    def __init__(
        self,
        root: Path = Path("/"),
        user: str = "edge-agent",
        executable: Path | None = None,
        dry_run: bool = False,
        say: Callable[[str], None] = print,
    ) -> None:
        self.root = root
        self.user = user
        self.executable = executable or agent_executable()
        self.dry_run = dry_run
        self.say = say
        self.staged = root.resolve() != Path("/")
        self.refusals: list[str] = []  # what the real run refuses (a dry run lists them and goes on)
        self._user_planned = False  # a dry run that would create the user: the real run's owners have it

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def run(self) -> None:
        self._check()
        ids = self._user()
        if ids is None and self._user_planned:
            ids = PLANNED  # for the owners printed only: a dry run writes nothing
        etc = self.path("/etc/edge-agent")
        self._mkdir(etc, 0o750, ids)
        self._write(self.path(CONFIG), example_config(), 0o640, ids, keep=True)
        self._write(self.path(ENV_FILE), ENV_TEXT, 0o640, ids, keep=True)
        self._state_dir(ids)
        unit = self.path(f"/etc/systemd/system/{UNIT_NAME}")
        self._mkdir(unit.parent, 0o755, None)
        self._write(unit, render_unit(self.executable), 0o644, None, keep=False)

    def _check(self) -> None:
        """Refuse what could not work under the unit; a dry run shows the plan and what would be refused."""
        if not self.staged and os.geteuid() != 0:
            if not self.dry_run:
                raise InstallError("installing the service needs root (sudo), or --root DIR to stage it")
            self.say("note: the real run needs root (sudo); the owners below are the ones it sets")
        problems = self.problems()
        if problems and not self.dry_run:
            raise InstallError("\n".join(problems))
        self.refusals = problems
        for problem in problems:
            self.say(f"refused without --dry-run: {problem}")

    def problems(self) -> list[str]:
        """What would make the service fail at start: ExecStart or its interpreter hidden by ProtectHome=
        or not executable by the service user (both: status=203/EXEC, Permission denied), or systemd-python
        missing (a Type=notify unit that cannot notify is killed after TimeoutStartSec)."""
        exe = self.executable
        interpreter = interpreter_of(exe)
        paths = [exe] if interpreter is None else [exe, interpreter]
        found: list[str] = []
        for path in paths:
            real = os.path.realpath(path)
            if str(path).startswith(HIDDEN_BY_PROTECT_HOME):
                why = "the unit has ProtectHome=yes, which hides this path from the service"
            elif real.startswith(HIDDEN_BY_PROTECT_HOME):
                why = f"it resolves to {real}, which the unit's ProtectHome=yes hides from the service"
            else:
                why = exec_denied(path, self._service_user(), script=path == exe and interpreter is not None)
            if why is not None:
                found.append(f"{path}: {why} (systemd: status=203/EXEC, Permission denied); {FIX_VENV}")
                break  # the first that could not start is enough to say
        try:
            import systemd.daemon  # noqa: F401
        except ImportError:
            found.append(MISSING_SYSTEMD_PYTHON)
        return found

    def _service_user(self) -> ServiceUser:
        """The user as the unit runs it: its groups plus video (SupplementaryGroups=). Before useradd, the
        groups it will be given only (its own group does not exist yet)."""
        etc = self.path("/etc")
        try:
            lines = (etc / "group").read_text().splitlines()
        except OSError:
            lines = []
        groups = [f for f in (line.split(":") for line in lines) if len(f) > 3]
        gids = {int(f[2]) for f in groups if f[0] in ("video", "render") or self.user in f[3].split(",")}
        ids = _ids_in(etc / "passwd", etc / "group", self.user)
        if ids is None:
            return ServiceUser(self.user, None, frozenset(gids))
        return ServiceUser(self.user, ids[0], frozenset(gids | {ids[1]}))

    def _user(self) -> tuple[int, int] | None:
        etc = self.path("/etc")
        ids = _ids_in(etc / "passwd", etc / "group", self.user)
        if ids is not None:
            self.say(f"user {self.user}: exists")
            return ids
        if self.staged and not (etc / "passwd").exists():
            self.say(f"user {self.user}: skipped ({etc}/passwd does not exist in the staged root)")
            return None
        groups = [g for g in ("video", "render") if self._group_exists(g)]
        cmd = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/var/lib/edge-agent"]
        cmd += ["--shell", "/usr/sbin/nologin", "--comment", "edge-agent service"]
        if groups:
            cmd += ["--groups", ",".join(groups)]
        if self.staged:
            cmd += ["--prefix", str(self.root)]
        cmd.append(self.user)
        self.say(f"user {self.user}: {' '.join(cmd)}")
        if self.dry_run:
            self._user_planned = True
            return None
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InstallError(f"useradd failed ({done.returncode}): {done.stderr.strip()}")
        return _ids_in(etc / "passwd", etc / "group", self.user)

    def _group_exists(self, name: str) -> bool:
        if self.staged:
            group = self.path("/etc/group")
            lines = group.read_text().splitlines() if group.exists() else []
            return any(line.startswith(f"{name}:") for line in lines)
        try:
            grp.getgrnam(name)
        except KeyError:
            return False
        return True

    def _owners(self, ids: tuple[int, int] | None, service_owned: bool = False) -> str:
        """user:group the real run leaves on what it makes: root and the service's group (the service user
        itself with `service_owned`) as root; the caller's own when it stages without root (no chown)."""
        if self.staged and os.geteuid() != 0:
            return f"{user_name(os.geteuid())}:{group_name(os.getegid())}"
        group = self.user if ids is not None else "root"
        return f"{group}:{group}" if service_owned else f"root:{group}"

    def _mkdir(self, path: Path, mode: int, ids: tuple[int, int] | None) -> None:
        self.say(f"dir  {path} ({mode:o} {self._owners(ids)})")
        if self.dry_run:
            return
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
        self._own(path, ids)

    def _state_dir(self, ids: tuple[int, int] | None) -> None:
        """/var/lib/edge-agent as the unit's StateDirectory= makes it at the first start (0750, the service
        user's), made now: `--check-config` run as the service user before that start checks engine_dir
        under it (it must be creatable and writable) and would be refused otherwise."""
        state = self.path("/var/lib/edge-agent")
        self.say(f"dir  {state} (750 {self._owners(ids, service_owned=True)})")
        if self.dry_run:
            return
        state.mkdir(parents=True, exist_ok=True)
        state.chmod(0o750)
        if ids is not None and os.geteuid() == 0:
            os.chown(state, ids[0], ids[1])

    def _write(self, path: Path, text: str, mode: int, ids: tuple[int, int] | None, keep: bool) -> None:
        if keep and path.exists():
            self.say(f"file {path}: kept (exists)")
            return
        self.say(f"file {path} ({mode:o} {self._owners(ids)})")
        if self.dry_run:
            return
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:  # temp + fsync + rename: a half-written unit or config never shows
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(mode)
        self._own(tmp, ids)
        tmp.replace(path)

    def _own(self, path: Path, ids: tuple[int, int] | None) -> None:
        # root owns; the service's group may read (config, env) or enter (dirs) but not write.
        if ids is None or os.geteuid() != 0:
            return
        os.chown(path, 0, ids[1])


NEXT_STEPS = """
Next:
  sudoedit /etc/edge-agent/agent.yaml          # cameras, MQTT broker (secrets in edge-agent.env)
  sudo -u {user} {exe} run -c /etc/edge-agent/agent.yaml --check-config
  sudo systemctl daemon-reload
  sudo systemctl enable --now edge-agent
  systemctl status edge-agent                   # Status: "1/1 cameras streaming, 5 fps, detector ..."
  journalctl -u edge-agent -f                   # fields: journalctl -u edge-agent CAMERA=demo
  sudo systemctl reload edge-agent              # after editing the config (SIGHUP)
"""


def install_service(root: Path, user: str, dry_run: bool, say: Callable[[str], None] = print) -> int:
    """0 when installed (or a dry run found nothing the real run refuses); 2 for a dry run that lists
    what the real run would refuse, said last on stderr (the real run raises InstallError instead)."""
    installer = Installer(root, user, dry_run=dry_run, say=say)
    installer.run()
    say(NEXT_STEPS.format(user=user, exe=installer.executable))
    for problem in installer.refusals:
        print(f"edge-agent install-service: the real run would refuse: {problem}", file=sys.stderr)
    return 2 if installer.refusals else 0
