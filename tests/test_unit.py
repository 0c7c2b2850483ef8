"""The systemd unit and `edge-agent install-service`: systemd-analyze verify/security, a staged install
(user, modes, kept files), and the installed example config running the bundled model as shipped."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_agent import wait_until

from agent.config import load_config
from agent.service.install import Installer, InstallError, render_unit

REPO = Path(__file__).resolve().parents[1]
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt: systemd)")
EXE = Path(sys.executable).parent / "edge-agent"


def fake_venv(top: Path, python_target: str) -> Path:
    """top/venv/bin/edge-agent, a console script as pip writes it, whose python links to `python_target`."""
    bin_dir = top / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(python_target)
    exe = bin_dir / "edge-agent"
    exe.write_text(f"#!{bin_dir / 'python'}\nimport sys\nfrom agent.cli import main\nsys.exit(main())\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is under a 0700 directory, which the service user
    could not enter: install-service rightly refuses executables there)."""
    top = Path(tempfile.mkdtemp(prefix="edge-agent-test-", dir="/var/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


@pytest.fixture
def service_exe(public_dir: Path) -> Path:
    """An edge-agent script the service user can run: its python links to /bin/sh, which anyone may execute
    (only its permissions are checked; the unit is verified, never started, here)."""
    return fake_venv(public_dir, "/bin/sh")


def unit_file(tmp_path: Path) -> Path:
    # ExecStart must name an existing executable for verify: this venv's edge-agent.
    path = tmp_path / "edge-agent.service"
    path.write_text(render_unit(EXE))
    return path


def test_shipped_unit_is_the_one_in_the_package() -> None:
    assert (REPO / "agent" / "assets" / "edge-agent.service").read_text() == (
        REPO / "systemd" / "edge-agent.service"
    ).read_text()


@needs_analyze
def test_unit_verifies_cleanly(tmp_path: Path) -> None:
    out = subprocess.run([ANALYZE, "verify", str(unit_file(tmp_path))], capture_output=True, text=True)
    # Unknown keys and bad values only warn (exit 0): stderr must be empty too.
    assert out.returncode == 0 and out.stderr == "", out.stderr


@needs_analyze
def test_unit_hardening_exposure_is_at_most_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(unit_file(tmp_path))],
        capture_output=True,
        text=True,
    )
    m = re.search(r"Overall exposure level for edge-agent\.service: (\d+\.\d+)", out.stdout)
    assert m, out.stdout[-2000:] + out.stderr
    assert float(m.group(1)) <= 2.0, out.stdout
    musts = ("NoNewPrivileges=", "ProtectSystem=", "RestrictAddressFamilies=~AF_PACKET", "PrivateMounts=")
    for setting in musts:
        assert re.search(rf"✓ {re.escape(setting)}", out.stdout), setting


def unit_settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_unit_is_notify_with_watchdog_reload_and_secrets_file() -> None:
    s = unit_settings((REPO / "systemd" / "edge-agent.service").read_text())
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert int(s["WatchdogSec"][0]) >= 10
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["Restart"] == ["on-failure"]
    assert s["User"] == ["edge-agent"] and s["SupplementaryGroups"] == ["video"]
    assert s["EnvironmentFile"] == ["-/etc/edge-agent/edge-agent.env"]
    assert {"StateDirectory", "CacheDirectory", "ConfigurationDirectory"} <= set(s)
    assert "char-nvidia* rw" in s["DeviceAllow"]


