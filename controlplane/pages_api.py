"""The pages listener: /metrics (the whole fleet for Prometheus), /health,
and the fleet's state as JSON. Nothing here writes to the registry but the
background task that forgets nodes gone for long."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import generate_latest

from controlplane.export.exposition import FleetExposition
from controlplane.export.own_metrics import ControlPlaneMetrics
from controlplane.history.backends import EmbeddedHistory, GridPart
from controlplane.history.heatmap import Part
from controlplane.ingest.agent_api import no_tracebacks
from controlplane.keys import EXPOSITION, METRICS, RECORDER, REGISTRY
from controlplane.listen.page_access import PAGE_ACCESS, PageAccess, add_headers, may_change_fleet, page_access
from controlplane.listen.page_worker import PAGE_WORKER, PageWorker, SharedAnswers, page_worker_ctx, shared
from controlplane.samples import hindsight
from controlplane.samples.hindsight import HINDSIGHT, HindsightFetches
from controlplane.samples.incidents import Incidents
from controlplane.samples.incidents import add_routes as add_incident_routes
from controlplane.samples.incidents import add_routes_when_off as add_incident_routes_when_off
from controlplane.samples.live import LIVE, LiveSamples, live_stream
from controlplane.state import registry_state
from controlplane.state.registry import NodeRegistry
from controlplane.state.registry_state import STATE_FILE

PRUNE_EVERY_S = 60.0
log = logging.getLogger(__name__)


def _scrape(exposition: FleetExposition, own: ControlPlaneMetrics) -> bytes:
    started = time.perf_counter()
    fleet = exposition.render()
    own.last_scrape_seconds = time.perf_counter() - started
    own.scrape_errors = exposition.errors
    return fleet.encode() + generate_latest(own.prometheus)


@shared()
async def metrics(request: web.Request) -> web.Response:
    body = await request.app[PAGE_WORKER].run(_scrape, request.app[EXPOSITION], request.app[METRICS], lane="scrape")
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "nodes": len(request.app[REGISTRY])})


# The fleet beyond this replica (controlplane/fleet/peers.py), when it has peers: given this
# replica's rows, the whole fleet's, with the peers whose rows did not come named
# (`view`: "nodes", rows as /api/nodes lists them; "cluster", as the cluster page does).
class FleetRows(Protocol):
    def __call__(self, own: list[dict[str, Any]], view: str = "nodes") -> Awaitable[dict[str, Any]]: ...


FLEET_ROWS = web.AppKey("fleet_rows", FleetRows)


# ... and the peers' parts of the fleet charts (controlplane/fleet/cluster_view.py), with why any did not come.
class FleetChartParts(Protocol):
    def __call__(self, end: float, span: float, step: float
                 ) -> Awaitable[tuple[list[list[dict[str, GridPart]]], list[str]]]: ...  # fmt: skip


FLEET_CHART_PARTS = web.AppKey("fleet_chart_parts", FleetChartParts)


# ... and the peers' parts of the fleet's picture (controlplane/history/heatmap.py), with why any did not come.
class HeatmapParts(Protocol):
    def __call__(self, measure: str, end: float, columns: int) -> Awaitable[tuple[list[Part], list[str]]]: ...


HEATMAP_PARTS = web.AppKey("heatmap_parts", HeatmapParts)


@shared("here")
async def nodes(request: web.Request) -> web.Response:
    """GET /api/nodes: every node of the fleet (with peers, theirs too: `?here=1`, this replica's alone)."""
    live = request.app.get(LIVE)  # read here, on the loop that changes it
    watched = {node: live.describe(node) for node in live.live_nodes()} if live is not None else {}
    worker = request.app[PAGE_WORKER]
    fleet = request.app.get(FLEET_ROWS)
    if fleet is None or request.query.get("here") == "1":
        body = (await worker.run(nodes_json, request.app[REGISTRY], watched)).encode()
    else:
        own = await worker.run(node_rows, request.app[REGISTRY], watched)
        # msgspec: a peer's rows hold what its nodes measured as it sent it (msgspec.Raw, controlplane/fleet/peers.py).
        body = await worker.run(msgspec.json.encode, await fleet(own))
    return web.Response(body=body, content_type="application/json")


def nodes_json(registry: NodeRegistry, watched: dict[str, dict[str, Any] | None] | None = None) -> str:
    return json.dumps({"nodes": node_rows(registry, watched)})


def node_rows(registry: NodeRegistry, watched: dict[str, dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    """Each node this replica knows, as `/api/nodes` lists it."""
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
            "registration": msgspec.to_builtins(state.registration),
            # A stale node's measurements are not shown as current.
            "heartbeat": state.received.as_json() if fresh and state.received is not None else None,
            # Watched live: its viewers and the samples kept (absent while nobody watches).
            **({"live": d} if (d := (watched or {}).get(state.node)) is not None else {}),
        })  # fmt: skip
    return out


async def forget_node(request: web.Request) -> web.Response:
    """DELETE /api/nodes/NODE: an operator removes a node that is gone for good
    (its series leave /metrics, so its NodeDown resolves). Only a user the
    web config names, or `nodesampler forget` through the admin socket
    (controlplane/listen/page_access.py): a loopback peer is no operator."""
    if not may_change_fleet(request):
        raise web.HTTPForbidden(text="forgetting a node needs a user of --web-config-file's basic_auth_users, "
                                     "or `nodesampler forget NODE` on the control plane's machine (--admin-socket)\n")
    node = request.match_info["node"]
    registry = request.app[REGISTRY]
    state = registry.get(node)
    if state is None:
        raise web.HTTPNotFound(text="no such node\n")
    # A node still heard from is not gone: its agent registers it again at its
    # next heartbeat, and `forget` said "forgot" while the agent logged that the
    # control plane had restarted. Refused unless forced.
    age = state.age(registry.clock())
    if age is not None and age <= registry.stale_after and request.query.get("force") not in ("1", "true"):
        raise web.HTTPConflict(text=f"{node} last heartbeat {age:.0f} s ago, within --stale-after "
                                    f"({registry.stale_after:g} s): its agent still runs and would register it "
                                    "again; stop the agent first, or force it (?force=1, `nodesampler forget "
                                    "--force`)\n")  # fmt: skip
    registry.forget(node)
    registry.remember_forgotten(node, registry.clock())  # told to the peers: a copy one kept goes too
    if (history := request.app.get(RECORDER)) is not None:
        history.forget(node)
    if (fetches := request.app.get(HINDSIGHT)) is not None:
        fetches.forget(node)
    log.info("node %s forgotten at an operator's request", node)
    if STATE_FILE in request.app:
        await registry_state.save(request.app)  # a forgotten node does not come back with a restart
    return web.json_response({"forgotten": node})


async def forget_gone_nodes(app: web.Application) -> AsyncIterator[None]:
    """A node silent for long is gone: it leaves the registry, and every series with it."""

    async def prune() -> None:
        while True:
            await asyncio.sleep(PRUNE_EVERY_S)
            for node in app[REGISTRY].forget_gone():
                if (history := app.get(RECORDER)) is not None:
                    history.forget(node)
                if (fetches := app.get(HINDSIGHT)) is not None:
                    fetches.forget(node)

    task = asyncio.create_task(prune())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def create_app(registry: NodeRegistry, own: ControlPlaneMetrics | None = None,
               history: EmbeddedHistory | None = None, state_file: Path | None = None,
               live: LiveSamples | None = None, access: PageAccess | None = None,
               share_for: float = 0.0, fetches: HindsightFetches | None = None,
               incidents: Incidents | None = None) -> web.Application:  # fmt: skip
    """`share_for`: seconds a rendered view serves the requests after it
    (controlplane/listen/page_worker.py's SharedAnswers); the control plane's is
    SHARE_FOR_S, 0 (the tests' default) shares only renders under way."""
    app = web.Application(middlewares=[no_tracebacks, page_access])
    if access is not None:
        app[PAGE_ACCESS] = access
        app.on_response_prepare.append(add_headers)
    if state_file is not None:
        registry_state.keep_state(app, state_file)
    app[REGISTRY] = registry
    if history is not None:
        app[RECORDER] = history
    app[METRICS] = own or ControlPlaneMetrics(registry)
    app[EXPOSITION] = FleetExposition(registry)
    app[PAGE_WORKER] = PageWorker(SharedAnswers(share_for, lambda: registry.generation))
    app.cleanup_ctx.append(page_worker_ctx)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/api/nodes", nodes)
    app.router.add_delete("/api/nodes/{node}", forget_node)
    if live is not None:
        app[LIVE] = live
        app.router.add_get("/node/{node}/live", live_stream)
    if fetches is not None:
        hindsight.add_routes(app, fetches)
    if incidents is not None:
        add_incident_routes(app, incidents)
    else:
        add_incident_routes_when_off(app)
    app.cleanup_ctx.append(forget_gone_nodes)
    return app
