"""A replica whose `--peer` list names something hostile: a stranger that
answers at a peer's address without the cluster secret, or a peer that
holds it and answers badly. Each finding of the replicas' review, shown on
the code as it is (and each failed on the code before it):

- a stranger receives nothing it can use again: a request it captured is
  refused at every other replica and at the one it was meant for, later;
- a stranger's held list lets nothing go, and a page it answers never
  reaches the operator;
- a peer's bad answer (an age of 10^400, a row without `state`, a picture
  of more rows than the fleet) marks that peer down with the reason, and
  the others are read and the pages drawn;
- forwarded streams are capped per viewer and in all, on a pool apart from
  the polls';
- a header that is not UTF-8 is a 401, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane import pages_api
from controlplane.fleet import forward, peers
from controlplane.ingest import agent_api
from controlplane.listen.page_access import PageAccess
from controlplane.listen.peer_auth import CHALLENGE_PATH, HEADER, PROOF, PeerAuth, answer_proof, parse_header
from controlplane.state.registry import NodeRegistry
from tests.peer_requests import SignedPeer, replica_pages
from tests.test_controlplane_api import heartbeat, registration
from web.pages import add_pages
from wire.schema import Heartbeat, Registration

SECRET = b"s3cret-s3cret-s3cret-s3cret"


class FakeReplica:
    """An aiohttp server at a peer's address that answers as it is told: with
    the cluster's secret (a peer gone wrong) or without (a stranger). It
    keeps every request it was sent."""

    def __init__(self, secret: bytes | None) -> None:
        self.key = PeerAuth(secret, "fake").key if secret is not None else None
        self.received: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers
        self.answers: dict[str, bytes] = {}  # path -> body
        self.challenges = 0
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    async def answer(self, request: web.Request) -> web.StreamResponse:
        if request.path == CHALLENGE_PATH:
            self.challenges += 1
            return web.json_response({"challenge": f"fake-{self.challenges}"})
        self.received.append((request.method, request.path_qs, dict(request.headers)))
        await request.read()
        body = self.answers.get(request.path, b"<script>alert('a stranger wrote this')</script>")
        headers = {}
        fields = parse_header(request.headers.get(HEADER, ""))
        if self.key is not None and fields is not None:
            headers[PROOF] = answer_proof(self.key, fields["challenge"], 200, body)
        return web.Response(body=body, headers=headers, content_type="application/json")


def fleet_registry(*nodes: str) -> NodeRegistry:
    registry = NodeRegistry(stale_after=60)
    for node in nodes:
        registry.register(msgspec.convert(registration(node), Registration))
        registry.heartbeat(msgspec.convert(heartbeat(node), Heartbeat))
    return registry


def forgetting(registry: NodeRegistry) -> Callable[[str], None]:
    def let_go(node: str) -> None:
        registry.forget(node)

    return let_go


async def a_replica(aiohttp_client: Any, *nodes: str) -> tuple[Any, NodeRegistry, peers.Peers]:
    """A real replica's peer routes, as a test client."""
    registry = fleet_registry(*nodes)
    replicas = peers.Peers([], SECRET, registry, forgetting(registry))
    app = agent_api.create_app(registry, SECRET)
    peers.add_routes(app, replicas, lambda: pages_api.nodes_json(registry))
    return await aiohttp_client(app), registry, replicas


@pytest.fixture
async def sessions() -> Any:
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as forwarding:
        yield session, forwarding


