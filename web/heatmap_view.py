"""The cluster page's picture of the fleet (controlplane/history/heatmap.py; with
`--prometheus`, controlplane/history/heatmap_prometheus.py): the image, what its
script needs to name a cell, and a cell's node at its moment.

Every view names the picture it was drawn from by its last instant (`end`,
a whole column): the image, its legend and a click's cell agree whatever
happened between, and a view within a column's width reuses the picture.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from controlplane.history.backends import HOUR_S, EmbeddedHistory, HistoryError, PrometheusHistory
from controlplane.history.heatmap import MEASURES, Heatmap, Measure, Part, build, column_end, column_grid, own_part
from controlplane.history.heatmap_prometheus import prometheus_heatmap
from controlplane.keys import HISTORY
from controlplane.listen.page_worker import PAGE_WORKER, shared
from controlplane.pages_api import HEATMAP_PARTS

DEFAULT_MEASURE = "cpu"
ROW_PX = (2, 12)  # a row's height on the page: the picture fits about 480 px, its rows readable


def _measure(request: web.Request) -> Measure:
    key = request.query.get("measure", DEFAULT_MEASURE)
    if key not in MEASURES:
        raise web.HTTPBadRequest(text=f"measure: one of {', '.join(MEASURES)}")
    return MEASURES[key]


Drawn = EmbeddedHistory | PrometheusHistory  # the histories a picture is drawn from


def _end(request: web.Request, history: Drawn) -> float:
    """The picture's end as asked: a whole column of the last hour (an older
    picture would show an hour the history no longer holds whole)."""
    now = history.clock()
    try:
        end = float(request.query["end"])
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="end: the picture's last instant, in seconds since the epoch") from None
    step = column_grid(end, history.interval)[1]
    if not math.isfinite(end) or not now - HOUR_S <= end <= now + step or abs(end / step - round(end / step)) > 1e-6:
        raise web.HTTPBadRequest(text="end: a whole column of the last hour (the page's own link)")
    return round(end / step) * step


def _history(request: web.Request) -> Drawn:
    history = request.app[HISTORY]
    if not isinstance(history, EmbeddedHistory | PrometheusHistory):
        raise web.HTTPNotFound(text="no history to draw the fleet's picture from")
    return history


class PicturesKept:
    """The fleet's pictures by measure and end, each made once (this
    replica's part and its peers', combined on the page thread; or
    Prometheus' answers, which hold the whole fleet) and kept for the next
    views of that column: the page, its image, its legend and a click's cell
    ask for the same one. A picture whose making failed is not kept."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, float], asyncio.Task[tuple[Heatmap, list[str]]]] = {}

    async def get(self, app: web.Application, history: Drawn, measure: Measure,
                  end: float) -> tuple[Heatmap, list[str]]:  # fmt: skip
        key = (measure.key, end)
        task = self._made.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._made[key] = asyncio.create_task(self._make(app, history, measure, end))
            while len(self._made) > 2 * len(MEASURES):
                del self._made[next(iter(self._made))]  # the oldest
        return await asyncio.shield(task)

    async def _make(self, app: web.Application, history: Drawn, measure: Measure,
                    end: float) -> tuple[Heatmap, list[str]]:  # fmt: skip
        columns = column_grid(end, history.interval)[2]
        worker = app[PAGE_WORKER]
        if isinstance(history, PrometheusHistory):
            return await prometheus_heatmap(history, worker, measure, end, columns), []
        ask_peers = app.get(HEATMAP_PARTS)
        own, (theirs, missing) = await asyncio.gather(
            worker.run(own_part, history, measure, end, columns),
            ask_peers(measure.key, end, columns) if ask_peers is not None else _none())
        return await worker.run(build, measure, [own, *theirs], end, columns), missing


async def _none() -> tuple[list[Part], list[str]]:
    return [], []


PICTURES_KEPT = web.AppKey("pictures_kept", PicturesKept)


