"""A node's pages from any replica: the requests about one node go to the
replica that holds it (controlplane/fleet/peers.py), and its answer comes back as
it leaves there, the live stream included.

What is forwarded: the node's page (`/node/NODE`), its live view
(`/node/NODE/live`), a span of its hindsight asked for
(`POST /api/nodes/NODE/hindsight`) and read (`/api/hindsight/ID`), its
incidents (`/api/incidents?node=NODE`, `/api/incidents/ID`) and an
operator's incident started for it (`POST /api/incidents`, each node's at
its holder). An operator's forgetting a node (`DELETE /api/nodes/NODE`)
goes to every replica: a node down for good is known where it was held
last. Otherwise a replica forwards only what a peer holds fresher than it
does (`Peers.holding_peer`); a request a peer forwarded is served where it
lands, never forwarded again, so two replicas that disagree for a poll do
not send a request round in circles.

The request goes to the peer's URL as this replica's `--peer` list (or its
SRV record) names it, never to a host or port an answer names, signed for
that peer alone (controlplane/listen/peer_auth.py) in place of the user's
password: this replica checked the user already, and names them
(`FORWARDED_USER`, in the request's MAC) so the peer counts their live
views as its own and gives them no more rights than its own web config
does. The peer's answer is passed on only with its proof that it holds
the cluster secret, then a piece at a time as it comes (nothing is held
whole here); a peer that does not answer, or not as a replica, is a 502
that names it. Forwarded requests have their own connection pool
(`Peers.forwarding`), apart from the polls', and streams through it are
capped below that pool's size, per viewer (an IPv4 address or IPv6 /64) too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

from controlplane.fleet.peers import TIMEOUT_S, Peer, Peers
from controlplane.listen.bodies import answer_body, request_body
from controlplane.listen.page_access import (
    ADMIN_SOCKET_USER,
    FORWARDED_FOR,
    FORWARDED_USER,
    FROM_PEER,
    USER,
    Handler,
    from_admin_socket,
    may_change_fleet,
    peer_of,
)
from controlplane.listen.peer_auth import PROOF
from controlplane.samples.hindsight import HINDSIGHT
from controlplane.samples.incidents import BODY_READ, INCIDENTS

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 30.0  # a page or a span's samples from a peer; a live stream has none (its keepalives)
STREAM_READ_TIMEOUT_S = 40.0  # a live stream is a keepalive every 15 s: silent this long, the peer is gone
WRITE_TIMEOUT_S = 10.0  # as controlplane/samples/live.py's: a reader that reads nothing is let go
MAX_BODY = 2**20  # a forwarded request's body: a span asked for, an incident started
MAX_ANSWER = 64 * 1024  # a peer's answer to an incident's share: its id and nodes
# Streams forwarded at once (aiohttp's pool is 100 connections: the rest stay free for pages), and
# of one viewer (as the holder's own live views are capped, controlplane/samples/live.py).
MAX_STREAMS = 64
MAX_STREAMS_A_VIEWER = 4
REMEMBERED_SPANS = 4096  # span ids asked for through this replica, with the peer that fetches each
PASSED_ON = ("Content-Type", "Cache-Control", "Content-Disposition", "Retry-After", "X-Accel-Buffering")

ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # an incident's id: only such a one is asked of the peers
# Routes whose `{node}` names the node the request is about.
NODE_ROUTES = frozenset({"/node/{node}", "/node/{node}/live", "/api/nodes/{node}/hindsight"})


class Forwarder:
    """This replica's peers, as the pages listener forwards to them."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self.spans: collections.OrderedDict[str, Peer] = collections.OrderedDict()  # span id -> its fetcher
        self.forwarded = 0  # requests sent on to a peer
        self.failed = 0  # of them, those the peer did not answer (502)
        self.streams: collections.Counter[str] = collections.Counter()  # streams forwarded now, by viewer

    def remember_span(self, span_id: str, peer: Peer) -> None:
        self.spans[span_id] = peer
        self.spans.move_to_end(span_id)
        while len(self.spans) > REMEMBERED_SPANS:
            self.spans.popitem(last=False)

    @contextlib.contextmanager
    def _stream_slot(self, viewer: str) -> Iterator[str | None]:
        """A slot for one forwarded stream: None, or why there is none."""
        if self.streams.total() >= MAX_STREAMS:
            yield f"{MAX_STREAMS} streams are forwarded already"
            return
        if self.streams[viewer] >= MAX_STREAMS_A_VIEWER:
            yield f"{MAX_STREAMS_A_VIEWER} streams of this viewer are forwarded already"
            return
        self.streams[viewer] += 1
        try:
            yield None
        finally:
            self.streams[viewer] -= 1
            if self.streams[viewer] <= 0:
                del self.streams[viewer]

    async def send(self, request: web.Request, peer: Peer, body: bytes | None = None,
                   remember_span: bool = False) -> web.StreamResponse:  # fmt: skip
        """The request, served by `peer`: its answer as it comes. `body`: in
        place of the request's own (an incident's nodes, split by holder)."""
        session = self.peers.forwarding
        if session is None:
            return self._failed(request, peer, "the control plane is starting")
        if body is None and request.body_exists:
            body = await request_body(request, MAX_BODY)
        streams = getattr(request.match_info.handler, "streams", False)
        if not streams:
            return await self._send(session, request, peer, body, remember_span)
        with self._stream_slot(peer_of(request.remote)) as refused:
            if refused is not None:
                return web.Response(status=429, text=f"{refused}: try again later\n", headers={"Retry-After": "5"})
            return await self._send(session, request, peer, body, remember_span, streams=True)

    async def _send(self, session: aiohttp.ClientSession, request: web.Request, peer: Peer, body: bytes | None,
                    remember_span: bool, streams: bool = False) -> web.StreamResponse:  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=None if streams else ANSWER_TIMEOUT_S, sock_connect=TIMEOUT_S,
                                        sock_read=STREAM_READ_TIMEOUT_S if streams else None)  # fmt: skip
        self.forwarded += 1
        response: web.StreamResponse | None = None
        user, viewer = self._user(request), request.remote or "unknown"
        try:
            async with self.peers.request(session, request.method, peer, request.raw_path, user=user or "",
                                          viewer=viewer, headers=self._headers(request, user, viewer), data=body,
                                          timeout=timeout) as (answer, challenge):  # fmt: skip
                if not self.peers.auth.proven(answer.headers.get(PROOF), challenge, answer.status, None):
                    return self._failed(request, peer, f"HTTP {answer.status} without a peer's proof: "
                                                       "not a replica of this cluster")  # fmt: skip
                if remember_span and answer.status == 202:
                    return await self._span_asked(answer, peer)
                response = web.StreamResponse(
                    status=answer.status,
                    reason=answer.reason,
                    headers={k: answer.headers[k] for k in PASSED_ON if k in answer.headers},
                )
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    async with asyncio.timeout(WRITE_TIMEOUT_S):
                        await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            if response is not None:  # part of the answer left: the reader sees it end short
                if not isinstance(e, (ConnectionError, TimeoutError)):
                    log.info("forwarding %s to %s ended: %s", request.path, peer.url, e)
                return response
            return self._failed(request, peer, f"{type(e).__name__}: {e}"[:300])

    async def ask(self, request: web.Request, peer: Peer, body: bytes) -> dict[str, Any]:
        """The request with `body`, answered by `peer`: its JSON answer (at
        most `MAX_ANSWER` bytes), or why there is none."""
        session = self.peers.forwarding
        if session is None:
            return {"error": "not sent: the control plane is starting"}
        self.forwarded += 1
        user, viewer = self._user(request), request.remote or "unknown"
        try:
            async with self.peers.request(session, request.method, peer, request.raw_path, user=user or "",
                                          viewer=viewer, headers=self._headers(request, user, viewer), data=body,
                                          timeout=aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
                                          ) as (answer, challenge):  # fmt: skip
                if not self.peers.auth.proven(answer.headers.get(PROOF), challenge, answer.status, None):
                    raise ValueError(f"HTTP {answer.status} without a peer's proof: not a replica of this cluster")
                text = (await answer_body(answer, MAX_ANSWER)).decode(errors="replace")
                if answer.status >= 400:
                    return {"status": answer.status, "error": text[:300]}
                value = json.loads(text)
                return value if isinstance(value, dict) else {"error": "not an answer"}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            self.failed += 1
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    @staticmethod
    def _user(request: web.Request) -> str | None:
        # The operator through the admin socket has no name: the holder gives them the rights they have here.
        user: str | None = request.get(USER, ADMIN_SOCKET_USER if from_admin_socket(request) else None)
        return user

    @staticmethod
    def _headers(request: web.Request, user: str | None, viewer: str) -> dict[str, str]:
        headers = {FORWARDED_FOR: viewer}
        if user is not None:
            headers[FORWARDED_USER] = user
        for name in ("Content-Type", "Accept"):
            if name in request.headers:
                headers[name] = request.headers[name]
        return headers

    async def _span_asked(self, answer: aiohttp.ClientResponse, peer: Peer) -> web.Response:
        """The peer's 202 for a span: its id remembered, so the reads of it go there too."""
        text = await answer_body(answer, 64 * 1024)
        try:
            span_id = json.loads(text)["id"]
            if isinstance(span_id, str):
                self.remember_span(span_id, peer)
        except (ValueError, KeyError, TypeError):
            pass  # passed on as it is: the reader sees what the peer said
        return web.Response(status=202, body=text, content_type="application/json")

    def _failed(self, request: web.Request, peer: Peer, why: str) -> web.Response:
        self.failed += 1
        log.info("forwarding %s to %s failed: %s", request.path, peer.url, why)
        return web.Response(status=502, text=f"this node is held by the replica {peer.url}, whose pages did not "
                                              f"answer: {why}\n")  # fmt: skip

    async def find(self, request: web.Request, path: str) -> web.StreamResponse | None:
        """`/api/incidents/ID` this replica does not keep: asked of each peer in
        turn (few, and a 404 is quick), the first that has it answering. `path`
        as the client sent it (still encoded: what it names is the peer's to read)."""
        session = self.peers.forwarding
        for peer in self.peers.peers:
            if peer.is_us or session is None:
                continue
            try:
                async with self.peers.request(session, "HEAD", peer, path) as (r, challenge):
                    if r.status == 404 or not self.peers.auth.proven(r.headers.get(PROOF), challenge, r.status, None):
                        continue
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                continue
            return await self.send(request, peer)
        return None