def stage_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "gshadow", "login.defs"):
        if Path("/etc", name).exists():
            shutil.copy(Path("/etc", name), root / "etc" / name)
    return root


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="useradd --prefix needs root"
)
@needs_analyze
def test_install_service_stages_user_dirs_files_and_a_verifiable_unit(
    tmp_path: Path, service_exe: Path
) -> None:
    root = stage_root(tmp_path)
    lines: list[str] = []
    Installer(root, "edge-agent", service_exe, say=lines.append).run()

    passwd = (root / "etc" / "passwd").read_text()
    entry = next(line for line in passwd.splitlines() if line.startswith("edge-agent:"))
    uid, gid, home, shell = entry.split(":")[2], entry.split(":")[3], entry.split(":")[5], entry.split(":")[6]
    assert home == "/var/lib/edge-agent" and shell == "/usr/sbin/nologin" and int(uid) < 1000
    video = [g for g in (root / "etc" / "group").read_text().splitlines() if g.startswith("video:")]
    assert not video or "edge-agent" in video[0].split(":")[3].split(",")
    assert "edge-agent" not in Path("/etc/passwd").read_text().split(":")[0::6]  # the host is untouched

    etc = root / "etc" / "edge-agent"
    for path, mode in ((etc, 0o750), (etc / "agent.yaml", 0o640), (etc / "edge-agent.env", 0o640)):
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == mode, path
        assert st.st_uid == 0 and st.st_gid == int(gid), path  # root-owned, readable by the service group
    unit = root / "etc" / "systemd" / "system" / "edge-agent.service"
    assert f"ExecStart={service_exe} run -c /etc/edge-agent/agent.yaml" in unit.read_text()
    out = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr

    # A second run keeps the operator's files and says so.
    (etc / "agent.yaml").write_text("# mine\n")
    lines.clear()
    Installer(root, "edge-agent", service_exe, say=lines.append).run()
    assert (etc / "agent.yaml").read_text() == "# mine\n"
    assert any("agent.yaml: kept" in line for line in lines)
    assert any("user edge-agent: exists" in line for line in lines)


def test_installed_example_config_runs_the_bundled_model_as_shipped(
    tmp_path: Path, service_exe: Path
) -> None:
    from agent.cli.daemon import local_device

    root = tmp_path / "root"
    Installer(root, "edge-agent", service_exe, say=lambda _l: None).run()
    cfg = load_config(root / "etc" / "edge-agent" / "agent.yaml")
    assert cfg.cameras["demo"].url and Path(cfg.cameras["demo"].url).exists()
    # Only where it writes and talks to moves: a temp engine dir, and no broker in this test.
    no_broker = cfg.mqtt.model_copy(update={"enabled": False})
    cfg = cfg.model_copy(update={"engine_dir": tmp_path / "engines", "mqtt": no_broker})
    agent = local_device(cfg, console=False)
    try:
        agent.start()
        assert wait_until(lambda: agent.runtime.results_out.get("detector", 0) >= 3, 60)
    finally:
        t0 = time.monotonic()
        agent.stop()
    assert time.monotonic() - t0 < 10


def test_installer_refuses_what_would_fail_under_the_unit(tmp_path: Path) -> None:
    with pytest.raises(InstallError, match="ProtectHome"):
        Installer(tmp_path, "edge-agent", Path("/home/me/.venv/bin/edge-agent"), say=lambda _l: None).run()
    if os.geteuid() != 0:
        with pytest.raises(InstallError, match="needs root"):
            Installer(Path("/"), "edge-agent", EXE, say=lambda _l: None).run()


def test_installer_refuses_an_interpreter_the_service_user_cannot_execute(
    tmp_path: Path, public_dir: Path
) -> None:
    """203/EXEC "Permission denied" at start, measured under systemd for a venv made from a pyenv Python
    under /root: the venv's bin/python is a symlink, and what it resolves to must be reachable too."""

    staged = stage_root(tmp_path)

    def refusal(exe: Path) -> str:
        with pytest.raises(InstallError) as err:
            Installer(staged, "edge-agent", exe, say=lambda _l: None).run()
        return str(err.value)

    pyenv = fake_venv(public_dir / "pyenv", "/root/.pyenv/versions/3.11.7/bin/python3.11")
    why = refusal(pyenv)
    assert f"{pyenv.parent / 'python'}: it resolves to /root/.pyenv/versions/3.11.7/bin/python3.11" in why
    assert "ProtectHome=yes" in why and "203/EXEC" in why and "distribution's python3" in why

    private = public_dir / "private"  # e.g. a Python built under a 0700 directory outside /home
    private.mkdir(mode=0o700)
    os.symlink("/bin/sh", private / "python3")
    why = refusal(fake_venv(public_dir / "other", str(private / "python3")))
    assert f"edge-agent cannot enter {private} (drwx------ root:root)" in why

    script = fake_venv(public_dir / "script", "/bin/sh")
    script.chmod(0o711)  # the interpreter must read the script too
    assert f"edge-agent cannot read and execute {script} (-rwx--x--x root:root)" in refusal(script)

    # The same problems in a dry run: said, and nothing written.
    lines: list[str] = []
    root = tmp_path / "dry"
    Installer(root, "edge-agent", pyenv, dry_run=True, say=lines.append).run()
    assert any(line.startswith("refused without --dry-run: ") and "ProtectHome" in line for line in lines)
    assert not root.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making files of another group needs root")
