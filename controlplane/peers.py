"""Replicas that share a fleet: each tells the others which nodes it holds,
so that a node is one series, at the replica that holds it.

A node is held by the replica its agent heartbeats to (sampler/agent/replicas.py);
when it moves (its replica went away, or came back), the replica it left
still knows it, stale, and would export it as down. Each replica asks its
peers (`--peer URL`, their pages listeners) every `POLL_S` which nodes they
hold fresh and how long ago each last spoke (`GET /v1/peer/held`, an age on
the answering replica's own clock: no two replicas' clocks are compared),
and lets go of a node a peer heard from more recently than it did: the node
leaves its registry, `/metrics` and history, as a node forgotten does. The
replica that holds a node never lets it go, so a node down everywhere stays
with its last replica, down, and alerts. A node that registers at a replica
(an agent moving there) is also told to the peers at once (`POST
/v1/peer/arrived`, the arrivals of `ARRIVALS_EVERY_S` in one body a peer),
and a peer that has not heard from it for `ARRIVED_AFTER_S` lets it go then:
a moved node is up at two replicas for less than a scrape, not a poll.

Peers show each other a token made from the cluster secret they share
(controlplane/ingest/tokens.py's `peer_token`); a peer's answer is bounded
like any client's: `MAX_ANSWER_BYTES`, `TIMEOUT_S`, each entry checked and a
bad one left out. A replica names itself with a random id in its answers,
so the same `--peer` list serves every replica, itself included.
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import json
import logging
import math
import secrets
import ssl
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from controlplane.cluster_view import chart_grid, chart_parts, chart_parts_json, cluster_json, parse_chart_parts
from controlplane.heatmap import MAX_COLUMNS, MEASURES, Part, own_part, parse_part, part_json
from controlplane.hindsight import Refused as IncidentsRefused
from controlplane.history import EmbeddedHistory, GridPart
from controlplane.incidents import INCIDENTS
from controlplane.ingest import tokens
from controlplane.state.registry import NodeRegistry
from wire.discovery import REFRESH_S, Replicas
from wire.limits import NODE_ID

log = logging.getLogger(__name__)

POLL_S = 5.0  # a moved node leaves its former replica's /metrics within this and one scrape
TIMEOUT_S = 4.0
MAX_ANSWER_BYTES = 16 * 2**20  # 30,000 nodes at ~60 bytes each, with room
ARRIVALS_EVERY_S = 0.2  # arrivals told together: a replica's death moves thousands of nodes at once
MAX_ARRIVALS = 50_000  # node names in one telling (~1.5 MB): more wait for the next
ARRIVED_AFTER_S = 1.0  # a node told arrived elsewhere is let go here if silent here this long
MAX_ALERTS_BODY = 2**20  # as Alertmanager's own body to /api/alertmanager
MAX_FORWARD_ANSWER = 64 * 1024  # a peer's answer to forwarded alerts: an incident's id and its nodes
ROWS_TIMEOUT_S = 2.0  # a page waits this long for a peer's rows, then names it and shows the rest
MAX_ROWS_BYTES = 64 * 2**20  # 10,000 GPU nodes' rows, with room
ROWS_SHARED_S = 1.0  # one fetch of the peers' rows serves every page view for this long
MAX_CHART_BYTES = 4 * 2**20  # the fleet charts' totals: a few groups of a few hundred instants
# The fleet's picture's part: a name and a zlib-packed row of 720 levels a node (10 to 400 bytes in
# base64: an idle node's row is all alike, a busy one's is not), at 10,000 nodes a few MB at most.
MAX_HEATMAP_BYTES = 16 * 2**20


@dataclass(eq=False)  # one a replica: each is itself (and a key)
class Peer:
    url: str
    instance: str | None = None  # its id, once it answered (ours: it is this replica)
    holds: dict[str, float] = field(default_factory=dict)  # node -> seconds since it last spoke there
    answered_at: float = 0.0  # when `holds` came (this replica's clock): its ages are older by now
    error: str | None = None  # why the last poll failed; None: it answered
    pages: str | None = None  # its pages listener (controlplane/forward.py), once it said where
    rows_error: str | None = None  # why its rows did not come for the last fleet view

    @property
    def is_us(self) -> bool:
        return self.instance == _INSTANCE


_INSTANCE = secrets.token_hex(8)  # this process's id among its peers


def held_answer(registry: NodeRegistry, pages: tuple[str, int] | None = None) -> dict[str, object]:
    """The nodes this replica holds fresh, each with its age here; and the
    scheme and port of its pages listener, for a peer to forward a node's
    pages to (on the host the peer reaches this replica by)."""
    now = registry.clock()
    held = [[s.node, round(now - s.received_at, 3)] for s in registry.nodes()
            if s.received_at is not None and s.fresh(now, registry.stale_after)]  # fmt: skip
    answer: dict[str, object] = {"replica": _INSTANCE, "nodes": held}
    if pages is not None:
        answer["pages"] = {"scheme": pages[0], "port": pages[1]}
    return answer


def pages_url(peer_url: str, pages: Any) -> str | None:
    """Where a peer's pages are: its URL's host, with the scheme and port its
    answer names; None when the answer names none, or not those."""
    if not isinstance(pages, dict) or pages.get("scheme") not in ("http", "https"):
        return None
    port = pages.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    host = urllib.parse.urlsplit(peer_url).hostname
    if not host:
        return None
    return f"{pages['scheme']}://{f'[{host}]' if ':' in host else host}:{port}"


def parse_held(body: bytes) -> tuple[str, dict[str, float], int]:
    """A peer's answer: its id, the nodes it holds with their ages, and how
    many entries were left out (not a node name, or not a finite age)."""
    value = json.loads(body)
    return _parse_held(value)


def _parse_held(value: Any) -> tuple[str, dict[str, float], int]:
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
        self.replicas = Replicas(urls, clock=registry.clock)  # given, or named by DNS SRV records (wire/discovery.py)
        self.peers = [Peer(url) for url in self.replicas.urls]
        self.token = tokens.peer_token(secret)
        self.registry, self.let_go, self.ssl_context = registry, let_go, ssl_context
        self.let_go_count = 0
        self.pages: tuple[str, int] | None = None  # this replica's pages listener (scheme, port), told to peers
        self.listening = asyncio.Event()  # set when this replica's listeners are up: polled at once
        self.serving = False  # its listeners are up (before: its own entry cannot answer)
        self.session: aiohttp.ClientSession | None = None  # while the control plane runs (`polled`)
        self._rows: dict[str, tuple[float, list[tuple[Peer, list[dict[str, Any]]]]]] = {}  # a view's, and when
        self._rows_lock = asyncio.Lock()
        self._arrivals: dict[str, None] = {}  # nodes that registered here, not yet told
        self._telling: asyncio.Task[None] | None = None

    def arrived(self, node: str) -> None:
        """A node registered here: the peers are told soon, with the others that came meanwhile."""
        if len(self._arrivals) < MAX_ARRIVALS:
            self._arrivals[node] = None
        if self._telling is None and self.session is not None:
            self._telling = asyncio.create_task(self._tell())

    async def _tell(self) -> None:
        try:
            await asyncio.sleep(ARRIVALS_EVERY_S)
            nodes, self._arrivals = list(self._arrivals), {}
            body = {"replica": _INSTANCE, "nodes": nodes}
            await asyncio.gather(*(self._tell_one(p, body) for p in self.peers if not p.is_us))
        finally:
            self._telling = None
            if self._arrivals and self.session is not None:
                self._telling = asyncio.create_task(self._tell())

    async def _tell_one(self, peer: Peer, body: dict[str, Any]) -> None:
        assert self.session is not None
        try:
            async with self.session.post(f"{peer.url}/v1/peer/arrived", json=body, ssl=self.ssl_context or True,
                                         headers={"Authorization": f"Bearer {self.token}"}) as r:  # fmt: skip
                await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass  # it is down, or slow: the polls settle it

    def holder(self, node: str) -> str | None:
        """The URL of the peer that holds `node` (heard from it last, at the
        last poll), or None when this replica does or nobody does."""
        peer = self.holding_peer(node)
        return None if peer is None else peer.url

    def holding_peer(self, node: str) -> Peer | None:
        now = self.registry.clock()
        state = self.registry.get(node)
        best, age = None, math.inf if state is None or state.received_at is None else now - state.received_at
        for peer in self.peers:
            theirs = peer.holds.get(node)
            if theirs is not None and not peer.is_us and theirs + (now - peer.answered_at) < age:
                best, age = peer, theirs + (now - peer.answered_at)
        return best

    async def forward_alerts(self, peer: str, body: dict[str, Any]) -> dict[str, Any]:
        """Alertmanager's alerts of nodes `peer` holds, for it to capture: its answer, or why there is none."""
        if self.session is None:
            return {"error": "not sent: the control plane is starting"}
        try:
            async with self.session.post(f"{peer}/v1/peer/alerts", json=body, ssl=self.ssl_context or True,
                                         headers={"Authorization": f"Bearer {self.token}"}) as r:  # fmt: skip
                text = (await r.content.read(MAX_FORWARD_ANSWER)).decode(errors="replace")
                if r.status != 200:
                    return {"error": f"HTTP {r.status}: {text[:200]}"}
                answer = json.loads(text)
                return answer if isinstance(answer, dict) else {"error": "not an answer"}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    def told_arrived(self, nodes: list[str]) -> int:
        """A peer says these nodes registered there: each silent here for
        `ARRIVED_AFTER_S` is let go. How many were."""
        now, let_go = self.registry.clock(), 0
        for node in nodes:
            state = self.registry.get(node)
            if state is None:
                continue
            ours = math.inf if state.received_at is None else now - state.received_at
            if ours > ARRIVED_AFTER_S:
                log.info("node %s registered at a peer (it spoke here %.1f s ago): let go", node, ours)
                self.let_go(node)
                self.let_go_count += 1
                let_go += 1
        return let_go

    async def discover(self) -> None:
        """The peers a DNS record names now, read again every `REFRESH_S`: a
        peer still named keeps what it said; one gone is no longer asked."""
        due = self.replicas.refreshed_at is None or self.registry.clock() - self.replicas.refreshed_at >= REFRESH_S
        if self.replicas.discovered and due and await self.replicas.refresh():
            known = {p.url: p for p in self.peers}
            self.peers = [known.get(url) or Peer(url) for url in self.replicas.urls]
            log.info("peers now: %s", ", ".join(p.url for p in self.peers) or "none")

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """Every peer at once; then the nodes a peer heard from more recently, let go."""
        await self.discover()
        await asyncio.gather(*(self._ask(session, p) for p in self.peers))
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

    async def _get(self, session: aiohttp.ClientSession, url: str, most: int, seconds: float) -> bytes:
        """A peer's answer, whole: ValueError when it is not 200 or over `most` bytes."""
        async with session.get(url, headers={"Authorization": f"Bearer {self.token}"},
                               timeout=aiohttp.ClientTimeout(total=seconds), ssl=self.ssl_context or True) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            body = await r.content.read(most + 1)
        if len(body) > most:
            raise ValueError(f"an answer over {most >> 20} MiB")
        return body

    async def _ask(self, session: aiohttp.ClientSession, peer: Peer) -> None:
        error = None
        try:
            value = json.loads(await self._get(session, f"{peer.url}/v1/peer/held", MAX_ANSWER_BYTES, TIMEOUT_S))
            peer.instance, peer.holds, bad = _parse_held(value)
            peer.pages = pages_url(peer.url, value.get("pages"))
            peer.answered_at = self.registry.clock()
            if bad:
                error = f"{bad} entries of its answer left out"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            peer.holds = {}  # what it held is not known now: nothing is let go on its word
            error = f"{type(e).__name__}: {e}"[:300]
        if error != peer.error and not peer.is_us:
            if error is None:
                log.info("peer %s answers", peer.url)
            elif not self.serving and peer.instance is None:
                # The poll before this replica listens: its own entry cannot answer yet.
                log.info("peer %s: %s (asked again once this replica listens)", peer.url, error)
            else:
                log.warning("peer %s: %s", peer.url, error)
        peer.error = error

    async def fleet_rows(self, view: str = "nodes") -> list[tuple[Peer, list[dict[str, Any]]]]:
        """Every other peer's rows of its own nodes (`view`: "nodes", as
        `/api/nodes` lists them; "cluster", as the cluster page does), fetched
        at once and bounded in time and size; a peer whose rows did not come
        has none, and its `rows_error` says why. Shared for `ROWS_SHARED_S`:
        a flood of page views asks the peers once a second."""
        async with self._rows_lock:
            now = self.registry.clock()
            shared = self._rows.get(view)
            if shared is not None and now - shared[0] < ROWS_SHARED_S:
                return shared[1]
            peers = [p for p in self.peers if not p.is_us]
            got = await asyncio.gather(*(self._fetch_rows(p, view) for p in peers))
            rows = self._rows[view] = (self.registry.clock(), list(zip(peers, got, strict=True)))
            return rows[1]

    async def _fetch_rows(self, peer: Peer, view: str) -> list[dict[str, Any]]:
        if self.session is None:
            peer.rows_error = "not asked: the control plane is starting"
            return []
        try:
            url = f"{peer.url}/v1/peer/nodes" + ("?view=cluster" if view == "cluster" else "")
            body = await self._get(self.session, url, MAX_ROWS_BYTES, ROWS_TIMEOUT_S)
            rows = await asyncio.get_running_loop().run_in_executor(None, json.loads, body)
            if not isinstance(rows, dict) or not isinstance(rows.get("nodes"), list):
                raise ValueError("not a list of nodes")
            peer.rows_error = None
            return [n for n in rows["nodes"] if isinstance(n, dict) and isinstance(n.get("node"), str)
                    and NODE_ID.fullmatch(n["node"])]  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            peer.rows_error = f"{type(e).__name__}: {e}"[:300]
            return []


