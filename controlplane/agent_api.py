"""The agent-facing listener: registration and heartbeats.

Every request is authenticated (a bearer token naming the node it may speak
for), bounded in size, and validated field by field before anything in the
registry changes. Answers: 200; 400 with the field and the reason; 401 no
or bad token; 403 a token for another node; 404 a heartbeat for a node the
control plane does not know (register again); 413 a body over the limit.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from controlplane.history import EmbeddedHistory
from controlplane.keys import AUTHENTICATOR, METRICS, RECORDER, REGISTRY
from controlplane.live import LIVE, LiveSamples
from controlplane.node_identity import Forbidden, NodeAuthenticator, Unauthenticated
from controlplane.own_metrics import ControlPlaneMetrics
from controlplane.registry import NodeRegistry, UnknownNode
from nodesampler import wire

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


REASONS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "unknown_node", 413: "too_large",
           500: "internal_error"}  # fmt: skip


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


class _RefusalLog:
    """Why a token was refused, in the log: once a minute per reason, so that a
    misconfigured fleet (or a scanner) is seen without flooding the log."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def log(self, status: int, reason: str, remote: str | None) -> None:
        now = time.monotonic()
        if now - self._last.get(reason, -self.EVERY_S) < self.EVERY_S:
            return
        if len(self._last) > 1000:
            self._last.clear()
        self._last[reason] = now
        log.warning("token refused (%d) from %s: %s", status, remote, reason)


_refusals = _RefusalLog()


async def _checked_body(request: web.Request, parse: Callable[[bytes], wire.Json]) -> wire.Json | web.Response:
    """The request's body, authenticated, validated and spoken by its own node;
    or the answer refusing it (401, 400, 403). `parse` may leave out bad
    entries of a list (see `_parse_keeping`)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return _error(401, "missing bearer token")
    try:
        token_node = await request.app[AUTHENTICATOR].node(token.strip())
    except Unauthenticated as e:
        _refusals.log(401, str(e), request.remote)
        return _error(401, "invalid token")
    except Forbidden as e:
        _refusals.log(403, str(e), request.remote)
        return _error(403, str(e))
    try:
        body = parse(await request.read())
    except wire.WireError as e:
        return _error(400, e.reason, e.field)
    if body["node"] != token_node:
        return _error(403, f"token is for node {token_node!r}", "node")
    return body


_INDEX_ON = re.compile(r"\[\d+\].*")


def _parse_keeping(parse: Callable[[bytes, wire.Dropped], wire.Json],
                   dropped: wire.Dropped) -> Callable[[bytes], wire.Json]:  # fmt: skip
    return lambda data: parse(data, dropped)


def _answer(request: web.Request, body: dict[str, object], dropped: wire.Dropped) -> web.Response:
    """200, naming the entries left out; each counted by its list and reason."""
    if dropped:
        counter = request.app[METRICS].items_dropped
        for d in dropped:
            which = _INDEX_ON.sub("", d["field"])  # "shards[7].command" -> "shards": a bounded label
            counter.labels(f"{which}: {d['reason']}").inc()
        body["dropped"] = dropped[:100]
    return web.json_response(body)


async def register(request: web.Request) -> web.Response:
    dropped: wire.Dropped = []
    registration = await _checked_body(request, _parse_keeping(wire.parse_registration, dropped))
    if isinstance(registration, web.Response):
        return registration
    registry: NodeRegistry = request.app[REGISTRY]
    known = registry.get(registration["node"]) is not None
    registry.register(registration)
    if not known:
        log.info("node %s registered", registration["node"])
    return _answer(request, {"node": registration["node"], "stale_after": registry.stale_after}, dropped)


async def heartbeat(request: web.Request) -> web.Response:
    """A window's summary. While someone watches the node live, the answer
    asks for raw samples (`"raw": true`), and those that come are the live
    view's, never the registry's (controlplane/live.py)."""
    dropped: wire.Dropped = []
    live = request.app.get(LIVE)
    hb = await _checked_body(request, lambda data: wire.parse_heartbeat(data, dropped,
                                                                        live.wanted if live is not None else None))
    if isinstance(hb, web.Response):
        return hb
    came_raw = "raw" in hb
    raw = hb.pop("raw", None)
    try:
        request.app[REGISTRY].heartbeat(hb)
    except UnknownNode:
        return _error(404, "unknown node: register again")
    if (history := request.app.get(RECORDER)) is not None:
        history.record(hb["node"], hb)
    answer: dict[str, object] = {"ok": True}
    if came_raw:
        request.app[METRICS].live_heartbeats.labels("true" if raw is not None else "false").inc()
    if live is not None and live.wanted(hb["node"]):
        if raw is not None:
            live.record(hb["node"], hb, raw)
        answer["raw"] = True
    return _answer(request, answer, dropped)


def create_app(registry: NodeRegistry, auth: NodeAuthenticator | bytes, metrics: ControlPlaneMetrics | None = None,
               history: EmbeddedHistory | None = None, live: LiveSamples | None = None) -> web.Application:  # fmt: skip
    """`auth` verifies tokens; bytes are a cluster secret (HMAC node tokens only)."""
    app = web.Application(client_max_size=wire.MAX_BODY_BYTES, middlewares=[counted, no_tracebacks])
    app[REGISTRY] = registry
    app[AUTHENTICATOR] = auth if isinstance(auth, NodeAuthenticator) else NodeAuthenticator(secret=auth)
    app[METRICS] = metrics or ControlPlaneMetrics(registry)
    if history is not None:
        app[RECORDER] = history
    if live is not None:
        app[LIVE] = live
    app.router.add_post("/v1/register", register)
    app.router.add_post("/v1/heartbeat", heartbeat)
    return app
