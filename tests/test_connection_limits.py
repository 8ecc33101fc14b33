"""The control plane held under abuse, as deployed: its own process, a real
agent heartbeating, and thousands of connections that send half a request,
half a body, or nothing. Every one is closed by the server (its deadline,
its idle time or its peer's cap), counted by reason, while the agent's
heartbeats keep being taken. Connections come from other loopback addresses
than the agent's (127.0.0.1), as they would from other machines."""

from __future__ import annotations

import asyncio
import re
import resource
import selectors
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_fleet import Fleet, fresh_with_seq

pytestmark = pytest.mark.live

HALF_HEAD = b"POST /v1/heartbeat HTTP/1.1\r\nHost: cp\r\nContent-Length: 100\r\n"


def half_body(token: bytes) -> bytes:
    """An authenticated heartbeat whose body stops short (a token holder's, so
    that the body is read; an unauthenticated one is answered 401 at once)."""
    return (b"POST /v1/heartbeat HTTP/1.1\r\nHost: cp\r\nAuthorization: Bearer " + token.strip() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"no")  # fmt: skip


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    # Both this process and the control plane (which inherits it) hold thousands of sockets.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    f = Fleet(tmp_path)
    yield f
    f.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(port: int, source: str, send: bytes = b"") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    if send:
        s.sendall(send)
    return s


def wait_closed_by_server(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Wait for the server to close each socket (EOF or reset); returns those it
    left open when `timeout` passed (the assertions say what that means)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while sel.get_map() and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            assert isinstance(key.fileobj, socket.socket)
            s = key.fileobj
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:  # closed (an answer before the close is read and waited past)
                sel.unregister(s)
    still_open = [k.fileobj for k in sel.get_map().values()]
    sel.close()
    return [s for s in socks if s in still_open]


def closed_counts(fleet: Fleet) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.pages_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = r'^nodesampler_connections_closed_total\{listener="(\w+)",reason="(\w+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


def test_thousands_of_half_requests_are_closed_while_agents_heartbeat(fleet: Fleet) -> None:
    fleet.start_control_plane("--request-deadline", "3", "--idle-timeout", "4")
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    slow_body = half_body((fleet.tmp / "token").read_bytes())
    socks: list[socket.socket] = []
    try:
        # 2,000 half heads, 200 half bodies and 500 silent connections from ten
        # addresses (250 each: under the default cap of 256 a peer).
        for i in range(10):
            source = f"127.0.0.{i + 2}"
            socks += [connect(fleet.agent_port, source, HALF_HEAD) for _ in range(200)]
            socks += [connect(fleet.agent_port, source, slow_body) for _ in range(20)]
            socks += [connect(fleet.agent_port, source) for _ in range(20)]
        # A page view kept alive after its answer: idle on the pages listener.
        kept = connect(fleet.pages_port, "127.0.0.12", b"GET /health HTTP/1.1\r\nHost: cp\r\n\r\n")
        socks.append(kept)
        # The agent's heartbeats are taken while those are held.
        [node] = fleet.wait_for(lambda n: fresh_with_seq(n, above=node["heartbeat"]["seq"] + 2))
        left_open = wait_closed_by_server(socks, timeout=120)
        assert not left_open, f"{len(left_open)} of {len(socks)} connections still open"
        counts = closed_counts(fleet)
        assert counts[("agents", "request_deadline")] == 2200, counts
        assert counts[("agents", "idle")] == 200, counts
        assert counts[("pages", "idle")] >= 1, counts
        assert counts[("agents", "per_peer")] == 0, counts
        # And the node is still fed after it all.
        fleet.wait_for(lambda n: fresh_with_seq(n, above=node["heartbeat"]["seq"] + 1))
    finally:
        for s in socks:
            s.close()


def test_one_address_gets_no_more_than_its_cap(fleet: Fleet) -> None:
    fleet.start_control_plane("--max-connections-per-peer", "20", "--idle-timeout", "600")
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    socks = [connect(fleet.agent_port, "127.0.0.2") for _ in range(25)]
    try:
        # The five past the cap are closed at once; the twenty are kept (idle for 600 s).
        still_open = wait_closed_by_server(socks, timeout=10)
        assert len(still_open) == 20 and still_open == socks[:20], (len(still_open), socks.index(still_open[-1]))
        assert closed_counts(fleet)[("agents", "per_peer")] == 5
        # Another address, and the agent's, are not affected.
        other = connect(fleet.agent_port, "127.0.0.3", b"GET /nothing HTTP/1.1\r\nHost: cp\r\n\r\n")
        socks.append(other)
        assert other.recv(12) == b"HTTP/1.1 404"
        fleet.wait_for(lambda n: fresh_with_seq(n, above=node["heartbeat"]["seq"] + 1))
    finally:
        for s in socks:
            s.close()


def test_readers_that_never_read_are_let_go_once_their_answer_is_late(fleet: Fleet) -> None:
    """250 sockets from one address ask for a page and read nothing (a small
    receive window, as a stalled client's fills): each is closed once its
    answer has not left within the request deadline, counted, while a reader
    that reads gets the whole page and the agent's heartbeats go on."""
    fleet.start_control_plane("--request-deadline", "2", "--idle-timeout", "600")
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    ask = b"GET /node/n1 HTTP/1.1\r\nHost: cp\r\n\r\n"
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.pages_port}/node/n1", timeout=10) as r:
        page = r.read()
    assert len(page) > 8 * 1024, len(page)  # more than a stalled reader's window (SO_RCVBUF below) takes
    socks: list[socket.socket] = []
    try:
        for _ in range(250):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel's least: a window of ~2 KiB
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", fleet.pages_port))
            s.sendall(ask)
            socks.append(s)
        # Waited for from the server's side: reading the sockets would make them readers.
        deadline = time.monotonic() + 60
        while closed_counts(fleet).get(("pages", "write_deadline"), 0) < 250 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert closed_counts(fleet)[("pages", "write_deadline")] == 250
        assert not wait_closed_by_server(socks, timeout=10)  # each really closed (reset), what it had read aside
        with urllib.request.urlopen(f"http://127.0.0.1:{fleet.pages_port}/node/n1", timeout=10) as r:
            assert r.read().rstrip().endswith(b"</html>")  # a reader that reads is served whole
        fleet.wait_for(lambda n: fresh_with_seq(n, above=node["heartbeat"]["seq"] + 1))
    finally:
        for s in socks:
            s.close()


