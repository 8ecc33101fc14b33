"""The cluster page and the node pages, on the pages listener.

Pages are rendered on the server (jinja2, autoescaped: every hostname, model
and label is text, never markup) with SVG charts. Each page refreshes in
place: a small script fetches `?fragment=1` every 15 s and swaps the page's
<main>, so figures and charts change while the page, and its scroll, stay.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import jinja2
from aiohttp import web

import wire
from controlplane.fleet.cluster_view import FLEET_CHARTS, chart_end, chart_parts, cluster_rows, fleet_summary
from controlplane.history.backends import (
    ChartSpec,
    EmbeddedHistory,
    GridPart,
    HistoryError,
    PrometheusHistory,
    Series,
    combine,
    step_grid,
)
from controlplane.keys import HISTORY, REGISTRY
from controlplane.listen.page_worker import PAGE_WORKER, PageWorker, page_worker_ctx, shared
from controlplane.pages_api import FLEET_CHART_PARTS, FLEET_ROWS
from controlplane.samples.hindsight import HINDSIGHT
from controlplane.samples.incidents import INCIDENTS
from controlplane.samples.live import LIVE
from controlplane.state.registry import NodeRegistry, NodeState
from controlplane.state.starvation import Verdict
from web.charts import WIDTH, WIDTHS, chart_note, columns, format_value, svg_chart
from web.heatmap_view import add_heatmap, heatmap_context, heatmap_rows
from wire.schema import Gpu, Machine, Shard

PROMETHEUS_URL = web.AppKey("prometheus_url", str)
TEMPLATES = web.AppKey("templates", jinja2.Environment)

SPAN_S = 3600.0
REFRESH_S = 15
PAGE_ROWS = 100  # a thousand nodes are ten pages, not one page a browser renders slowly
DASH = "—"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return DASH
    return format_value(float(value), unit)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)  # fmt: skip
    env.filters["fmt"] = _fmt
    env.filters["pct"] = lambda v: DASH if v is None else f"{v:.1f}%"
    env.filters["num"] = lambda v, digits=2: DASH if v is None else f"{v:.{digits}f}"
    env.filters["age"] = lambda v: DASH if v is None else (f"{v:.0f} s" if v < 120 else f"{v / 60:.0f} min")
    env.globals["held_back"] = _held_back
    return env


# A card's clock-event reasons as its row names them (sampler/gpu/gpm.py's CLOCK_EVENTS).
HELD_BACK_BY = (("sw_power_cap", "power cap"), ("power_brake", "power brake"), ("hw_slowdown", "hw slowdown"),
                ("sw_thermal_slowdown", "thermal"), ("hw_thermal_slowdown", "hw thermal"), ("sync_boost", "sync boost"))


def _held_back(g: Gpu) -> str:
    """The reason that held the card's clocks back longest in the window, and
    its share; "none" when measured and never; a dash where the card does not say."""
    shares = [(getattr(g, f"clock_event_{reason}_ratio"), name) for reason, name in HELD_BACK_BY]
    measured = [(share, name) for share, name in shares if share is not None]
    if not measured:
        return DASH
    share, name = max(measured, key=lambda m: m[0])
    return f"{name} {100 * share:.0f}%" if share > 0 else "none"


def _verdict(verdict: Verdict | None) -> dict[str, str] | None:
    """What the engine table says of the control plane's verdict (controlplane/state/starvation.py)."""
    if verdict is None:
        return None  # not judged: neither a quota nor a run-queue wait was measured
    if verdict.host_bound:
        return {"kind": "host-bound", "why": verdict.why}
    if verdict.cpu_starved:
        return {"kind": "CPU-starved", "why": verdict.why}
    if verdict.card_held_back:
        return {"kind": "card held back", "why": verdict.why}
    return {"kind": "ok", "why": ""}


