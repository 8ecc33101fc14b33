"""Replicas that share a fleet: each tells the others which nodes it holds,
so that a node is one series, at the replica that holds it.

A node is held by the replica its agent heartbeats to (sampler/agent/replicas.py);
when it moves (its replica went away, or came back), the replica it left
still knows it, stale, and would export it as down. Each replica asks its
peers (`--peer URL`, their pages listeners) every `POLL_S` which nodes they
hold and how long ago each last spoke (`GET /v1/peer/held`, an age on
the answering replica's own clock: no two replicas' clocks are compared),
and lets go of a node a peer heard from more recently than it did: the node
leaves its registry, `/metrics` and history, as a node forgotten does. The
replica that holds a node never lets it go, so a node down everywhere stays
with its last replica, down, and alerts. A node that registers at a replica
(an agent moving there) is also told to the peers at once (`POST
/v1/peer/arrived`, the arrivals of `ARRIVALS_EVERY_S` in one body a peer),
and a peer that has not heard from it for `ARRIVED_AFTER_S` lets it go then:
a moved node is up at two replicas for less than a scrape, not a poll.

Held lists carry every node a replica has heard from, fresh or stale, with
its age there, and the older copy lets go: a node that moved and then died
is down at exactly one replica, the one that heard it last. They carry the
nodes a replica forgot too (tombstones, NodeRegistry.forgotten), so that a
replica that was down or cut off when a node was forgotten lets its copy go.

Peers prove themselves on every request (controlplane/listen/peer_auth.py:
a challenge bound to the request, HMAC'd by each side), and only to the
URLs `--peer` (or its SRV record) names: nothing an answer says chooses
where a request goes. Every answer is read whole under its bound
(controlplane/listen/bodies.py) and decoded against a typed schema
(msgspec, as the heartbeat is); each peer is asked and judged on its own:
a malformed, huge or hostile answer marks that peer down with the reason
and changes nothing else. Polls, arrivals and alerts have a connection
pool of their own (`session`), apart from the forwarded pages and streams
(controlplane/fleet/forward.py), so no flood of viewers starves them.
A replica names itself with a random id in its requests, so the same
`--peer` list serves every replica, itself included.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import secrets
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import aiohttp
import msgspec
import yarl
from aiohttp import web

from controlplane.fleet.cluster_view import chart_grid, chart_parts, chart_parts_json, cluster_json, parse_chart_parts
from controlplane.history.backends import EmbeddedHistory, GridPart
from controlplane.history.heatmap import MAX_COLUMNS, MEASURES, Part, own_part, parse_part, part_json
from controlplane.listen.bodies import TooLarge, answer_body, request_body
from controlplane.listen.page_access import PEER_REQUEST, verify_peer
from controlplane.listen.peer_auth import CHALLENGE_PATH, HEADER, PROOF, PeerAuth
from controlplane.samples.hindsight import Refused as IncidentsRefused
from controlplane.samples.incidents import INCIDENTS
from controlplane.state.registry import NodeRegistry
from wire.discovery import REFRESH_S, Replicas
from wire.limits import NODE_ID

log = logging.getLogger(__name__)

POLL_S = 5.0  # a moved node leaves its former replica's /metrics within this and one scrape
TIMEOUT_S = 4.0
# Sized for the fleet replicas exist for: 30,000 nodes of 64-byte names over three replicas, every one
# of them in one replica's list (the other two down) at ~80 bytes an entry: 2.4 MB; with room.
MAX_FLEET_NODES = 60_000
MAX_ANSWER_BYTES = 8 * 2**20
MAX_CHALLENGE_BYTES = 1024
ARRIVALS_EVERY_S = 0.2  # arrivals told together: a replica's death moves thousands of nodes at once
MAX_ARRIVALS = MAX_FLEET_NODES  # node names in one telling (~4 MB at 64 bytes): more wait for the next
MAX_ARRIVALS_BODY = MAX_ARRIVALS * 70 + 1024
ARRIVED_AFTER_S = 1.0  # a node told arrived elsewhere is let go here if silent here this long
MAX_ALERTS_BODY = 2**20 + 64 * 1024  # Alertmanager's own body to /api/alertmanager, and its wrapping
ALERTS_TIMEOUT_S = 10.0  # a webhook's share (up to a megabyte) sent on and captured there: Alertmanager waits
MAX_FORWARD_ANSWER = 64 * 1024  # a peer's answer to forwarded alerts: an incident's id and its nodes
# A page waits this long for a peer's rows (10,000 GPU nodes' /api/nodes rows: seconds), then names it.
ROWS_TIMEOUT_S = 10.0
# Every peer's rows for one view together (a peer's share of them: this over the peers asked, at
# most MAX_ROWS_BYTES): 10,000 GPU nodes' cluster rows are ~4 MB, their /api/nodes rows ~50.
MAX_ROWS_BYTES = 64 * 2**20
MAX_ALL_ROWS_BYTES = 128 * 2**20
ROWS_SHARED_S = 1.0  # one fetch of the peers' rows serves every page view for this long
MAX_CHART_BYTES = 4 * 2**20  # the fleet charts' totals: a few groups of a few hundred instants
# The fleet's picture's parts: a name and a zlib-packed row of 720 levels a node (10 to 400 bytes in
# base64). Over all peers together: MAX_ALL_HEATMAP_BYTES packed, and MAX_FLEET_NODES rows inflated
# (43 MB of levels at 720 columns), whatever the peers' count.
MAX_HEATMAP_BYTES = 16 * 2**20
MAX_ALL_HEATMAP_BYTES = 32 * 2**20

NodeName = Annotated[str, msgspec.Meta(pattern=f"^{NODE_ID.pattern}$")]
Age = Annotated[float, msgspec.Meta(ge=0)]  # seconds; JSON has no infinity, and msgspec refuses 1e400
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Number = Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]
Text = Annotated[str, msgspec.Meta(max_length=256)]


class HeldAnswer(msgspec.Struct, forbid_unknown_fields=False):
    """GET /v1/peer/held: the replica's id, every node it has heard from with
    the seconds since, on its own clock (no two replicas' clocks compared)."""

    replica: Annotated[str, msgspec.Meta(max_length=64)]
    nodes: Annotated[list[tuple[NodeName, Age]], msgspec.Meta(max_length=MAX_FLEET_NODES)]
    # Nodes it forgot, with the seconds since: a copy heard from before that is forgotten here too.
    forgotten: Annotated[list[tuple[NodeName, Age]], msgspec.Meta(max_length=MAX_FLEET_NODES)] = []


class Arrivals(msgspec.Struct):
    replica: Annotated[str, msgspec.Meta(max_length=64)]
    nodes: Annotated[list[NodeName], msgspec.Meta(max_length=MAX_ARRIVALS)]


class NodeRow(msgspec.Struct, omit_defaults=True):
    """A node as a peer's `/api/nodes` lists it: what it measured passed on as it came (JSON, never HTML)."""

    node: NodeName
    state: Literal["fresh", "stale"]
    sample_age_seconds: Age | None = None
    heartbeats: Count = 0
    registration: msgspec.Raw = msgspec.Raw(b"null")
    heartbeat: msgspec.Raw = msgspec.Raw(b"null")
    live: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class ClusterRow(msgspec.Struct):
    """A node as a peer's cluster page lists it (controlplane/fleet/cluster_view.py's `cluster_row`)."""

    node: NodeName
    state: Literal["fresh", "stale"]
    sample_age_seconds: Age | None = None
    hostname: Text | None = None
    cpu: Number | None = None
    memory_used: Count | None = None
    memory_total: Count | None = None
    memory_share: Number | None = None
    load_1m: Number | None = None
    gpu_count: Count | None = None
    gpu_util: Number | None = None
    gpu_memory_used: Count | None = None
    gpu_memory_total: Count | None = None
    engines: Count | None = None
    cpu_starved: Count = 0
    host_bound: Count = 0


class NodeRows(msgspec.Struct):
    nodes: list[NodeRow]


class ClusterRows(msgspec.Struct):
    nodes: list[ClusterRow]


_HELD = msgspec.json.Decoder(HeldAnswer)
_NODE_ROWS = msgspec.json.Decoder(NodeRows)
_CLUSTER_ROWS = msgspec.json.Decoder(ClusterRows)


def rows_of(body: bytes, view: str) -> list[dict[str, Any]]:
    """A peer's rows, checked against their schema: msgspec.ValidationError (a ValueError) when any is not one."""
    rows: list[NodeRow] | list[ClusterRow] = (_CLUSTER_ROWS if view == "cluster" else _NODE_ROWS).decode(body).nodes
    return [{k: v for k, v in msgspec.structs.asdict(row).items() if v is not msgspec.UNSET} for row in rows]


@dataclass(eq=False)  # one a replica: each is itself (and a key)
class Peer:
    url: str
    instance: str | None = None  # its id, once it answered
    is_us: bool = False  # it answered with this replica's own id: it is this replica
    holds: dict[str, float] = field(default_factory=dict)  # node -> seconds since it last spoke there
    forgot: dict[str, float] = field(default_factory=dict)  # node -> seconds since it was forgotten there
    answered_at: float = 0.0  # when `holds` came (this replica's clock): its ages are older by now
    error: str | None = None  # why the last poll failed; None: it answered
    rows_error: str | None = None  # why its rows did not come for the last fleet view


def held_answer(registry: NodeRegistry, instance: str) -> bytes:
    """Every node this replica has heard from, fresh or stale, each with its
    age here; and the nodes it forgot, with the seconds since."""
    now = registry.clock()
    held = [(s.node, round(max(0.0, now - s.received_at), 3)) for s in registry.nodes() if s.received_at is not None]
    forgot = [(node, round(max(0.0, now - at), 3)) for node, at in registry.forgotten.items()]
    return msgspec.json.encode(HeldAnswer(instance, held, forgot))


def parse_held(body: bytes) -> HeldAnswer:
    """A peer's answer: its id, the nodes it has heard from with their ages,
    and those it forgot. ValueError (msgspec's) when any of it is not that:
    the peer is down with the reason, and nothing is let go on its word."""
    return _HELD.decode(body)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


class Peers:
    """This replica's peers, asked in turn; and the nodes it lets go."""

    def __init__(self, urls: list[str], secret: bytes, registry: NodeRegistry,
                 let_go: Callable[[str], None], ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.replicas = Replicas(urls, clock=registry.clock)  # given, or named by DNS SRV records (wire/discovery.py)
        self.peers = [Peer(url) for url in self.replicas.urls]
        self.instance = secrets.token_hex(8)  # this replica's id among its peers
        self.auth = PeerAuth(secret, self.instance)
        self.auth.candidates = [p.url for p in self.peers]
        self.registry, self.let_go, self.ssl_context = registry, let_go, ssl_context
        self.let_go_count = 0
        self.listening = asyncio.Event()  # set when this replica's listeners are up: polled at once
        self.serving = False  # its listeners are up (before: its own entry cannot answer)
        # While the control plane runs (`polled`): polls, arrivals, alerts, rows and parts; and the
        # forwarded pages and streams (controlplane/fleet/forward.py) on a pool of their own.
        self.session: aiohttp.ClientSession | None = None
        self.forwarding: aiohttp.ClientSession | None = None
        self._rows: dict[str, tuple[float, list[tuple[Peer, list[dict[str, Any]]]]]] = {}  # a view's, and when
        self._rows_lock = asyncio.Lock()
        self._arrivals: dict[str, None] = {}  # nodes that registered here, not yet told
        self._telling: asyncio.Task[None] | None = None

    # --- asking a peer ----------------------------------------------------------------------

    async def challenge(self, session: aiohttp.ClientSession, peer: Peer) -> str:
        """A challenge of `peer`'s own, for one request to it."""
        async with session.get(peer.url + CHALLENGE_PATH, ssl=self.ssl_context or True, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:  # fmt: skip
            if r.status != 200:
                raise ValueError(f"its challenge: HTTP {r.status}")
            challenge = msgspec.json.decode(await answer_body(r, MAX_CHALLENGE_BYTES), type=dict[str, str])
        if "challenge" not in challenge:
            raise ValueError("its challenge: not one")
        return challenge["challenge"]

    @contextlib.asynccontextmanager
    async def request(self, session: aiohttp.ClientSession, method: str, peer: Peer, path_qs: str, *,
                      user: str = "", viewer: str = "", headers: dict[str, str] | None = None,
                      data: bytes | None = None, timeout: aiohttp.ClientTimeout | None = None,
                      ) -> AsyncIterator[tuple[aiohttp.ClientResponse, str]]:  # fmt: skip
        """`method path_qs` at `peer`, signed for it alone (controlplane/listen/peer_auth.py):
        its answer (not read yet) and the challenge its proof is over."""
        challenge = await self.challenge(session, peer)
        signed = {**(headers or {}), HEADER: self.auth.sign(method, peer.url, path_qs, challenge, user, viewer)}
        # Sent as signed, byte for byte (encoded=True: yarl would quote it again), as the answerer reads it (raw_path).
        async with session.request(method, yarl.URL(peer.url + path_qs, encoded=True), headers=signed, data=data,
                                   allow_redirects=False,
                                   timeout=timeout or aiohttp.ClientTimeout(total=TIMEOUT_S),
                                   ssl=self.ssl_context or True) as answer:  # fmt: skip
            yield answer, challenge

    async def _get(self, session: aiohttp.ClientSession, peer: Peer, path_qs: str, most: int, seconds: float,
                   method: str = "GET", body: bytes | None = None) -> bytes:  # fmt: skip
        """A peer's answer, whole and proven: ValueError when it is not 200,
        over `most` bytes, or not from a replica that holds the secret."""
        headers = {"Content-Type": "application/json"} if body is not None else None
        async with self.request(session, method, peer, path_qs, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=seconds)) as (r, challenge):  # fmt: skip
            answer = await answer_body(r, most)
            if not self.auth.proven(r.headers.get(PROOF), challenge, r.status, answer):
                raise ValueError(f"HTTP {r.status} without a peer's proof: not a replica of this cluster")
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}: {answer[:200].decode(errors='replace')}")
        return answer

    # --- arrivals ---------------------------------------------------------------------------

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
            body = msgspec.json.encode(Arrivals(self.instance, nodes))
            await asyncio.gather(*(self._tell_one(p, body) for p in self.peers if not p.is_us))
        finally:
            self._telling = None
            if self._arrivals and self.session is not None:
                self._telling = asyncio.create_task(self._tell())

    async def _tell_one(self, peer: Peer, body: bytes) -> None:
        if self.session is None:
            return
        try:
            await self._get(self.session, peer, "/v1/peer/arrived", MAX_FORWARD_ANSWER, TIMEOUT_S, "POST", body)
        except Exception as e:  # noqa: BLE001 (it is down, slow or not a replica: the polls settle it)
            log.debug("telling %s of arrivals: %s", peer.url, _reason(e))

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

    # --- who holds a node -------------------------------------------------------------------

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

    def peer_at(self, url: str) -> Peer | None:
        return next((p for p in self.peers if p.url == url), None)

    async def forward_alerts(self, peer: str, body: dict[str, Any]) -> dict[str, Any]:
        """Alertmanager's alerts of nodes `peer` holds, for it to capture: its answer, or why there is none."""
        target = self.peer_at(peer)
        if self.session is None or target is None:
            return {"error": "not sent: " + ("the control plane is starting" if self.session is None
                                             else "not a peer of this replica")}  # fmt: skip
        try:
            text = await self._get(self.session, target, "/v1/peer/alerts", MAX_FORWARD_ANSWER, ALERTS_TIMEOUT_S,
                                   "POST", msgspec.json.encode(body))  # fmt: skip
            answer = msgspec.json.decode(text)
            return answer if isinstance(answer, dict) else {"error": "not an answer"}
        except Exception as e:  # noqa: BLE001 (whatever a peer did, it is that peer's answer alone)
            return {"error": _reason(e)}

    # --- polls ------------------------------------------------------------------------------

    async def discover(self) -> None:
        """The peers a DNS record names now, read again every `REFRESH_S`: a
        peer still named keeps what it said; one gone is no longer asked."""
        due = self.replicas.refreshed_at is None or self.registry.clock() - self.replicas.refreshed_at >= REFRESH_S
        if self.replicas.discovered and due and await self.replicas.refresh():
            known = {p.url: p for p in self.peers}
            self.peers = [known.get(url) or Peer(url) for url in self.replicas.urls]
            self.auth.candidates = [p.url for p in self.peers]
            log.info("peers now: %s", ", ".join(p.url for p in self.peers) or "none")

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """Every peer at once, each on its own; then what they said, settled."""
        await self.discover()
        await asyncio.gather(*(self._ask(session, p) for p in self.peers))
        self.settle()

    def settle(self) -> None:
        """Each node a peer heard from more recently than this replica did,
        let go (it moved there); each a peer forgot after this replica last
        heard from it, forgotten here too, with the moment it was forgotten
        (so a replica that was down when an operator forgot a node does not
        bring it back); and this replica's own tombstone of a node a peer
        heard from since, dropped (the node came back)."""
        now = self.registry.clock()
        answered = [p for p in self.peers if not p.is_us and p.error is None]
        for state in self.registry.nodes():
            ours = math.inf if state.received_at is None else now - state.received_at
            for peer in answered:
                late = now - peer.answered_at  # its ages are older by now
                theirs, forgot = peer.holds.get(state.node), peer.forgot.get(state.node)
                if theirs is not None and theirs + late < ours:
                    log.info("node %s is held by %s (it spoke there %.1f s ago, here %.1f s ago): let go",
                             state.node, peer.url, theirs + late, ours)  # fmt: skip
                    self.let_go(state.node)
                    self.let_go_count += 1
                    break
                if forgot is not None and forgot + late < ours:
                    log.info("node %s was forgotten at %s %.1f s ago, after it last spoke here (%.1f s ago): "
                             "forgotten here too", state.node, peer.url, forgot + late, ours)  # fmt: skip
                    self.let_go(state.node)
                    self.registry.remember_forgotten(state.node, now - (forgot + late))
                    break
        for node, at in list(self.registry.forgotten.items()):
            if any(p.holds.get(node, math.inf) + (now - p.answered_at) < now - at for p in answered):
                del self.registry.forgotten[node]  # heard from since, at a peer: it came back
        for peer in answered:  # a tombstone that reached this replica is told on by it too
            for node, forgot in peer.forgot.items():
                age = forgot + now - peer.answered_at
                if self.registry.get(node) is None and node not in self.registry.forgotten and not any(
                        p.holds.get(node, math.inf) + (now - p.answered_at) < age for p in answered):  # fmt: skip
                    self.registry.remember_forgotten(node, now - age)

    def heard(self, peer: Peer, body: bytes | None, error: str | None = None) -> None:
        """`peer`'s held answer (`body`), or why there is none (`error`)."""
        if body is not None:
            try:
                answer = parse_held(body)
                peer.instance, peer.is_us = answer.replica, answer.replica == self.instance
                peer.holds, peer.forgot = dict(answer.nodes), dict(answer.forgotten)
                peer.answered_at = self.registry.clock()
            except ValueError as e:
                error = _reason(e)
        if error is not None:
            peer.holds, peer.forgot = {}, {}  # what it held is not known now: nothing is let go on its word
        if error != peer.error and not peer.is_us:
            if error is None:
                log.info("peer %s answers", peer.url)
            elif not self.serving and peer.instance is None:
                # The poll before this replica listens: its own entry cannot answer yet.
                log.info("peer %s: %s (asked again once this replica listens)", peer.url, error)
            else:
                log.warning("peer %s: %s", peer.url, error)
        peer.error = error

    async def _ask(self, session: aiohttp.ClientSession, peer: Peer) -> None:
        try:
            body = await self._get(session, peer, "/v1/peer/held", MAX_ANSWER_BYTES, TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 (a peer's fault of any kind is that peer's alone)
            self.heard(peer, None, _reason(e))
            return
        self.heard(peer, body)

    # --- the fleet's views ------------------------------------------------------------------

    async def fleet_rows(self, view: str = "nodes") -> list[tuple[Peer, list[dict[str, Any]]]]:
        """Every other peer's rows of its own nodes (`view`: "nodes", as
        `/api/nodes` lists them; "cluster", as the cluster page does), fetched
        at once and bounded in time and size, all of them together; a peer
        whose rows did not come has none, and its `rows_error` says why.
        Shared for `ROWS_SHARED_S`: a flood of page views asks the peers once a second."""
        async with self._rows_lock:
            now = self.registry.clock()
            shared = self._rows.get(view)
            if shared is not None and now - shared[0] < ROWS_SHARED_S:
                return shared[1]
            peers = [p for p in self.peers if not p.is_us]
            most = min(MAX_ROWS_BYTES, MAX_ALL_ROWS_BYTES // max(1, len(peers)))
            got = await asyncio.gather(*(self._fetch_rows(p, view, most) for p in peers))
            rows = self._rows[view] = (self.registry.clock(), list(zip(peers, got, strict=True)))
            return rows[1]

    async def _fetch_rows(self, peer: Peer, view: str, most: int) -> list[dict[str, Any]]:
        if self.session is None:
            peer.rows_error = "not asked: the control plane is starting"
            return []
        try:
            path = "/v1/peer/nodes" + ("?view=cluster" if view == "cluster" else "")
            body = await self._get(self.session, peer, path, most, ROWS_TIMEOUT_S)
            rows = await asyncio.get_running_loop().run_in_executor(None, rows_of, body, view)
            peer.rows_error = None
            return rows
        except Exception as e:  # noqa: BLE001 (a peer's rows of any kind are that peer's alone)
            peer.rows_error = _reason(e)
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
            body = await peers._get(peers.session, peer, f"/v1/peer/fleet-charts?{query}", MAX_CHART_BYTES,
                                    ROWS_TIMEOUT_S)  # fmt: skip
            return parse_chart_parts(msgspec.json.decode(body), steps)
        except Exception as e:  # noqa: BLE001 (that peer's part alone)
            return f"{peer.url}: {_reason(e)}"

    got = await asyncio.gather(*(one(p) for p in peers.peers if not p.is_us))
    return [g for g in got if not isinstance(g, str)], [g for g in got if isinstance(g, str)]


async def heatmap_parts(peers: Peers, measure: str, end: float, columns: int) -> tuple[list[Part], list[str]]:
    """Every other peer's part of the fleet's picture (its own nodes' levels on
    the grid), fetched at once; bounded over all peers together: packed bytes
    (`MAX_ALL_HEATMAP_BYTES`, shared out) and rows inflated (`MAX_FLEET_NODES`,
    taken in turn as parts come); and, for each peer whose part did not come, why."""
    query = urllib.parse.urlencode({"measure": measure, "end": repr(end), "columns": columns})
    asked = [p for p in peers.peers if not p.is_us]
    most = min(MAX_HEATMAP_BYTES, MAX_ALL_HEATMAP_BYTES // max(1, len(asked)))
    rows_left = [MAX_FLEET_NODES]

    def parse(body: bytes) -> Part:
        value = msgspec.json.decode(body)
        names = value.get("nodes") if isinstance(value, dict) else None
        count = len(names) if isinstance(names, list) else 0
        if count > rows_left[0]:
            raise ValueError(f"{count} rows, over the {MAX_FLEET_NODES} the whole picture holds")
        rows_left[0] -= count  # taken before inflating: two parts at once cannot both have it
        return parse_part(value, columns)

    async def one(peer: Peer) -> Part | str:
        if peers.session is None:
            return f"{peer.url}: not asked: the control plane is starting"
        try:
            body = await peers._get(peers.session, peer, f"/v1/peer/heatmap?{query}", most, ROWS_TIMEOUT_S)
            return await asyncio.get_running_loop().run_in_executor(None, parse, body)
        except Exception as e:  # noqa: BLE001 (that peer's part alone)
            return f"{peer.url}: {_reason(e)}"

    got = await asyncio.gather(*(one(p) for p in asked))
    return [g for g in got if not isinstance(g, str)], [g for g in got if isinstance(g, str)]


# --- the routes a peer asks -------------------------------------------------------------


def _proven(request: web.Request, body: bytes, content_type: str = "application/json",
            status: int = 200) -> web.Response:  # fmt: skip
    """An answer to a peer, with the proof that this replica made it, over its body."""
    peer = request[PEER_REQUEST]
    proof = request.app[PEERS].auth.prove(peer.challenge, status, body)
    return web.Response(body=body, status=status, content_type=content_type, headers={PROOF: proof})


def _proven_json(request: web.Request, value: Any, status: int = 200) -> web.Response:
    return _proven(request, msgspec.json.encode(value), status=status)


def _refused(request: web.Request) -> web.Response | None:
    """None for a peer's request that verifies (the pages' middleware may have checked it already)."""
    why = verify_peer(request, request.app[PEERS].auth)
    if why is not None:
        return web.json_response({"error": why.strip()}, status=401)
    return None


async def challenge(request: web.Request) -> web.Response:
    """GET /v1/peer/challenge: open to all, like /health (controlplane/listen/peer_auth.py)."""
    return web.json_response({"challenge": request.app[PEERS].auth.challenge()})


async def heatmap_part(request: web.Request) -> web.Response:
    """GET /v1/peer/heatmap?measure=M&end=T&columns=C, for a peer: this
    replica's own nodes in the fleet's picture (controlplane/history/heatmap.py)."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        measure = MEASURES[request.query["measure"]]
        end, columns = float(request.query["end"]), int(request.query["columns"])
        if not math.isfinite(end) or not 1 <= columns <= MAX_COLUMNS:
            raise ValueError(f"end: finite; columns: 1 to {MAX_COLUMNS}")
    except (KeyError, ValueError) as e:
        return _proven_json(request, {"error": f"{type(e).__name__}: {e}"[:200]}, 400)
    history = request.app[PEER_HISTORY]
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: part_json(own_part(history, measure, end, columns)))
    return _proven(request, body)


async def fleet_charts(request: web.Request) -> web.Response:
    """GET /v1/peer/fleet-charts?end=T&span=S&step=D, for a peer: this
    replica's own nodes' totals of each fleet chart (controlplane/fleet/cluster_view.py)."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        end, span, step = (float(request.query[k]) for k in ("end", "span", "step"))
        chart_grid(end, span, step)
    except (KeyError, ValueError) as e:
        return _proven_json(request, {"error": str(e)[:200]}, 400)
    history = request.app[PEER_HISTORY]
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: chart_parts_json(chart_parts(history, end, span, step)))
    return _proven(request, body.encode())


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
    return _proven(request, body.encode())


async def held(request: web.Request) -> web.Response:
    """GET /v1/peer/held, for a peer."""
    if (refused := _refused(request)) is not None:
        return refused
    peers = request.app[PEERS]
    return _proven(request, held_answer(peers.registry, peers.instance))


async def arrived(request: web.Request) -> web.Response:
    """POST /v1/peer/arrived, from a peer: `{"replica": ID, "nodes": [...]}`, nodes that registered there."""
    if (refused := _refused(request)) is not None:
        return refused
    try:
        told = msgspec.json.decode(await request_body(request, MAX_ARRIVALS_BODY), type=Arrivals)
        if told.replica == request.app[PEERS].instance:
            raise ValueError("this replica's own arrivals")
    except (ValueError, TooLarge) as e:
        return _proven_json(request, {"error": str(e)[:200]}, 400)
    return _proven_json(request, {"let_go": request.app[PEERS].told_arrived(told.nodes)})


async def alerts(request: web.Request) -> web.Response:
    """POST /v1/peer/alerts, from a peer: Alertmanager's alerts of nodes this
    replica holds, captured here as if Alertmanager had sent them (and sent
    on no further: a peer that thinks otherwise answers for what it holds)."""
    if (refused := _refused(request)) is not None:
        return refused
    incidents = request.app.get(INCIDENTS)
    if incidents is None:
        return _proven_json(request, {"error": "this replica keeps no incidents (--incidents-dir)"}, 503)
    try:
        body = msgspec.json.decode(await request_body(request, MAX_ALERTS_BODY))
        return _proven_json(request, incidents.alerts(body))
    except (ValueError, RecursionError) as e:
        return _proven_json(request, {"error": str(e)[:200]}, 400)
    except IncidentsRefused as e:
        return _proven_json(request, {"error": str(e)[:200]}, e.status)


class OwnRows(Protocol):
    def __call__(self) -> str: ...


PEER_ROWS = web.AppKey("peer_rows", OwnRows)
PEER_CLUSTER_ROWS = web.AppKey("peer_cluster_rows", OwnRows)
PEER_HISTORY = web.AppKey("peer_history", EmbeddedHistory)
PEERS = web.AppKey("peers", Peers)


def add_routes(app: web.Application, peers: Peers, own_rows: OwnRows, history: EmbeddedHistory | None = None) -> None:
    """The peers' routes on the pages listener, which `--peer` names;
    `own_rows`: this replica's nodes as `/api/nodes` writes them (made on a
    thread, as the cluster page's rows are); `history`: the embedded one,
    whose part of the fleet charts a peer asks for (none with --prometheus:
    Prometheus has the fleet)."""
    app[PEERS] = peers
    app[PEER_ROWS] = own_rows
    app[PEER_CLUSTER_ROWS] = functools.partial(cluster_json, peers.registry)
    app.router.add_get(CHALLENGE_PATH, challenge)
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
    # The forwarded pages' own pool (aiohttp's 100 connections): 100 live views through this
    # replica once took the pool the polls shared, and every peer looked down.
    forwarding = peers.forwarding = aiohttp.ClientSession()

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
    peers.session = peers.forwarding = None
    await session.close()
    await forwarding.close()