async def test_page_requests_take_turns_and_the_scrape_goes_at_once() -> None:
    """The pages listener's guard lets `max_active` requests be under way and
    keeps the rest unread in arrival order (a loop of page views must not fill
    the event loop ahead of heartbeats); /metrics and /health go at once; an
    answer that starts to leave gives its turn to the next request."""
    from aiohttp import web

    from controlplane.listen.connection_limits import GUARD, ConnectionGuard, ConnectionLimits, end_turn_when_answering
    from controlplane.server import FIRST_IN_LINE

    entered: list[int] = []
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        entered.append(int(request.query["i"]))
        await release.wait()
        return web.Response(text="slow\n")

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(text=f"entered {len(entered)}\n")

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/metrics", metrics)
    guard = app[GUARD] = ConnectionGuard(ConnectionLimits(), max_active=2, first_in_line=FIRST_IN_LINE)
    app.on_response_prepare.append(end_turn_when_answering)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_server(guard.protocol_factory(runner.server), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def ask(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        return reader, writer

    try:
        slows = [await ask(f"/slow?i={i}") for i in range(5)]
        while len(entered) < 2 or len(guard._turns) < 3:  # two under way, three waiting unread
            await asyncio.sleep(0)
        reader, writer = await ask("/metrics")
        answer = await reader.read(4096)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"entered 2\n")
        writer.close()
        assert entered == [0, 1] and guard.active == 2
        release.set()
        bodies = [await r.read(4096) for r, _ in slows]
        assert all(b.startswith(b"HTTP/1.1 200") and b.endswith(b"slow\n") for b in bodies)
        assert entered == [0, 1, 2, 3, 4]  # in arrival order
        assert guard.active == 0 and not guard._turns
        for _, w in slows:
            w.close()
    finally:
        server.close()
        await runner.cleanup()