def _engine(s: Shard, verdict: Verdict | None, cpus: int | None) -> dict[str, Any]:
    cores = None if s.cpu_cores is None else s.cpu_cores.mean
    return {"shard": s.id, "model": s.model, "replica": s.replica, "cores": cores,
            "namespace": s.namespace, "pod": s.pod, "container": s.container,
            "cores_max": None if s.cpu_cores is None else s.cpu_cores.max,
            "share": None if cores is None or not cpus else min(1.0, cores / cpus),
            "memory": s.memory_bytes, "gpu_memory": s.gpu_memory_bytes,
            "command": s.command, "quota": s.cpu_quota_cores,
            "throttled": None if s.cpu_throttled_ratio is None else 100 * s.cpu_throttled_ratio,
            "threads": s.threads, "gpu_busy": s.gpu_utilization_percent,
            "waiting": s.requests_waiting, "running": s.requests_running,
            "kv_cache": s.kv_cache_usage_ratio, "verdict": _verdict(verdict)}  # fmt: skip


def _node_view(state: NodeState, now: float, stale_after: float) -> dict[str, Any]:
    fresh = state.fresh(now, stale_after)
    got = state.received if fresh else None  # a stale node's figures are not current: dashes
    hb = got.heartbeat if got is not None else None
    m = hb.machine if hb is not None else Machine()
    cpus = m.cpus or state.registration.cpus
    all_gpus: tuple[Gpu, ...] = (hb.gpus if hb is not None else None) or ()
    gpus = [g for g in all_gpus if not g.lost]
    utils = [g.utilization_percent for g in gpus if g.utilization_percent is not None]
    used = [g.memory_used_bytes for g in gpus if g.memory_used_bytes is not None]
    total = [g.memory_total_bytes for g in gpus if g.memory_total_bytes is not None]
    mem_total, mem_used = m.memory_bytes, m.memory_used_bytes
    engines = [] if got is None else [_engine(s, v, cpus) for s, v in zip(got.shards, got.verdicts, strict=True)]
    load = None if m.load is None else {"1m": m.load.one, "5m": m.load.five, "15m": m.load.fifteen}
    return {
        "node": state.node, "state": "fresh" if fresh else "stale", "age": state.age(now),
        "registration": state.registration, "backend": None if hb is None else hb.backend,
        "cpu": None if m.cpu_percent is None else m.cpu_percent.mean,
        "cpu_max": None if m.cpu_percent is None else m.cpu_percent.max,
        "cpus": cpus, "load": load, "memory_used": mem_used, "memory_total": mem_total,
        "memory_share": None if mem_used is None or not mem_total else mem_used / mem_total,
        "disks": m.disks, "gpus": all_gpus, "gpu_count": len(gpus),
        "gpu_util": sum(utils) / len(utils) if utils else None,
        "gpu_memory_used": sum(used) if used else None, "gpu_memory_total": sum(total) if total else None,
        "engines": engines,
    }  # fmt: skip


Specs = list[tuple[str, list[tuple[ChartSpec, str]], str, float | None]]


def _labelled(series: list[Series], label: str) -> list[Series]:
    for s in series:
        s.label = " ".join(x for x in (label, s.label) if x)
    return series


def _embedded_charts(history: EmbeddedHistory, specs: Specs, now: float, width: int) -> tuple[list[str], list[str]]:
    """On the page thread: the embedded history read and drawn."""
    step = SPAN_S / columns(width)
    read = [(title, [s for spec, label in parts
                     for s in _labelled(history.query_now(spec, now - SPAN_S, now, step), label)],
             unit, y_max) for title, parts, unit, y_max in specs]  # fmt: skip
    return _draw(read, now, width), []


def _draw(read: list[tuple[str, list[Series], str, float | None]], now: float, width: int = WIDTH) -> list[str]:
    return [svg_chart(title, series, now - SPAN_S, now, unit, y_max, width=width)
            for title, series, unit, y_max in read]  # fmt: skip


def chart_width(request: web.Request) -> int:
    """`?width=`: the width the page's script draws its charts at (one of WIDTHS); 400 otherwise."""
    value = request.query.get("width")
    if value is None:
        return WIDTH
    if value not in {str(w) for w in WIDTHS}:
        raise web.HTTPBadRequest(text=f"width: one of {', '.join(map(str, WIDTHS))}")
    return int(value)