async def fleet_chart_parts(peers: Peers, end: float, span: float, step: float
                            ) -> tuple[list[list[dict[str, GridPart]]], list[str]]:  # fmt: skip
    """Every other peer's part of the fleet charts (its own nodes' totals on
    the grid), fetched at once and bounded like its rows; and, for each peer
    whose part did not come, why."""
    steps = len(chart_grid(end, span, step))
    query = f"end={end!r}&span={span!r}&step={step!r}"

    async def one(peer: Peer) -> list[dict[str, GridPart]] | str:
        if peers.session is None:
            return f"{peer.url}: not asked: the control plane is starting"
        try:
            body = await peers._get(peers.session, f"{peer.url}/v1/peer/fleet-charts?{query}", MAX_CHART_BYTES,
                                    ROWS_TIMEOUT_S)  # fmt: skip
            return parse_chart_parts(json.loads(body), steps)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, TypeError) as e:
            return f"{peer.url}: {type(e).__name__}: {e}"[:300]

    got = await asyncio.gather(*(one(p) for p in peers.peers if not p.is_us))
    return [g for g in got if not isinstance(g, str)], [g for g in got if isinstance(g, str)]


async def heatmap_parts(peers: Peers, measure: str, end: float, columns: int) -> tuple[list[Part], list[str]]:
    """Every other peer's part of the fleet's picture (its own nodes' levels on
    the grid), fetched at once and bounded like its rows; and, for each peer
    whose part did not come, why."""
    query = urllib.parse.urlencode({"measure": measure, "end": repr(end), "columns": columns})

    async def one(peer: Peer) -> Part | str:
        if peers.session is None:
            return f"{peer.url}: not asked: the control plane is starting"
        try:
            body = await peers._get(peers.session, f"{peer.url}/v1/peer/heatmap?{query}", MAX_HEATMAP_BYTES,
                                    ROWS_TIMEOUT_S)  # fmt: skip
            return await asyncio.get_running_loop().run_in_executor(None, lambda: parse_part(json.loads(body), columns))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, TypeError, binascii.Error, zlib.error) as e:
            return f"{peer.url}: {type(e).__name__}: {e}"[:300]

    got = await asyncio.gather(*(one(p) for p in peers.peers if not p.is_us))
    return [g for g in got if not isinstance(g, str)], [g for g in got if isinstance(g, str)]


