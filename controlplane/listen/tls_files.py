"""A listener's TLS: its settings, and its certificate re-read when its files change.

cert-manager and the kubelet replace a mounted Secret's files in place (an
atomic swap of a symlink), so the listener checks the files' identity at each
new connection and, when they changed, hands that connection and the ones
after it a context made from the new files. A pair that does not load (half
written, key and certificate not matching) is logged and the last good one
stays in force: the listener never goes without a certificate.

The check runs before the connection's TLS object is made
(`handshake_context`), and what it loads becomes the listener's context
whole: whether a client certificate is asked for and the protocol versions
are fixed when that object is made, so a context swapped in during the
handshake (SNI's callback) changed the certificate alone, and a reload to
`RequireAndVerifyClientCert` and TLS 1.3 let a TLS 1.2 client without a
certificate in until a restart. The SNI swap stays for listeners that hold
the context itself (aiohttp's own sites, in tests): a certificate there.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The web configuration file's names (controlplane/listen/web_config.py) for what a client may present.
CLIENT_AUTH = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven",
               "RequireAndVerifyClientCert")  # fmt: skip
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}  # fmt: skip


def stamp(path: Path) -> tuple[int, int, int]:
    """A file's identity: os.stat follows the symlink, so a Secret's swapped ..data is a new inode."""
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


@dataclass(frozen=True, slots=True)
class TlsSettings:
    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Path | None = None
    min_version: str = "TLS12"
    max_version: str | None = None
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[Path, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())

    def context(self) -> ssl.SSLContext:
        """A server context as these settings say; OSError or ssl.SSLError when a file does not load."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = TLS_VERSIONS[self.min_version]
        if self.max_version is not None:
            context.maximum_version = TLS_VERSIONS[self.max_version]
        if not self.prefer_server_cipher_suites:
            context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            context.load_verify_locations(cafile=str(self.client_ca_file))
        # Python cannot ask for a certificate it then does not verify, so the
        # toolkit's RequestClientCert and RequireAnyClientCert verify against
        # client_ca_file too (and RequestClientCert asks for none without one).
        context.verify_mode = {
            "NoClientCert": ssl.CERT_NONE,
            "RequestClientCert": ssl.CERT_OPTIONAL if self.client_ca_file else ssl.CERT_NONE,
            "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
            "RequireAnyClientCert": ssl.CERT_REQUIRED,
            "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
        }[self.client_auth_type]
        return context


class ReloadingServerTLS:
    """`handshake_context()` is the context a new connection is wrapped with:
    the settings' files as they are now (and, with `before_hello` set, the
    web config's settings as its file is now: it runs first)."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._stamps = self._stamps_now()
        self.context = self._listening(settings.context())  # raises at start: no listener without its certificate
        self.reloads = 0
        self.before_hello: Callable[[], object] | None = None

    def _listening(self, context: ssl.SSLContext) -> ssl.SSLContext:
        context.sni_callback = self._on_hello
        return context

    def _stamps_now(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(stamp(p) for p in self.settings.files())

    def use(self, settings: TlsSettings, context: ssl.SSLContext) -> None:
        """Other settings (the web config changed), already loaded: the next handshake's, whole."""
        self.settings, self._stamps = settings, self._stamps_now()
        self.context = self._listening(context)
        self.reloads += 1

    def maybe_reload(self) -> None:
        try:
            stamps = self._stamps_now()
            if stamps == self._stamps:
                return
            context = self.settings.context()
        except (OSError, ssl.SSLError) as e:
            log.error("TLS certificate %s not reloaded, keeping the last good one: %s", self.settings.cert_file, e)
            return
        self._stamps, self.context = stamps, self._listening(context)
        self.reloads += 1
        log.info("TLS certificate %s reloaded", self.settings.cert_file)

    def handshake_context(self) -> ssl.SSLContext:
        """The context for a connection about to shake hands (one stat a file)."""
        if self.before_hello is not None:
            self.before_hello()
        self.maybe_reload()
        return self.context

    def _on_hello(self, conn: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        # Called for every handshake, with or without SNI; a connection made from
        # an older context (a listener that holds it) gets the newer certificate.
        current = self.handshake_context()
        if current is not context:
            conn.context = current