async def _charts(app: web.Application, specs: Specs, now: float, width: int = WIDTH) -> tuple[list[str], list[str]]:
    """SVG for each chart; the reasons history could not be read, if any. The
    drawing, and the embedded history's reading, are done on the page thread."""
    history = app[HISTORY]
    if isinstance(history, EmbeddedHistory):
        return await app[PAGE_WORKER].run(_embedded_charts, history, specs, now, width)
    read, errors = [], []
    for title, parts, unit, y_max in specs:
        series: list[Series] = []
        try:
            for spec, label in parts:
                # One point a column: no finer than the chart can draw (a
                # Prometheus range query answers every step from its lookback).
                series += _labelled(await history.query(spec, now - SPAN_S, now, SPAN_S / columns(width)), label)
        except HistoryError as e:
            if str(e) not in errors:
                errors.append(str(e))
            continue
        read.append((title, series, unit, y_max))
    return await app[PAGE_WORKER].run(_draw, read, now, width), errors


def _shard_specs(node: str, shard: str, view: dict[str, Any]) -> tuple[Specs, list[str]]:
    """One engine's hour: the charts a row of the engines table links to, and
    the lines that stand for those it has nothing to draw in."""
    f = (("node", node), ("shard", shard))
    specs: Specs = [
        (f"CPU cores of {shard} (window mean, and window max)",
         [(ChartSpec("llmgw_shard_cpu_cores", f), "mean"), (ChartSpec("llmgw_shard_cpu_cores_max", f), "max")],
         "cores", None),
        (f"Memory of {shard}", [(ChartSpec("llmgw_shard_memory_bytes", f), "resident"),
                                (ChartSpec("llmgw_shard_gpu_memory_bytes", f), "GPU")], "bytes", None),
    ]  # fmt: skip
    title = f"Requests waiting in {shard}"
    if any(e["shard"] == shard and e["waiting"] is not None for e in view["engines"]):
        specs.append((title, [(ChartSpec("llmgw_shard_requests_waiting", f), "waiting"),
                              (ChartSpec("llmgw_shard_requests_running", f), "running")],
                      "requests", None))  # fmt: skip
        return specs, []
    return specs, [chart_note(title, "this engine exports no queue (its metrics_url gives one)")]


def _node_specs(node: str, view: dict[str, Any]) -> tuple[Specs, list[str]]:
    f = (("node", node),)
    specs: Specs = [
        ("CPU (window mean, and window max so bursts show)",
         [(ChartSpec("llmgw_node_cpu_utilization_percent", f), "mean"),
          (ChartSpec("llmgw_node_cpu_utilization_max_percent", f), "max")], "percent", 100.0),
        ("Memory used", [(ChartSpec("llmgw_node_memory_used_bytes", f), "used"),
                         (ChartSpec("llmgw_node_memory_bytes", f), "total")], "bytes", None),
        ("Load", [(ChartSpec("llmgw_node_load", f, ("window",)), "")], "load", None),
        ("CPU cores by model", [(ChartSpec("llmgw_shard_cpu_cores", f, ("model",)), "")], "cores", None),
        ("Memory by model", [(ChartSpec("llmgw_shard_memory_bytes", f, ("model",)), "")], "bytes", None),
        ("Wait for a CPU by engine (p99 where the kernel histogram runs; mean per timeslice)",
         [(ChartSpec("llmgw_shard_runqueue_wait_seconds", (*f, ("quantile", "0.99")), ("shard",), "max"), "p99"),
          (ChartSpec("llmgw_shard_runqueue_wait_per_slice_seconds", f, ("shard",), "max"), "mean")],
         "seconds", None),
    ]  # fmt: skip
    # The queue: the router's per replica (the seed's chart; Prometheus only), the
    # replicas those on this node now, and the engines' own from their metrics.
    # Drawn where an engine here exports its queue or a router may have its replicas'.
    queue = [(ChartSpec("llmgw_shard_requests_waiting", f, ("shard",)), "engine")]
    replicas = tuple(sorted({e["replica"] for e in view["engines"] if e["replica"]}))
    if replicas:
        queue.insert(0, (ChartSpec("llmgw_endpoint_waiting", (), ("replica",), one_of=(("replica", replicas),)),
                         "router"))  # fmt: skip
    notes = []
    title = "Requests waiting (the router's per replica; each engine's own)"
    if replicas or any(e["waiting"] is not None for e in view["engines"]):
        specs.append((title, queue, "requests", None))
    else:
        notes.append(chart_note("Requests waiting", "no engine here exports a queue (an engine's metrics_url "
                                                    "gives one)"))  # fmt: skip
    if view["gpus"]:
        specs += [
            ("GPU utilisation by card", [(ChartSpec("llmgw_gpu_utilization_percent", f, ("gpu",)), "GPU")],
             "percent", 100.0),
            ("GPU memory used by card", [(ChartSpec("llmgw_gpu_memory_used_bytes", f, ("gpu",)), "GPU")],
             "bytes", None),
            ("GPU temperature by card", [(ChartSpec("llmgw_gpu_temperature_celsius", f, ("gpu",)), "GPU")],
             "celsius", None),
            ("GPU power by card", [(ChartSpec("llmgw_gpu_power_watts", f, ("gpu",)), "GPU")], "watts", None),
        ]  # fmt: skip
    if any(g.sm_activity_percent is not None for g in view["gpus"]):  # a card with GPM: what its SMs did
        specs.append(("GPU SMs busy by card (GPM; utilisation says only that a kernel ran)",
                      [(ChartSpec("llmgw_gpu_sm_active_ratio", f, ("gpu",)), "GPU")], "ratio", 1.0))  # fmt: skip
    return specs, notes