async def heatmap_part(request: web.Request) -> web.Response:
    """GET /v1/peer/heatmap?measure=M&end=T&columns=C, for a peer: this
    replica's own nodes in the fleet's picture (controlplane/heatmap.py)."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        measure = MEASURES[request.query["measure"]]
        end, columns = float(request.query["end"]), int(request.query["columns"])
        if not math.isfinite(end) or not 1 <= columns <= MAX_COLUMNS:
            raise ValueError(f"end: finite; columns: 1 to {MAX_COLUMNS}")
    except (KeyError, ValueError) as e:
        return web.json_response({"error": f"{type(e).__name__}: {e}"[:200]}, status=400)
    history = request.app[PEER_HISTORY]
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: part_json(own_part(history, measure, end, columns)))
    return web.Response(body=body, content_type="application/json")


async def fleet_charts(request: web.Request) -> web.Response:
    """GET /v1/peer/fleet-charts?end=T&span=S&step=D, for a peer: this
    replica's own nodes' totals of each fleet chart (controlplane/cluster_view.py)."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        end, span, step = (float(request.query[k]) for k in ("end", "span", "step"))
        chart_grid(end, span, step)
    except (KeyError, ValueError) as e:
        return web.json_response({"error": str(e)[:200]}, status=400)
    history = request.app[PEER_HISTORY]
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: chart_parts_json(chart_parts(history, end, span, step)))
    return web.Response(text=body, content_type="application/json")


