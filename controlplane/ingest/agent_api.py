"""The agent-facing listener: registration and heartbeats.

Every request is authenticated (a bearer token naming the node it may speak
for), bounded in size, and validated field by field before anything in the
registry changes. Answers: 200; 400 with the field and the reason; 401 no
or bad token; 403 a token for another node; 404 a heartbeat for a node the
control plane does not know (register again); 409 a heartbeat whose `seq`
is not after the last one accepted since the node registered (a replay); 413
a body over the limit; 429 a node sending faster than `HEARTBEAT_RATE`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from aiohttp import web

import wire
from controlplane.export.own_metrics import ControlPlaneMetrics
from controlplane.history.backends import EmbeddedHistory
from controlplane.ingest.node_identity import Forbidden, NodeAuthenticator, Unauthenticated
from controlplane.keys import AUTHENTICATOR, METRICS, RECORDER, REGISTRY
from controlplane.listen.rate_limited_log import RateLimitedLog
from controlplane.samples.hindsight import HINDSIGHT, HindsightFetches
from controlplane.samples.incidents import INCIDENTS, Incidents
from controlplane.samples.live import LIVE, LiveSamples
from controlplane.state.registry import NodeRegistry, Received, UnknownNode

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body: dict[str, str] = {"error": message}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


@web.middleware
async def no_tracebacks(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unexpected error is logged here and answered 500 without details."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status == 413:
            return _error(413, f"body larger than {wire.MAX_BODY_BYTES} bytes")
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error")


REASONS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "unknown_node", 409: "replay",
           413: "too_large", 429: "rate_limited", 500: "internal_error"}  # fmt: skip
HEARTBEAT_RATE = 2  # a node's heartbeats a second, sustained (--max-heartbeats-per-second): an agent sends one per
#                     --interval (5 s by default)


class HeartbeatRate:
    """A token bucket per node: a valid token used to flood costs its node
    429s, not the control plane's time. The burst (five seconds' worth, at
    least 10) lets through a backlog after a pause and a re-registration's
    resend. One entry per node that has spoken (a token speaks for one
    node), pruned to the fleet's size. A rate of 0 is no limit (benchmarks)."""

    MAX_NODES = 100_000

    def __init__(self, rate: float = HEARTBEAT_RATE, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = rate, max(10.0, 5 * rate)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # node -> (tokens, when)

    def allow(self, node: str) -> bool:
        if not self.rate:
            return True
        now = self._clock()
        tokens, then = self._buckets.get(node, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if len(self._buckets) >= self.MAX_NODES and node not in self._buckets:
            self._buckets.clear()  # a bucket forgotten is a full one: generous, never wrong
        self._buckets[node] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1


HEARTBEAT_RATES = web.AppKey("heartbeat_rates", HeartbeatRate)


class Registered(Protocol):
    def __call__(self, node: str) -> None: ...


# Told of each node that registers here (controlplane/fleet/peers.py: a node that arrives from
# another replica is let go there at once, not at the next poll).
ON_REGISTERED = web.AppKey("on_registered", Registered)


@web.middleware
async def counted(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every agent request counted: accepted, or refused and why."""
    response = await handler(request)
    kind = request.path.rsplit("/", 1)[-1]
    if kind in ("register", "heartbeat"):
        metrics = request.app[METRICS]
        if response.status == 200:
            metrics.accepted.labels(kind).inc()
        elif (reason := REASONS.get(response.status)) is not None:
            metrics.rejected.labels(kind, reason).inc()
    return response


B = TypeVar("B")  # a body as its parser gives it
_refusals = RateLimitedLog("token refused", log)
_left_out = RateLimitedLog("heartbeat entry left out", log)


async def _checked_body(request: web.Request, parse: Callable[[bytes], B], node_of: Callable[[B], str],
                        admit: Callable[[str], web.Response | None] | None = None) -> B | web.Response:  # fmt: skip
    """The request's body, authenticated, validated and spoken by its own node;
    or the answer refusing it (401, 400, 403). `parse` may leave out bad
    entries of a list (see `_parse_keeping`)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return _error(401, "missing bearer token")
    if not (token.isascii() and token.strip().isprintable()):  # aiohttp keeps other bytes as surrogates
        _refusals.log("not printable ASCII", 401, "from", request.remote)
        return _error(401, "malformed bearer token")
    try:
        token_node = await request.app[AUTHENTICATOR].node(token.strip())
    except Unauthenticated as e:
        _refusals.log(str(e), 401, "from", request.remote)
        return _error(401, "invalid token")
    except Forbidden as e:
        _refusals.log(str(e), 403, "from", request.remote)
        return _error(403, str(e))
    data = await request.read()  # whole, within the request's deadline, before it is counted
    # The token's node is admitted before its body is parsed: a node past its rate costs no
    # parse (20 nodes sending 250 KB hindsight pieces at 4 a second, most of them 429s,
    # took heartbeats' p99 from 8 ms to 470 ms while each was parsed first).
    if admit is not None and (refused := admit(token_node)) is not None:
        return refused
    try:
        body = parse(data)
    except wire.WireError as e:
        return _error(400, e.reason, e.field)
    if node_of(body) != token_node:
        return _error(403, f"token is for node {token_node!r}", "node")
    return body


_INDEX = re.compile(r"\[\d+\]")
_FIELD = re.compile(r"[a-z0-9_]+(\[\])?(\.[a-z0-9_]+(\[\])?)*")


def field_category(field: str) -> str:
    """A field's path with its indices taken out ("shards[7].command" ->
    "shards[].command"): the schema's names alone, so a bounded label."""
    path = _INDEX.sub("[]", field)
    return path if len(path) <= 80 and _FIELD.fullmatch(path) else "other"


def _answer(request: web.Request, node: str, body: dict[str, object], dropped: wire.Dropped) -> web.Response:
    """200, naming the entries left out; each counted by its list and reason."""
    if dropped:
        counter = request.app[METRICS].items_dropped
        for d in dropped:
            # The field's path alone labels the count: the reason carries the
            # sender's numbers ("2 lengths but 3 values"), a new series each.
            field = field_category(d["field"])
            counter.labels(field).inc()
            _left_out.log(f"{d['field']}: {d['reason']}", "from", node, f"({field})")
        body["dropped"] = dropped[:100]
    if body == _OK:  # most answers: written once, not encoded at each
        return web.Response(body=_OK_BYTES, content_type="application/json")
    return web.json_response(body)


_OK: dict[str, object] = {"ok": True}
_OK_BYTES = json.dumps(_OK).encode()


async def register(request: web.Request) -> web.Response:
    dropped: wire.Dropped = []
    registration = await _checked_body(request, lambda data: wire.decode_registration(data, dropped),
                                       lambda r: r.node)  # fmt: skip
    if isinstance(registration, web.Response):
        return registration
    registry: NodeRegistry = request.app[REGISTRY]
    node = registration.node
    known = registry.get(node) is not None
    registry.register(registration)
    if not known:
        log.info("node %s registered", node)
    if (told := request.app.get(ON_REGISTERED)) is not None:
        told(node)
    # The rate this node's heartbeats are taken at: an agent whose --interval is
    # shorter lengthens its windows to fit, rather than meet 429s (0: no limit).
    rate = request.app[HEARTBEAT_RATES].rate
    return _answer(request, node, {"node": node, "stale_after": registry.stale_after,
                                   "max_heartbeats_per_second": rate}, dropped)  # fmt: skip


def _within_rate(rates: HeartbeatRate) -> Callable[[str], web.Response | None]:
    def admit(node: str) -> web.Response | None:
        if rates.allow(node):
            return None
        return _error(429, f"more than {rates.rate:g} heartbeats a second from this node")

    return admit


async def heartbeat(request: web.Request) -> web.Response:
    """A window's summary. While someone watches the node live, the answer
    asks for raw samples (`"raw": true`), and those that come are the live
    view's, never the registry's (controlplane/samples/live.py). While a span of
    the node's hindsight is asked for, the answer names it, and the pieces
    that come are the fetch's (controlplane/samples/hindsight.py)."""
    dropped: wire.Dropped = []
    live = request.app.get(LIVE)
    fetches = request.app.get(HINDSIGHT)
    decoded = await _checked_body(request, lambda data: wire.decode_heartbeat(
        data, dropped, live.wanted if live is not None else None, fetches.asked if fetches is not None else None),
        lambda d: d.heartbeat.node, _within_rate(request.app[HEARTBEAT_RATES]))  # fmt: skip
    if isinstance(decoded, web.Response):
        return decoded
    hb = decoded.heartbeat
    registry: NodeRegistry = request.app[REGISTRY]
    state = registry.get(hb.node)
    if state is not None and state.last_seq is not None and hb.seq <= state.last_seq:
        # The agent's resend of one whose answer it lost is the same refusal: it has it already.
        return _error(409, f"seq {hb.seq} is not after {state.last_seq}, the last since it registered: a replay",
                      "seq")  # fmt: skip
    incidents = request.app.get(INCIDENTS)
    before = _starved(state.received if state is not None else None) if incidents is not None else {}
    try:
        state = registry.heartbeat(hb)
    except UnknownNode:
        return _error(404, "unknown node: register again")
    if incidents is not None:  # an engine's starvation verdict turning on starts an incident
        incidents.verdicts_changed(hb.node, before, _starved(state.received), hb.window.start)
    state.last_seq = hb.seq
    if (history := request.app.get(RECORDER)) is not None and state.received is not None:
        history.record(hb.node, state.received)
    answer: dict[str, object] = {"ok": True}
    if decoded.raw_came:
        request.app[METRICS].live_heartbeats.labels("true" if decoded.raw is not None else "false").inc()
    if live is not None and live.wanted(hb.node):
        if decoded.raw is not None:
            live.record(hb.node, hb, decoded.raw)
        answer["raw"] = True
    if fetches is not None:
        if decoded.hindsight is not None:
            fetches.received(hb.node, decoded.hindsight)
        elif decoded.hindsight_came:  # a piece not of the span asked, or not one: left out whole
            foreign = fetches.asked(hb.node) is None or any(d["field"] == "hindsight.id" for d in dropped)
            fetches.refused_piece("not_asked" if foreign else "bad")
        if (span := fetches.asked(hb.node)) is not None:
            answer["hindsight"] = span.as_json()
    return _answer(request, hb.node, answer, dropped)


def _starved(received: Received | None) -> dict[str, bool]:
    """Each engine's verdict: starved of CPU, or held back by the host or by its card."""
    if received is None:
        return {}
    return {s.id: bool(v is not None and (v.cpu_starved or v.host_bound or v.card_held_back))
            for s, v in zip(received.shards, received.verdicts, strict=True)}  # fmt: skip


def create_app(registry: NodeRegistry, auth: NodeAuthenticator | bytes, metrics: ControlPlaneMetrics | None = None,
               history: EmbeddedHistory | None = None, live: LiveSamples | None = None,
               heartbeat_rate: float = HEARTBEAT_RATE, fetches: HindsightFetches | None = None,
               incidents: Incidents | None = None) -> web.Application:  # fmt: skip
    """`auth` verifies tokens; bytes are a cluster secret (HMAC node tokens only)."""
    app = web.Application(client_max_size=wire.MAX_BODY_BYTES, middlewares=[counted, no_tracebacks])
    app[REGISTRY] = registry
    app[AUTHENTICATOR] = auth if isinstance(auth, NodeAuthenticator) else NodeAuthenticator(secret=auth)
    app[METRICS] = metrics or ControlPlaneMetrics(registry)
    app[HEARTBEAT_RATES] = HeartbeatRate(heartbeat_rate, registry.clock)
    if history is not None:
        app[RECORDER] = history
    if live is not None:
        app[LIVE] = live
    if fetches is not None:
        app[HINDSIGHT] = fetches
    if incidents is not None:
        app[INCIDENTS] = incidents
    app.router.add_post("/v1/register", register)
    app.router.add_post("/v1/heartbeat", heartbeat)
    return app
