"""The engine store keeps what serves: faults during a rebuild never lose the current engine.

Real files, real TensorRT-RTX builds of the bundled NanoDet (CPU, ahead of time), real faults:
- a full tmpfs (ENOSPC on the plan; out of inodes, ENOSPC on the manifest after the plan was written),
  root only;
- RLIMIT_FSIZE in a child process (EFBIG on the plan);
- SIGKILL of a forced rebuild at random points, in a builder child and through `edge-agent rebuild`;
- an exception between plan and manifest (monkeypatched write).
After each: the previous engine is listed, its plan verifies (read_plan), check() says ok, and the next
build leaves no orphan plan or temp file: only the new plan and the one it replaced, kept as the key's
previous plan (rollback) until pruned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures_agent import REPO
from test_engine_store import NANODET, sample_manifest

from engines.errors import StoreError
from engines.settings import BuildSettings
from engines.store import EngineStore, plan_file_name, sha256_file
from engines.store.fsutil import TMP_MARK

pytest.importorskip("tensorrt_rtx")

from engines.build.builder import build
from engines.build.compat import check
from engines.fingerprint import probe_fingerprint
from engines.trt import import_trt

MODEL = "det"
pytestmark = pytest.mark.slow

# What `edge-agent rebuild --force` does for an fp32 model, without the agent package around it:
# a forced build of the same key, reporting phases on stdout. argv: engine_dir model onnx [fsize_limit]
# KILL_AT=plan-temp|after-plan|after-manifest: SIGKILL itself at that point of the store's writes.
BUILDER_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    import engines.store.commit
    from engines.build.builder import build
    from engines.errors import EngineError
    from engines.store.fsutil import temp_path_for
    from engines.settings import BuildSettings
    from engines.store import EngineStore
    from engines.trt import import_trt

    api = import_trt("tensorrt_rtx")
    if len(sys.argv) > 4:  # a file size limit: writes beyond it fail with EFBIG instead of SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[4]), int(sys.argv[4])))
    kill_at = os.environ.get("KILL_AT")
    real_write = engines.store.commit.atomic_write_bytes
    def write(path, data):
        if kill_at == "plan-temp" and path.suffix == ".plan":  # half the plan in its temp file
            temp_path_for(path).write_bytes(bytes(data)[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)
        if (kill_at, path.suffix) in (("after-plan", ".plan"), ("after-manifest", ".json")):
            os.kill(os.getpid(), signal.SIGKILL)
    engines.store.commit.atomic_write_bytes = write
    def progress(phase, step, total):
        print(json.dumps({"phase": phase, "step": step}), flush=True)
    try:
        r = build(EngineStore(sys.argv[1]), sys.argv[2], BuildSettings(onnx=Path(sys.argv[3])), api=api,
                  force=True, on_progress=progress)
    except EngineError as e:
        print(json.dumps({"error_type": type(e).__name__, "error": str(e)}), flush=True)
        sys.exit(2)
    print(json.dumps({"phase": "done", "plan": r.plan_path.name}), flush=True)
""")


@pytest.fixture(scope="module")
def api():
    return import_trt("tensorrt_rtx")


@pytest.fixture(scope="module")
def fp(api):
    return probe_fingerprint(api)


@pytest.fixture(scope="module")
def settings() -> BuildSettings:
    return BuildSettings(onnx=NANODET, precision="fp32")


@pytest.fixture(scope="module")
def template(tmp_path_factory, api, fp, settings) -> Path:
    """An engine_dir holding one real FP32 engine of MODEL; tests work on copies."""
    root = tmp_path_factory.mktemp("faults-template")
    build(EngineStore(root), MODEL, settings, api=api, fingerprint=fp)
    return root


def copy_store(template: Path, dest: Path) -> EngineStore:
    shutil.copytree(template, dest, dirs_exist_ok=True)
    return EngineStore(dest)


def current(store: EngineStore) -> tuple[str, str]:
    """(key, plan sha256) of the engine the store lists first, after proving it intact and loadable."""
    entries = store.entries(MODEL)
    assert entries, (
        f"no engine listed in {store.model_dir(MODEL)}: {sorted(os.listdir(store.model_dir(MODEL)))}"
    )
    m = entries[0]
    assert m.key is not None
    data = store.read_plan(MODEL, m.key)  # sha256 verified
    assert len(data) > 1_000_000
    return m.key, m.build.plan_sha256