def merged_rows(own: list[dict[str, Any]], theirs: list[tuple[Peer, list[dict[str, Any]]]]) -> dict[str, Any]:
    """The fleet as one list: each node once, from the replica that heard from
    it last (`replica`: the peer's URL; absent: this replica), and each peer
    whose rows did not come named, with the nodes it held at the last poll."""
    best: dict[str, dict[str, Any]] = {row["node"]: row for row in own}

    def age(row: dict[str, Any]) -> float:
        a = row.get("sample_age_seconds")
        return float(a) if isinstance(a, (int, float)) and math.isfinite(a) else math.inf

    for peer, rows in theirs:
        for row in rows:
            row["replica"] = peer.url
            mine = best.get(row["node"])
            if mine is None or age(row) < age(mine):
                best[row["node"]] = row
    peers = [{"peer": peer.url, "answered": peer.rows_error is None, "error": peer.rows_error,
              "nodes_not_shown": None if peer.rows_error is None else len(peer.holds)}
             for peer, _ in theirs]  # fmt: skip
    return {"nodes": sorted(best.values(), key=lambda r: r["node"]), "peers": peers}


async def peer_nodes(request: web.Request) -> web.Response:
    """GET /v1/peer/nodes, for a peer: this replica's own nodes, as `/api/nodes`
    lists them (`?view=cluster`: as the cluster page does)."""
    if (refused := _refused(request)) is not None:
        return refused
    rows = request.app[PEER_CLUSTER_ROWS] if request.query.get("view") == "cluster" else request.app[PEER_ROWS]
    body = await asyncio.get_running_loop().run_in_executor(None, rows)
    return web.Response(text=body, content_type="application/json")


