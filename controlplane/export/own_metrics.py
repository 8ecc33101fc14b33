"""The control plane's own metrics, with prometheus-client: requests it
accepted and refused (by reason), nodes registered, and what the last fleet
scrape cost. Counters of its own events are counted as they happen; the
rest is read at scrape time by a collector (and by
controlplane/samples/surface_metrics.py's, for spans, incidents and
password checks)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.listen.connection_limits import CLOSE_REASONS
from controlplane.state.registry import NodeRegistry

REJECT_REASONS = ("bad_request", "unauthorized", "forbidden", "unknown_node", "replay", "too_large", "rate_limited",
                  "internal_error")  # fmt: skip


class ControlPlaneMetrics:
    def __init__(self, registry: NodeRegistry) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        self.accepted = Counter("nodesampler_requests_accepted", "Agent requests accepted, by kind",
                                ["kind"], registry=self.prometheus)  # fmt: skip
        self.rejected = Counter("nodesampler_requests_rejected", "Agent requests refused, by kind and reason",
                                ["kind", "reason"], registry=self.prometheus)  # fmt: skip
        self.items_dropped = Counter("nodesampler_heartbeat_items_dropped",
                                     "Entries of accepted bodies left out (a shard, disk or GPU), by list and reason",
                                     ["reason"], registry=self.prometheus)  # fmt: skip
        self.live_heartbeats = Counter("nodesampler_live_heartbeats",
                                       "Heartbeats that carried raw samples, by whether a live view used them",
                                       ["used"], registry=self.prometheus)  # fmt: skip
        for used in ("true", "false"):
            self.live_heartbeats.labels(used)
        self.connections_closed = Counter("nodesampler_connections_closed",
                                          "Connections the control plane closed: idle, a request not complete "
                                          "in time, or one too many from a peer address",
                                          ["listener", "reason"], registry=self.prometheus)  # fmt: skip
        for listener in ("agents", "pages"):
            for why in CLOSE_REASONS:
                self.connections_closed.labels(listener, why)
        for kind in ("register", "heartbeat"):
            self.accepted.labels(kind)
            for reason in REJECT_REASONS:
                self.rejected.labels(kind, reason)
        self.last_scrape_seconds: float | None = None
        self.scrape_errors = 0
        self.prometheus.register(_StateCollector(registry, self))


class _StateCollector(Collector):
    def __init__(self, registry: NodeRegistry, metrics: ControlPlaneMetrics) -> None:
        self.registry, self.metrics = registry, metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.registry.clock()
        nodes = self.registry.nodes()
        g = GaugeMetricFamily("nodesampler_registered_nodes", "Nodes the control plane knows, by state",
                              labels=["state"])  # fmt: skip
        fresh = sum(1 for n in nodes if n.fresh(now, self.registry.stale_after))
        g.add_metric(["fresh"], fresh)
        g.add_metric(["stale"], len(nodes) - fresh)
        yield g
        if self.metrics.last_scrape_seconds is not None:
            yield GaugeMetricFamily("nodesampler_fleet_scrape_duration_seconds",
                                    "Time the previous scrape took to render the fleet's families",
                                    value=self.metrics.last_scrape_seconds)  # fmt: skip
        yield CounterMetricFamily("nodesampler_fleet_scrape_errors", "Nodes or families left out of a scrape",
                                  value=self.metrics.scrape_errors)  # fmt: skip
