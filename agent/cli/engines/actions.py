"""`edge-agent engines list | show | rollback | prune`: rollback and prune write under the model's build
lock; prune --dry-run lists only what no running build owns."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent.cli.engines.store import EngineCliError, build_lock, key_in, model_in, open_store, reported
from agent.cli.engines.table import describe, mb, render, rows, size_of, when
from engines.errors import StoreError
from engines.store import EngineStore
from engines.store.lock import BuildLock
from engines.store.paths import LOCK_NAME


def cmd_list(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        configured = None
        if getattr(args, "config", None):
            from agent.config import load_config
            from agent.lifecycle.commands import configured_keys

            configured, notes = configured_keys(load_config(args.config))
            for note in notes:
                print(f"edge-agent engines list: {note}", file=sys.stderr)
        table, problems = rows(store, args.model, configured)
        for p in problems:
            print(f"edge-agent engines list: skipped {p}", file=sys.stderr)
        if args.json:
            print(json.dumps(table, indent=2))
        elif not table:
            print(f"no engines in {store.root}")
        else:
            print(render(table))
        return 0

    return reported("engines list", body)


def cmd_show(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        model = model_in(store, args.model)
        key = key_in(store, model, args.key)
        m = store.manifest(model, key)  # ManifestError names the file
        assert m is not None and m.path is not None
        prev = store.previous(model, key)
        if args.previous:
            if prev is None:
                raise EngineCliError(
                    f"engine {key} of model {model!r} has no previous plan in {store.model_dir(model)}"
                )
            m, plan, record, state = prev.manifest, prev.plan, prev.record, "previous"
        else:
            plan, record, state = store.plan_path_for(model, m), m.path, "current"
        if args.json:
            print(json.dumps(m.to_dict(), indent=2))
            return 0
        print(describe(store, model, key, m, plan, state, record))
        if not args.previous and prev is not None:
            print(
                f"  previous    {prev.plan} built {when(prev.manifest.build.built_at)} "
                f"({prev.manifest.build.precision}): "
                f"`edge-agent engines rollback {model} {key}` makes it current"
            )
        return 0

    return reported("engines show", body)


def cmd_rollback(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        model = model_in(store, args.model)
        key = key_in(store, model, args.key)
        try:
            EngineStore.ensure_writable(store.model_dir(model))
        except StoreError as e:
            raise EngineCliError(str(e).replace("engine_dir", "model directory", 1)) from None
        with build_lock(store, model, args.wait, f"engines rollback {model} {key}"):
            now, prev = store.rollback(model, key)
        print(
            f"{model}: engine {key} rolled back: plan {store.plan_path_for(model, now).name} "
            f"(built {when(now.build.built_at)}, {now.build.precision}) is current"
        )
        if prev is not None:
            print(
                f"{model}: plan {prev.plan.name} (built {when(prev.manifest.build.built_at)}) is kept as "
                f"previous: the same command rolls forward"
            )
        print(
            f"{model}: a running daemon swaps it in within its engine watch (when {key} is the engine its "
            "configuration asks for; `edge-agent check` says which)"
        )
        return 0

    return reported("engines rollback", body)


def cmd_prune(args: argparse.Namespace) -> int:
    def body() -> int:
        if args.key and not args.model:
            raise EngineCliError("--key needs --model")
        store = open_store(args)
        models = [model_in(store, args.model)] if args.model else store.models()
        if args.key:
            key_in(store, models[0], args.key)
        total, count = 0, 0
        verb = "would delete" if args.dry_run else "deleted"
        for model in models:
            if args.dry_run:
                files = dry_run(store, model, args.key)
            else:
                with build_lock(store, model, args.wait, f"engines prune {model}"):
                    planned = store.previous_files(model, args.key) + store.stale_files(model)
                    sizes = {p: size_of(p) for p in planned}
                    files = [(p, sizes.get(p)) for p in store.prune_previous(model, args.key)]
            for p, n in files:
                total, count = total + (n or 0), count + 1
                print(f"{model}: {verb} {p} ({mb(n)})")
        if not count:
            print(f"nothing to prune in {store.root}")
        else:
            print(f"{verb} {count} file(s), {mb(total)}")
        return 0

    return reported("engines prune", body)


def dry_run(store: EngineStore, model: str, key: str | None) -> list[tuple[Path, int | None]]:
    """What prune would delete, writing nothing (no lock file either); a build running now (its lock
    held) owns its temp files: not listed."""
    files = store.previous_files(model, key)
    stale = store.stale_files(model)
    holder = BuildLock(store.model_dir(model) / LOCK_NAME, model).held_elsewhere()
    if holder is not None:
        print(
            f"{model}: another build is running ({holder}); its temp files are not stale and not listed",
            file=sys.stderr,
        )
        stale = [p for p in stale if not p.name.startswith(".")]
    return [(p, size_of(p)) for p in files + stale]
