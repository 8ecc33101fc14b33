"""A node as the cluster page lists it: one small row of its current figures.

The cluster page reads every node of the fleet at each view, its own and
its peers' (controlplane/peers.py): a row is the few figures the page shows
(about 400 bytes, against tens of KiB of a GPU node's whole heartbeat in
`/api/nodes`), so a 10,000-node fleet over three replicas is a few MB to
fetch and parse, not a few hundred.
"""

from __future__ import annotations

import json
from typing import Any

from controlplane.state.registry import NodeRegistry, NodeState


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