FORWARDER = web.AppKey("forwarder", Forwarder)


@web.middleware
async def to_holder(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The pages' middleware (after page_access: the user is checked here first)."""
    forwarder = request.app.get(FORWARDER)
    if forwarder is None or request.get(FROM_PEER):
        return await handler(request)
    info = request.match_info
    route = info.route.resource.canonical if info.route.resource is not None else ""
    holders = forwarder.peers
    if route in NODE_ROUTES:
        if (peer := holders.holding_peer(info["node"])) is not None:
            return await forwarder.send(request, peer, remember_span=route.endswith("/hindsight"))
    elif route == "/api/hindsight/{id}":
        fetches = request.app.get(HINDSIGHT)
        if (fetches is None or fetches.get(info["id"]) is None) and (peer := forwarder.spans.get(info["id"])):
            return await forwarder.send(request, peer)
    elif route == "/api/incidents/{id}" and request.method in ("GET", "HEAD"):
        incidents = request.app.get(INCIDENTS)
        if incidents is None or incidents.get(info["id"]) is None:
            found = await forwarder.find(request, request.raw_path) if ID.fullmatch(info["id"]) else None
            if found is not None:
                return found
    elif route == "/api/incidents" and request.method == "GET":
        node = request.query.get("node")
        if node is not None and (peer := holders.holding_peer(node)) is not None:
            return await forwarder.send(request, peer)
    elif route == "/api/incidents" and request.method == "POST" and may_change_fleet(request):
        return await _start_where_held(request, handler, forwarder)
    elif route == "/api/nodes/{node}" and request.method == "DELETE" and may_change_fleet(request):
        return await _forget_everywhere(request, handler, forwarder)
    return await handler(request)


async def _forget_everywhere(request: web.Request, handler: Handler, forwarder: Forwarder) -> web.StreamResponse:
    """An operator forgets a node at every replica that knows it: a node down
    for good is known (stale) where it was last held, which no peer's held
    list names. 404 only when no replica knew it."""
    peers = [p for p in forwarder.peers.peers if not p.is_us]
    answers = await asyncio.gather(*(forwarder.ask(request, peer, b"") for peer in peers))
    forgotten_at = [peer.url for peer, answer in zip(peers, answers, strict=True) if "forgotten" in answer]
    errors = {peer.url: answer["error"] for peer, answer in zip(peers, answers, strict=True)
              if "error" in answer and answer.get("status") != 404}  # fmt: skip
    try:
        await handler(request)
        forgotten_at.insert(0, "here")
    except web.HTTPNotFound:
        if not forgotten_at:
            raise
    return web.json_response({"forgotten": request.match_info["node"], "replicas": forgotten_at,
                              **({"errors": errors} if errors else {})})  # fmt: skip


async def _start_where_held(request: web.Request, handler: Handler, forwarder: Forwarder) -> web.StreamResponse:
    """An operator's incident: each node's at the replica that holds it. All of
    them at one peer: the request is that peer's; split: each peer's share
    sent on, this replica's started here, the peers' answers under
    `forwarded` (as the Alertmanager webhook's)."""
    raw = await request_body(request, MAX_BODY)
    request[BODY_READ] = raw
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    nodes = body.get("nodes") if isinstance(body, dict) else None
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
        return await handler(request)  # its own 400 says what is wrong
    groups: dict[Peer | None, list[str]] = {}
    for node in nodes:
        groups.setdefault(forwarder.peers.holding_peer(node), []).append(node)
    if list(groups) == [None]:
        return await handler(request)
    if len(groups) == 1:
        [peer] = groups
        assert peer is not None
        return await forwarder.send(request, peer, raw)
    assert isinstance(body, dict)
    shares = [(peer, json.dumps({**body, "nodes": share}).encode()) for peer, share in groups.items() if peer]
    answers = await asyncio.gather(*(forwarder.ask(request, peer, share) for peer, share in shares))
    forwarded = {peer.url: answer for (peer, _), answer in zip(shares, answers, strict=True)}
    if None not in groups:
        return web.json_response({"forwarded": forwarded}, status=202)
    request[BODY_READ] = json.dumps({**body, "nodes": groups[None]}).encode()
    try:
        local = await handler(request)
    except web.HTTPException as e:  # refused here: the peers' shares may still have started
        return web.json_response({"error": e.text, "forwarded": forwarded}, status=e.status)
    assert isinstance(local, web.Response) and isinstance(local.body, bytes)
    return web.json_response({**json.loads(local.body), "forwarded": forwarded}, status=local.status)
