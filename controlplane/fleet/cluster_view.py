"""A node as the cluster page lists it: one small row of its current figures.

The cluster page reads every node of the fleet at each view, its own and
its peers' (controlplane/fleet/peers.py): a row is the few figures the page shows
(about 400 bytes, against tens of KiB of a GPU node's whole heartbeat in
`/api/nodes`), so a 10,000-node fleet over three replicas is a few MB to
fetch and parse, not a few hundred.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from typing import Any

import numpy as np

from controlplane.history.backends import ChartSpec, EmbeddedHistory, GridPart, step_grid
from controlplane.state.registry import NodeRegistry, NodeState

# The cluster page's charts of the whole fleet (web/pages.py titles them): with
# peers, each replica's totals for its own nodes, added together (`chart_parts`).
FLEET_CHARTS = (
    ChartSpec("llmgw_gpu_utilization_percent", (), ("gpu_model",), "avg"),
    ChartSpec("llmgw_gpu_memory_used_bytes", (), ("gpu_model",), "sum"),
)
MAX_CHART_STEPS = 2000  # a chart's columns are a few hundred; a peer's ask is bounded all the same
MAX_CHART_SPAN_S = 2 * 3600.0


def cluster_row(state: NodeState, now: float, stale_after: float) -> dict[str, Any]:
    """The node's row: a stale node's figures are not current, so it has none (None: a dash)."""
    fresh = state.fresh(now, stale_after)
    age = state.age(now)
    got = state.received if fresh else None
    hb = got.heartbeat if got is not None else None
    m = hb.machine if hb is not None else None
    gpus = [g for g in (hb.gpus or ()) if not g.lost] if hb is not None else []
    utils = [g.utilization_percent for g in gpus if g.utilization_percent is not None]
    used = [g.memory_used_bytes for g in gpus if g.memory_used_bytes is not None]
    total = [g.memory_total_bytes for g in gpus if g.memory_total_bytes is not None]
    mem_used, mem_total = (m.memory_used_bytes, m.memory_bytes) if m is not None else (None, None)
    verdicts = [v for v in got.verdicts if v is not None] if got is not None else []
    return {
        "node": state.node, "state": "fresh" if fresh else "stale",
        "sample_age_seconds": None if age is None else round(age, 3),
        "hostname": state.registration.hostname,
        "cpu": None if m is None or m.cpu_percent is None else m.cpu_percent.mean,
        "memory_used": mem_used, "memory_total": mem_total,
        "memory_share": None if mem_used is None or not mem_total else mem_used / mem_total,
        "load_1m": None if m is None or m.load is None else m.load.one,
        "gpu_count": len(gpus) if fresh else None,
        "gpu_util": sum(utils) / len(utils) if utils else None,
        "gpu_memory_used": sum(used) if used else None, "gpu_memory_total": sum(total) if total else None,
        "engines": len(got.shards) if got is not None else None,
        "cpu_starved": sum(1 for v in verdicts if v.cpu_starved and not v.host_bound),
        "host_bound": sum(1 for v in verdicts if v.host_bound),
    }  # fmt: skip


def cluster_rows(registry: NodeRegistry) -> list[dict[str, Any]]:
    now = registry.clock()
    return [cluster_row(s, now, registry.stale_after) for s in registry.nodes()]


def cluster_json(registry: NodeRegistry) -> str:
    """This replica's rows, for a peer's cluster page (`/v1/peer/nodes?view=cluster`)."""
    return json.dumps({"nodes": cluster_rows(registry)})


def fleet_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the top of the cluster page says of the whole fleet, whatever the filter."""
    fresh = [r for r in rows if r["state"] == "fresh"]
    busiest = max((r for r in fresh if isinstance(r.get("cpu"), (int, float))), key=lambda r: r["cpu"], default=None)

    def total(key: str) -> int:
        return sum(r[key] for r in fresh if isinstance(r.get(key), int))

    return {"nodes": len(rows), "fresh": len(fresh), "stale": len(rows) - len(fresh), "gpus": total("gpu_count"),
            "engines": total("engines"), "cpu_starved": total("cpu_starved"), "host_bound": total("host_bound"),
            "busiest": busiest}  # fmt: skip