def _refused(request: web.Request) -> web.Response | None:
    secret = request.app[PEER_SECRET]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not tokens.is_peer_token(secret, token.strip()):
        return web.json_response({"error": "a peer's token is needed"}, status=401)
    return None


async def held(request: web.Request) -> web.Response:
    """GET /v1/peer/held, for a peer (its token, from the cluster secret)."""
    if (refused := _refused(request)) is not None:
        return refused
    peers = request.app[PEERS]
    return web.json_response(held_answer(peers.registry, peers.pages))


async def arrived(request: web.Request) -> web.Response:
    """POST /v1/peer/arrived, from a peer: `{"replica": ID, "nodes": [...]}`, nodes that registered there."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        body = json.loads(await request.content.read(MAX_ARRIVALS * 300))
        nodes = body["nodes"] if isinstance(body, dict) and isinstance(body.get("nodes"), list) else None
        if nodes is None or body.get("replica") == _INSTANCE:
            raise ValueError("not a peer's arrivals")
    except (ValueError, RecursionError) as e:
        return web.json_response({"error": str(e)[:200]}, status=400)
    named = [n for n in nodes[:MAX_ARRIVALS] if isinstance(n, str) and NODE_ID.fullmatch(n)]
    return web.json_response({"let_go": request.app[PEERS].told_arrived(named)})


async def alerts(request: web.Request) -> web.Response:
    """POST /v1/peer/alerts, from a peer: Alertmanager's alerts of nodes this
    replica holds, captured here as if Alertmanager had sent them (and sent
    on no further: a peer that thinks otherwise answers for what it holds)."""
    if (refused := _refused(request)) is not None:
        return refused
    incidents = request.app.get(INCIDENTS)
    if incidents is None:
        return web.json_response({"error": "this replica keeps no incidents (--incidents-dir)"}, status=503)
    try:
        body = json.loads(await request.content.read(MAX_ALERTS_BODY))
        return web.json_response(incidents.alerts(body))
    except (ValueError, RecursionError) as e:
        return web.json_response({"error": str(e)[:200]}, status=400)
    except IncidentsRefused as e:
        return web.json_response({"error": str(e)[:200]}, status=e.status)


PEER_SECRET = web.AppKey("peer_secret", bytes)


class OwnRows(Protocol):
    def __call__(self) -> str: ...


PEER_ROWS = web.AppKey("peer_rows", OwnRows)
PEER_CLUSTER_ROWS = web.AppKey("peer_cluster_rows", OwnRows)
PEER_HISTORY = web.AppKey("peer_history", EmbeddedHistory)
PEERS = web.AppKey("peers", Peers)


def add_routes(app: web.Application, peers: Peers, secret: bytes, own_rows: OwnRows,
               history: EmbeddedHistory | None = None) -> None:  # fmt: skip
    """The peers' routes on a listener (the pages listener, which `--peer`
    names; and the agent listener, for a `--peer` that names that); `own_rows`:
    this replica's nodes as `/api/nodes` writes them (made on a thread, as
    the cluster page's rows are); `history`: the embedded one, whose part of
    the fleet charts a peer asks for (none with --prometheus: Prometheus has
    the fleet)."""
    app[PEERS] = peers
    app[PEER_SECRET] = secret
    app[PEER_ROWS] = own_rows
    app[PEER_CLUSTER_ROWS] = functools.partial(cluster_json, peers.registry)
    app.router.add_get("/v1/peer/held", held)
    app.router.add_get("/v1/peer/nodes", peer_nodes)
    app.router.add_post("/v1/peer/arrived", arrived)
    app.router.add_post("/v1/peer/alerts", alerts)
    if history is not None:
        app[PEER_HISTORY] = history
        app.router.add_get("/v1/peer/fleet-charts", fleet_charts)
        app.router.add_get("/v1/peer/heatmap", heatmap_part)


async def polled(peers: Peers) -> AsyncIterator[None]:
    """The peers asked once before the control plane serves (after its state
    file is loaded: a node that moved while it was down is let go before
    any scrape sees it twice; `TIMEOUT_S` at most), again once it listens
    (its own entry in the --peer list answers then, and is known as itself),
    then every `POLL_S`."""
    session = peers.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def poll() -> None:
        try:
            await peers.poll(session)
        except Exception:  # one poll's fault: logged, and the next poll goes on
            log.exception("asking the peers failed")

    async def forever() -> None:
        while True:
            try:  # the next poll in POLL_S, or at once when this replica starts to listen
                await asyncio.wait_for(peers.listening.wait(), POLL_S)
                peers.listening.clear()
            except TimeoutError:
                pass
            await poll()

    await poll()
    task = asyncio.create_task(forever())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    peers.session = None
    await session.close()
