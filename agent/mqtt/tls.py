"""TLS for the MQTT connection: the options, the client SSLContext, readable failure reasons.

One builder serves both the config check at load (``--check-config`` fails on a bad CA file, not the
daemon an hour later) and the client, so what was validated is exactly what connects. Messages name
the option and the path, never a file's contents.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsOptions:
    """``TlsOptions()`` = verified against the system CA store, the host name checked.

    ca_file: PEM CA certificate(s) to trust *instead of* the system store.
    cert_file / key_file: client certificate and its unencrypted key (brokers with require_certificate).
    insecure: no verification at all (chain and host name). Anyone on the path can then pose as the
    broker and read the password and the data; only ever on when named explicitly.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("give cert_file and key_file together (the client certificate and its key)")
        if self.insecure and self.ca_file is not None:
            raise ValueError("insecure: true verifies nothing, so ca_file would be ignored: remove one")


class TlsFileError(ValueError):
    """A TLS file that cannot be used; ``key`` is the option (ca_file, cert_file, key_file)."""

    def __init__(self, key: str, path: Path, reason: str) -> None:
        super().__init__(f"{key}: {path}: {reason}")
        self.key, self.path, self.reason = key, path, reason


def _no_key_password() -> str:
    # Without a callback OpenSSL would prompt for an encrypted key's pass phrase on the terminal, and a
    # daemon (or --check-config in a script) would hang there.
    raise ValueError("the key is encrypted; give an unencrypted key readable only by the service user")


def _load(key: str, path: Path, action: Callable[[], None], hints: dict[str, str]) -> None:
    try:
        action()
    except ssl.SSLError as exc:  # before OSError: SSLError is one
        reason = hints.get(exc.reason or "", "") or f"not usable ({clean_ssl_text(str(exc))})"
        raise TlsFileError(key, path, reason) from None
    except OSError as exc:
        raise TlsFileError(key, path, f"cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # _no_key_password
        raise TlsFileError(key, path, str(exc)) from None


def client_context(opts: TlsOptions) -> ssl.SSLContext:
    """The SSLContext for ``opts``; TlsFileError naming the option and the path if a file is unusable."""
    if opts.insecure:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # must precede CERT_NONE (ssl refuses the other order)
        ctx.verify_mode = ssl.CERT_NONE
    elif opts.ca_file is None:
        ctx = ssl.create_default_context()  # system store, CERT_REQUIRED, host name checked, TLS >= 1.2
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # same defaults, but only the given CA(s)
        ca = opts.ca_file
        _load("ca_file", ca, lambda: ctx.load_verify_locations(cafile=ca), _NO_CERT)
    if opts.cert_file is not None and opts.key_file is not None:
        cert, key = opts.cert_file, opts.key_file
        # Parsed on its own first, so a bad certificate is blamed on cert_file and not on key_file.
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _load("cert_file", cert, lambda: probe.load_verify_locations(cafile=cert), _NO_CERT)
        _load("key_file", key, lambda: ctx.load_cert_chain(cert, key, password=_no_key_password), _BAD_KEY)
    return ctx


_NO_CERT = {"NO_CERTIFICATE_OR_CRL_FOUND": "no PEM certificate in it"}
_BAD_KEY = {
    "KEY_VALUES_MISMATCH": "not the private key of cert_file",
    "": "not a PEM private key",  # OpenSSL says only "PEM lib"
}

_SSL_NOISE = re.compile(r"\[SSL(?:: [A-Z0-9_]+)?\]\s*|\s*\(_ssl\.c:\d+\)")


def clean_ssl_text(text: str) -> str:
    """'[SSL: X] tlsv13 alert certificate required (_ssl.c:2580)' -> 'tlsv13 alert certificate required'."""
    return _SSL_NOISE.sub("", text).strip() or text


# What to check, for the failures that have an obvious cause.
_TLS_HINTS = (
    ("certificate verify failed", "is mqtt.tls.ca_file the CA that signed the broker's certificate?"),
    ("certificate required", "the broker requires a client certificate: mqtt.tls.cert_file and key_file"),
    ("unknown ca", "the broker does not trust the CA of the client certificate"),
)


def describe_tls_failure(error: BaseException | str) -> str:
    """One line for a failed handshake, e.g. 'certificate verify failed: self-signed certificate (...)'."""
    if isinstance(error, ssl.SSLCertVerificationError):
        text = f"certificate verify failed: {error.verify_message}"
    else:
        text = clean_ssl_text(str(error))
    hint = next((h for needle, h in _TLS_HINTS if needle in text.lower()), None)
    return f"{text} ({hint})" if hint else text
