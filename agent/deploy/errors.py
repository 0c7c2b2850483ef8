"""The errors of a deployment: one line each, safe to publish on the state topic and in a command result.

A `reason` never holds a secret: no URL credentials (callers pass URLs through pipelines.urls' mask/scrub
helpers), no key material and no value taken from a document (a 1 MB field must not become a 1 MB state).
`field` names the document field where one applies ("artifacts.onnx.sha256"); the reason names it too, so
`str(exc)` alone says what and where.
"""

from __future__ import annotations

MAX_REASON = 500  # characters of a reason; longer ones are cut (a retained state stays small)


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """`text` as one printable line: control characters escaped (a newline would split a journal line),
    cut at `limit` characters."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


class DeployError(Exception):
    """A deployment refused or failed, with the reason an operator reads."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        self.reason = one_line(reason)
        self.field = field
        super().__init__(self.reason)

    def __str__(self) -> str:
        return self.reason


class SignatureError(DeployError):
    """The document's signature is missing (and unsigned documents are not allowed), malformed, by a key
    that is not trusted, or does not match the document."""


class DownloadError(DeployError):
    """An artifact could not be fetched; `retryable`: a network drop, a 5xx or a timeout (try again,
    resuming), as opposed to a refusal (404, a wrong size or sha256, a redirect off https, no space)."""

    def __init__(self, reason: str, field: str | None = None, *, retryable: bool = False) -> None:
        super().__init__(reason, field)
        self.retryable = retryable


class DeviceFault(DeployError):
    """The device let a deployment down (its disk, a lost file, the hot swap), not the candidate: the
    deployment ends `failed`, never `rejected`."""


class VerifyError(DeployError):
    """A downloaded artifact is not what the document says, or not a model the format adapter can serve."""