def chart_end(now: float, step: float) -> float:
    """The fleet charts' last instant: `now` down to a whole step, so that every
    replica asked within a step draws (and keeps, `chart_parts`) the same grid."""
    return math.floor(now / step) * step


# A history's parts by grid: the last few grids (a page's and its peers' asks).
_parts_kept: weakref.WeakKeyDictionary[EmbeddedHistory, dict[tuple[float, float, float], list[dict[str, GridPart]]]] = (
    weakref.WeakKeyDictionary())  # fmt: skip
_parts_lock = threading.Lock()


def chart_parts(history: EmbeddedHistory, end: float, span: float, step: float) -> list[dict[str, GridPart]]:
    """This replica's part of each fleet chart, on the grid `(end - span, end]`
    every `step`. Kept for the grid: every page view and peer that asks within
    the step (`chart_end`) is answered from it. Measured: the parts of 3,300
    GPU nodes are ~200 ms of a page thread (py-spy: `_columns` and `_on_grid`,
    a Python loop a node), asked by each replica's page views; a chart's
    column is a step wide, so what a step adds is its last point alone."""
    key = (end, span, step)
    with _parts_lock:
        kept = _parts_kept.setdefault(history, {})
        if (parts := kept.get(key)) is not None:
            return parts
    grid = step_grid(end - span, end, step)
    parts = [history.grid_parts(spec, grid) for spec in FLEET_CHARTS]
    with _parts_lock:
        kept[key] = parts
        while len(kept) > 4:
            del kept[next(iter(kept))]  # the oldest grid
    return parts


def chart_grid(end: float, span: float, step: float) -> np.ndarray:
    """The grid a peer is asked for: ValueError when the ask is no chart's."""
    if not all(math.isfinite(x) for x in (end, span, step)) or not 0 < span <= MAX_CHART_SPAN_S or step <= 0:
        raise ValueError("end, span and step: finite; span at most two hours")
    if span / step > MAX_CHART_STEPS:
        raise ValueError(f"at most {MAX_CHART_STEPS} steps")
    return step_grid(end - span, end, step)


def chart_parts_json(parts: list[dict[str, GridPart]]) -> str:
    """Each group's sums, counts and maxima as lists (a maximum where nothing was measured is 0: its count says so)."""
    return json.dumps({"charts": [{key: [s.round(6).tolist(), c.tolist(), np.where(c > 0, m, 0.0).round(6).tolist()]
                                   for key, (s, c, m) in part.items()} for part in parts]})  # fmt: skip


def parse_chart_parts(value: Any, steps: int) -> list[dict[str, GridPart]]:
    """A peer's parts, checked: ValueError when they are not one part a fleet chart of `steps` instants."""
    charts = value.get("charts") if isinstance(value, dict) else None
    if not isinstance(charts, list) or len(charts) != len(FLEET_CHARTS):
        raise ValueError("not the fleet charts' parts")
    out: list[dict[str, GridPart]] = []
    for chart in charts:
        if not isinstance(chart, dict) or len(chart) > 1000:
            raise ValueError("not a chart's parts")
        part: dict[str, GridPart] = {}
        for key, arrays in chart.items():
            if not isinstance(arrays, list) or len(arrays) != 3 or any(
                    not isinstance(a, list) or len(a) != steps for a in arrays):  # fmt: skip
                raise ValueError("a group's totals are not three lists of the grid's length")
            s, c, m = (np.array(arrays[0], dtype=np.float64), np.array(arrays[1], dtype=np.int64),
                       np.array(arrays[2], dtype=np.float64))  # fmt: skip
            if not (np.isfinite(s).all() and np.isfinite(m).all() and (c >= 0).all()):
                raise ValueError("a group's totals are not finite counts and values")
            part[str(key)[:256]] = (s, c, np.where(c > 0, m, -np.inf))
        out.append(part)
    return out
