"""The web configuration file Prometheus, node_exporter and Alertmanager read
(the exporter-toolkit's `--web.config.file`), so operators reuse theirs:

    tls_server_config:
      cert_file: /etc/nodesampler/tls/tls.crt
      key_file: /etc/nodesampler/tls/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional, with client_ca_file
      client_ca_file: /etc/nodesampler/tls/ca.crt
      min_version: TLS12
    http_server_config:
      headers: {X-Frame-Options: deny}
    basic_auth_users:
      prometheus: $2y$10$...   # bcrypt hashes (htpasswd -nBC 10 USER)

As in the toolkit, an unknown key is an error (a misspelt `basic_auth_user`
must not leave the pages open), TLS is on when the certificate and key are
given, and an empty file is plain HTTP without users. What the toolkit has
and this does not (`cipher_suites`, `curve_preferences`,
`client_allowed_sans`, inline `cert`/`key`, `rate_limit`, `http2: true`) is refused with a
line saying so, never ignored. The file is parsed here; `ReloadingWebConfig`
re-reads it, and the files it names, when they change.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controlplane.listen.tls_files import CLIENT_AUTH, TLS_VERSIONS, ReloadingServerTLS, TlsSettings, stamp

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20  # an operator's file is a few hundred bytes: a larger one is not theirs

# The headers the toolkit lets a file set on every answer, by their names there.
HEADERS = ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options", "X-XSS-Protection",
           "Strict-Transport-Security")  # fmt: skip
_NOT_SUPPORTED = {"cipher_suites", "curve_preferences", "client_allowed_sans", "cert", "key", "client_ca",
                  "rate_limit"}  # fmt: skip


class WebConfigError(ValueError):
    """The file cannot be used; the message names the key and why."""


@dataclass(frozen=True, slots=True)
class WebConfig:
    tls: TlsSettings | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)


def _mapping(value: Any, where: str, known: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping")
    for key in value:
        if not isinstance(key, str):
            raise WebConfigError(f"{where}: keys must be text")
        if key in _NOT_SUPPORTED:
            raise WebConfigError(f"{where}.{key}: not supported by nodesampler (remove it)")
        if key not in known:
            raise WebConfigError(f"{where}.{key}: unknown key")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WebConfigError(f"{where}: expected text")
    return value


def _path(value: Any, where: str, base: Path) -> Path:
    # As the toolkit does: a relative path is relative to the file's own folder.
    return base / _text(value, where)


def _tls(doc: Any, base: Path) -> TlsSettings | None:
    known = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
             "prefer_server_cipher_suites"}  # fmt: skip
    t = _mapping(doc, "tls_server_config", known)
    if not t.get("cert_file") and not t.get("key_file"):
        if t.get("client_ca_file") or t.get("client_auth_type", "NoClientCert") != "NoClientCert":
            raise WebConfigError("tls_server_config: client certificates need cert_file and key_file")
        return None
    if not t.get("cert_file") or not t.get("key_file"):
        raise WebConfigError("tls_server_config: cert_file and key_file go together")
    auth = t.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        raise WebConfigError(f"tls_server_config.client_auth_type: {auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    ca = _path(t["client_ca_file"], "tls_server_config.client_ca_file", base) if t.get("client_ca_file") else None
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert", "RequireAnyClientCert") and ca is None:
        raise WebConfigError(f"tls_server_config.client_auth_type {auth}: needs client_ca_file")
    versions = {}
    for key in ("min_version", "max_version"):
        if t.get(key) is not None:
            if t[key] not in TLS_VERSIONS:
                raise WebConfigError(f"tls_server_config.{key}: {t[key]!r} is not one of {', '.join(TLS_VERSIONS)}")
            versions[key] = t[key]
    prefer = t.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError("tls_server_config.prefer_server_cipher_suites: expected true or false")
    return TlsSettings(_path(t["cert_file"], "tls_server_config.cert_file", base),
                       _path(t["key_file"], "tls_server_config.key_file", base), auth, ca,
                       versions.get("min_version", "TLS12"), versions.get("max_version"), prefer)  # fmt: skip


def _users(doc: Any) -> dict[str, bytes]:
    users = _mapping(doc, "basic_auth_users", set(doc) if isinstance(doc, dict) else set())
    out = {}
    for user, hashed in users.items():
        if not user or ":" in user:
            raise WebConfigError(f"basic_auth_users: {user!r} is not a user name (no ':', not empty)")
        text = _text(hashed, f"basic_auth_users.{user}")
        # bcrypt's modular crypt: $2a$, $2b$ or $2y$, cost, 53 characters of salt and hash.
        if not (text.startswith(("$2a$", "$2b$", "$2y$")) and len(text) == 60):
            raise WebConfigError(f"basic_auth_users.{user}: not a bcrypt hash (htpasswd -nBC 10 {user})")
        out[user] = text.encode()
    return out


def _headers(doc: Any) -> dict[str, str]:
    http = _mapping(doc, "http_server_config", {"http2", "headers"})
    if "http2" in http and not isinstance(http["http2"], bool):
        raise WebConfigError("http_server_config.http2: expected true or false")
    if http.get("http2") is True:  # the toolkit's default; what it asks for is not done here, so said, never ignored
        raise WebConfigError("http_server_config.http2: nodesampler serves HTTP/1.1 alone; "
                             "drop the key or set it to false")  # fmt: skip
    headers = _mapping(http.get("headers"), "http_server_config.headers", set(HEADERS))
    return {name: _text(value, f"http_server_config.headers.{name}") for name, value in headers.items()}


def parse(data: bytes, base: Path) -> WebConfig:
    """A web configuration file's bytes -> WebConfig; WebConfigError saying what is wrong."""
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as e:
        raise WebConfigError(f"not YAML: {e}") from None
    top = _mapping(doc, "the file", {"tls_server_config", "http_server_config", "basic_auth_users"})
    return WebConfig(_tls(top.get("tls_server_config"), base), _users(top.get("basic_auth_users")),
                     _headers(top.get("http_server_config")))  # fmt: skip


