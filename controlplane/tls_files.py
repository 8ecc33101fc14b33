"""The agent listener's TLS certificate, re-read when its files change.

cert-manager and the kubelet replace a mounted Secret's files in place (an
atomic swap of a symlink), so the listener checks the files' identity at each
new connection and, when they changed, hands that connection and the ones
after it a context made from the new files. A pair that does not load (half
written, key and certificate not matching) is logged and the last good one
stays in force: the listener never goes without a certificate.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

log = logging.getLogger(__name__)


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)  # follows the symlink: a swapped ..data is a new inode
    return st.st_ino, st.st_mtime_ns, st.st_size


class ReloadingServerTLS:
    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._stamps = (_stamp(cert), _stamp(key))
        self.current = self._load()  # raises at start: a listener without its certificate does not start
        self.context = self._load()
        self.context.sni_callback = self._on_hello
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context

    def maybe_reload(self) -> None:
        try:
            stamps = (_stamp(self.cert), _stamp(self.key))
            if stamps == self._stamps:
                return
            context = self._load()
        except (OSError, ssl.SSLError) as e:
            log.error("TLS certificate %s not reloaded, keeping the last good one: %s", self.cert, e)
            return
        self._stamps, self.current = stamps, context
        self.reloads += 1
        log.info("TLS certificate %s reloaded", self.cert)

    def _on_hello(self, conn: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        # Called for every handshake, with or without SNI.
        self.maybe_reload()
        if self.current is not context:
            conn.context = self.current
