"""The fleet's picture at 10,000 nodes, an hour of heartbeats each (720 at
5 s): what its requests cost. Target (#50): under 300 ms and 2 MB.

Measured in one process, on the page thread as the app runs it:
- the picture made cold (every node's hour read and binned, the rows
  grouped, ordered and banded), for each measure, and from parts kept (the
  combining alone; a view within a column's width takes the kept picture);
- the PNG's and the legend's sizes as sent (the legend also gzipped, for
  a proxy that compresses), and their encoding time;
- what a peer sends of it (`/v1/peer/heatmap`: the part of a replica
  holding every node, the most one can send);
- beside them, in the same run, the fleet charts' parts of the same
  history (controlplane/fleet/cluster_view.py: the cluster page's other reader of
  every node's hour), as the reference the ratio is taken against.

    PYTHONPATH=. .venv/bin/python bench/heatmap.py [--nodes 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.fleet.cluster_view import chart_parts  # noqa: E402
from controlplane.history.heatmap import MEASURES, _kept, column_grid, heatmap, own_part, part_json  # noqa: E402
from tests.heatmap_fleet import fleet_with_history, node_name  # noqa: E402


def timed(fn: object, runs: int) -> tuple[float, object]:
    times, got = [], None
    for _ in range(runs):
        t = time.perf_counter()
        got = fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--heartbeats", type=int, default=720)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    t = time.perf_counter()
    _, history, now = fleet_with_history(args.nodes, args.heartbeats, {node_name(args.nodes // 2): 100}, varied=True)
    print(f"{args.nodes} nodes x {args.heartbeats} heartbeats recorded in {time.perf_counter() - t:.0f} s")
    end = (now // 5 + 1) * 5

    def cold(key: str) -> object:
        _kept.clear()
        return heatmap(history, MEASURES[key], end, history.interval)

    reference, _ = timed(lambda: _fresh_parts(history, end), args.runs)
    print(f"reference: the fleet charts' parts of the same history: {reference:.0f} ms")
    for key in MEASURES:
        made, picture = timed(lambda key=key: cold(key), args.runs)
        warm, _ = timed(lambda key=key: heatmap(history, MEASURES[key], end, history.interval), args.runs)
        png_ms, png = timed(picture.png, args.runs)  # type: ignore[attr-defined]
        legend_ms, legend = timed(lambda picture=picture: json.dumps(picture.legend()).encode(), args.runs)
        assert isinstance(png, bytes) and isinstance(legend, bytes)
        print(f"{key:8} picture cold {made:5.0f} ms ({made / reference:.2f} x reference), "
              f"from kept parts {warm:.0f} ms; "
              f"PNG {len(png) / 1024:.0f} KiB in {png_ms:.1f} ms; legend {len(legend) / 1024:.0f} KiB "
              f"({len(gzip.compress(legend)) / 1024:.0f} KiB gzipped) in {legend_ms:.0f} ms; "
              f"a cold request: {made + max(png_ms, legend_ms):.0f} ms, "
              f"at most {max(len(png), len(legend)) / 2**20:.2f} MB; "
              f"{len(picture.rows)} rows")  # type: ignore[attr-defined]  # fmt: skip
        grid = column_grid(end, history.interval)[2]
        sent_ms, sent = timed(lambda key=key, grid=grid: part_json(own_part(history, MEASURES[key], end, grid)),
                              args.runs)  # fmt: skip
        assert isinstance(sent, bytes)
        print(f"{'':8} a peer's part of {args.nodes} nodes: {len(sent) / 2**20:.2f} MB, {sent_ms:.0f} ms warm")


_asked = [0.0]


def _fresh_parts(history: object, end: float) -> object:
    """chart_parts on a grid not kept yet (each run a step later): the work of a view with none kept."""
    _asked[0] += 3600.0 / 496
    return chart_parts(history, end + _asked[0], 3600.0, 3600.0 / 496)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
