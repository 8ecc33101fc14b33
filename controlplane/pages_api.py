"""The pages listener: health and the fleet's state as JSON (the pages and
/metrics join it in their own issues). Nothing here writes to the registry."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from controlplane.agent_api import no_tracebacks
from controlplane.keys import REGISTRY
from controlplane.registry import NodeRegistry


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "nodes": len(request.app[REGISTRY])})


async def nodes(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    now = registry.clock()
    out: list[dict[str, Any]] = []
    for state in registry.nodes():
        age = state.age(now)
        fresh = state.fresh(now, registry.stale_after)
        out.append({
            "node": state.node,
            "state": "fresh" if fresh else "stale",
            "sample_age_seconds": None if age is None else round(age, 3),
            "heartbeats": state.heartbeats,
            "registration": state.registration,
            # A stale node's measurements are not shown as current.
            "heartbeat": state.heartbeat if fresh else None,
        })  # fmt: skip
    return web.json_response({"nodes": out})


def create_app(registry: NodeRegistry) -> web.Application:
    app = web.Application(middlewares=[no_tracebacks])
    app[REGISTRY] = registry
    app.router.add_get("/health", health)
    app.router.add_get("/api/nodes", nodes)
    return app
