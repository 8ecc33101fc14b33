"""What a replica knows of its peers (controlplane/fleet/peers.py), read at scrape
time: whether each answered its last poll and how many nodes it holds, and
the nodes this replica let go to them, and the page requests it forwarded to
the replica holding their node (controlplane/fleet/forward.py). A peer is labelled by its URL, as
`--peer` names it: the operator's list bounds the set. This replica's own
entry in that list is left out."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.fleet.forward import Forwarder
from controlplane.fleet.peers import Peers


class PeersCollector(Collector):
    def __init__(self, peers: Peers, forwarder: Forwarder | None = None) -> None:
        self.peers, self.forwarder = peers, forwarder

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("nodesampler_peer_up", "Whether the peer answered this replica's last poll",
                               labels=["peer"])  # fmt: skip
        held = GaugeMetricFamily("nodesampler_peer_nodes", "Nodes the peer held, fresh or stale, at this replica's "
                                 "last poll (absent: it did not answer)", labels=["peer"])  # fmt: skip
        for peer in self.peers.peers:
            if peer.is_us:
                continue
            up.add_metric([peer.url], 0 if peer.error is not None and not peer.holds else 1)
            if peer.error is None or peer.holds:
                held.add_metric([peer.url], len(peer.holds))
        yield up
        yield held
        yield CounterMetricFamily("nodesampler_nodes_let_go", "Nodes this replica let go because a peer heard "
                                  "from them more recently (they moved)", value=self.peers.let_go_count)  # fmt: skip
        if self.forwarder is not None:
            forwarded = CounterMetricFamily("nodesampler_forwarded_requests", "Page requests about a node sent on "
                                            "to the replica holding it, by whether it answered", labels=["result"])
            forwarded.add_metric(["answered"], self.forwarder.forwarded - self.forwarder.failed)
            forwarded.add_metric(["failed"], self.forwarder.failed)
            yield forwarded
