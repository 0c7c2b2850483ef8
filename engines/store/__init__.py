"""The engine store (engines.store.commit: layout and guarantees), its build lock and crash-safe writes.

store = EngineStore("/var/lib/edge-agent/engines")
"""

from engines.store.commit import (
    PLAN_HASH_LEN,
    PREVIOUS_SUFFIX,
    EngineStore,
    Previous,
    plan_file_name,
    previous_file_name,
    sha256_file,
)

__all__ = [
    "PLAN_HASH_LEN",
    "PREVIOUS_SUFFIX",
    "EngineStore",
    "Previous",
    "plan_file_name",
    "previous_file_name",
    "sha256_file",
]
