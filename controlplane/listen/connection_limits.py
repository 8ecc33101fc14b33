"""Connections held to account. A client that opens a connection and sends
half a request, or nothing, must not keep it: enough such connections take
the listener's file descriptors and blind the fleet. aiohttp times out
neither a request head that never ends nor a connection that never sends
one, so every connection's protocol is wrapped here:

- a connection with no request under way (new, or kept alive between
  requests) is closed after `idle_s`;
- from the first byte of a request, its head, its body and the answer must
  be done within `request_s`: the head is timed here, the rest by the
  `within_deadline` middleware (the body is read inside the handler);
- the answer, written once the handler has returned, must have left within
  `request_s` more: a reader that does not read would otherwise keep a copy
  of a page of megabytes (the fleet's `/api/nodes`, `/metrics`) per socket
  for the idle time. Left means out of aiohttp's buffer and out of the
  kernel's send queue (SIOCOUTQ: what the peer has not acknowledged, which
  it stops doing when it reads nothing and its window is full);
- a peer address already holding `per_peer` connections has the next one
  closed at once (0: no cap). Agents behind one NAT share an address: the
  cap is per address, not per node, and has a flag;
- on the pages listener, at most `max_active` requests are under way at once
  (from their first byte until their answer starts to leave); the others wait
  unread, in arrival order, their deadline running, and cost the event loop
  nothing meanwhile. Requests that start with a `first_in_line` prefix
  (Prometheus' scrape, the probes) never wait.

On a TLS listener the guard sees the connection before its handshake, not
after: asyncio's own `ssl=` server hands a protocol its connection only
once the handshake is done, while each pending handshake already holds a
256 KiB read buffer (asyncio's SSLProtocol) for up to its timeout, so
thousands of idle sockets were an OOM that no cap counted. Here a raw
connection is admitted (counted against `per_peer`, and against
`max_handshakes` pending on the whole listener) and only then upgraded
(`loop.start_tls`'s steps, with a 32 KiB `TlsLayer`), within `request_s`;
one that does not finish in time, or fails, is closed as `handshake`. One `ConnectionGuard` per listener;
controlplane/server.py listens through it.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import collections
import contextlib
import fcntl
import ssl
import struct
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

TLS_WRITE_BUFFER = 64 * 1024  # as a plain socket's transport: aiohttp's answers drain past it


class TlsLayer(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS layer with a 32 KiB read buffer, not its 256 KiB: each
    connection holds one from its first byte, handshake pending or not. A
    control plane's TLS reads are heartbeats (a few KiB) and requests; with
    250 sockets of a peer that read nothing, a connection cost 619 KiB of
    RSS with asyncio's buffer and 347 KiB with this one."""

    max_size = 32 * 1024
CLOSE_REASONS = ("idle", "request_deadline", "write_deadline", "per_peer", "handshake", "handshakes")


