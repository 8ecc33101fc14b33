"""Time to render /metrics for a fleet of N nodes x 8 GPUs x 4 engines, at
100, 1,000 and 10,000 nodes (it should grow linearly), against
prometheus-client's own path (GaugeMetricFamily objects + generate_latest)
for the same samples, measured in the same run. Target: under 250 ms at
1,000 nodes.

    PYTHONPATH=. .venv/bin/python bench/metrics_render.py [--counts 100,1000,10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heartbeat_throughput import gpu_node_heartbeat  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.core import GaugeMetricFamily  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

import wire  # noqa: E402
from controlplane.export.exposition import FleetExposition  # noqa: E402
from controlplane.state.registry import NodeRegistry  # noqa: E402
from tests.test_controlplane_api import registration  # noqa: E402


def fleet(n: int) -> NodeRegistry:
    registry = NodeRegistry()
    for i in range(n):
        node = f"node-{i:05d}"
        registry.register(wire.decode_registration(json.dumps(registration(node)).encode()))
        registry.heartbeat(wire.decode_heartbeat(json.dumps(gpu_node_heartbeat(node)).encode()).heartbeat)
    return registry


class PlainCollector(Collector):
    """The obvious alternative: the same samples as prometheus-client objects."""

    def __init__(self, text: str) -> None:
        self.families = [(f.name, f.documentation, [(s.labels, s.value) for s in f.samples])
                         for f in text_string_to_metric_families(text)]  # fmt: skip

    def collect(self):  # type: ignore[no-untyped-def]
        for name, doc, samples in self.families:
            labels = list(samples[0][0]) if samples else []
            g = GaugeMetricFamily(name, doc, labels=labels)
            for ls, v in samples:
                g.add_metric([ls[k] for k in labels], v)
            yield g


def timed(fn, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="100,1000,10000")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"{'nodes':>6} {'samples':>8}  {'render (ms)':<26} {'us/sample':>9}  "
          f"{'prometheus-client path (ms)':<30} ratio")
    for n in (int(c) for c in args.counts.split(",")):
        exposition = FleetExposition(fleet(n))
        text = exposition.render()
        samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        ours = timed(exposition.render, args.runs)
        med = statistics.median(ours)
        plain = ""
        ratio = ""
        if n <= 1000:  # the plain path is slow enough that 10,000 nodes only shows the same ratio
            reg = CollectorRegistry()
            reg.register(PlainCollector(text))
            theirs = timed(lambda reg=reg: generate_latest(reg), max(1, args.runs // 2))
            plain = f"{statistics.median(theirs):8.1f} ({min(theirs):.1f}..{max(theirs):.1f})"
            ratio = f"{statistics.median(theirs) / med:5.1f}x"
        print(f"{n:>6} {samples:>8}  {med:8.1f} ({min(ours):.1f}..{max(ours):.1f}){'':<6} {med * 1e3 / samples:9.2f}  "
              f"{plain:<30} {ratio}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
