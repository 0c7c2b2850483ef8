"""What makes a directory an engine store, so that commands given any folder (`engines prune --dir`)
refuse one that is not, rather than treat its files as stale.

A store is marked by `.edge-agent-engines` at its root, written the first time it is opened for writing
(the daemon, `edge-agent build`, a rebuild). Stores made before the marker existed are recognised by
their layout: a model directory holding a manifest that reads as one (`{model}/{key}.json`). An empty
directory is a store with nothing built yet (nothing in it can be deleted either).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from engines.errors import ManifestError
from engines.manifest import load_manifest
from engines.store.fsutil import atomic_write_bytes
from engines.store.paths import MODEL_NAME_RE, PREVIOUS_RE

MARKER_NAME = ".edge-agent-engines"
MARKER_TEXT = b"edge-agent engine store: {model}/{key}.json manifests and the plans they point at\n"


def mark(root: Path) -> None:
    """Write the marker once (the caller proved `root` writable); a failure leaves the layout to tell."""
    marker = root / MARKER_NAME
    if not marker.exists():
        with contextlib.suppress(OSError):
            atomic_write_bytes(marker, MARKER_TEXT)


def _holds_manifest(d: Path) -> bool:
    for p in d.iterdir():
        if p.name.startswith(".") or not p.is_file():
            continue
        if p.suffix == ".json" or PREVIOUS_RE.match(p.name):
            try:
                load_manifest(p)
            except ManifestError:
                continue
            return True
    return False


def not_a_store(root: Path) -> str | None:
    """None when `root` is an engine store, else why not (for a one-line error). OSError when unreadable."""
    if (root / MARKER_NAME).is_file():
        return None
    entries = list(root.iterdir())
    if not entries:
        return None
    for d in entries:
        if d.is_dir() and MODEL_NAME_RE.match(d.name) and d.name != "timing" and _holds_manifest(d):
            return None
    return f"no {MARKER_NAME} and no model directory with an engine manifest ({{model}}/{{key}}.json)"