FLEET_SPECS: Specs = [
    ("GPU utilisation by GPU model (mean of cards)", [(FLEET_CHARTS[0], "")], "percent", 100.0),
    ("GPU memory used by GPU model (all cards)", [(FLEET_CHARTS[1], "")], "bytes", None),
]  # fmt: skip


FleetParts = tuple[list[list[dict[str, GridPart]]], list[str]]  # every replica's parts of each chart; who is missing


class FleetChartsKept:
    """The fleet's chart parts (this replica's and its peers') by grid end,
    summed once a step (`chart_end`) in the background. A view draws the
    newest summed: while a step's parts are summed (about half a second at
    10,000 GPU nodes over three replicas), the step before's, so no view
    waits for the sum and the charts lag a step at most."""

    def __init__(self) -> None:
        self.ready: dict[float, FleetParts] = {}
        self.summing: asyncio.Task[None] | None = None

    async def newest(self, app: web.Application, history: EmbeddedHistory, end: float,
                     step: float) -> tuple[float, FleetParts]:  # fmt: skip
        if end not in self.ready and (self.summing is None or self.summing.done()):
            self.summing = asyncio.create_task(self._sum(app, history, end, step))
        if end not in self.ready and end - step not in self.ready and self.summing is not None:
            await asyncio.shield(self.summing)  # none kept near enough: this view waits
        newest = end if end in self.ready else end - step if end - step in self.ready else max(self.ready)
        return newest, self.ready[newest]

    async def _sum(self, app: web.Application, history: EmbeddedHistory, end: float, step: float) -> None:
        own, (theirs, missing) = await asyncio.gather(app[PAGE_WORKER].run(chart_parts, history, end, SPAN_S, step),
                                                      app[FLEET_CHART_PARTS](end, SPAN_S, step))  # fmt: skip
        self.ready[end] = ([own, *theirs], missing)
        for old in sorted(self.ready)[:-2]:
            del self.ready[old]

    def close(self) -> None:
        if self.summing is not None:
            self.summing.cancel()


FLEET_CHARTS_KEPT = web.AppKey("fleet_charts_kept", FleetChartsKept)


async def _fleet_charts(app: web.Application, history: EmbeddedHistory, now: float,
                       width: int = WIDTH) -> tuple[list[str], list[str]]:  # fmt: skip
    """The fleet charts with peers and the embedded history: each replica's
    totals for its own nodes, added; a peer whose totals did not come named.
    Their grid is the default width's whatever the page's (peers keep one
    grid a step); a wider chart draws its columns wider."""
    step = SPAN_S / columns()
    end, (parts, missing) = await app[FLEET_CHARTS_KEPT].newest(app, history, chart_end(now, step), step)
    grid = step_grid(end - SPAN_S, end, step)
    read = [(title, combine(spec, grid, [part[i] for part in parts]), unit, y_max)
            for i, (title, [(spec, _)], unit, y_max) in enumerate(FLEET_SPECS)]  # fmt: skip
    errors = [f"the charts leave out the nodes of replica {why}" for why in missing]
    return await app[PAGE_WORKER].run(_draw, read, end, width), errors


