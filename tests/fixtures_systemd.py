"""Real systemd as PID 1 for a test, booted over an overlay of / in namespaces of its own (systemd_boot.sh).

What the booted system writes goes to a tmpfs upper layer in a private mount namespace, so it vanishes
with the namespace; the host's files, mounts, hostname, kernel settings and cgroups stay as they were
(systemd's cgroups live in cgroups made for the boot, under the test's own, removed at teardown). The
network namespace is the host's: a mosquitto started by the test is reachable on 127.0.0.1.

The test reaches the system with `nsenter` (systemctl, journalctl, installing as a user would) and its
files through /proc/PID/root.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BOOT = Path(__file__).with_name("systemd_boot.sh")
SYSTEMD = Path("/lib/systemd/systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# What a root shell in the booted system starts with: nothing of the test's environment (venv, PYTHONPATH).
SHELL_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}


@dataclass(frozen=True)
class CgroupMount:
    fstype: str  # cgroup (v1) or cgroup2
    path: Path  # where the host mounts it
    options: str  # its super options, e.g. "rw,cpu" or "rw,name=systemd"
    current: str  # this process's cgroup in it, e.g. "/process_api/37a6..."

    @property
    def relative(self) -> str:
        return "." if self.path == CGROUP_ROOT else str(self.path.relative_to(CGROUP_ROOT))


def cgroup_plan(mounts: list[CgroupMount]) -> str:
    """WORK/cgroups for systemd_boot.sh: FSTYPE DIR OPTIONS per line."""
    return "".join(f"{m.fstype} {m.relative} {m.options}\n" for m in mounts)


def cgroup_mounts() -> list[CgroupMount]:
    """The host's cgroup hierarchies under /sys/fs/cgroup with this process's place in each."""
    mine: dict[frozenset[str], str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        mine[frozenset(controllers.split(",")) if controllers else frozenset()] = path
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = right.split()[:3]
        point = Path(left.split()[4])
        if fstype not in ("cgroup", "cgroup2") or not point.is_relative_to(CGROUP_ROOT):
            continue
        if fstype == "cgroup2":
            key = frozenset()
        else:  # a v1 hierarchy: the /proc/self/cgroup line whose controllers its options name
            key = next((k for k in mine if k and k <= set(options.split(","))), frozenset({"?"}))
        if key in mine:
            found.append(CgroupMount(fstype, point, options, mine[key]))
    return found


CGROUP_PREFIX = "edge-agent-test-"  # + the pid of the test that made it


def remove_cgroups(top: Path, deadline: float) -> list[Path]:
    """rmdir `top` and every cgroup below it (systemd's slices), deepest first; those left over."""
    left: list[Path] = []
    below = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*below, top]:
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last processes of the namespace are reaped
                if time.monotonic() > deadline:
                    left.append(d)
                    break
                time.sleep(0.1)
    return left


class Cgroups:
    """One cgroup per hierarchy, under this process's own, for the booted systemd to be the root of."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.mounts = cgroup_mounts()
        try:
            self._make()
        except OSError:
            self.remove(timeout=1)
            raise

    def _make(self) -> None:
        for m in self.mounts:
            mine = m.path / m.current.lstrip("/")
            # Those of a test killed before its teardown (its booted system died with it: --kill-child).
            for stale in mine.glob(f"{CGROUP_PREFIX}*"):
                if not Path("/proc", stale.name.removeprefix(CGROUP_PREFIX)).exists():
                    remove_cgroups(stale, time.monotonic() + 1)
            d = mine / f"{CGROUP_PREFIX}{os.getpid()}"
            d.mkdir()
            self.dirs.append(d)
            # A new v1 cpuset has no CPUs and memory nodes: nothing could join it.
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (d / knob).exists() and not (d / knob).read_text().strip():
                    (d / knob).write_text((d.parent / knob).read_text())

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self, timeout: float = 10.0) -> list[Path]:
        """Remove them with systemd's below (once the namespace is gone); those left over."""
        deadline = time.monotonic() + timeout
        return [left for top in self.dirs if top.exists() for left in remove_cgroups(top, deadline)]