def test_installer_counts_the_groups_the_service_user_will_have(tmp_path: Path, public_dir: Path) -> None:
    video = next((g for g in Path("/etc/group").read_text().splitlines() if g.startswith("video:")), None)
    if video is None:
        pytest.skip("no video group here")
    shared = public_dir / "for-video"  # 0750 root:video: the unit's SupplementaryGroups=video may enter
    shared.mkdir(mode=0o750)
    os.chown(shared, 0, int(video.split(":")[2]))
    os.symlink("/bin/sh", shared / "python3")
    installer = Installer(
        stage_root(tmp_path), "edge-agent", fake_venv(public_dir / "venv", str(shared / "python3"))
    )
    assert installer.problems() == []
    shared.chmod(0o700)
    assert "edge-agent cannot enter" in installer.problems()[0]


def test_install_service_cli_dry_run_changes_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "install-service", "--root", str(tmp_path / "r"), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Exit 2 when the real run would refuse (this venv's Python may sit under /root: ProtectHome), else 0.
    refusals = Installer(tmp_path / "r", "edge-agent", EXE, dry_run=True).problems()
    assert out.returncode == (2 if refusals else 0), out.stderr
    assert "systemctl enable --now edge-agent" in out.stdout
    assert not (tmp_path / "r").exists()


def test_install_service_dry_run_works_without_systemd_python(tmp_path: Path) -> None:
    """systemd-python has no wheel (it builds against libsystemd): a dry run says so and shows the plan;
    the real run refuses."""
    root = str(tmp_path / "r")

    def install(*extra: str) -> subprocess.CompletedProcess[str]:
        code = (
            "import sys; sys.modules['systemd'] = None\n"  # import systemd: ImportError, as if not there
            "from agent.cli import main\n"
            f"sys.exit(main(['install-service', '--root', {root!r}, *{list(extra)!r}]))"
        )
        return subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
        )

    dry = install("--dry-run")
    # Issue 36 (15): the real run refuses, so the dry run does not exit 0 (before: 0); stderr says why.
    assert dry.returncode == 2, dry.stderr
    assert "refused without --dry-run: systemd-python is missing" in dry.stdout
    assert "edge-agent install-service: the real run would refuse: systemd-python is missing" in dry.stderr
    assert "C compiler" in dry.stdout and "--system-site-packages" in dry.stdout
    assert "edge-agent.service" in dry.stdout and "systemctl enable --now edge-agent" in dry.stdout
    real = install()
    assert real.returncode == 2 and "systemd-python is missing" in real.stderr, real.stderr
    assert "Traceback" not in dry.stderr + real.stderr
    assert not Path(root).exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="useradd --prefix needs root"
)
def test_dry_run_prints_the_owners_the_real_run_sets(tmp_path: Path, service_exe: Path) -> None:
    """Issue 36 (15): before, a dry run that would create the service user printed root:root for what the
    real run makes root:edge-agent (and edge-agent:edge-agent for the state dir). Now the dry run's lines
    are the real run's, and those say what the files are."""
    root = stage_root(tmp_path)
    dry: list[str] = []
    installer = Installer(root, "edge-agent", service_exe, dry_run=True, say=dry.append)
    installer.run()
    assert installer.refusals == [] and not (root / "etc" / "edge-agent").exists()
    real: list[str] = []
    Installer(root, "edge-agent", service_exe, say=real.append).run()
    assert [line for line in dry if not line.startswith("user ")] == [
        line for line in real if not line.startswith("user ")
    ]
    etc = root / "etc" / "edge-agent"
    assert f"dir  {etc} (750 root:edge-agent)" in dry
    assert f"file {etc / 'agent.yaml'} (640 root:edge-agent)" in dry
    assert f"dir  {root / 'var' / 'lib' / 'edge-agent'} (750 edge-agent:edge-agent)" in dry
    names = {int(f.split(":")[2]): f.split(":")[0] for f in (root / "etc" / "group").read_text().splitlines()}
    for line in real:
        kind, _, rest = line.partition(" ")
        if kind not in ("dir", "file"):
            continue
        path, owners = rest.strip().split(" (")[0], rest.rsplit(" ", 1)[1].rstrip(")")
        st = Path(path).stat()
        users = {0: "root"} | {
            int(f.split(":")[2]): f.split(":")[0] for f in (root / "etc" / "passwd").read_text().splitlines()
        }
        assert f"{users[st.st_uid]}:{names[st.st_gid]}" == owners, line