def unsent_bytes(transport: asyncio.Transport) -> int:
    """What the transport still holds, and what the kernel has not had
    acknowledged (SIOCOUTQ, which Linux names TIOCOUTQ) for its socket."""
    held = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return held


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    request_s: float = 10.0
    idle_s: float = 60.0
    per_peer: int = 256
    # Pending TLS handshakes on one listener: 1,024 hold 32 MiB of TlsLayer's
    # read buffers at most (5,000 idle sockets: 606 MiB peak against 520 alone).
    max_handshakes: int = 1024


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind its timers."""

    def __init__(self, guard: ConnectionGuard, inner: web.RequestHandler) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.admitted = self.lost = self.started = False
        self.handling = False
        self._handshake: asyncio.Future[None] | None = None
        self._early: list[bytes] = []
        self.in_turn = False  # one of the listener's requests under way (ConnectionGuard.max_active)
        self._waiting: list[bytes] | None = None  # a request's first bytes, while it waits for its turn
        self._deadline = 0.0  # loop time by which the request under way must be in
        self._loop = asyncio.get_running_loop()  # made by the listener's server, in its loop
        # One timer, moved lazily: `_due` is when the current `_reason` expires;
        # the timer fires at `_timer_at` <= `_due` and, if the deadline moved on
        # since, sets itself again. Cancelling and making a timer at each of a
        # request's three steps took 13% of the control plane's time under a
        # heartbeat flood (bench/heartbeat_throughput.py).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = self._due = 0.0

    # --- the transport's calls, passed on ----------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if not self.guard.admit(self):
            transport.abort()
            return
        self.admitted = True
        if self.guard.tls is None:
            self._start(transport)
            return
        # Nothing is read until the TLS layer is in place (start_tls resumes reading).
        transport.pause_reading()
        self.guard.handshakes += 1
        # Held: a task nobody holds may be collected before it ends.
        self._handshake = asyncio.ensure_future(self._upgrade(transport, self.guard.tls()))

    async def _upgrade(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        # loop.start_tls's own steps (CPython 3.11-3.14), with the smaller TLS layer.
        loop = self._loop
        waiter = loop.create_future()
        layer = TlsLayer(loop, self, context, waiter, server_side=True, call_connection_made=False,
                         ssl_handshake_timeout=self.guard.limits.request_s)  # type: ignore[arg-type]  # a float is fine: it is a timer
        raw.set_protocol(layer)  # reading is paused since connection_made
        made, resumed = loop.call_soon(layer.connection_made, raw), loop.call_soon(raw.resume_reading)
        tls: asyncio.Transport | None = None
        try:
            await waiter
            tls = layer._app_transport
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError, RuntimeError):
            made.cancel()
            resumed.cancel()
        finally:
            self.guard.handshakes -= 1
        if tls is None:  # not finished in time, failed, or its client went
            self.guard.closed("handshake")
            raw.abort()
            self.connection_lost(None)  # the raw transport's went to the TLS layer, which keeps it
            return
        if not self.lost:  # lost between the handshake's end and now: already released
            # asyncio lets the TLS layer hold 512 KiB of answer a connection before
            # it pushes back; a reader that reads nothing would keep that much.
            tls.set_write_buffer_limits(high=TLS_WRITE_BUFFER)
            self._start(tls)

    def _start(self, transport: asyncio.Transport) -> None:
        self.guard.started(self, transport)
        self.transport = transport
        self.started = True
        self._arm(self.guard.limits.idle_s, "idle")
        self.inner.connection_made(transport)
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if not self.started:
            # The TLS layer hands over what followed the handshake before start_tls's
            # caller resumes: kept for `_start` (one loop turn's reading at most).
            if self.admitted and not self.lost:
                self._early.append(data)
            return
        if self._waiting is not None:
            self._waiting.append(data)
            return
        if not self.handling and self._reason in ("idle", "write_deadline"):  # a request's first byte: its deadline
            self._deadline = self._loop.time() + self.guard.limits.request_s
            self._arm(self.guard.limits.request_s, "request_deadline")
            if not self.guard.take_turn(self, data):  # it waits, unread, its deadline running
                assert self.transport is not None
                self.transport.pause_reading()
                self._waiting = [data]
                return
        self.inner.data_received(data)

    def turn_given(self) -> None:
        """The guard's: this connection's waiting request may go on."""
        data, self._waiting = self._waiting or [], None
        if self.transport is not None:
            self.transport.resume_reading()
        for chunk in data:
            self.inner.data_received(chunk)

    def end_turn(self) -> None:
        if self.in_turn:
            self.in_turn = False
            self.guard.turn_ended()

    def eof_received(self) -> None:
        if self.started:
            self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        self._stop_timer()
        self.end_turn()
        if self.admitted:
            self.guard.release(self)
        if self.started:
            self.inner.connection_lost(exc)

    # --- the middleware's calls ----------------------------------------------------

    def handler_started(self) -> float:
        """The head is in: the head's timer stops; returns the seconds the rest
        of the request (body and answer) has left."""
        now = self._loop.time()
        left = self._deadline - now if self._reason == "request_deadline" else self.guard.limits.request_s
        self._cancel()
        self.handling = True
        return max(0.0, left)

    def answered(self) -> None:
        self.handling = False
        self.end_turn()
        if not self.lost:
            self._arm(self.guard.limits.request_s, "write_deadline")

    def close(self, reason: str) -> None:
        self.guard.closed(reason)
        if self.transport is not None:
            self.transport.abort()

    # --- timers --------------------------------------------------------------------

    _reason = ""

    def _arm(self, seconds: float, reason: str) -> None:
        self._reason = reason
        self._due = self._loop.time() + seconds
        if self._timer is None or self._timer_at > self._due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = self._due
            self._timer = self._loop.call_at(self._due, self._wake)

    def _wake(self) -> None:
        self._timer = None
        if not self._reason or self.lost:
            return
        if self._loop.time() < self._due:  # re-armed later since this timer was set
            self._timer_at = self._due
            self._timer = self._loop.call_at(self._due, self._wake)
            return
        self._expired(self._reason)

    def _expired(self, reason: str) -> None:
        if reason == "write_deadline" and self.transport is not None and unsent_bytes(self.transport) == 0:
            self._arm(max(0.0, self.guard.limits.idle_s - self.guard.limits.request_s), "idle")  # all out: idle
            return
        self.close(reason)

    def _cancel(self) -> None:
        """No deadline runs; the timer, if set, wakes to nothing or is moved by the next `_arm`."""
        self._reason = ""

    def _stop_timer(self) -> None:
        self._reason = ""
        if self._timer is not None:  # a closed connection is not held until its timer would have fired
            self._timer.cancel()
            self._timer = None


class ConnectionGuard:
    """One listener's connections: counted per peer, found by transport."""

    def __init__(self, limits: ConnectionLimits, on_close: Callable[[str], None] | None = None,
                 tls: Callable[[], ssl.SSLContext] | None = None, max_active: int = 0,
                 first_in_line: tuple[bytes, ...] = ()) -> None:  # fmt: skip
        self.limits = limits
        self.tls = tls
        self.handshakes = 0  # pending now
        # Requests under way at once (0: no cap), the rest waiting unread in
        # arrival order: the pages listener's, so that a flood of page views
        # never fills the event loop's queue ahead of the agents' heartbeats.
        self.max_active, self.first_in_line = max_active, first_in_line
        self.active = 0
        self._turns: collections.deque[GuardedConnection] = collections.deque()
        self._on_close = on_close
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._by_transport: dict[asyncio.BaseTransport, GuardedConnection] = {}

    def protocol_factory(self, inner: Callable[[], web.RequestHandler]) -> Callable[[], GuardedConnection]:
        return lambda: GuardedConnection(self, inner())

    def admit(self, conn: GuardedConnection) -> bool:
        if self.tls is not None and self.handshakes >= self.limits.max_handshakes:
            self.closed("handshakes")
            return False
        if conn.peer is not None:
            if self.limits.per_peer and self._per_peer[conn.peer] >= self.limits.per_peer:
                self.closed("per_peer")
                return False
            self._per_peer[conn.peer] += 1
        return True

    def take_turn(self, conn: GuardedConnection, first: bytes) -> bool:
        """Whether a request may go on now; if not, it is queued for `turn_ended`.
        One whose request line starts with a `first_in_line` prefix goes at once
        (Prometheus' scrape and the probes never queue behind page views)."""
        if self.max_active and self.active >= self.max_active and not first.startswith(self.first_in_line):
            self._turns.append(conn)
            return False
        self.active += 1
        conn.in_turn = True
        return True

    def turn_ended(self) -> None:
        self.active -= 1
        while self._turns and (not self.max_active or self.active < self.max_active):
            conn = self._turns.popleft()
            if not conn.lost:
                self.active += 1
                conn.in_turn = True
                conn.turn_given()

    def started(self, conn: GuardedConnection, transport: asyncio.Transport) -> None:
        """Serving on `transport` (the TLS one, on a TLS listener): requests find their connection by it."""
        self._by_transport[transport] = conn

    def release(self, conn: GuardedConnection) -> None:
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)
        if conn.peer is not None:
            self._per_peer[conn.peer] -= 1
            if self._per_peer[conn.peer] <= 0:
                del self._per_peer[conn.peer]

    def find(self, transport: asyncio.BaseTransport | None) -> GuardedConnection | None:
        return self._by_transport.get(transport) if transport is not None else None

    def closed(self, reason: str) -> None:
        if self._on_close is not None:
            self._on_close(reason)

    def open_connections(self) -> int:
        return len(self._by_transport)


