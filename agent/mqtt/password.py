"""The one reader of MQTT password files: the config's `mqtt.password_file`, `fleet status --password-file`.

Both must turn one file into the same password, or the fleet tool fails to log in where the daemon
succeeds: surrounding whitespace (an editor's trailing newline, a stray space) is not part of it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.mqtt.errors import MqttError


class PasswordFileError(MqttError):
    """Why a password file cannot be used; `problem` never quotes the file's bytes (they are the secret)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"mqtt password_file {path}: {problem}")
        self.path, self.problem = path, problem


def read_password_file(path: str | Path) -> str:
    """The password in `path` without surrounding whitespace; PasswordFileError naming the path."""
    p = Path(path)
    try:
        # Non-blocking: a FIFO given by mistake must not hang the caller (it is refused below).
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PasswordFileError(p, f"cannot read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "is a directory, not a file" if stat.S_ISDIR(mode) else "is not a regular file"
            raise PasswordFileError(p, what)
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        raise PasswordFileError(p, f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    try:
        password = data.decode("utf-8").strip()
    except UnicodeDecodeError:  # its message would quote bytes of the password
        raise PasswordFileError(p, "not UTF-8 text") from None
    if not password:
        raise PasswordFileError(p, "the file is empty")
    return password