def boot_problem() -> str | None:
    """Why systemd cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "booting systemd needs root (namespaces, mounts, cgroups)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} is missing (apt-get install systemd dbus)"
    return None


class BootedSystem:
    """A systemd booted by systemd_boot.sh; `pid` is its host pid (PID 1 inside)."""

    def __init__(self, work: Path, pid: int, launcher: subprocess.Popen[bytes]) -> None:
        self.work = work
        self.pid = pid
        self._launcher = launcher

    def path(self, inside: str) -> Path:
        """A path of the booted system, as the host reaches it."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`cmd` in the booted system (its pid, mount, uts and ipc namespaces and root), as root."""
        nsenter = ["nsenter", "-t", str(self.pid), "-p", "-m", "-u", "-i", "-r", "-w", "--"]
        done = subprocess.run(
            [*nsenter, *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**SHELL_ENV, **(env or {})},
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.run("systemctl", *args, check=check).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> list[dict[str, str]]:
        """journalctl ARGS as records (-o json); values that are not text come as lists: left out."""
        out = self.run("journalctl", "--no-pager", "-o", "json", *args).stdout
        records = []
        for line in out.splitlines():
            raw = json.loads(line)
            records.append({k: v for k, v in raw.items() if isinstance(v, str)})
        return records

    def wait_booted(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        # systemctl says "offline" until PID 1 listens on its private socket.
        while not self.path("/run/systemd/private").exists():
            if self._launcher.poll() is not None or time.monotonic() > deadline:
                return "no /run/systemd/private"
            time.sleep(0.05)
        # --wait returns once the boot job finished: "running", or "degraded" when a unit failed.
        done = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=timeout)
        return done.stdout.strip()

    def poweroff(self, timeout: float = 30.0) -> int | None:
        """SIGRTMIN+4 (PID 1 ignores SIGTERM); SIGKILL of PID 1 (the whole namespace) if it hangs."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGRTMIN + 4)
        try:
            return self._launcher.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._launcher.wait(10)
            return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _namespace_init(launcher: int, timeout: float) -> int:
    """The host pid of the booted namespace's PID 1: unshare's child, once the launcher became unshare
    (before that, its children are the script's own commands)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if _comm(launcher) == "unshare":
                children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
                if children:
                    return int(children[0])
        time.sleep(0.02)
    raise RuntimeError(f"unshare ({launcher}) started no namespace within {timeout} s")


def _host_mounts_under(path: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if Path(p).is_relative_to(path)]


@contextlib.contextmanager
def booted(work: Path, boot_timeout: float = 60.0) -> Iterator[BootedSystem]:
    """Boot, yield, and always power off, check the host kept no mount, remove the cgroups."""
    (work / "probe").mkdir(parents=True)
    plan = cgroup_plan(cgroup_mounts())
    (work / "probe" / "cgroups").write_text(plan)
    (work / "cgroups").write_text(plan)
    probe = subprocess.run(["bash", str(BOOT), "probe", str(work / "probe")], capture_output=True, text=True)
    (work / "probe.log").write_text(probe.stdout + probe.stderr)
    if probe.returncode != 0:
        pytest.skip(f"cannot build the overlay root in new namespaces here: {probe.stderr.strip()[-500:]}")
    try:
        cgroups = Cgroups()
    except OSError as exc:
        pytest.skip(f"cannot make cgroups for the booted systemd: {exc}")
    launcher: subprocess.Popen[bytes] | None = None
    system: BootedSystem | None = None
    try:
        with (work / "boot.log").open("wb") as log:
            # setpriv --pdeathsig: if the test dies before its teardown runs, unshare gets SIGKILL, and
            # through its --kill-child the booted system.
            launcher = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "bash", str(BOOT), "outer", str(work), *cgroups.procs],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of pytest must not reach PID 1 of the booted system
            )
        init = _namespace_init(launcher.pid, 10)
        deadline = time.monotonic() + boot_timeout
        while _comm(init) != "systemd":
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"systemd did not start:\n{(work / 'boot.log').read_text()}")
            time.sleep(0.05)
        system = BootedSystem(work, init, launcher)
        state = system.wait_booted(boot_timeout)
        assert state in ("running", "degraded"), (state, system.systemctl("--failed", check=False))
        yield system
    finally:
        if system is not None:
            system.poweroff()
        elif launcher is not None and launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        leaked = _host_mounts_under(work)
        for point in reversed(leaked):  # never expected: the mounts lived in the namespace only
            subprocess.run(["umount", "-l", point], check=False)
        left = cgroups.remove()
        assert not leaked, f"mounts of the booted system reached the host: {leaked}"
        assert not left, f"cgroups left behind: {left}"