def assert_serves(store: EngineStore, settings: BuildSettings, fp, key: str, sha: str) -> None:
    assert current(store) == (key, sha)
    res = check(store, MODEL, settings, fp)
    assert res.status == "ok", res.reasons
    assert res.plan_path == store.model_dir(MODEL) / plan_file_name(key, sha)
    assert sha256_file(res.plan_path) == sha


def leftovers(store: EngineStore) -> list[str]:
    """Plan files neither a manifest nor a kept previous record points at, previous records that keep
    nothing, and temp files, in the model and timing dirs."""
    referenced = {store.plan_path_for(MODEL, m).name for m in store.entries(MODEL)}
    kept = [p for m in store.entries(MODEL) if (p := store.previous(MODEL, m.key)) is not None]
    referenced |= {p.plan.name for p in kept} | {p.record.name for p in kept}
    names = [p.name for p in store.model_dir(MODEL).iterdir()]
    if store.timing_dir.is_dir():
        names += [p.name for p in store.timing_dir.iterdir()]
    return sorted(
        n for n in names if TMP_MARK in n or (n.endswith((".plan", ".prev")) and n not in referenced)
    )


def assert_clean_after_next_build(store: EngineStore, settings: BuildSettings, fp, api) -> None:
    # A killed CLI's job child dies with it (PR_SET_PDEATHSIG) and its lock goes a moment later.
    before = store.plan_path(MODEL, current(store)[0])
    res = build(store, MODEL, settings, api=api, fingerprint=fp, force=True, lock_wait_s=10)
    assert res.built
    assert leftovers(store) == []
    # The plan the build replaced is kept (intact) as the key's previous plan, and nothing else.
    previous = store.previous(MODEL, res.key)
    assert (
        previous is not None
        and previous.plan == before
        and sha256_file(before) == previous.manifest.build.plan_sha256
    )
    assert sorted(p.name for p in store.model_dir(MODEL).glob("*.plan")) == sorted(
        [res.plan_path.name, before.name]
    )
    assert_serves(store, settings, fp, res.key, res.manifest.build.plan_sha256)


# --- an exception between plan and manifest --------------------------------------------------
@pytest.mark.parametrize("fault", ["enospc", "exception"])
def test_manifest_write_failure_keeps_previous_engine(
    tmp_path, monkeypatch, template, settings, fp, api, fault
):
    store = copy_store(template, tmp_path / "engines")
    key, sha = current(store)
    import engines.store.commit as store_mod

    real_write = store_mod.atomic_write_bytes
    written: list[Path] = []

    def failing_write(path: Path, data: bytes | memoryview) -> None:
        if path.suffix == ".json":  # the plan went through; the manifest does not
            assert written and written[-1].suffix == ".plan" and written[-1].exists()
            if fault == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            raise RuntimeError("interrupted between plan and manifest")
        real_write(path, data)
        if path.suffix == ".prev":  # the manifest being replaced, recorded as previous first
            assert written and written[-1].suffix == ".plan"
        else:
            written.append(path)

    monkeypatch.setattr(store_mod, "atomic_write_bytes", failing_write)
    if fault == "enospc":
        with pytest.raises(StoreError) as info:
            build(store, MODEL, settings, api=api, fingerprint=fp, force=True)
        msg = str(info.value)
        assert f"cannot write manifest {store.manifest_path(MODEL, key)}" in msg
        assert "No space left on device" in msg and "previous engine stays current" in msg
    else:
        with pytest.raises(RuntimeError, match="interrupted between plan and manifest"):
            build(store, MODEL, settings, api=api, fingerprint=fp, force=True)
    new_plan = written[-1]
    assert new_plan.name != plan_file_name(key, sha)  # RTX plans differ per build (not same bytes)
    # The new plan (and the previous record written for it) is removed at once; the old engine is current,
    # intact, and nothing is left over.
    assert not new_plan.exists() and not list(store.model_dir(MODEL).glob("*.prev"))
    assert_serves(store, settings, fp, key, sha)
    assert leftovers(store) == []
    monkeypatch.undo()
    assert_clean_after_next_build(store, settings, fp, api)


