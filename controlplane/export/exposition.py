"""The fleet on one /metrics, built from the registry at scrape time.

Every family of DESIGN.md's Prometheus contract, in the text exposition
format. Nothing is kept in step with the registry: each scrape reads it.
Absent is not zero: a field the last heartbeat did not carry has no series;
a stale node keeps `llmgw_node_up 0`, `llmgw_node_info` and its sample age
and loses every measurement; a node that is gone loses everything.

prometheus-client's own path (GaugeMetricFamily + generate_latest) costs
about 9 us a sample, four times the budget for a 1,000-node fleet (80,000
samples in under 250 ms). Label sets change only when a node registers or
its engines and cards change, so each is escaped once and cached; a scrape
only formats values. The output is checked in tests against prometheus-
client's parser and `promtool check metrics`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from controlplane.export.series import FAMILIES, NodeStatus
from controlplane.state.registry import NodeRegistry, NodeState
from wire.schema import Gpu, Shard

log = logging.getLogger(__name__)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def fmt(value: float | int) -> str:
    if type(value) is int:
        return str(value)
    return repr(float(value))


K = TypeVar("K")
LABELS_KEPT_S = 3600.0  # a label set no scrape used for this long (to twice it) is dropped


class _Generations(Generic[K]):
    """Label sets by key in two generations: at each turn the older is
    dropped, so what no scrape asked for in a whole generation goes (engines
    that restarted under new names, cards that left) and the cache stays
    the size of what the node has now."""

    def __init__(self) -> None:
        self.now: dict[K, str] = {}
        self.before: dict[K, str] = {}

    def get(self, key: K, make: Callable[[K], str]) -> str:
        labels = self.now.get(key)
        if labels is None:
            labels = self.before.pop(key, None) or make(key)
            self.now[key] = labels
        return labels

    def turn(self) -> None:
        self.before, self.now = self.now, {}

    def __len__(self) -> int:
        return len(self.now) + len(self.before)


@dataclass
class _NodeLabels:
    """Escaped label sets of one node, made once and reused by every scrape."""

    node: str
    base: str  # node="..."
    info: str = ""
    info_of: int = 0  # id() of the registration they were made from
    shards: _Generations[tuple[str, str, str, str | None, str | None, str | None]] = field(
        default_factory=_Generations)
    gpus: _Generations[tuple[int, str]] = field(default_factory=_Generations)
    mounts: _Generations[str] = field(default_factory=_Generations)
    turned_at: float | None = None

    def turn(self, now: float) -> None:
        if self.turned_at is None or now - self.turned_at >= LABELS_KEPT_S:
            for cache in (self.shards, self.gpus, self.mounts):
                cache.turn()
            self.turned_at = now

    def shard(self, s: Shard) -> str:
        key = (s.model or "", s.replica or "", s.id, s.namespace, s.pod, s.container)
        return self.shards.get(key, self._shard_labels)

    def _shard_labels(self, key: tuple[str, str, str, str | None, str | None, str | None]) -> str:
        labels = f'{self.base},model="{escape(key[0])}",replica="{escape(key[1])}",shard="{escape(key[2])}"'
        # Kubernetes' names only where known: absent, not empty.
        for label, value in zip(("namespace", "pod", "container"), key[3:], strict=True):
            if value is not None:
                labels += f',{label}="{escape(value)}"'
        return labels

    def gpu(self, g: Gpu) -> str:
        return self.gpus.get((g.index, g.name or ""),
                             lambda k: f'{self.base},gpu="{k[0]}",gpu_model="{escape(k[1])}"')  # fmt: skip

    def mount(self, mount: str) -> str:
        return self.mounts.get(mount, lambda m: f'{self.base},mount="{escape(m)}"')

    def more(self, labels: str, *pairs: tuple[str, str]) -> str:
        return labels + "".join(f',{k}="{escape(v)}"' for k, v in pairs)




class FleetExposition:
    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry
        self._labels: dict[str, _NodeLabels] = {}
        self.errors = 0  # nodes or families left out of a scrape because they failed

    def _node_labels(self, state: NodeState) -> _NodeLabels:
        labels = self._labels.get(state.node)
        if labels is None:
            labels = self._labels[state.node] = _NodeLabels(state.node, f'node="{escape(state.node)}"')
        if labels.info_of != id(state.registration):
            reg = state.registration
            identity = {"hostname": reg.hostname, "kernel": reg.kernel, "agent_version": reg.agent_version,
                        "backend": reg.backend}  # fmt: skip
            labels.info = labels.base + "".join(f',{k}="{escape(v or "")}"' for k, v in identity.items())
            labels.info_of = id(state.registration)
        return labels

    def render(self) -> str:
        now = self.registry.clock()
        stale_after = self.registry.stale_after
        nodes = []
        for state in self.registry.nodes():
            fresh = state.fresh(now, stale_after)
            labels = self._node_labels(state)
            labels.turn(now)
            nodes.append((state, labels, fresh, NodeStatus(fresh, state.age(now))))
        # Nodes that are gone leave the cache with the registry.
        if len(self._labels) > len(nodes):
            known = {s.node for s, _, _, _ in nodes}
            self._labels = {k: v for k, v in self._labels.items() if k in known}

        out: list[str] = []
        for family in FAMILIES:
            out.append(f"# HELP {family.name} {family.help}\n# TYPE {family.name} {family.type}\n")
            name = family.name
            if (of_status := family.status) is not None:  # every node's, stale or not
                for _, labels, _, status in nodes:
                    out.extend(f"{name}{{{ls}}} {fmt(v)}\n" for ls, v in of_status(labels, status))
                continue
            for state, labels, fresh, _ in nodes:
                if not fresh or (received := state.received) is None:
                    continue
                try:
                    lines = [f"{name}{{{ls}}} {fmt(v)}\n" for ls, v in family.samples(labels, received)]
                except Exception:  # one bad node never fails the scrape
                    self.errors += 1
                    log.exception("node %s left out of %s", state.node, name)
                    continue
                out.extend(lines)
        return "".join(out)
