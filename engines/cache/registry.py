"""The HTTP side of the engine cache: oras-py's Registry, made fit for a daemon that must not hang.

oras-py retries every failed request five times with sleeps of 3 to 83 s, sends no timeout, and reads the
user's ~/.docker/config.json; here a request has a timeout (connect, and between bytes), is never retried
(the caller builds locally instead), reads no Docker config, and answers a 401 with the Basic login of the
credentials file, or with a bearer token from the registry's token server (docker's token protocol, as
Harbor, GitLab or a Distribution with `auth: token` use; asked with the same credentials, or anonymously).
Every failure to reach or use the registry is a CacheUnavailable whose reason names the registry and the
cause, never a credential.

Credentials file: JSON `{"username": "...", "password": "..."}` (as `docker login` would store them, in
clear; keep it 0600).
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import oras.provider
import requests

from engines.cache.errors import CacheUnavailable
from engines.cache.ref import CacheRef

MAX_CREDENTIALS_FILE = 64 * 1024
MAX_TOKEN_ANSWER = 1 << 20
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def read_credentials(path: Path) -> tuple[str, str]:
    """(username, password) of a credentials file; CacheUnavailable naming the path, never the content."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CREDENTIALS_FILE:
            raise CacheUnavailable(f"credentials file {path}: not a small regular file")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CacheUnavailable(f"credentials file {path}: no such file") from None
    except OSError as e:
        raise CacheUnavailable(f"credentials file {path}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError):  # not UTF-8 or JSON, too deep, an integer of 4300+ digits
        raise CacheUnavailable(f"credentials file {path}: not JSON") from None
    if (
        not isinstance(data, dict)
        or set(data) != {"username", "password"}
        or not all(isinstance(v, str) and v for v in data.values())
        or ":" in data["username"]
    ):
        raise CacheUnavailable(
            f'credentials file {path}: must be {{"username": "...", "password": "..."}} '
            "(non-empty strings, no ':' in the user name)"
        )
    return data["username"], data["password"]


def _tls_reason(where: str, exc: Exception) -> str:
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"{where}: TLS certificate not trusted (give engines.ca_file the registry's CA, "
            "or fix the registry's certificate)"
        )
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return f"{where}: does not speak TLS (a plain-HTTP registry: oci://...?plain-http=true)"
    if "doesn't match" in text or "hostname mismatch" in text.lower():
        return f"{where}: TLS certificate is for another host name"
    return f"{where}: TLS handshake failed"


def unavailable(where: str, exc: Exception, timeout_s: float) -> CacheUnavailable:
    """The CacheUnavailable of a requests exception (its text may name the URL: never a credential)."""
    if isinstance(exc, requests.exceptions.SSLError):
        return CacheUnavailable(_tls_reason(where, exc))
    if isinstance(exc, requests.exceptions.Timeout) or "timed out" in str(exc):
        return CacheUnavailable(f"{where}: no answer within {timeout_s:g} s (engines.timeout_s)")
    if isinstance(exc, (requests.exceptions.ConnectionError, OSError)) or "Connection" in type(exc).__name__:
        why = "connection refused" if "refused" in str(exc).lower() else "connection failed"
        return CacheUnavailable(f"{where}: {why}")
    return CacheUnavailable(f"{where}: {type(exc).__name__}")