def test_clean_stale_removes_orphans_only(tmp_path, template):
    """What a killed writer leaves (temp files, plans no manifest points at, a pre-hash-naming orphan)
    goes; the plans manifests point at (hashed or legacy name) and those of unreadable manifests stay."""
    store = copy_store(template, tmp_path / "engines")
    key, sha = current(store)
    d = store.model_dir(MODEL)
    served = d / plan_file_name(key, sha)
    orphans = [
        d / plan_file_name(key, "0" * 64),  # new plan written, manifest never switched (killed)
        d / f"{key}.plan",  # the old code's orphan: its manifest deleted first, then killed
        d / "feedc0deba5e1234.plan",  # a key without manifest
        d / f".{plan_file_name(key, 'f' * 64)}{TMP_MARK}999-abcd",  # half-written temp
    ]
    for p in orphans:
        p.write_bytes(b"half a plan")
    # Another key with a legacy layout: manifest + `{key}.plan` (still read) and one manifest we cannot read.
    legacy_plan = b"legacy plan bytes"
    legacy = sample_manifest(plan_sha256=hashlib.sha256(legacy_plan).hexdigest())
    (d / "0123456789abcdef.json").write_text(legacy.to_json())
    (d / "0123456789abcdef.plan").write_bytes(legacy_plan)
    (d / "badbadbadbadbad0.json").write_text("{}")
    kept_unreadable = d / plan_file_name("badbadbadbadbad0", "1" * 64)
    kept_unreadable.write_bytes(b"unknown")

    removed = store.clean_stale(MODEL)
    assert sorted(p.name for p in removed) == sorted(p.name for p in orphans)
    assert served.exists() and kept_unreadable.exists()
    assert store.plan_path("det", "0123456789abcdef") == d / "0123456789abcdef.plan"
    assert store.read_plan("det", "0123456789abcdef") == legacy_plan
    assert current(store) == (key, sha)


def test_legacy_layout_reads_and_rebuild_moves_to_hashed_name(tmp_path, template, settings, fp, api):
    """An installation from before hash-named plans (`{key}.plan`) keeps serving; a forced rebuild
    writes the hashed name and keeps the legacy file as the key's previous plan (rollback finds it),
    until pruned."""
    store = copy_store(template, tmp_path / "engines")
    key, sha = current(store)
    d = store.model_dir(MODEL)
    (d / plan_file_name(key, sha)).rename(d / f"{key}.plan")
    assert store.plan_path(MODEL, key) == d / f"{key}.plan"
    assert current(store) == (key, sha)
    res = check(store, MODEL, settings, fp)
    assert res.ok and res.plan_path == d / f"{key}.plan"
    assert_clean_after_next_build(store, settings, fp, api)
    previous = store.previous(MODEL, key)
    assert previous is not None and previous.plan == d / f"{key}.plan"
    with store.lock(MODEL):
        assert store.rollback(MODEL, key)[0].build.plan_sha256 == sha  # the legacy plan serves again
        assert store.plan_path(MODEL, key) == d / f"{key}.plan" and current(store) == (key, sha)
        store.rollback(MODEL, key)
        store.prune_previous(MODEL)
    assert not (d / f"{key}.plan").exists() and leftovers(store) == []


# --- a full disk -----------------------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """mount(options) -> a fresh tmpfs directory (root only; unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """Write a filler file until the filesystem is full, then give `leave` bytes back."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(filler, "ab", buffering=0) as f:  # the last partial MiB
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    os.truncate(filler, filler.stat().st_size - leave)
    return filler


def test_disk_full_rebuild_keeps_previous_engine(tmpfs, template, settings, fp, api):
    plan_size = next(template.joinpath(MODEL).glob("*.plan")).stat().st_size
    mnt = tmpfs(f"size={(3 * plan_size) // (1 << 20) + 4}m")
    store = copy_store(template, mnt / "engines")
    key, sha = current(store)
    # Room for the build lock's pid and the timing cache (engines.store.lock writes its pid unguarded: on a
    # disk without a free block that is a raw OSError before the store is reached), none for a plan.
    filler = fill(mnt, leave=256 << 10)
    assert os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize < plan_size

    with pytest.raises(StoreError) as info:
        build(store, MODEL, settings, api=api, fingerprint=fp, force=True)
    msg = str(info.value)
    assert (
        f"cannot write engine plan {store.model_dir(MODEL)}/{key}-" in msg
        and "No space left on device" in msg
    )
    assert_serves(store, settings, fp, key, sha)
    assert leftovers(store) == []

    filler.unlink()
    assert_clean_after_next_build(store, settings, fp, api)


