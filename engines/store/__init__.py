"""The engine store: one directory per model holding manifests and the plans they point at.

    {engine_dir}/{model}/{key}.json                the manifest of engine `key`: what it was built from and
                                                   build.plan_sha256, the sha256 of its plan
    {engine_dir}/{model}/{key}-{sha256[:12]}.plan  that plan; its name carries its content hash
    {engine_dir}/{model}/{key}-{sha256[:12]}.prev  the manifest of the previous good plan of `key` (the one
                                                   the last rebuild replaced), kept with its plan for
                                                   rollback until pruned
    {engine_dir}/{model}/{key}.plan                a plan written before plans were named by hash; still
                                                   read when its manifest's hashed plan file does not exist
    {engine_dir}/{model}/{key}.calib[.meta]        INT8 calibration cache of `key` (engines.build.calibrator)
    {engine_dir}/{model}/.build.lock               the model's build lock (engines.store.lock)
    {engine_dir}/timing/*.cache                    TensorRT timing caches, shared by all models
    {engine_dir}/.edge-agent-engines               the marker: this directory is an engine store
                                                   (engines.store.marker; older stores: their manifests)

    store = EngineStore("/var/lib/edge-agent/engines")   # StoreError now if the dir is not writable
    store.entries("detector")          # manifests, newest first (invalid ones skipped, see `problems`)
    store.read_plan("detector", key)   # bytes, sha256 verified against the manifest
    store.plan_path("detector", key)   # the plan file the current manifest of `key` points at
    store.previous("detector", key)    # the previous good plan of `key` (a Previous), or None
    with store.lock("detector", wait_s=0): store.clean_stale("detector"); store.write(...)
    with store.lock("detector"): store.rollback("detector", key)      # the previous plan is current again
    with store.lock("detector"): store.prune_previous("detector")     # previous plans and stale files go

Guarantee: the manifest is the commit point, and an engine is current only once its plan and its
manifest are both complete on disk. `write` puts the new plan under its own hashed name (temp file,
fsync, rename, fsync of the directory), records the manifest it replaces as `{key}-{sha[:12]}.prev` the
same way, then renames the new manifest over `{key}.json`, and only then deletes what neither points
at (an older previous plan of the key). So a failure at any point - ENOSPC/EFBIG, SIGKILL, power loss,
an exception - leaves the previous engine of the key listed, intact (its sha256 verifies) and loadable,
or the new one complete; never a manifest whose plan is missing. A failed manifest write removes the
new plan at once and raises StoreError naming the path and the OS reason. What a killed writer can
leave behind - temp files (".*.tmp-*"), a plan that no manifest or previous record points at, a
previous record whose plan is gone or that duplicates the current one - is never listed, and
`clean_stale` (called by the builder under the model lock at the start of every build) deletes it. A
plan a manifest points at is never deleted, nor any plan of a key whose manifest cannot be read (it may
be a newer schema's). Calibration caches are per key, not per plan: they stay for the next build of
that key and go with its prune.

Rollback swaps the two plans of a key with the same care: the current manifest is recorded as previous
first, then the previous manifest is renamed over `{key}.json` (the commit point, which the daemon's
engine watcher notices), then the record of the plan that became current is deleted. Killed between
any two steps, the key serves one of its two plans and keeps the other as previous.

Older keys stay for rollback (a config or TensorRT revert finds its engine again), pruned to `keep`
per model; a pruned key's previous plan goes with it.

Modules, by job: paths (names and where files lie), reading (manifests, plans, previous records),
cleanup (the lock, stale files, pruning), commit (EngineStore: write, rollback, manifest rewrites);
lock (the build lock) and fsutil (crash-safe writes) under them; marker (what is a store: commands given
any folder refuse one that is not). Housekeeping deletes only what the store's naming owns: plans of a key
with a manifest or previous record, named by a fingerprint key, or named by their own content hash; never
someone's `important.plan`.
"""

from engines.store.commit import EngineStore
from engines.store.paths import (
    PLAN_HASH_LEN,
    PREVIOUS_SUFFIX,
    plan_file_name,
    previous_file_name,
    sha256_file,
)
from engines.store.reading import Previous

__all__ = [
    "PLAN_HASH_LEN",
    "PREVIOUS_SUFFIX",
    "EngineStore",
    "Previous",
    "plan_file_name",
    "previous_file_name",
    "sha256_file",
]
