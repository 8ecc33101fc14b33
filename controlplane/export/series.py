"""One map from a heartbeat to its series: every family the control plane
exports, what it is (type, help) and which fields of a heartbeat make its
samples. The exposition (`/metrics`) and the embedded history both read this
table; the pages' chart specs and the metric reference are checked against
it (tests/test_exposition.py, tests/test_pages.py). A family is added here
and nowhere else.

A family's samples are made through a `LabelMaker`, which says how a label
set is written: the exposition's makes escaped text, cached per node
(controlplane/export/exposition.py); the history's makes (name, value) tuples
(`SeriesLabels` below). The node's own label is the maker's `base`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.state.registry import Received
from wire.schema import Gpu, Shard

Sample = tuple[Any, float | int]  # (a label set as the maker writes it, value)
Samples = Callable[["LabelMaker", Received], Iterator[Sample]]


class LabelMaker(Protocol):
    base: Any  # the node's labels
    info: Any  # the node's labels and its identity (host name, kernel, agent version, backend)

    def shard(self, s: Shard) -> Any: ...
    def gpu(self, g: Gpu) -> Any: ...
    def mount(self, mount: str) -> Any: ...
    def more(self, labels: Any, *pairs: tuple[str, str]) -> Any: ...


@dataclass(frozen=True)
class NodeStatus:
    """What the control plane knows of a node besides its last heartbeat."""

    fresh: bool
    age: float | None  # seconds since its last heartbeat arrived; None before the first


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    help: str
    samples: Samples  # read from the node's last heartbeat, as the registry holds it
    # A family of the node's status, not of its heartbeat (identity and
    # freshness): made from this instead of `samples`, for stale nodes too.
    status: Callable[[LabelMaker, NodeStatus], Iterator[Sample]] | None = None
    charted: bool = False  # kept by the embedded history: what the pages chart


def _machine(key: str, stat: str | None = None) -> Samples:
    def samples(labels: LabelMaker, r: Received) -> Iterator[Sample]:
        value: Any = getattr(r.heartbeat.machine, key)
        if stat is not None and value is not None:
            value = getattr(value, stat)
        if value is not None:
            yield labels.base, value

    return samples


def _load(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    if (load := r.heartbeat.machine.load) is not None:
        for window, value in (("1m", load.one), ("5m", load.five), ("15m", load.fifteen)):
            yield labels.more(labels.base, ("window", window)), value


def _disks(key: str) -> Samples:
    def samples(labels: LabelMaker, r: Received) -> Iterator[Sample]:
        for d in r.heartbeat.machine.disks or ():
            yield labels.mount(d.mount), getattr(d, key)

    return samples


def _shards(key: str, stat: str | None = None, per: float = 1.0) -> Samples:
    def samples(labels: LabelMaker, r: Received) -> Iterator[Sample]:
        for s in r.shards:
            value = getattr(s, key)
            if stat is not None and value is not None:
                value = getattr(value, stat)
            if value is not None:
                yield labels.shard(s), value if per == 1.0 else value / per  # a division: 9.5 / 100 is 0.095

    return samples


def _waits(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    for s in r.shards:
        if (wait := s.runqueue_wait_seconds) is not None:
            for value, quantile in ((wait.p50, "0.5"), (wait.p99, "0.99")):
                if value is not None:
                    yield labels.more(labels.shard(s), ("quantile", quantile)), value


def _starved(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    for s, verdict in zip(r.shards, r.verdicts, strict=True):
        if verdict is not None:
            for kind, value in (("cpu_starved", verdict.cpu_starved), ("host_bound", verdict.host_bound),
                                ("card_held_back", verdict.card_held_back)):
                if value is not None:
                    yield labels.more(labels.shard(s), ("kind", kind)), int(value)


def _pressure(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    if (pressure := r.heartbeat.machine.pressure) is None:
        return
    for resource in ("cpu", "memory", "io"):
        if (stall := getattr(pressure, resource)) is not None:
            for kind, value in (("some", stall.some), ("full", stall.full)):
                if value is not None:
                    yield labels.more(labels.base, ("resource", resource), ("kind", kind)), value


def _gpus(key: str, per: float = 1.0) -> Samples:
    """A card's field, divided by `per` (100: a percent as a ratio, as DCGM's are)."""

    def samples(labels: LabelMaker, r: Received) -> Iterator[Sample]:
        for g in r.heartbeat.gpus or ():
            value = getattr(g, key)
            if isinstance(value, bool):
                yield labels.gpu(g), int(value)
            elif value is not None:
                yield labels.gpu(g), value if per == 1.0 else value / per

    return samples


def _instances(key: str, per: float = 1.0) -> Samples:
    """A MIG instance's field, labelled by its card and its GPU instance id:
    families of their own, so that a sum over a family counts each card once."""

    def samples(labels: LabelMaker, r: Received) -> Iterator[Sample]:
        for g in r.heartbeat.gpus or ():
            for i in g.mig_instances or ():
                if (value := getattr(i, key)) is not None:
                    value = value if per == 1.0 else value / per
                    yield labels.more(labels.gpu(g), ("gpu_instance", str(i.gpu_instance_id))), value

    return samples


# The reasons' label values -> the heartbeat's fields (sampler/gpu/gpm.py's CLOCK_EVENTS).
CLOCK_EVENT_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "power_brake",
                       "sync_boost")  # fmt: skip


def _clock_events(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    for g in r.heartbeat.gpus or ():
        for reason in CLOCK_EVENT_REASONS:
            if (value := getattr(g, f"clock_event_{reason}_ratio")) is not None:
                yield labels.more(labels.gpu(g), ("reason", reason)), value


def _left_out(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    yield labels.base, r.shards_left_out or 0  # counted by the agent and the registry: 0 is measured


def _never(labels: LabelMaker, r: Received) -> Iterator[Sample]:
    return iter(())


def _up(labels: LabelMaker, status: NodeStatus) -> Iterator[Sample]:
    yield labels.base, 1 if status.fresh else 0


def _info(labels: LabelMaker, status: NodeStatus) -> Iterator[Sample]:
    yield labels.info, 1


def _age(labels: LabelMaker, status: NodeStatus) -> Iterator[Sample]:
    if status.age is not None:
        yield labels.base, round(status.age, 3)


FAMILIES: tuple[Family, ...] = (
    Family("llmgw_node_up", "gauge", "1 if the node's last heartbeat is fresh, 0 if stale", _never, _up),
    Family("llmgw_node_info", "gauge", "The node's identity: host name, kernel, agent version, backend", _never, _info),
    Family("llmgw_node_sample_age_seconds", "gauge", "Seconds since the node's last heartbeat arrived", _never, _age),
    Family("llmgw_node_cpus", "gauge", "Online CPUs", _machine("cpus"), charted=True),
    Family("llmgw_node_shards_left_out", "gauge",
           "Engines of the node not exported: beyond the wire's or the control plane's cap (the busiest are kept)",
           _left_out),
    Family("llmgw_node_cpu_utilization_percent", "gauge", "CPU utilisation of all cores, the window's mean",
           _machine("cpu_percent", "mean"), charted=True),
    Family("llmgw_node_cpu_utilization_p95_percent", "gauge", "CPU utilisation, p95 of the window's samples",
           _machine("cpu_percent", "p95"), charted=True),
    Family("llmgw_node_cpu_utilization_max_percent", "gauge", "CPU utilisation, max of the window's samples",
           _machine("cpu_percent", "max"), charted=True),
    Family("llmgw_node_cpu_steal_percent", "gauge",
           "Share of the CPUs' time the hypervisor gave to others (steal), the window's mean; not in utilisation",
           _machine("cpu_steal_percent", "mean")),
    Family("llmgw_node_load", "gauge", "Load average over the window label", _load, charted=True),
    Family("llmgw_node_memory_bytes", "gauge", "Memory in total (MemTotal)", _machine("memory_bytes"), charted=True),
    Family("llmgw_node_memory_used_bytes", "gauge", "Memory used (MemTotal - MemAvailable)",
           _machine("memory_used_bytes"), charted=True),
    Family("llmgw_node_memory_available_bytes", "gauge", "Memory available (MemAvailable)",
           _machine("memory_available_bytes")),
    Family("llmgw_node_pressure_ratio", "gauge",
           "Share of the window in which some (kind=some) or all (kind=full) tasks stalled on the resource",
           _pressure),
    Family("llmgw_node_disk_bytes", "gauge", "Size of the filesystem mounted at mount", _disks("bytes")),
    Family("llmgw_node_disk_used_bytes", "gauge", "Used space of the filesystem mounted at mount",
           _disks("used_bytes")),
    Family("llmgw_shard_cpu_cores", "gauge", "CPU cores the engine used, the window's mean",
           _shards("cpu_cores", "mean"), charted=True),
    Family("llmgw_shard_cpu_cores_max", "gauge", "CPU cores the engine used, max of the window's samples",
           _shards("cpu_cores", "max"), charted=True),
    Family("llmgw_shard_memory_bytes", "gauge", "Resident memory of the engine's processes", _shards("memory_bytes"),
           charted=True),
    Family("llmgw_shard_gpu_memory_bytes", "gauge", "GPU memory of the engine's processes, on all cards",
           _shards("gpu_memory_bytes"), charted=True),
    # A summary: the quantile label is its own (promtool refuses it on a gauge); its
    # running total is the separate counter below, as the dashboards name it.
    Family("llmgw_shard_runqueue_wait_seconds", "summary",
           "How long the engine's threads waited for a CPU, per wait, quantile of the window", _waits, charted=True),
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
           _shards("requests_waiting"), charted=True),
    Family("llmgw_shard_requests_running", "gauge", "Requests the engine is running, from its own metrics",
           _shards("requests_running"), charted=True),
    Family("llmgw_shard_kv_cache_usage_ratio", "gauge", "The engine's KV-cache use (0-1), from its own metrics",
           _shards("kv_cache_usage_ratio"), charted=True),
    Family("llmgw_shard_starved", "gauge",
           "1 if the engine was CPU-starved (kind=cpu_starved), CPU-starved with idle GPUs (kind=host_bound), or"
           " queued behind a card held back by power or heat (kind=card_held_back) in the window, else 0; absent"
           " when not judged",
           _starved, charted=True),
    Family("llmgw_shard_runqueue_wait_seconds_total", "counter",
           "Time the engine's threads spent waiting for a CPU, since the agent started",
           _shards("runqueue_wait_seconds", "cumulative")),
    Family("llmgw_shard_runqueue_wait_per_slice_seconds", "gauge",
           "Mean wait for a CPU per timeslice in the window (schedstat)",
           _shards("runqueue_wait_seconds", "mean"), charted=True),
    Family("llmgw_gpu_utilization_percent", "gauge", "GPU utilisation, the window's mean",
           _gpus("utilization_percent"), charted=True),
    Family("llmgw_gpu_memory_used_bytes", "gauge", "GPU memory used", _gpus("memory_used_bytes"), charted=True),
    Family("llmgw_gpu_memory_total_bytes", "gauge", "GPU memory in total", _gpus("memory_total_bytes"), charted=True),
    Family("llmgw_gpu_memory_bandwidth_utilization_percent", "gauge", "Time the GPU memory was read or written",
           _gpus("memory_bandwidth_percent")),
    Family("llmgw_gpu_sm_clock_hertz", "gauge", "SM clock", _gpus("sm_clock_hz")),
    Family("llmgw_gpu_ecc_uncorrected_errors", "gauge", "Uncorrected ECC errors since the driver loaded",
           _gpus("ecc_uncorrected")),
    Family("llmgw_gpu_temperature_celsius", "gauge", "GPU temperature", _gpus("temperature_celsius"), charted=True),
    Family("llmgw_gpu_power_watts", "gauge", "GPU power draw", _gpus("power_watts"), charted=True),
    Family("llmgw_gpu_energy_joules_total", "counter", "GPU energy since the driver loaded",
           _gpus("energy_joules")),
    # What the SMs did (GPM, Hopper and later), named after DCGM's profiling fields
    # (DCGM_FI_PROF_SM_ACTIVE, _SM_OCCUPANCY, _PIPE_TENSOR_ACTIVE, _DRAM_ACTIVE, _PCIE_TX_BYTES, ...), 0-1 as theirs.
    Family("llmgw_gpu_sm_active_ratio", "gauge", "Share of the GPU's SMs busy, the window's mean (GPM)",
           _gpus("sm_activity_percent", per=100), charted=True),
    Family("llmgw_gpu_sm_active_max_ratio", "gauge", "Share of the GPU's SMs busy, the window's highest GPM interval",
           _gpus("sm_activity_max_percent", per=100)),
    Family("llmgw_gpu_sm_occupancy_ratio", "gauge", "Warps resident on the SMs, of the most possible (GPM)",
           _gpus("sm_occupancy_percent", per=100)),
    Family("llmgw_gpu_pipe_tensor_active_ratio", "gauge", "Time any tensor pipe was busy, the window's mean (GPM)",
           _gpus("tensor_activity_percent", per=100)),
    Family("llmgw_gpu_pipe_tensor_active_max_ratio", "gauge",
           "Time any tensor pipe was busy, the window's highest GPM interval",
           _gpus("tensor_activity_max_percent", per=100)),
    Family("llmgw_gpu_pipe_tensor_hmma_active_ratio", "gauge", "Time the HMMA tensor pipes were busy (GPM)",
           _gpus("tensor_hmma_activity_percent", per=100)),
    Family("llmgw_gpu_dram_active_ratio", "gauge", "DRAM bandwidth used, of the most possible (GPM)",
           _gpus("dram_bandwidth_percent", per=100)),
    Family("llmgw_gpu_pcie_tx_bytes_per_second", "gauge", "PCIe bytes a second out of the GPU (GPM)",
           _gpus("pcie_tx_bytes_per_second")),
    Family("llmgw_gpu_pcie_rx_bytes_per_second", "gauge", "PCIe bytes a second into the GPU (GPM)",
           _gpus("pcie_rx_bytes_per_second")),
    Family("llmgw_gpu_nvlink_tx_bytes_per_second", "gauge", "NVLink bytes a second out of the GPU, all links (GPM)",
           _gpus("nvlink_tx_bytes_per_second")),
    Family("llmgw_gpu_nvlink_rx_bytes_per_second", "gauge", "NVLink bytes a second into the GPU, all links (GPM)",
           _gpus("nvlink_rx_bytes_per_second")),
    # What breaks a card (DCGM's DCGM_FI_DEV_XID_ERRORS, _PCIE_REPLAY_COUNTER, _*_REMAPPED_ROWS, _ROW_REMAP_*).
    Family("llmgw_gpu_xid_errors_total", "counter", "XID errors the driver raised, since the agent watched the GPU",
           _gpus("xid_errors_total")),
    Family("llmgw_gpu_last_xid", "gauge", "The last XID error's code, since the agent watched the GPU",
           _gpus("xid_last")),
    Family("llmgw_gpu_pcie_replays_total", "counter", "PCIe replays since the driver loaded",
           _gpus("pcie_replays_total")),
    Family("llmgw_gpu_remapped_rows_correctable", "gauge", "Memory rows remapped for correctable errors",
           _gpus("remapped_rows_correctable")),
    Family("llmgw_gpu_remapped_rows_uncorrectable", "gauge", "Memory rows remapped for uncorrectable errors",
           _gpus("remapped_rows_uncorrectable")),
    Family("llmgw_gpu_row_remap_pending", "gauge", "1 if a row remapping waits for the GPU's reset",
           _gpus("row_remap_pending")),
    Family("llmgw_gpu_row_remap_failed", "gauge", "1 if a row remapping failed", _gpus("row_remap_failed")),
    Family("llmgw_gpu_clock_event_ratio", "gauge",
           "Share of the window a reason held the GPU's clocks below their maximum", _clock_events),
    # A card's MIG instances (DCGM labels its rows GPU_I_ID): families of their own beside the card's.
    Family("llmgw_gpu_instance_memory_used_bytes", "gauge", "MIG instance's memory used",
           _instances("memory_used_bytes")),
    Family("llmgw_gpu_instance_memory_total_bytes", "gauge", "MIG instance's memory in total",
           _instances("memory_total_bytes")),
    Family("llmgw_gpu_instance_sm_active_ratio", "gauge",
           "Share of the MIG instance's SMs busy, the window's mean (GPM)", _instances("sm_activity_percent", per=100)),
    Family("llmgw_gpu_instance_sm_occupancy_ratio", "gauge", "Warps resident on the MIG instance's SMs, of the most "
           "possible (GPM)", _instances("sm_occupancy_percent", per=100)),
    Family("llmgw_gpu_instance_pipe_tensor_active_ratio", "gauge",
           "Time any of the MIG instance's tensor pipes was busy, the window's mean (GPM)",
           _instances("tensor_activity_percent", per=100)),
    Family("llmgw_gpu_instance_dram_active_ratio", "gauge", "MIG instance's DRAM bandwidth used, of the most possible "
           "(GPM)", _instances("dram_bandwidth_percent", per=100)),
)  # fmt: skip

FAMILY_NAMES = frozenset(f.name for f in FAMILIES)


FlatLabels = tuple[str, ...]  # name, value, name, value, ...


class SeriesLabels:
    """Label sets as flat tuples of names and values (`FlatLabels`), the
    node's left out (the history keeps each node apart): what `series_of`
    yields. Flat: a tuple of strings is untracked by the collector the first
    time it looks, where (name, value) pairs in a tuple took a full
    collection a level, and a fleet's first heartbeats made three levels of
    them (bench/held_heartbeats_gc.py).

    One maker a node, kept by its history: a label set is made once and the
    same object comes back at each heartbeat while the engine or card keeps
    its names, so the history finds a heartbeat's series the same as the last
    one's by identity, not by hashing 80 nested tuples (9.6% of the control
    plane's time at 10,000 nodes, bench/heartbeat_throughput.py). Bounded:
    engines restarting under new names for a day start it afresh."""

    base: FlatLabels = ()
    info: FlatLabels = ()  # no charted family is the node's status
    MOST = 4096

    def __init__(self) -> None:
        # Each kind its own: a shard's key could be written to equal a label set.
        self._shards: dict[tuple[str | None, ...], FlatLabels] = {}
        self._gpus: dict[tuple[int, str | None], FlatLabels] = {}
        self._more: dict[FlatLabels, FlatLabels] = {}

    def _kept(self, made: dict[Any, FlatLabels], key: Any, labels: FlatLabels) -> FlatLabels:
        if len(made) >= self.MOST:
            made.clear()
        made[key] = labels
        return labels

    def shard(self, s: Shard) -> FlatLabels:
        key = (s.id, s.model, s.replica, s.namespace, s.pod, s.container)
        labels = self._shards.get(key)
        if labels is None:
            made = ["model", s.model or "", "replica", s.replica or "", "shard", s.id]
            for k, v in (("namespace", s.namespace), ("pod", s.pod), ("container", s.container)):
                if v is not None:
                    made += (k, v)
            labels = self._kept(self._shards, key, tuple(made))
        return labels

    def gpu(self, g: Gpu) -> FlatLabels:
        key = (g.index, g.name)
        labels = self._gpus.get(key)
        if labels is None:
            labels = self._kept(self._gpus, key, ("gpu", str(g.index), "gpu_model", g.name or ""))
        return labels

    def mount(self, mount: str) -> FlatLabels:
        return ("mount", mount)

    def more(self, labels: FlatLabels, *pairs: tuple[str, str]) -> FlatLabels:
        # Keyed by the set it makes (flat: no tuple of tuples for the collector to walk).
        key = labels + tuple(x for pair in pairs for x in pair)
        more = self._more.get(key)
        return more if more is not None else self._kept(self._more, key, key)


def label_pairs(labels: FlatLabels) -> dict[str, str]:
    return dict(zip(labels[::2], labels[1::2], strict=True))


_CHARTED_FAMILIES = tuple(f for f in FAMILIES if f.charted)
SeriesKey = tuple[str, FlatLabels]  # (family, labels)


def series_of(r: Received, labels: SeriesLabels | None = None) -> tuple[tuple[SeriesKey, ...], list[float | int]]:
    """A heartbeat's series of the families the history keeps: their keys (a
    tuple, which the collector untracks), and their values."""
    labels = labels or SeriesLabels()
    keys: list[SeriesKey] = []
    values: list[float | int] = []
    for family in _CHARTED_FAMILIES:
        name = family.name
        for made, value in family.samples(labels, r):
            keys.append((name, made))
            values.append(value)
    return tuple(keys), values