def test_out_of_inodes_fails_the_manifest_after_the_plan(tmpfs, template, settings, fp, api):
    """The plan fits, its manifest does not (no inode left for the manifest's temp file): ENOSPC on the
    manifest, the new plan is removed, the previous engine stays current."""
    mnt = tmpfs("size=256m,nr_inodes=64")
    store = copy_store(template, mnt / "engines")
    key, sha = current(store)
    # Leave one free inode: the timing cache's temp takes and gives it back (its rename frees the old
    # file), the new plan takes it for good (another name than the current plan), the manifest finds none.
    fillers = mnt / "fillers"
    fillers.mkdir()
    i = 0
    while os.statvfs(mnt).f_ffree > 1:
        (fillers / str(i)).touch()
        i += 1
    with pytest.raises(StoreError) as info:
        build(store, MODEL, settings, api=api, fingerprint=fp, force=True)
    msg = str(info.value)
    assert f"cannot write manifest {store.manifest_path(MODEL, key)} of engine plan" in msg
    assert "No space left on device" in msg
    assert_serves(store, settings, fp, key, sha)
    assert leftovers(store) == [] and len(list(store.model_dir(MODEL).glob("*.plan"))) == 1

    shutil.rmtree(fillers)
    assert_clean_after_next_build(store, settings, fp, api)


