"""The engine store behind `edge-agent build` and `edge-agent engines`: which directory, whether it is one,
a model and key in it, its build lock, and one line (exit 2) for what goes wrong."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.cli.argtypes import seconds
from engines.errors import EngineError, StoreError
from engines.store import EngineStore
from engines.store.marker import not_a_store

DEFAULT_DIR = Path("engines")


class EngineCliError(EngineError):
    """One line for the user, naming the path or value at fault."""


def add_store_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--dir", help=f"the engine store (default: ./{DEFAULT_DIR})")
    where.add_argument("-c", "--config", help="use this agent.yaml's engine_dir")


def add_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=seconds(86400, zero=True),
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the model's build lock (default: refuse at once, naming the holder)",
    )


def store_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """(the store directory, where it came from) for --dir / -c / the default."""
    if getattr(args, "dir", None):
        return Path(args.dir), "--dir"
    if getattr(args, "config", None):
        from agent.config import load_config

        return Path(load_config(args.config).engine_dir), f"engine_dir of {args.config}"
    return DEFAULT_DIR, f"default ./{DEFAULT_DIR}; give --dir DIR or -c agent.yaml"


def open_store(args: argparse.Namespace) -> EngineStore:
    d, origin = store_dir(args)
    if not d.exists():
        raise EngineCliError(f"engine store {d} does not exist ({origin})")
    if not d.is_dir():
        raise EngineCliError(f"engine store {d} is not a directory ({origin})")
    try:
        why = not_a_store(d)
    except OSError as e:
        raise EngineCliError(f"engine store {d} cannot be read: {e.strerror or e}") from None
    if why is not None:
        raise EngineCliError(f"{d} is not an engine store: {why} ({origin}); nothing was changed")
    return EngineStore(d, check_writable=False)


def model_in(store: EngineStore, model: str) -> str:
    models = store.models()
    try:
        known = model in models or store.model_dir(model).is_dir()
    except StoreError as e:
        raise EngineCliError(str(e)) from None
    if not known:
        have = ", ".join(models) or "none"
        raise EngineCliError(f"model {model!r} is not in engine store {store.root} (models: {have})")
    return model


def key_in(store: EngineStore, model: str, key: str | None) -> str:
    """The key given (it must have a manifest), or the model's newest."""
    keys = store.keys(model)
    if key is None:
        entries = store.entries(model)
        if not entries:
            raise EngineCliError(
                f"model {model!r} has no readable engine manifest in {store.model_dir(model)}"
            )
        assert entries[0].key is not None
        return entries[0].key
    if key not in keys:
        raise EngineCliError(
            f"model {model!r} has no engine {key!r} in {store.model_dir(model)} "
            f"(keys: {', '.join(keys) or 'none'})"
        )
    return key


def build_lock(store: EngineStore, model: str, wait_s: float, what: str) -> Any:
    from engines.store.lock import process_command

    return store.lock(
        model,
        wait_s=wait_s,
        command=f"{process_command()} [{what}]",
        on_wait=lambda holder: print(
            f"{model}: waiting up to {wait_s:g} s for the build lock ({holder})", file=sys.stderr
        ),
    )


def reported(name: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except (EngineError, OSError) as exc:
        msg = (
            str(exc)
            if isinstance(exc, EngineError)
            else f"{getattr(exc, 'filename', '')}: {exc.strerror or exc}"
        )
        print(f"edge-agent {name}: {msg}", file=sys.stderr)
        return 2