def load(path: Path) -> WebConfig:
    """The file, parsed, and its TLS files tried; WebConfigError (or OSError) when it cannot be used."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise WebConfigError(f"larger than {MAX_FILE_BYTES} bytes")
    config = parse(data, path.parent)
    if config.tls is not None:
        try:
            config.tls.context()
        except (OSError, ssl.SSLError) as e:
            raise WebConfigError(f"tls_server_config: {e}") from None
    return config


class ReloadingWebConfig:
    """The file as it stands: re-read when it changes (checked at each request
    and each handshake: one stat), its certificate files re-read as the
    agent listener's are (controlplane/listen/tls_files.py). A file that does not
    load is logged and the last good one stays in force, as for
    certificates: a listener is never left without its users or its
    certificate. Whether TLS is on is fixed at start (a listener cannot
    change its scheme under its clients)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.current = load(path)  # raises at start: a control plane with a bad file does not start
        self._stamp = stamp(path)
        self.reloads = 0
        self.tls = ReloadingServerTLS(self.current.tls) if self.current.tls is not None else None
        if self.tls is not None:
            self.tls.before_hello = self.maybe_reload

    def maybe_reload(self) -> WebConfig:
        try:
            now = stamp(self.path)
            if now == self._stamp:
                return self.current
            self._stamp = now  # said once per change, not once per request
            config = load(self.path)
            if (config.tls is None) != (self.current.tls is None):
                raise WebConfigError("TLS cannot be turned on or off without a restart")
            context = config.tls.context() if config.tls is not None else None
        except (OSError, WebConfigError, ssl.SSLError) as e:
            log.error("web config %s not reloaded, keeping the last good one: %s", self.path, e)
            return self.current
        if self.tls is not None and config.tls is not None and context is not None and config.tls != self.tls.settings:
            self.tls.use(config.tls, context)
        self.current = config
        self.reloads += 1
        log.info("web config %s reloaded (%d users, TLS %s)", self.path, len(config.users),
                 "on" if config.tls else "off")  # fmt: skip
        return config
