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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from controlplane.registry import NodeRegistry, NodeState

log = logging.getLogger(__name__)

Json = dict[str, Any]
Sample = tuple[str, float | int]  # (label set without braces, value)


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

    def shard(self, s: Json) -> str:
        key = (s.get("model") or "", s.get("replica") or "", s["id"], s.get("namespace"), s.get("pod"),
               s.get("container"))  # fmt: skip
        return self.shards.get(key, self._shard_labels)

    def _shard_labels(self, key: tuple[str, str, str, str | None, str | None, str | None]) -> str:
        labels = f'{self.base},model="{escape(key[0])}",replica="{escape(key[1])}",shard="{escape(key[2])}"'
        # Kubernetes' names only where known: absent, not empty.
        for label, value in zip(("namespace", "pod", "container"), key[3:], strict=True):
            if value is not None:
                labels += f',{label}="{escape(value)}"'
        return labels

    def gpu(self, g: Json) -> str:
        return self.gpus.get((g["index"], g.get("name") or ""),
                             lambda k: f'{self.base},gpu="{k[0]}",gpu_model="{escape(k[1])}"')  # fmt: skip

    def mount(self, mount: str) -> str:
        return self.mounts.get(mount, lambda m: f'{self.base},mount="{escape(m)}"')


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    help: str
    samples: Callable[[_NodeLabels, Json], Iterator[Sample]]
    stale_too: bool = False  # shown for stale nodes (identity and freshness, not measurements)


