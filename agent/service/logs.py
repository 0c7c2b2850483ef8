"""Logging set-up for every entry point (the CLI, a shard process): journald fields under systemd, else one
line per record on stderr. Low on purpose: it imports nothing of the daemon."""

from __future__ import annotations

import logging
import sys

from agent.service.journal import journal_handler


def setup_logging(level: str) -> None:
    journal = journal_handler()  # under systemd: structured records (PRIORITY, CAMERA, MODEL) to journald
    if journal is not None:
        journal.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # journald stamps time and level
        logging.basicConfig(level=getattr(logging, level.upper()), handlers=[journal])
    else:
        logging.basicConfig(
            level=getattr(logging, level.upper()),
            format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    if logging.getLogger().level > logging.INFO:
        # TensorRT's builder warnings (reshape placeholders, kOPT guesses) are noise unless asked for.
        logging.getLogger("engines.trt").setLevel(logging.ERROR)