GUARD = web.AppKey("connection_guard", ConnectionGuard)


def end_turn(request: web.Request) -> None:
    """The request's work on the event loop is done (or waits elsewhere): its
    turn goes to the next request (ConnectionGuard.max_active)."""
    guard = request.app.get(GUARD)
    conn = guard.find(request.transport) if guard is not None else None
    if conn is not None:
        conn.end_turn()


async def end_turn_when_answering(request: web.Request, response: web.StreamResponse) -> None:
    """An answer that starts to leave has done its work; its writing is the
    write deadline's to bound (a reader that reads nothing held a turn for
    its whole deadline)."""
    end_turn(request)


@web.middleware
async def within_deadline(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:  # fmt: skip
    """The rest of a request's deadline (its body is read by the handler, the
    answer made there): past it, the connection is closed, not answered."""
    guard = request.app.get(GUARD)
    conn = guard.find(request.transport) if guard is not None else None
    if guard is None or conn is None:  # not behind a guard (the tests' in-process clients)
        return await handler(request)
    left = conn.handler_started()
    if getattr(request.match_info.handler, "streams", False):
        # A stream (controlplane/samples/live.py) answers a GET at once and lasts as long
        # as its reader: it bounds its own writes, and holds no request open (nor a turn).
        conn.end_turn()
        try:
            return await handler(request)
        finally:
            conn.answered()
    deadline = asyncio.timeout(left)
    try:
        async with deadline:
            return await handler(request)
    except TimeoutError:
        if not deadline.expired():  # the handler's own
            raise
        # An answer already leaving (a shared one, written in pieces) that did
        # not leave in time is its reader's fault, as after the handler.
        conn.close("write_deadline" if request.writer.output_size else "request_deadline")
        raise web.HTTPRequestTimeout(text=f"request not complete within {guard.limits.request_s:g} s\n") from None
    finally:
        conn.answered()
