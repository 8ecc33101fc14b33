"""What the surfaces a node or a client can push cost, read at scrape time:
hindsight spans asked, refused and given up (by who asked), their pieces
taken and refused (by reason) and the bytes they hold; incidents kept (by
source and state), started and refused (by source) and their bytes on
disk; password checks waiting, and their results. Every label set is fixed
where it is counted: a sender's values (node names, reasons) are never a
label (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.listen.page_access import PasswordChecker
from controlplane.samples.hindsight import HindsightFetches
from controlplane.samples.incidents import Incidents


class SurfacesCollector(Collector):
    """Read at scrape time from the objects that count (absent: the surface is off)."""

    def __init__(self, fetches: HindsightFetches, incidents: Incidents | None, checker: PasswordChecker | None) -> None:
        self.fetches, self.incidents, self.checker = fetches, incidents, checker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        f = self.fetches
        for name, doc, counts in (
            ("asked", "Hindsight spans asked of nodes, by who asked (an incident or a page's viewer)", f.asks),
            ("refused", "Hindsight spans refused when asked (a node asked too often, its queue or the memory "
                        "budget full, or it keeps no samples), by who asked", f.asks_refused),
            ("given_up", "Hindsight spans ended at their deadline before their node sent the whole, by who "
                         "asked", f.given_up),
        ):  # fmt: skip
            family = CounterMetricFamily(f"nodesampler_hindsight_spans_{name}", doc, labels=["kind"])
            for kind, n in counts.items():  # keys fixed where they are counted
                family.add_metric([kind], n)
            yield family
        yield CounterMetricFamily("nodesampler_hindsight_pieces_taken", "Pieces of hindsight spans nodes sent "
                                  "and the control plane kept", value=f.pieces_taken)  # fmt: skip
        refused = CounterMetricFamily("nodesampler_hindsight_pieces_refused",
                                      "Pieces of hindsight spans refused, by reason: not_asked (no span of that "
                                      "id in its turn), bad (not read), no_advance (not after what came), "
                                      "span_budget or all_budget (bytes)", labels=["reason"])  # fmt: skip
        for reason, n in f.pieces_refused.items():
            refused.add_metric([reason], n)
        yield refused
        yield GaugeMetricFamily("nodesampler_hindsight_held_bytes", "Bytes the hindsight spans held take, as "
                                "counted against their budget", value=f.held_bytes)  # fmt: skip
        if self.incidents is not None:
            kept = GaugeMetricFamily("nodesampler_incidents", "Incidents kept, by source and state",
                                     labels=["source", "state"])  # fmt: skip
            for (source, state), n in self.incidents.kept().items():
                kept.add_metric([source, state], n)
            yield kept
            for name, doc, counts in (
                ("started", "Incidents started, by source", self.incidents.started),
                ("refused", "Incidents refused for their source's start budget, by source", self.incidents.refused),
            ):
                family = CounterMetricFamily(f"nodesampler_incidents_{name}", doc, labels=["source"])
                for source, n in counts.items():
                    family.add_metric([source], n)
                yield family
            yield GaugeMetricFamily("nodesampler_incident_bytes_on_disk", "Bytes the kept incidents' files take "
                                    "(within --incidents-mib)", value=self.incidents.bytes_on_disk())  # fmt: skip
        if self.checker is not None:
            c = self.checker
            yield GaugeMetricFamily("nodesampler_password_checks_waiting", "Password checks waiting for bcrypt",
                                    value=c.waiting())  # fmt: skip
            checks = CounterMetricFamily("nodesampler_password_checks", "Password checks, by result: good or "
                                         "wrong (bcrypt ran), refused (too many waiting: 429)",
                                         labels=["result"])  # fmt: skip
            for result, n in (("good", c.good), ("wrong", c.wrong), ("refused", c.refused)):
                checks.add_metric([result], n)
            yield checks