class Registry(oras.provider.Registry):  # type: ignore[no-any-unimported]  # oras-py ships no types
    def __init__(
        self, ref: CacheRef, *, credentials_file: Path | None, ca_file: Path | None, timeout_s: float,
        connect_timeout_s: float | None = None,
    ) -> None:
        plain = ref.uses_http(ca_file)
        super().__init__(
            hostname=ref.registry, insecure=plain, tls_verify=str(ca_file) if ca_file else True
        )
        self.auth._auth_config = {"auths": {}}  # loaded: oras never reads ~/.docker/config.json
        self.where = f"registry {ref.registry}"
        self.timeout_s = timeout_s
        self.timeouts = (connect_timeout_s or timeout_s, timeout_s)  # (connect, between bytes)
        self._credentials = None if credentials_file is None else read_credentials(credentials_file)
        self._credentials_file = credentials_file
        self._login: dict[str, str] = {}

    def _send(self, method: str, url: str, headers: dict[str, str], **kw: Any) -> requests.Response:
        try:
            r: requests.Response = self.session.request(
                method, url, headers={**headers, **self._login}, verify=self._tls_verify,
                timeout=self.timeouts, allow_redirects=method in ("GET", "HEAD"), **kw,
            )
        except requests.RequestException as e:
            raise unavailable(self.where, e, self.timeout_s) from None
        except ValueError:  # a redirect to an unparsable URL ("Invalid IPv6 URL"); a header not latin-1
            raise CacheUnavailable(f"{self.where}: answered with a URL or login it cannot use") from None
        if r.status_code == 400 and b"HTTPS server" in r.content[:200]:
            raise CacheUnavailable(f"{self.where}: speaks HTTPS (give engines.ca_file, or drop plain-http)")
        if r.status_code >= 500:
            raise CacheUnavailable(f"{self.where}: answered {r.status_code} {r.reason}")
        return r

    def _basic(self) -> dict[str, str]:
        if self._credentials is None:
            return {}
        user, password = self._credentials
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")}

    def authorization(self) -> str | None:
        """The Authorization header of the login a 401 led to (Basic or a Bearer token), for a client that
        fetches a blob by other means (agent/deploy/oci_source.py); None: none was asked for."""
        return self._login.get("Authorization")

    def _log_in(self, challenge: str) -> None:
        """Answer a 401: Basic with the credentials file, or a token from the challenge's realm (asked
        with the same credentials; anonymously without them, as registries allowing anonymous pulls want)."""
        scheme = challenge.split(" ", 1)[0].lower()
        if scheme == "bearer":
            self._login = {"Authorization": f"Bearer {self._token(challenge)}"}
        elif self._credentials is None:
            raise CacheUnavailable(f"{self.where}: asks for a login and no credentials file is configured")
        elif scheme == "basic":
            self._login = self._basic()
        else:
            raise CacheUnavailable(f"{self.where}: asks for a login of an unknown kind ({scheme[:20]!r})")

    def _token(self, challenge: str) -> str:
        """A bearer token for the challenge's service and scope, from its realm (docker's token protocol)."""
        params = dict(_CHALLENGE_PARAM.findall(challenge))
        realm = params.get("realm", "")
        if not realm.startswith(("https://", "http://")):
            raise CacheUnavailable(f"{self.where}: token login without a usable realm")
        if realm.startswith("http://") and self.prefix == "https" and self._credentials is not None:
            raise CacheUnavailable(f"{self.where}: its token server is plain HTTP: no login is sent there")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        try:
            r = self.session.get(realm, params=query, headers=self._basic(), verify=self._tls_verify,
                                 timeout=self.timeouts, allow_redirects=False)
        except requests.RequestException as e:
            raise unavailable(f"{self.where}'s token server", e, self.timeout_s) from None
        with r:
            if r.status_code in (401, 403):
                who = "anonymous" if self._credentials is None else f"the user of {self._credentials_file}"
                raise CacheUnavailable(f"{self.where}: its token server refused {who} ({r.status_code})")
            try:
                body = r.json() if r.status_code == 200 and len(r.content) <= MAX_TOKEN_ANSWER else None
            except (ValueError, RecursionError):
                body = None
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not isinstance(token, str) or not token or " " in token:
            raise CacheUnavailable(f"{self.where}: its token server answered {r.status_code} without a token")
        if not token.isascii() or not token.isprintable():
            raise CacheUnavailable(f"{self.where}: its token server answered {r.status_code} without a token")
        return token

    def do_request(
        self,
        url: str,
        method: str = "GET",
        data: dict[str, Any] | bytes | None = None,
        headers: dict[str, str] | None = None,
        json: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> requests.Response:
        """oras-py's request, without its retries, with a timeout and a login on a 401."""
        headers = dict(headers or {})
        r = self._send(method, url, headers, data=data, json=json, stream=stream)
        if r.status_code == 401:  # not logged in, or a token of another scope: answer it once
            r.close()
            self._log_in(r.headers.get("WWW-Authenticate", ""))
            r = self._send(method, url, headers, data=data, json=json, stream=stream)
        if r.status_code == 401 and self._credentials is None:
            raise CacheUnavailable(f"{self.where}: refused without a login (no credentials file configured)")
        if r.status_code == 401:
            raise CacheUnavailable(
                f"{self.where}: login refused for the user of credentials file {self._credentials_file}"
            )
        if r.status_code == 403:
            raise CacheUnavailable(f"{self.where}: access denied (403) to this repository for this login")
        return r
