"""Replicas that share a fleet: each tells the others which nodes it holds,
so that a node is one series, at the replica that holds it.

A node is held by the replica its agent heartbeats to (sampler/agent/replicas.py);
when it moves (its replica went away, or came back), the replica it left
still knows it, stale, and would export it as down. Each replica asks its
peers (`--peer URL`, their agent listeners) every `POLL_S` which nodes they
hold fresh and how long ago each last spoke (`GET /v1/peer/held`, an age on
the answering replica's own clock: no two replicas' clocks are compared),
and lets go of a node a peer heard from more recently than it did: the node
leaves its registry, `/metrics` and history, as a node forgotten does. The
replica that holds a node never lets it go, so a node down everywhere stays
with its last replica, down, and alerts.

Peers show each other a token made from the cluster secret they share
(controlplane/ingest/tokens.py's `peer_token`); a peer's answer is bounded
like any client's: `MAX_ANSWER_BYTES`, `TIMEOUT_S`, each entry checked and a
bad one left out. A replica names itself with a random id in its answers,
so the same `--peer` list serves every replica, itself included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from controlplane.ingest import tokens
from controlplane.state.registry import NodeRegistry
from wire.limits import NODE_ID

log = logging.getLogger(__name__)

POLL_S = 5.0  # a moved node leaves its former replica's /metrics within this and one scrape
TIMEOUT_S = 4.0
MAX_ANSWER_BYTES = 16 * 2**20  # 30,000 nodes at ~60 bytes each, with room
INSTANCE_HEADER = "X-Nodesampler-Replica"


@dataclass
class Peer:
    url: str
    instance: str | None = None  # its id, once it answered (ours: it is this replica)
    holds: dict[str, float] = field(default_factory=dict)  # node -> seconds since it last spoke there
    error: str | None = None  # why the last poll failed; None: it answered

    @property
    def is_us(self) -> bool:
        return self.instance == _INSTANCE


_INSTANCE = secrets.token_hex(8)  # this process's id among its peers


def held_answer(registry: NodeRegistry) -> dict[str, object]:
    """The nodes this replica holds fresh, each with its age here."""
    now = registry.clock()
    held = [[s.node, round(now - s.received_at, 3)] for s in registry.nodes()
            if s.received_at is not None and s.fresh(now, registry.stale_after)]  # fmt: skip
    return {"replica": _INSTANCE, "nodes": held}


def parse_held(body: bytes) -> tuple[str, dict[str, float], int]:
    """A peer's answer: its id, the nodes it holds with their ages, and how
    many entries were left out (not a node name, or not a finite age)."""
    value = json.loads(body)
    if not isinstance(value, dict) or not isinstance(value.get("replica"), str) or not isinstance(
            value.get("nodes"), list):  # fmt: skip
        raise ValueError("not a peer's answer")
    holds, bad = {}, 0
    for entry in value["nodes"]:
        if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and NODE_ID.fullmatch(entry[0])
                and isinstance(entry[1], (int, float)) and math.isfinite(entry[1]) and entry[1] >= 0):  # fmt: skip
            holds[entry[0]] = float(entry[1])
        else:
            bad += 1
    return value["replica"][:64], holds, bad


class Peers:
    """This replica's peers, asked in turn; and the nodes it lets go."""

    def __init__(self, urls: list[str], secret: bytes, registry: NodeRegistry,
                 let_go: Callable[[str], None], ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.peers = [Peer(url.rstrip("/")) for url in dict.fromkeys(urls)]
        self.token = tokens.peer_token(secret)
        self.registry, self.let_go, self.ssl_context = registry, let_go, ssl_context
        self.polls = 0
        self.let_go_count = 0

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """Every peer at once; then the nodes a peer heard from more recently, let go."""
        await asyncio.gather(*(self._ask(session, p) for p in self.peers))
        self.polls += 1
        now = self.registry.clock()
        for state in self.registry.nodes():
            ours = math.inf if state.received_at is None else now - state.received_at
            for peer in self.peers:
                theirs = peer.holds.get(state.node)
                if theirs is not None and not peer.is_us and theirs < ours:
                    log.info("node %s is held by %s (it spoke there %.1f s ago, here %.1f s ago): let go",
                             state.node, peer.url, theirs, ours)  # fmt: skip
                    self.let_go(state.node)
                    self.let_go_count += 1
                    break

    async def _ask(self, session: aiohttp.ClientSession, peer: Peer) -> None:
        error = None
        try:
            async with session.get(f"{peer.url}/v1/peer/held", headers={"Authorization": f"Bearer {self.token}"},
                                   ssl=self.ssl_context if self.ssl_context is not None else True) as r:  # fmt: skip
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                body = await r.content.read(MAX_ANSWER_BYTES + 1)
                if len(body) > MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer over {MAX_ANSWER_BYTES >> 20} MiB")
            peer.instance, peer.holds, bad = parse_held(body)
            if bad:
                error = f"{bad} entries of its answer left out"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            peer.holds = {}  # what it held is not known now: nothing is let go on its word
            error = f"{type(e).__name__}: {e}"[:300]
        if error != peer.error and not peer.is_us:
            if error is None:
                log.info("peer %s answers", peer.url)
            else:
                log.warning("peer %s: %s", peer.url, error)
        peer.error = error


async def held(request: web.Request) -> web.Response:
    """GET /v1/peer/held, for a peer (its token, from the cluster secret)."""
    secret = request.app[PEER_SECRET]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not tokens.is_peer_token(secret, token.strip()):
        return web.json_response({"error": "a peer's token is needed"}, status=401)
    return web.json_response(held_answer(request.app[PEER_REGISTRY]))


PEER_SECRET = web.AppKey("peer_secret", bytes)
PEER_REGISTRY = web.AppKey("peer_registry", NodeRegistry)


def add_routes(agents: web.Application, secret: bytes, registry: NodeRegistry) -> None:
    agents[PEER_SECRET] = secret
    agents[PEER_REGISTRY] = registry
    agents.router.add_get("/v1/peer/held", held)


async def polled(peers: Peers) -> AsyncIterator[None]:
    """The peers asked once before the control plane serves (after its state
    file is loaded: a node that moved while it was down is let go before
    any scrape sees it twice; `TIMEOUT_S` at most), then every `POLL_S`."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def poll() -> None:
        try:
            await peers.poll(session)
        except Exception:  # one poll's fault: logged, and the next poll goes on
            log.exception("asking the peers failed")

    async def forever() -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await poll()

    await poll()
    task = asyncio.create_task(forever())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await session.close()
