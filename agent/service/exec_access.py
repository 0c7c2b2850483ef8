"""Whether the service user can execute the agent: the kernel's mode checks along every directory and
symlink on the way, for the executable and (for a pip console script) its interpreter. Used by
`install-service` (agent.service.install) before it writes a unit systemd could not start (203/EXEC).
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServiceUser:
    """Whom systemd runs the unit as, for permission checks; uid None while the user is yet to be made."""

    name: str
    uid: int | None
    gids: frozenset[int]

    def may(self, st: os.stat_result, bit: int) -> bool:
        """The kernel's mode check for `bit` (stat.S_IXOTH or S_IROTH): the owner's, the group's or the
        others' bits, whichever class applies first. ACLs are not read."""
        if self.uid is not None and st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid in self.gids:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)


PIP_SH_EXEC = "'''exec' "  # second line of pip's `#!/bin/sh` scripts, for a Python path #! cannot hold


def interpreter_of(executable: Path) -> Path | None:
    """The interpreter a script's "#!" line names (pip's console scripts), None for a binary."""
    try:
        with open(executable, "rb") as f:
            head = f.read(4096).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    if words == ["/bin/sh"] and len(head) > 1 and head[1].startswith(PIP_SH_EXEC):
        words = shlex.split(head[1][len(PIP_SH_EXEC) :])
    return Path(words[0]) if words else None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _describe(path: Path, st: os.stat_result) -> str:
    return f"{path} ({stat.filemode(st.st_mode)} {user_name(st.st_uid)}:{group_name(st.st_gid)})"


def _hops(path: Path) -> list[Path]:
    """`path`, each path its symlinks lead to (a venv's bin/python -> python3 -> /usr/bin/python3 ...),
    and where it resolves to in the end."""
    hops = [path]
    while hops[-1].is_symlink() and len(hops) < 40:  # 40: the kernel's limit too
        hops.append(hops[-1].parent / os.readlink(hops[-1]))
    return [*hops, Path(os.path.realpath(path))]


def exec_denied(path: Path, user: ServiceUser, script: bool) -> str | None:
    """Why `user` could not execute `path` (nor read it, for a script), or None. Every directory on the
    way counts, for each symlink followed, as the kernel walks them."""
    hops = _hops(path)
    real = hops[-1]
    for d in dict.fromkeys(d for hop in hops for d in reversed(hop.parents)):
        try:
            st = d.stat()
        except OSError as exc:
            return f"{d}: {exc.strerror}"
        if not user.may(st, stat.S_IXOTH):
            return f"{user.name} cannot enter {_describe(d, st)}"
    try:
        st = real.stat()
    except OSError as exc:
        return f"{real}: {exc.strerror}"
    if not user.may(st, stat.S_IXOTH) or (script and not user.may(st, stat.S_IROTH)):
        return f"{user.name} cannot {'read and ' if script else ''}execute {_describe(real, st)}"
    return None