def test_file_size_limit_efbig_keeps_previous_engine(tmp_path, template, settings, fp):
    """Always runs: RLIMIT_FSIZE in the builder child makes the plan write fail with EFBIG."""
    store = copy_store(template, tmp_path / "engines")
    key, sha = current(store)
    child = subprocess.run(
        [sys.executable, "-c", BUILDER_CHILD, str(store.root), MODEL, str(NANODET), str(1 << 20)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 2, child.stdout + child.stderr[-2000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["error_type"] == "StoreError"
    assert f"cannot write engine plan {store.model_dir(MODEL)}/{key}-" in result["error"]
    assert "File too large" in result["error"]
    assert_serves(store, settings, fp, key, sha)
    assert leftovers(store) == []


# --- SIGKILL at random points of a forced rebuild --------------------------------------------
def run_and_kill(argv: list[str], delay: float | None = None, after_save: float | None = None) -> dict:
    """Run argv; SIGKILL it `delay` s after its start or `after_save` s after its "save" phase began
    (neither: let it finish). Returns {"ended": "killed"|"finished", "run_s", "save_at_s"}."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    save_seen = threading.Event()
    save_at: list[float] = []

    def read(stream) -> None:  # drain stdout so the child never blocks on a full pipe
        for line in stream:
            if '"save"' in line and not save_at:
                save_at.append(time.monotonic() - t0)
                save_seen.set()

    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        if delay is not None:
            try:
                proc.wait(delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        elif after_save is not None and save_seen.wait(60):
            time.sleep(after_save)
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
        proc.stdout.close()
    ended = "killed" if rc == -signal.SIGKILL else "finished"
    return {"ended": ended, "run_s": time.monotonic() - t0, "save_at_s": save_at[0] if save_at else None}


def kill_trials(store: EngineStore, argv: list[str], trials: int, settings, fp, seed: int) -> list[str]:
    """Time one full run, then SIGKILL `trials` runs at random points: every other one anywhere in the
    run, the others within its save phase (the plan and manifest writes). After each: the engine of the
    key is listed, verifies and checks ok. Returns what each trial ended as and left behind."""
    rng = random.Random(seed)
    key, _ = current(store)
    timing = run_and_kill(argv)
    assert timing["ended"] == "finished" and timing["save_at_s"] is not None
    full, save_s = timing["run_s"], max(0.02, timing["run_s"] - timing["save_at_s"])
    report = []
    for i in range(trials):
        before = {m.build.plan_sha256 for m in store.entries(MODEL)}
        if i % 2 == 0:
            run = run_and_kill(argv, delay=rng.uniform(0, full))
        else:
            run = run_and_kill(argv, after_save=rng.uniform(0, save_s))
        now_key, now_sha = current(store)  # an engine is listed and its plan verifies
        assert now_key == key
        res = check(store, MODEL, settings, fp)
        assert res.status == "ok", (i, run, res.reasons)
        left = leftovers(store)
        report.append(f"{run['ended']} {'new' if now_sha not in before else 'old'} engine, left {left}")
    return report


@pytest.mark.parametrize("kill_at", ["plan-temp", "after-plan", "after-manifest"])
def test_sigkill_at_each_step_of_the_store_write(tmp_path, template, settings, fp, api, kill_at):
    """SIGKILL exactly in the windows that matter: while the plan's temp file is written, between the plan
    and the manifest renames, and between the manifest rename and the removal of the previous plan."""
    store = copy_store(template, tmp_path / "engines")
    key, sha = current(store)
    child = subprocess.run(
        [sys.executable, "-c", BUILDER_CHILD, str(store.root), MODEL, str(NANODET)],
        cwd=REPO,
        env={**os.environ, "KILL_AT": kill_at},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr[-2000:]
    left = leftovers(store)
    new_key, new_sha = current(store)  # listed, and its plan verifies
    assert new_key == key and check(store, MODEL, settings, fp).status == "ok"
    if kill_at == "plan-temp":
        assert (new_sha, len(left)) == (sha, 1) and TMP_MARK in left[0]
    elif kill_at == "after-plan":  # the new plan is complete but not current: an orphan, never listed
        assert (
            new_sha == sha and len(left) == 1 and left[0].startswith(f"{key}-") and left[0].endswith(".plan")
        )
    else:  # the new engine is current; the previous plan is kept as the key's previous (no orphan)
        assert new_sha != sha and left == []
        previous = store.previous(MODEL, key)
        assert previous is not None and previous.plan.name == plan_file_name(key, sha)
    assert_clean_after_next_build(store, settings, fp, api)


def test_sigkill_forced_rebuild_at_random_points(tmp_path, template, settings, fp, api):
    store = copy_store(template, tmp_path / "engines")
    argv = [sys.executable, "-c", BUILDER_CHILD, str(store.root), MODEL, str(NANODET)]
    seed = int(time.time())
    report = kill_trials(store, argv, trials=6, settings=settings, fp=fp, seed=seed)
    print(f"builder child trials (seed {seed}):", *report, sep="\n  ")
    assert_clean_after_next_build(store, settings, fp, api)


def test_sigkill_edge_agent_rebuild_force(tmp_path, template, settings, fp, api):
    """The same through the CLI: `edge-agent rebuild --force` killed at random points."""
    engine_dir = tmp_path / "engines"
    store = copy_store(template, engine_dir)
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
device_id: faults
engine_dir: {engine_dir}
models:
  {MODEL}:
    onnx: {NANODET}
    format: nanodet
    labels: {REPO / "agent" / "assets" / "coco.names"}
    backend: tensorrt_rtx
    precision: fp32
    streams: 1  # one execution context: the same engine key as the `settings` fixture
cameras:
  street: {{url: {REPO / "agent" / "assets" / "bikes.mp4"}, model: {MODEL}}}
""")
    argv = [sys.executable, "-m", "agent.cli", "rebuild", "-c", str(config), "--force"]
    t0 = time.monotonic()
    probe = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    full = time.monotonic() - t0
    assert probe.returncode == 0, probe.stdout + probe.stderr[-2000:]
    assert "built engine" in probe.stdout
    key, _ = current(store)
    seed = int(time.time())
    rng = random.Random(seed)
    report = []
    for _ in range(2):
        run = run_and_kill(argv, delay=rng.uniform(0, full))
        assert current(store)[0] == key and check(store, MODEL, settings, fp).status == "ok"
        report.append(f"{run['ended']}, left {leftovers(store)}")
    print(f"CLI trials (seed {seed}):", *report, sep="\n  ")
    assert_clean_after_next_build(store, settings, fp, api)
