"""journald logging: a JournalHandler with CAMERA= / MODEL= fields when stderr goes to the journal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping


class JournalFields(logging.Filter):
    """Adds CAMERA= / MODEL= journal fields to records that follow the log convention "camera %s: ..." /
    "model %s: ...", so `journalctl -u edge-agent CAMERA=gate` shows one camera's story."""

    _FIELDS = (("camera %s", "CAMERA"), ("model %s", "MODEL"), ("model(s) %s", "MODEL"))

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        if isinstance(msg, str) and isinstance(args, tuple) and args:
            for prefix, key in self._FIELDS:
                if msg.startswith(prefix):
                    setattr(record, key, str(args[0]))
                    break
        return True


def journal_handler(env: Mapping[str, str] | None = None) -> logging.Handler | None:
    """A JournalHandler when stderr goes to journald (JOURNAL_STREAM names stderr's device:inode), so
    records keep their fields (PRIORITY, CAMERA, MODEL, ...); None otherwise or without systemd-python."""
    env = os.environ if env is None else env
    stream = env.get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return None
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return None
    if (st.st_dev, st.st_ino) != (int(dev), int(ino)):
        return None
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        return None
    handler = JournalHandler(SYSLOG_IDENTIFIER="edge-agent")
    handler.addFilter(JournalFields())
    return handler
