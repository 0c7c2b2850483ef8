"""Errors raised by the engine manager. Every message names the path, model or field involved.

EngineError                  base class: the daemon catches this and falls back to ONNX Runtime
├── UnavailableError         a feature/precision is not available on this TensorRT flavour+version
├── ManifestError            a manifest file is unreadable or has a bad schema/field
├── StoreError               engine_dir unusable, plan missing or corrupted (sha256 mismatch)
├── BuildLockedError         another process is building the same model (names its pid)
└── BuildError               ONNX unreadable, parse error (node + op), builder failure
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of every error the engines package raises on purpose."""


class UnavailableError(EngineError):
    """Something is not available on the TensorRT flavour/version (or device) at hand."""


class ManifestError(EngineError):
    """A manifest is unreadable or invalid; the message names the manifest path and the field."""


class StoreError(EngineError):
    """The engine store cannot be used, or a stored plan is missing/corrupt."""


class BuildLockedError(EngineError):
    """Another process holds the build lock of this model."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


class BuildError(EngineError):
    """An engine build failed; nothing in the store was changed."""
