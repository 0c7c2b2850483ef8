"""ed25519 key files and key ids as the config names them (`deploy.trusted_keys`, `engines.trusted_keys`,
checked at load). The rules live in engines.keys (the engine cache verifies plan signatures there, below
agent/); this module keeps the names the config and agent.deploy.signing import.
"""

from __future__ import annotations

from engines.keys import (
    KEY_ID_RE,
    KEY_ID_RULE,
    MAX_KEY_FILE,
    KeyFileError,
    key_id_problem,
    public_key_problem,
    read_key_file,
    read_private_key,
    read_public_key,
)

__all__ = [
    "KEY_ID_RE",
    "KEY_ID_RULE",
    "MAX_KEY_FILE",
    "KeyFileError",
    "key_id_problem",
    "public_key_problem",
    "read_key_file",
    "read_private_key",
    "read_public_key",
]
