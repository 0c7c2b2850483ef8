"""The engines of a model version, found and deleted when the version is pruned.

An engine says what it was built from: its manifest's `build.onnx_sha256` (engines.manifest), the sha256 of
the ONNX the builder read. That is the version's `model.onnx`, or, for `postprocess: graph`, its grafted copy
`{engine_dir}/{model}/graft/{source sha256[:16]}-*.onnx` (agent.lifecycle.graft). Engines are deleted
through the engine store under the model's build lock (engines.store): manifest and previous records first,
then the plans nothing points at any more (`clean_stale`), and the key's calibration cache. An engine whose
manifest cannot be read cannot be told apart: it is left, and the note says so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from engines.errors import BuildLockedError, EngineError
from engines.store import EngineStore, sha256_file


def delete_engines_of(engine_dir: Path, model: str, onnx_sha256: str) -> list[str]:
    """Delete the engines of `model` built from the ONNX with `onnx_sha256` (or its grafted copies) and
    those grafted copies. Returns notes: what was deleted, what was left and why (never raises for a store
    problem: pruning a version must not fail on its engines)."""
    model_dir = engine_dir / model
    if not model_dir.is_dir():
        return []
    grafted = sorted((model_dir / "graft").glob(f"{onnx_sha256[:16]}-*.onnx"))
    shas = {onnx_sha256}
    for g in grafted:
        with contextlib.suppress(OSError):
            shas.add(sha256_file(g))
    notes: list[str] = []
    try:
        store = EngineStore(engine_dir, check_writable=False)
        with store.lock(model, wait_s=0, command="deploy: prune model versions"):
            keys = [m.key for m in store.entries(model) if m.build.onnx_sha256 in shas and m.key]
            for key in keys:
                store.prune_previous(model, key)  # its previous plans and their records
                store.manifest_path(model, key).unlink(missing_ok=True)
                calib = store.calib_path(model, key)
                calib.with_name(calib.name + ".meta").unlink(missing_ok=True)
                calib.unlink(missing_ok=True)
            if keys:
                store.clean_stale(model)  # the plans no manifest points at now
            unreadable = store.problems(model)
    except BuildLockedError as exc:
        return [f"engines of {model} not deleted: the build lock is held ({exc})"[:300]]
    except (EngineError, OSError) as exc:
        return [f"engines of {model} not deleted: {exc}"[:300]]
    for g in grafted:
        with contextlib.suppress(OSError):
            g.unlink()
    if keys:
        notes.append(f"engines of {model} deleted: {', '.join(keys)}")
    if unreadable:
        notes.append(
            f"{len(unreadable)} engine manifest(s) of {model} cannot be read, so cannot be matched to a "
            "version: left in place"
        )
    return notes