async def _render(request: web.Request, template: str, **context: Any) -> web.Response:
    fragment = request.query.get("fragment") == "1"
    page = request.app[TEMPLATES].get_template(template)
    body = await request.app[PAGE_WORKER].run(functools.partial(
        page.render, fragment=fragment, refresh_s=REFRESH_S, rendered_at=time.strftime("%H:%M:%S"), **context))
    return web.Response(text=body, content_type="text/html", headers={"Cache-Control": "no-store"})


def _attention_first(v: dict[str, Any]) -> tuple[int, float, str]:
    """Stale nodes first (they need someone), then the busiest."""
    cpu = v.get("cpu")
    return (0 if v["state"] == "stale" else 1, -(cpu if isinstance(cpu, (int, float)) else -1.0), v["node"])


@shared("q", "state", "page", "fragment", "measure", "width")
async def cluster_page(request: web.Request) -> web.Response:
    width = chart_width(request)
    text = request.query.get("q", "")
    state = request.query.get("state", "")
    if len(text) > 200 or not text.isprintable():
        raise web.HTTPBadRequest(text="q: at most 200 printable characters")
    if state not in ("", "fresh", "stale"):
        raise web.HTTPBadRequest(text="state: fresh or stale")
    try:
        page = int(request.query.get("page", "1"))
    except ValueError:
        page = 0
    if page < 1:
        raise web.HTTPBadRequest(text="page: a whole number from 1")
    worker = request.app[PAGE_WORKER]
    history = request.app[HISTORY]

    async def fleet_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows = await worker.run(cluster_rows, request.app[REGISTRY])
        if (fleet := request.app.get(FLEET_ROWS)) is None:
            return rows, []
        merged = await fleet(rows, "cluster")  # with peers: theirs too, and those that did not answer
        return merged["nodes"], merged["peers"]

    async def charts() -> tuple[list[str], list[str]]:
        if isinstance(history, EmbeddedHistory) and FLEET_CHART_PARTS in request.app:
            return await _fleet_charts(request.app, history, time.time(), width)
        return await _charts(request.app, FLEET_SPECS, time.time(), width)

    # The rows and the charts at once: each asks the peers, which answer on their own threads.
    (rows, peers), (charts_drawn, errors) = await asyncio.gather(fleet_rows(), charts())
    summary, shown = await worker.run(_cluster_rows, rows, text, state)
    if not summary["gpus"]:  # the fleet charts are the GPUs': none drawn empty
        charts_drawn = [chart_note("GPU charts", "no GPUs on this fleet's fresh nodes")]
    picture = heatmap_context(request, ("cpu", "gpu", "sm", "starved") if summary["gpus"] else ("cpu", "starved"))
    if picture is not None:
        await heatmap_rows(request, picture)
    pages = max(1, -(-len(shown) // PAGE_ROWS))
    page = min(page, pages)
    rows = shown[(page - 1) * PAGE_ROWS : page * PAGE_ROWS]

    def link(to: int) -> str:
        query = {k: v for k, v in (("q", text), ("state", state)) if v}
        return "?" + urlencode({**query, "page": to})

    return await _render(request, "cluster.html", nodes=rows, matched=len(shown), summary=summary, q=text,
                         state=state, page=page, pages=pages, prev_link=link(page - 1) if page > 1 else None,
                         next_link=link(page + 1) if page < pages else None, charts=charts_drawn,
                         history_errors=errors, silent_peers=[p for p in peers if not p["answered"]],
                         picture=picture)  # fmt: skip


def _cluster_rows(rows: list[dict[str, Any]], text: str, state: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """On the page thread: the fleet's summary, and the rows the filter keeps, in order."""
    needle = text.strip().casefold()
    shown = sorted((r for r in rows if (not state or r["state"] == state)
                    and (not needle or needle in r["node"].casefold()
                         or needle in (r.get("hostname") or "").casefold())),
                   key=_attention_first)  # fmt: skip
    return fleet_summary(rows), shown


@shared("shard", "fragment", "at", "width")
async def node_page(request: web.Request) -> web.Response:
    registry: NodeRegistry = request.app[REGISTRY]
    # Only a node the registry knows reaches a history query.
    state = registry.get(request.match_info["node"])
    if state is None:
        raise web.HTTPNotFound(text="no such node")
    view = _node_view(state, registry.clock(), registry.stale_after)
    # ?shard=ID: one engine's hour first (a row's link), then the node's.
    shard = request.query.get("shard")
    if shard is not None and not (0 < len(shard) <= wire.MAX_NAME and shard.isprintable()):
        raise web.HTTPBadRequest(text=f"shard: must be printable text of 1-{wire.MAX_NAME} characters")
    at = _moment(request.query.get("at"), time.time())
    shard_specs, shard_notes = _shard_specs(state.node, shard, view) if shard else ([], [])
    node_specs, node_notes = _node_specs(state.node, view)
    charts, errors = await _charts(request.app, shard_specs + node_specs, time.time(), chart_width(request))
    charts += shard_notes + node_notes
    live_url = f"/node/{quote(state.node, safe='')}/live" if LIVE in request.app else None
    # Every sample around a moment of the hour, from the node's ring: where its agent keeps one.
    held = state.hindsight_held_seconds()
    hindsight_url = (f"/api/nodes/{quote(state.node, safe='')}/hindsight"
                     if HINDSIGHT in request.app and held is not None else None)  # fmt: skip
    incidents = _incidents(request.app[INCIDENTS].listed(state.node)) if INCIDENTS in request.app else None
    return await _render(request, "node.html", n=view, charts=charts, history_errors=errors, shard=shard,
                         live_url=live_url, hindsight_url=hindsight_url, hindsight_held_s=held, incidents=incidents,
                         at=at, at_utc=None if at is None else time.strftime("%H:%M:%S UTC", time.gmtime(at)))


def _moment(value: str | None, now: float) -> float | None:
    """`?at=`: a moment of the last hour the page is opened at (the fleet's
    picture links a cell so), in seconds since the epoch; 400 otherwise."""
    if value is None:
        return None
    try:
        at = float(value)
    except ValueError:
        at = math.nan
    if not (math.isfinite(at) and now - SPAN_S - 60 <= at <= now + 60):
        raise web.HTTPBadRequest(text="at: a moment of the last hour, in seconds since the epoch")
    return at


def _incidents(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The node's incidents as its page lists them, their times in UTC."""
    def utc(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))

    return [{**i, "when": utc(i["from"]) + " – " + utc(i["to"])[11:],
             "missing_count": sum(len(m) for m in i["missing"].values())} for i in listed[:50]]  # fmt: skip


async def prometheus_session(app: web.Application) -> AsyncIterator[None]:
    """With --prometheus, one client session for the pages' range queries."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    app[HISTORY] = PrometheusHistory(app[PROMETHEUS_URL], session)
    yield
    await session.close()


def add_pages(app: web.Application, history: EmbeddedHistory | None, prometheus_url: str | None = None) -> None:
    """The pages on an app that already has the registry (controlplane.pages_api)."""
    app[TEMPLATES] = _environment()
    if PAGE_WORKER not in app:  # pages_api's app has one already
        app[PAGE_WORKER] = PageWorker()
        app.cleanup_ctx.append(page_worker_ctx)
    if prometheus_url:
        app[PROMETHEUS_URL] = prometheus_url
        app.cleanup_ctx.append(prometheus_session)
    else:
        app[HISTORY] = history if history is not None else EmbeddedHistory()
    kept = app[FLEET_CHARTS_KEPT] = FleetChartsKept()

    async def stop_summing(app: web.Application) -> None:
        kept.close()

    app.on_cleanup.append(stop_summing)
    app.router.add_get("/", cluster_page)
    app.router.add_get("/node/{node}", node_page)
    add_heatmap(app)
    app.router.add_static("/static", Path(__file__).parent / "static")
