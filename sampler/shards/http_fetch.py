"""One bounded HTTP GET from the sampler's threads: the whole exchange
(connect, TLS handshake, status line, headers, chunk sizes, body) within one
deadline and the body within a size cap, or a `FetchError` saying why, in
one line.

Engines' metrics endpoints and the kubelet are read with it. Whoever runs
the server (a tenant's pod, for an engine) controls every byte it sends, so:
- one deadline for all of it. A socket timeout bounds each read only, and a
  server that sends a byte every 1.5 s meets every such timeout while it
  holds the thread for hours (urllib checked its deadline between body reads
  alone). A timer shuts the socket down at the deadline, which ends any
  read in progress, wherever in the exchange it is;
- no redirects: a 3xx is an answer, refused, never a second request to
  wherever the server points (a blind request forgery from the agent's pod);
- http and https only, no proxy from the environment: the agent asks
  servers on its own node;
- header lines and their count bounded by http.client's own limits
  (64 KiB a line, 100 headers).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

# What a verified TLS peer's certificate is checked against beyond its chain
# and name: `ssl.SSLSocket.getpeercert()`'s dict in, a reason to refuse (or None) out.
PeerCheck = Callable[[dict[str, Any]], str | None]


class FetchError(Exception):
    """Why a fetch gave no body."""


class _Connected(http.client.HTTPConnection):
    """http.client over a socket already connected (and wrapped) under the deadline."""

    def __init__(self, host: str, sock: socket.socket) -> None:
        super().__init__(host)
        self.sock = sock

    def connect(self) -> None:  # the socket is given; never connect again
        raise http.client.NotConnected()


def fetch_chunks(url: str, deadline_s: float, max_bytes: int, headers: dict[str, str] | None = None,
                 context: ssl.SSLContext | None = None,
                 peer_check: PeerCheck | None = None) -> Iterator[bytes]:  # fmt: skip
    """The body at `url`, chunk by chunk as it arrives, all within the
    deadline and the size cap. Closing the iterator early (a reader that has
    seen enough) closes the connection. `peer_check` judges a verified TLS
    peer's certificate before the request (and its headers) are sent."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{parts.scheme or 'no'} scheme: only http:// and https:// URLs are read")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise FetchError(f"bad port: {e}") from None
    end = time.monotonic() + deadline_s
    expired = threading.Event()
    sock: socket.socket | None = None
    watch: socket.socket | None = None
    timer: threading.Timer | None = None

    def cut() -> None:
        expired.set()
        if watch is not None:
            with contextlib.suppress(OSError):
                watch.shutdown(socket.SHUT_RDWR)  # shutdown acts on the socket, whichever fd names it

    try:
        try:
            sock = socket.create_connection((parts.hostname, port), timeout=deadline_s)
            # A duplicate of the socket's descriptor for the timer: TLS takes the original over.
            watch = socket.socket(fileno=socket.dup(sock.fileno()))
            timer = threading.Timer(max(0.0, end - time.monotonic()), cut)
            timer.daemon = True
            timer.start()
            if parts.scheme == "https":
                ctx = context if context is not None else ssl.create_default_context()
                sock = ctx.wrap_socket(sock, server_hostname=parts.hostname)
                if peer_check is not None and ctx.verify_mode != ssl.CERT_NONE:
                    assert isinstance(sock, ssl.SSLSocket)
                    refused = peer_check(sock.getpeercert() or {})
                    if refused is not None:
                        raise FetchError(refused)
            conn = _Connected(parts.hostname, sock)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"Host": parts.netloc.rpartition("@")[2], **(headers or {})})
            response = conn.getresponse()
            if expired.is_set():  # headers cut short by the timer read as their end
                raise FetchError(f"not whole within {deadline_s:g} s")
            if 300 <= response.status < 400:
                raise FetchError(f"HTTP {response.status}: redirects are not followed")
            if response.status != 200:
                raise FetchError(f"HTTP {response.status}")
            size = 0
            # read1: what one read of the socket gives, so that the deadline is
            # also checked between reads, not only by the timer.
            while chunk := response.read1(65536):
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError(f"more than {max_bytes >> 20} MiB")
                if time.monotonic() > end:
                    raise FetchError(f"not whole within {deadline_s:g} s")
                yield chunk
            if expired.is_set():  # a body cut short by the timer reads as its end
                raise FetchError(f"not whole within {deadline_s:g} s")
        except (OSError, http.client.HTTPException, ValueError) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise FetchError(f"not whole within {deadline_s:g} s") from None
            raise FetchError(f"{type(e).__name__}: {e}") from None
    finally:
        if timer is not None:
            timer.cancel()
        for s in (sock, watch):
            if s is not None:
                s.close()


def fetch(url: str, deadline_s: float, max_bytes: int, headers: dict[str, str] | None = None,
          context: ssl.SSLContext | None = None, peer_check: PeerCheck | None = None) -> bytes:  # fmt: skip
    """The body at `url`, whole within the deadline and the size cap."""
    return b"".join(fetch_chunks(url, deadline_s, max_bytes, headers, context, peer_check))