def _machine(key: str, *path: str) -> Callable[[_NodeLabels, Json], Iterator[Sample]]:
    def samples(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
        value: Any = hb.get("machine", {}).get(key)
        for p in path:
            value = value.get(p) if isinstance(value, dict) else None
        if value is not None:
            yield labels.base, value

    return samples


def _load(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    load = hb.get("machine", {}).get("load") or {}
    for window in ("1m", "5m", "15m"):
        if window in load:
            yield f'{labels.base},window="{window}"', load[window]


def _disks(key: str) -> Callable[[_NodeLabels, Json], Iterator[Sample]]:
    def samples(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
        for d in hb.get("machine", {}).get("disks") or ():
            yield labels.mount(d["mount"]), d[key]

    return samples


def _shards(key: str, stat: str | None = None, per: float = 1.0) -> Callable[[_NodeLabels, Json], Iterator[Sample]]:
    def samples(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
        for s in hb.get("shards") or ():
            value = s.get(key)
            if stat is not None:
                value = value.get(stat) if value else None
            if value is not None:
                yield labels.shard(s), value if per == 1.0 else value / per  # a division: 9.5 / 100 is 0.095

    return samples


def _waits(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    for s in hb.get("shards") or ():
        wait = s.get("runqueue_wait_seconds") or {}
        for key, quantile in (("p50", "0.5"), ("p99", "0.99")):
            if key in wait:
                yield f'{labels.shard(s)},quantile="{quantile}"', wait[key]


def _starved(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    for s in hb.get("shards") or ():
        verdict = s.get("starved") or {}
        for kind in ("cpu_starved", "host_bound"):
            if kind in verdict:
                yield f'{labels.shard(s)},kind="{kind}"', verdict[kind]


def _pressure(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    for resource, kinds in (hb.get("machine", {}).get("pressure") or {}).items():
        for kind, value in kinds.items():
            yield f'{labels.base},resource="{resource}",kind="{kind}"', value


def _gpus(key: str, scale: float = 1.0) -> Callable[[_NodeLabels, Json], Iterator[Sample]]:
    def samples(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
        for g in hb.get("gpus") or ():
            value = g.get(key)
            if value is not None:
                yield labels.gpu(g), value if scale == 1.0 else value * scale

    return samples


def _left_out(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    yield labels.base, hb.get("shards_left_out", 0)  # counted by the agent and the registry: 0 is measured


def _never(labels: _NodeLabels, hb: Json) -> Iterator[Sample]:
    return iter(())


FAMILIES: tuple[Family, ...] = (
    Family("llmgw_node_up", "gauge", "1 if the node's last heartbeat is fresh, 0 if stale", _never, True),
    Family("llmgw_node_info", "gauge", "The node's identity: host name, kernel, agent version, backend", _never, True),
    Family("llmgw_node_sample_age_seconds", "gauge", "Seconds since the node's last heartbeat arrived", _never, True),
    Family("llmgw_node_cpus", "gauge", "Online CPUs", _machine("cpus")),
    Family("llmgw_node_shards_left_out", "gauge",
           "Engines of the node not exported: beyond the wire's or the control plane's cap (the busiest are kept)",
           _left_out),
    Family("llmgw_node_cpu_utilization_percent", "gauge", "CPU utilisation of all cores, the window's mean",
           _machine("cpu_percent", "mean")),
    Family("llmgw_node_cpu_utilization_p95_percent", "gauge", "CPU utilisation, p95 of the window's samples",
           _machine("cpu_percent", "p95")),
    Family("llmgw_node_cpu_utilization_max_percent", "gauge", "CPU utilisation, max of the window's samples",
           _machine("cpu_percent", "max")),
    Family("llmgw_node_cpu_steal_percent", "gauge",
           "Share of the CPUs' time the hypervisor gave to others (steal), the window's mean; not in utilisation",
           _machine("cpu_steal_percent", "mean")),
    Family("llmgw_node_load", "gauge", "Load average over the window label", _load),
    Family("llmgw_node_memory_bytes", "gauge", "Memory in total (MemTotal)", _machine("memory_bytes")),
    Family("llmgw_node_memory_used_bytes", "gauge", "Memory used (MemTotal - MemAvailable)",
           _machine("memory_used_bytes")),
    Family("llmgw_node_memory_available_bytes", "gauge", "Memory available (MemAvailable)",
           _machine("memory_available_bytes")),
    Family("llmgw_node_pressure_ratio", "gauge",
           "Share of the window in which some (kind=some) or all (kind=full) tasks stalled on the resource",
           _pressure),
    Family("llmgw_node_disk_bytes", "gauge", "Size of the filesystem mounted at mount", _disks("bytes")),
    Family("llmgw_node_disk_used_bytes", "gauge", "Used space of the filesystem mounted at mount",
           _disks("used_bytes")),
    Family("llmgw_shard_cpu_cores", "gauge", "CPU cores the engine used, the window's mean",
           _shards("cpu_cores", "mean")),
    Family("llmgw_shard_cpu_cores_max", "gauge", "CPU cores the engine used, max of the window's samples",
           _shards("cpu_cores", "max")),
    Family("llmgw_shard_memory_bytes", "gauge", "Resident memory of the engine's processes", _shards("memory_bytes")),
    Family("llmgw_shard_gpu_memory_bytes", "gauge", "GPU memory of the engine's processes, on all cards",
           _shards("gpu_memory_bytes")),
    # A summary: the quantile label is its own (promtool refuses it on a gauge); its
    # running total is the separate counter below, as the dashboards name it.
    Family("llmgw_shard_runqueue_wait_seconds", "summary",
           "How long the engine's threads waited for a CPU, per wait, quantile of the window", _waits),
    Family("llmgw_shard_cpu_quota_cores", "gauge", "The engine's CFS CPU quota in cores (absent without one)",
           _shards("cpu_quota_cores")),
    Family("llmgw_shard_cpu_throttled_ratio", "gauge",
           "Share of the engine's CFS periods in the window in which it was throttled",
           _shards("cpu_throttled_ratio")),
    Family("llmgw_shard_cpu_throttled_seconds_total", "counter",
           "Time the engine's cgroup was throttled, the kernel's own cumulative count",
           _shards("cpu_throttled_seconds_total")),
    Family("llmgw_shard_threads", "gauge", "Threads of the engine's processes", _shards("threads")),
    Family("llmgw_shard_gpu_utilization_ratio", "gauge",
           "The engine's share of its GPUs' time (NVML per-process SM samples), the window's mean over its cards",
           _shards("gpu_utilization_percent", per=100)),
    Family("llmgw_shard_gpu_utilization_max_ratio", "gauge",
           "The engine's share of a GPU's time, max of the window's samples on any of its cards",
           _shards("gpu_utilization_max_percent", per=100)),
    Family("llmgw_shard_requests_waiting", "gauge", "Requests queued in the engine, from its own metrics",
           _shards("requests_waiting")),
    Family("llmgw_shard_requests_running", "gauge", "Requests the engine is running, from its own metrics",
           _shards("requests_running")),
    Family("llmgw_shard_kv_cache_usage_ratio", "gauge", "The engine's KV-cache use (0-1), from its own metrics",
           _shards("kv_cache_usage_ratio")),
    Family("llmgw_shard_starved", "gauge",
           "1 if the engine was CPU-starved (kind=cpu_starved) or CPU-starved with idle GPUs (kind=host_bound)"
           " in the window, else 0; absent when not judged",
           _starved),
    Family("llmgw_shard_runqueue_wait_seconds_total", "counter",
           "Time the engine's threads spent waiting for a CPU, since the agent started",
           _shards("runqueue_wait_seconds", "cumulative")),
    Family("llmgw_shard_runqueue_wait_per_slice_seconds", "gauge",
           "Mean wait for a CPU per timeslice in the window (schedstat)",
           _shards("runqueue_wait_seconds", "mean")),
    Family("llmgw_gpu_utilization_percent", "gauge", "GPU utilisation, the window's mean",
           _gpus("utilization_percent")),
    Family("llmgw_gpu_memory_used_bytes", "gauge", "GPU memory used", _gpus("memory_used_bytes")),
    Family("llmgw_gpu_memory_total_bytes", "gauge", "GPU memory in total", _gpus("memory_total_bytes")),
    Family("llmgw_gpu_memory_bandwidth_utilization_percent", "gauge", "Time the GPU memory was read or written",
           _gpus("memory_bandwidth_percent")),
    Family("llmgw_gpu_sm_clock_hertz", "gauge", "SM clock", _gpus("sm_clock_hz")),
    Family("llmgw_gpu_ecc_uncorrected_errors", "gauge", "Uncorrected ECC errors since the driver loaded",
           _gpus("ecc_uncorrected")),
    Family("llmgw_gpu_temperature_celsius", "gauge", "GPU temperature", _gpus("temperature_celsius")),
    Family("llmgw_gpu_power_watts", "gauge", "GPU power draw", _gpus("power_watts")),
    Family("llmgw_gpu_energy_joules_total", "counter", "GPU energy since the driver loaded",
           _gpus("energy_joules")),
)  # fmt: skip

FAMILY_NAMES = frozenset(f.name for f in FAMILIES)


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
            labels.info = labels.base + "".join(
                f',{k}="{escape(str(reg.get(k, "")))}"' for k in ("hostname", "kernel", "agent_version", "backend")
            )
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
            nodes.append((state, labels, fresh))
        # Nodes that are gone leave the cache with the registry.
        if len(self._labels) > len(nodes):
            known = {s.node for s, _, _ in nodes}
            self._labels = {k: v for k, v in self._labels.items() if k in known}

        out: list[str] = []
        for family in FAMILIES:
            out.append(f"# HELP {family.name} {family.help}\n# TYPE {family.name} {family.type}\n")
            name = family.name
            if family.name == "llmgw_node_up":
                out.extend(f"{name}{{{labels.base}}} {1 if fresh else 0}\n" for _, labels, fresh in nodes)
                continue
            if family.name == "llmgw_node_info":
                out.extend(f"{name}{{{labels.info}}} 1\n" for _, labels, _ in nodes)
                continue
            if family.name == "llmgw_node_sample_age_seconds":
                for state, labels, _ in nodes:
                    if (age := state.age(now)) is not None:
                        out.append(f"{name}{{{labels.base}}} {fmt(round(age, 3))}\n")
                continue
            for state, labels, fresh in nodes:
                if not fresh or state.heartbeat is None:
                    continue
                try:
                    lines = [f"{name}{{{ls}}} {fmt(v)}\n" for ls, v in family.samples(labels, state.heartbeat)]
                except Exception:  # one bad node never fails the scrape
                    self.errors += 1
                    log.exception("node %s left out of %s", state.node, name)
                    continue
                out.extend(lines)
        return "".join(out)