async def _picture(request: web.Request) -> Heatmap:
    history = _history(request)
    measure, end = _measure(request), _end(request, history)
    try:
        picture, _ = await request.app[PICTURES_KEPT].get(request.app, history, measure, end)
    except HistoryError as e:
        raise web.HTTPBadGateway(text=f"the fleet's picture: {e}") from None
    return picture


@shared("measure", "end")
async def heatmap_png(request: web.Request) -> web.Response:
    picture = await _picture(request)
    png = await request.app[PAGE_WORKER].run(picture.png)
    # A picture is named by its end: the same URL is the same picture for the hour.
    return web.Response(body=png, content_type="image/png", headers={"Cache-Control": "private, max-age=300"})


@shared("measure", "end")
async def heatmap_legend(request: web.Request) -> web.Response:
    picture = await _picture(request)
    return web.Response(text=json.dumps(picture.legend()), content_type="application/json",
                        headers={"Cache-Control": "private, max-age=300"})  # fmt: skip


async def heatmap_cell(request: web.Request) -> web.Response:
    """A click on a cell: the node that was worst there, at that moment (303)."""
    picture = await _picture(request)
    try:
        row, column = int(request.query["row"]), int(request.query["column"])
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="row and column: whole numbers") from None
    found = picture.cell(row, column)
    if found is None:
        raise web.HTTPNotFound(text="nothing was measured in that cell")
    node, at = found
    raise web.HTTPSeeOther(f"/node/{quote(node, safe='')}?{urlencode({'at': f'{at:.0f}'})}#hindsight")


def heatmap_context(request: web.Request, measures: tuple[str, ...]) -> dict[str, Any] | None:
    """What the cluster page draws the picture with; None with no history to draw it from."""
    history = request.app[HISTORY]
    if not isinstance(history, EmbeddedHistory | PrometheusHistory):
        return None
    key = request.query.get("measure", DEFAULT_MEASURE)
    measure = MEASURES[key] if key in measures else MEASURES[DEFAULT_MEASURE]
    end = column_end(history.clock(), history.interval)
    query = urlencode({"measure": measure.key, "end": f"{end:.3f}"})
    column = "window" if isinstance(history, EmbeddedHistory) else f"{history.interval:g} s of Prometheus' scrapes"
    return {"measure": measure, "measures": [MEASURES[k] for k in measures], "end": end,
            "png": f"/heatmap.png?{query}", "legend": f"/api/heatmap?{query}", "cell": f"/heatmap/cell?{query}",
            "until": time.strftime("%H:%M", time.localtime(end)), "error": None, "column": column}  # fmt: skip


async def heatmap_rows(request: web.Request, context: dict[str, Any]) -> None:
    """The picture's size, for the page to lay it out: its rows and their
    groups; and the peers whose nodes it lacks, with why; or why there is
    no picture (Prometheus did not answer)."""
    history = _history(request)
    try:
        picture, missing = await request.app[PICTURES_KEPT].get(request.app, history, context["measure"],
                                                                context["end"])  # fmt: skip
    except HistoryError as e:
        context["error"] = str(e)
        context["nodes"] = 0
        return
    rows = len(picture.rows)
    context["rows"] = rows
    context["nodes"] = picture.nodes
    context["missing"] = missing
    context["row_px"] = max(ROW_PX[0], min(ROW_PX[1], 480 // max(1, rows)))
    context["band"] = max((len(r.nodes) for r in picture.rows), default=1)
    groups: list[dict[str, Any]] = []
    for r in picture.rows:
        if groups and groups[-1]["group"] == r.group:
            groups[-1]["rows"] += 1
            groups[-1]["nodes"] += len(r.nodes)
        else:
            groups.append({"group": r.group, "rows": 1, "nodes": len(r.nodes)})
    context["groups"] = groups


def add_heatmap(app: web.Application) -> None:
    app[PICTURES_KEPT] = PicturesKept()
    app.router.add_get("/heatmap.png", heatmap_png)
    app.router.add_get("/api/heatmap", heatmap_legend)
    app.router.add_get("/heatmap/cell", heatmap_cell)