async def test_a_stranger_learns_nothing_it_can_use_and_its_word_lets_nothing_go(aiohttp_client: Any,
                                                                                sessions: Any) -> None:  # fmt: skip
    """Before, every poll sent the fixed peer token to whatever answered; a
    held list from anyone let nodes go. Now what a stranger receives is a
    signature of one request to it, which no replica takes, and an answer
    without the peer's proof is no answer."""
    stranger = FakeReplica(secret=None)
    await stranger.server.start_server()
    other, other_registry, _ = await a_replica(aiohttp_client, "n1", "n2")
    try:
        registry = fleet_registry("n1", "n2")
        ours = peers.Peers([stranger.url], SECRET, registry, forgetting(registry))
        # The stranger says it heard from both just now.
        stranger.answers["/v1/peer/held"] = json.dumps({"replica": "x", "nodes": [["n1", 0], ["n2", 0]]}).encode()
        await ours.poll(sessions[0])
        [peer] = ours.peers
        assert registry.get("n1") is not None and registry.get("n2") is not None  # nothing let go
        assert peer.holds == {} and "without a peer's proof" in (peer.error or "")
        assert ours.holding_peer("n1") is None  # and nothing forwarded to it
        # What it received is no credential: no bearer, and its signature is refused everywhere.
        [(method, path, captured)] = stranger.received
        assert "Authorization" not in captured and HEADER in captured
        replay = {HEADER: captured[HEADER]}
        assert (await other.get(path, headers=replay)).status == 401  # another replica
        # The challenge in it was the stranger's: not one a replica made. One a replica made, used
        # elsewhere (a request signed for the stranger and sent on): the target is not that replica.
        relayed = await SignedPeer(other, SECRET).headers("GET", path, target=stranger.url)
        assert (await other.get(path, headers=relayed)).status == 401
        # A request replayed at the replica it was signed for, later: its challenge is spent.
        signer = SignedPeer(other, SECRET)
        once = await signer.headers("GET", "/v1/peer/held")
        assert (await other.get("/v1/peer/held", headers=once)).status == 200
        assert (await other.get("/v1/peer/held", headers=once)).status == 401
        assert other_registry.get("n1") is not None
    finally:
        await stranger.server.close()


async def test_a_strangers_page_never_reaches_the_operator(aiohttp_client: Any, sessions: Any) -> None:
    """Before, a held answer named the pages port operators' requests were
    forwarded to, and the answer was passed on whatever it was. Now a
    node's request goes to the --peer URL alone, and an answer without the
    peer's proof is a 502 that names the peer."""
    stranger = FakeReplica(secret=None)
    await stranger.server.start_server()
    try:
        registry = fleet_registry("n1")
        ours = peers.Peers([stranger.url], SECRET, registry, forgetting(registry))
        [peer] = ours.peers
        peer.instance, peer.holds, peer.answered_at = "x", {"n1": 0.0}, registry.clock() + 5  # said fresher
        client = await aiohttp_client(replica_pages(registry, ours))
        ours.session, ours.forwarding = sessions
        r = await client.get("/node/n1")
        text = await r.text()
        assert r.status == 502 and stranger.url in text and "without a peer's proof" in text
        assert "<script>" not in text
        [(_, path, _)] = stranger.received
        assert path == "/node/n1"  # at the --peer URL itself
    finally:
        ours.session = ours.forwarding = None
        await stranger.server.close()


async def test_a_bad_peer_is_down_alone_and_the_others_are_read(sessions: Any) -> None:
    """Before, an age of 10^400 raised OverflowError out of the poll, and no
    peer was read. Now each peer's answer is decoded against the held list's
    schema on its own: that peer is down with the reason; another's word is
    taken."""
    bad, good = FakeReplica(SECRET), FakeReplica(SECRET)
    for fake in (bad, good):
        await fake.server.start_server()
    try:
        registry = fleet_registry("n1", "n2", "n3")
        ours = peers.Peers([bad.url, good.url], SECRET, registry, forgetting(registry))
        bad.answers["/v1/peer/held"] = b'{"replica": "bad", "nodes": [["n2", 1' + b"0" * 400 + b"]]}"
        good.answers["/v1/peer/held"] = json.dumps({"replica": "good", "nodes": [["n1", 0.0]]}).encode()
        registry.clock = lambda: 1e12  # everything here heard from long ago
        await ours.poll(sessions[0])
        [b, g] = ours.peers
        assert b.holds == {} and "out of range" in (b.error or "")
        assert g.error is None and g.holds == {"n1": 0.0}
        assert registry.get("n1") is None and registry.get("n2") is not None  # n1 let go, on the good peer's word
    finally:
        for fake in (bad, good):
            await fake.server.close()


async def test_a_peers_bad_rows_cost_its_rows_alone_and_the_cluster_page_is_drawn(aiohttp_client: Any,
                                                                                 sessions: Any) -> None:  # fmt: skip
    """Before, a peer row without `state` turned the cluster page into a 500."""
    bad, good = FakeReplica(SECRET), FakeReplica(SECRET)
    for fake in (bad, good):
        await fake.server.start_server()
    try:
        registry = fleet_registry("n1")
        ours = peers.Peers([bad.url, good.url], SECRET, registry, forgetting(registry))
        bad.answers["/v1/peer/nodes"] = json.dumps({"nodes": [{"node": "n9", "cpu": 1.0}]}).encode()
        good.answers["/v1/peer/nodes"] = json.dumps({"nodes": [{"node": "n8", "state": "fresh", "cpu": 12.5,
                                                                "sample_age_seconds": 1.0}]}).encode()  # fmt: skip
        app = pages_api.create_app(registry)
        add_pages(app, None)

        async def fleet_rows(own: list[dict[str, Any]], view: str = "nodes") -> dict[str, Any]:
            return peers.merged_rows(own, await ours.fleet_rows(view))

        app[pages_api.FLEET_ROWS] = fleet_rows
        client = await aiohttp_client(app)
        ours.session, ours.forwarding = sessions
        r = await client.get("/")
        page = await r.text()
        assert r.status == 200 and 'id="nodes">2<' in page  # n1 here, n8 at the good peer
        assert f"The replica {bad.url} did not answer" in page and "state" in page
        r = await client.get("/api/nodes")
        names = [n["node"] for n in (await r.json())["nodes"]]
        assert r.status == 200 and names == ["n1", "n8"]  # n9, without a state, under neither view
    finally:
        ours.session = ours.forwarding = None
        for fake in (bad, good):
            await fake.server.close()


async def wait_for(condition: Callable[[], bool]) -> None:
    """An event of another task's, awaited (a stream seen closed at its next keepalive); 60 s at most."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.05)


def a_part(names: list[str], columns: int) -> bytes:
    levels = zlib.compress(bytes(len(names) * columns), 9)  # all alike: a few hundred bytes packed
    return json.dumps({"nodes": names, "groups": ["g"] * len(names),
                       "levels": base64.b64encode(levels).decode()}).encode()  # fmt: skip


async def test_the_pictures_parts_are_bounded_over_all_peers_together(sessions: Any) -> None:
    """Before, each peer's part was bounded alone (100,000 rows inflated, each
    peer of up to 64): now every part of one picture together holds at most
    MAX_FLEET_NODES rows, taken before anything is inflated."""
    fakes = [FakeReplica(SECRET) for _ in range(3)]
    for fake in fakes:
        await fake.server.start_server()
    try:
        registry = fleet_registry()
        ours = peers.Peers([f.url for f in fakes], SECRET, registry, forgetting(registry))
        ours.session = sessions[0]
        share = peers.MAX_FLEET_NODES // 2 + 1  # two of them fit no picture
        for i, fake in enumerate(fakes):
            fake.answers["/v1/peer/heatmap"] = a_part([f"p{i}-{n}" for n in range(share if i < 2 else 10)], 4)
        parts, errors = await peers.heatmap_parts(ours, "cpu", 1e9, 4)
        assert sorted(len(p.names) for p in parts) == [10, share]
        [error] = errors
        assert f"over the {peers.MAX_FLEET_NODES} the whole picture holds" in error
    finally:
        ours.session = None
        for fake in fakes:
            await fake.server.close()


async def test_forwarded_streams_are_capped_on_a_pool_apart_from_the_polls(aiohttp_client: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, 100 forwarded live views took the pool the polls shared, and
    the peers looked down. Now each viewer (an address, or an IPv6 /64) has
    MAX_STREAMS_A_VIEWER streams forwarded at once, all viewers MAX_STREAMS,
    on the forwarding pool; the polls' own pool is untouched."""
    from controlplane.samples import live

    monkeypatch.setattr(live, "KEEPALIVE_S", 0.2)  # a stream closed here is seen ended there at its next keepalive
    holder_registry = fleet_registry("n1")
    holder = peers.Peers([], SECRET, holder_registry, lambda node: None)
    holder_access = PageAccess()
    holder_access.peer_auth = holder.auth
    holder_app = pages_api.create_app(holder_registry, access=holder_access, live=live.LiveSamples())
    peers.add_routes(holder_app, holder, lambda: pages_api.nodes_json(holder_registry))
    holder_server = TestServer(holder_app)
    await holder_server.start_server()
    holder_url = f"http://127.0.0.1:{holder_server.port}"
    holder.auth.own_urls.add(holder_url)
    registry = fleet_registry("n2")
    ours = peers.Peers([holder_url], SECRET, registry, forgetting(registry))
    [peer] = ours.peers
    peer.instance, peer.holds, peer.answered_at = "holder", {"n1": 0.0}, registry.clock() + 5
    app = replica_pages(registry, ours, live=live.LiveSamples())
    forwarder = app[forward.FORWARDER]
    client = await aiohttp_client(app)
    streams: list[Any] = []
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as forwarding:
        ours.session, ours.forwarding = session, forwarding
        try:
            for _ in range(forward.MAX_STREAMS_A_VIEWER):
                r = await client.get("/node/n1/live")
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # the holder's first event: the stream is open end to end
                streams.append(r)
            assert sum(forwarder.streams.values()) == forward.MAX_STREAMS_A_VIEWER
            r = await client.get("/node/n1/live")  # a fifth from the same viewer
            assert r.status == 429 and "of this viewer" in await r.text()
            streams.pop().close()  # one of ours closed: this viewer may have one more, but all viewers have the rest
            await wait_for(lambda: sum(forwarder.streams.values()) == forward.MAX_STREAMS_A_VIEWER - 1)
            forwarder.streams["other viewers"] = forward.MAX_STREAMS - forward.MAX_STREAMS_A_VIEWER + 1
            r = await client.get("/node/n1/live")
            assert r.status == 429 and f"{forward.MAX_STREAMS} streams are forwarded" in await r.text()
            # The polls go on, on their own pool, while every stream is held.
            await ours.poll(session)
            assert peer.error is None and peer.holds == {"n1": pytest.approx(0.0, abs=5)}
        finally:
            for r in streams:
                r.close()
            ours.session = ours.forwarding = None
            await holder_server.close()


async def test_a_header_that_is_not_utf8_is_refused_not_a_500(aiohttp_client: Any) -> None:
    """Before, a non-UTF-8 Authorization header on a replica with peers was an unauthenticated 500."""
    registry = fleet_registry("n1")
    ours = peers.Peers([], SECRET, registry, forgetting(registry))
    access = PageAccess()
    access.peer_auth = ours.auth
    app = pages_api.create_app(registry, access=access)
    peers.add_routes(app, ours, lambda: pages_api.nodes_json(registry))
    client = await aiohttp_client(app)
    for header in (b"Authorization: Bearer peer.\xff\xfe", b"X-Nodesampler-Peer: from=\xff; challenge=\xfe; mac=\xfd",
                   b"Authorization: Basic \xff\xfe\xfd"):  # fmt: skip
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(b"GET /v1/peer/held HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401"), (header, answer[:200])
