"""The heartbeat and the registration, declared once: every field's key,
type, bounds and unit (docs/wire-format.md).

These are msgspec `Struct`s: the control plane decodes a body straight into
them, which checks every type and bound on the way (wire/heartbeat.py), and
the same declarations name the field and the reason when a body is refused
(wire/explain.py). A value not measured is absent or `null` (`None` here);
keys this version does not know are ignored, so a newer agent may add keys,
and none may be renamed.

Lists (tuples here: a fleet's held heartbeats are then no work for a full
collection) marked `EACH` cost a bad entry that entry alone: it is left out and
named in the answer's `dropped`. Everything else is strict: the first
problem refuses the body (400). Free text is printable (no control
characters), checked where each struct is made.

Measured on one 8-GPU, 4-engine heartbeat (4.4 KB): `json.loads` and the
hand-written checks these replace took 59 us; decoding into these structs
takes 8 (bench/heartbeat_throughput.py has the whole ingest).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import msgspec.inspect
import msgspec.structs

from wire.limits import (
    MAX_BYTES,
    MAX_CORES,
    MAX_DISKS,
    MAX_GPU_INSTANCES,
    MAX_GPUS,
    MAX_K8S_NAME,
    MAX_NAME,
    MAX_PGIDS,
    MAX_QUOTA_CORES,  # fmt: skip
    MAX_SHARDS,
    MAX_TEXT,
    NODE_ID,
)

EACH = {"each": True}  # a list whose bad entries are left out one by one


def _unit(unit: str, ge: float, le: float) -> msgspec.Meta:
    return msgspec.Meta(ge=ge, le=le, extra={"unit": unit})


def _text(most: int) -> msgspec.Meta:
    return msgspec.Meta(min_length=1, max_length=most, extra={"text": True})


NodeId = Annotated[str, msgspec.Meta(pattern=f"^{NODE_ID.pattern}$",
                                     extra={"reason": "must be 1-253 letters, digits, '.', '-' or '_'"})]  # fmt: skip
Name = Annotated[str, _text(MAX_NAME)]  # model, replica and shard names
K8sName = Annotated[str, _text(MAX_K8S_NAME)]  # a pod's; namespaces and containers are 63
Text = Annotated[str, _text(MAX_TEXT)]  # anything else from the machine: kernels, mounts, reasons
Bytes = Annotated[int, _unit("bytes", ge=0, le=MAX_BYTES)]
Count = Annotated[int, _unit("count", ge=0, le=1 << 31)]
Pid = Annotated[int, _unit("pid", ge=1, le=1 << 31)]
Cpus = Annotated[int, _unit("cpus", ge=1, le=1 << 20)]
AffinityCpus = Annotated[int, _unit("cpus", ge=0, le=1 << 20)]
GpuIndex = Annotated[int, _unit("index", ge=0, le=4095)]
Errors = Annotated[int, _unit("errors", ge=0, le=MAX_BYTES)]
Seq = Annotated[int, _unit("heartbeats", ge=0, le=2**62)]
SampleCount = Annotated[int, _unit("samples", ge=0, le=10_000_000)]
Percent = Annotated[float, _unit("percent", ge=0, le=100)]
Ratio = Annotated[float, _unit("ratio", ge=0, le=1)]
Cores = Annotated[float, _unit("cores", ge=0, le=MAX_CORES)]
QuotaCores = Annotated[float, _unit("cores", ge=0, le=MAX_QUOTA_CORES)]
Tasks = Annotated[float, _unit("tasks", ge=0, le=1e7)]
WaitSeconds = Annotated[float, _unit("seconds", ge=0, le=1e12)]
ThrottledSeconds = Annotated[float, _unit("seconds", ge=0, le=1e9)]
ThrottledSecondsTotal = Annotated[float, _unit("seconds", ge=0, le=1e15)]
ThreadsPerCore = Annotated[float, _unit("threads", ge=0, le=1e12)]
Requests = Annotated[float, _unit("requests", ge=0, le=1e9)]
Hertz = Annotated[float, _unit("hertz", ge=0, le=1e11)]
BytesPerSecond = Annotated[float, _unit("bytes per second", ge=0, le=1e15)]  # NVLink 5: 1.8e12
GpmSeconds = Annotated[float, _unit("seconds", ge=0.1, le=1e6)]  # GPM's interval: 100 ms at the shortest
Celsius = Annotated[float, _unit("celsius", ge=-100, le=500)]
Watts = Annotated[float, _unit("watts", ge=0, le=1e6)]
Joules = Annotated[float, _unit("joules", ge=0, le=1e18)]
UnixTime = Annotated[float, _unit("unix seconds", ge=0, le=1e11)]


class _Checked(msgspec.Struct, gc=False, omit_defaults=True, frozen=True):
    """A struct whose free text is checked printable as it is made (msgspec
    bounds a string's length, not its characters). `gc=False`: they hold no
    cycles, and a fleet's thousands of held heartbeats cost a full collection
    nothing to scan. Frozen: what a node sent is held as it came, never
    edited on its way (the control plane's judgements are kept beside it)."""

    # Filled in from the declarations once every struct exists (`_find_checks`).
    _text_fields: ClassVar[tuple[str, ...]] = ()
    _not_before: ClassVar[tuple[tuple[str, str], ...]] = ()  # (field, the field it may not be less than)
    # Fields written even when not measured, as `null` (docs/summary.md promises their keys); every
    # other field not measured is absent (`json_values`).
    _always_sent: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for key in self._text_fields:
            value = getattr(self, key)
            if value is not None and not value.isprintable():
                raise ValueError(f"{key}: must be printable text (no control characters)")
        for key, other in self._not_before:
            if getattr(self, key) < getattr(self, other):
                raise ValueError(f"{key}: must not be less than {other}")


class Stats(_Checked, frozen=True):
    """A window's summary of a rate sampled many times: its time-weighted mean, p95 and max."""

    mean: float
    p95: float
    max: float


class PercentStats(Stats, frozen=True):
    mean: Percent
    p95: Percent
    max: Percent


class CoreStats(Stats, frozen=True):
    mean: Cores
    p95: Cores
    max: Cores


class Load(_Checked, rename={"one": "1m", "five": "5m", "fifteen": "15m"}, frozen=True):
    one: Tasks
    five: Tasks
    fifteen: Tasks


class Stall(_Checked, frozen=True):
    """Share of the window in which some, or all, tasks stalled (PSI)."""

    some: Ratio | None = None
    full: Ratio | None = None


class Pressure(_Checked, frozen=True):
    cpu: Stall | None = None
    memory: Stall | None = None
    io: Stall | None = None


class Disk(_Checked, frozen=True):
    mount: Text
    bytes: Bytes
    used_bytes: Bytes


class Machine(_Checked, frozen=True):
    _always_sent = ("cpu_percent",)

    cpus: Cpus | None = None
    cpu_percent: PercentStats | None = None
    cpu_steal_percent: PercentStats | None = None
    load: Load | None = None
    memory_bytes: Bytes | None = None
    memory_used_bytes: Bytes | None = None
    memory_available_bytes: Bytes | None = None
    disks: Annotated[tuple[Disk, ...], msgspec.Meta(max_length=MAX_DISKS, extra=EACH)] | None = None
    disks_left_out: Count | None = None
    pressure: Pressure | None = None


class RunqueueWait(_Checked, frozen=True):
    """How long the engine's threads waited for a CPU, in seconds."""

    p50: WaitSeconds | None = None
    p99: WaitSeconds | None = None
    mean: WaitSeconds | None = None
    total: WaitSeconds | None = None
    cumulative: WaitSeconds | None = None


class Shard(_Checked, frozen=True):
    """One engine the heartbeat reports."""

    _always_sent = ("cpu_cores", "memory_bytes")

    id: Name
    model: Name | None = None
    replica: Name | None = None
    namespace: K8sName | None = None
    pod: K8sName | None = None
    container: K8sName | None = None
    selector: Text | None = None
    command: Text | None = None
    metrics_error: Text | None = None  # why the engine's own metrics gave no figures
    pgid: Pid | None = None
    pgids: Annotated[tuple[Pid, ...], msgspec.Meta(max_length=MAX_PGIDS)] | None = None
    cpu_cores: CoreStats | None = None
    runqueue_wait_seconds: RunqueueWait | None = None
    memory_bytes: Bytes | None = None
    gpu_memory_bytes: Bytes | None = None
    cpu_quota_cores: QuotaCores | None = None
    cpu_throttled_ratio: Ratio | None = None
    cpu_throttled_seconds: ThrottledSeconds | None = None
    cpu_throttled_seconds_total: ThrottledSecondsTotal | None = None
    threads: Count | None = None
    cpu_affinity_cores: AffinityCpus | None = None
    threads_per_quota_core: ThreadsPerCore | None = None
    gpu_utilization_percent: Percent | None = None
    gpu_utilization_max_percent: Percent | None = None
    gpu_memory_bandwidth_percent: Percent | None = None
    gpu_memory_bandwidth_max_percent: Percent | None = None
    # The cards it holds a context on, and what their SMs did (GPM: the mean over those cards that say).
    gpu_indices: Annotated[tuple[GpuIndex, ...], msgspec.Meta(max_length=MAX_GPUS)] | None = None
    gpu_sm_activity_percent: Percent | None = None
    gpu_tensor_activity_percent: Percent | None = None
    requests_waiting: Requests | None = None
    requests_running: Requests | None = None
    kv_cache_usage_ratio: Ratio | None = None


class _GpmFigures(_Checked, frozen=True, kw_only=True):
    """What a card's (or a MIG instance's) SMs did (GPM, sampler/gpu/gpm.py):
    the window's mean, p95 and max over GPM's intervals, and their length."""

    gpm_interval_seconds: GpmSeconds | None = None
    sm_activity_percent: Percent | None = None
    sm_activity_p95_percent: Percent | None = None
    sm_activity_max_percent: Percent | None = None
    sm_occupancy_percent: Percent | None = None
    sm_occupancy_p95_percent: Percent | None = None
    sm_occupancy_max_percent: Percent | None = None
    tensor_activity_percent: Percent | None = None
    tensor_activity_p95_percent: Percent | None = None
    tensor_activity_max_percent: Percent | None = None
    tensor_hmma_activity_percent: Percent | None = None
    tensor_hmma_activity_p95_percent: Percent | None = None
    tensor_hmma_activity_max_percent: Percent | None = None
    dram_bandwidth_percent: Percent | None = None
    dram_bandwidth_p95_percent: Percent | None = None
    dram_bandwidth_max_percent: Percent | None = None
    pcie_tx_bytes_per_second: BytesPerSecond | None = None
    pcie_tx_p95_bytes_per_second: BytesPerSecond | None = None
    pcie_tx_max_bytes_per_second: BytesPerSecond | None = None
    pcie_rx_bytes_per_second: BytesPerSecond | None = None
    pcie_rx_p95_bytes_per_second: BytesPerSecond | None = None
    pcie_rx_max_bytes_per_second: BytesPerSecond | None = None
    nvlink_tx_bytes_per_second: BytesPerSecond | None = None
    nvlink_tx_p95_bytes_per_second: BytesPerSecond | None = None
    nvlink_tx_max_bytes_per_second: BytesPerSecond | None = None
    nvlink_rx_bytes_per_second: BytesPerSecond | None = None
    nvlink_rx_p95_bytes_per_second: BytesPerSecond | None = None
    nvlink_rx_max_bytes_per_second: BytesPerSecond | None = None


class GpuInstance(_GpmFigures, frozen=True):
    """A MIG instance of a card (sampler/gpu/mig.py): named by its GPU
    instance id under its card; its memory, and what its SMs did (GPM)."""

    gpu_instance_id: Annotated[int, _unit("id", ge=0, le=255)]
    compute_instance_id: Annotated[int, _unit("id", ge=0, le=255)] | None = None
    uuid: Text | None = None
    memory_used_bytes: Bytes | None = None
    memory_total_bytes: Bytes | None = None


class Gpu(_GpmFigures, frozen=True):
    index: GpuIndex
    uuid: Text | None = None
    name: Name | None = None
    pci_bus_id: Text | None = None
    driver_version: Text | None = None
    lost: bool | None = None
    utilization_percent: Percent | None = None
    utilization_p95_percent: Percent | None = None
    utilization_max_percent: Percent | None = None
    memory_bandwidth_percent: Percent | None = None
    sm_clock_hz: Hertz | None = None
    temperature_celsius: Celsius | None = None
    power_watts: Watts | None = None
    energy_joules: Joules | None = None
    memory_used_bytes: Bytes | None = None
    memory_total_bytes: Bytes | None = None
    ecc_uncorrected: Errors | None = None
    # What breaks it: XID errors (this window's, since the agent watched, the last code), PCIe
    # replays (this window's, NVML's count), rows of memory remapped.
    xid_errors: Count | None = None
    xid_errors_total: Count | None = None
    xid_last: Count | None = None
    pcie_replays: Count | None = None
    pcie_replays_total: Count | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    # What held its clocks back: each reason's share of the window.
    clock_event_sw_power_cap_ratio: Ratio | None = None
    clock_event_hw_slowdown_ratio: Ratio | None = None
    clock_event_sw_thermal_slowdown_ratio: Ratio | None = None
    clock_event_hw_thermal_slowdown_ratio: Ratio | None = None
    clock_event_power_brake_ratio: Ratio | None = None
    clock_event_sync_boost_ratio: Ratio | None = None
    # A card split into MIG instances: a row each (absent: not in MIG mode). The card's own figures
    # stay the whole card's: a sum over cards counts each once.
    mig_instances: Annotated[tuple[GpuInstance, ...], msgspec.Meta(max_length=MAX_GPU_INSTANCES, extra=EACH)] | None = (
        None
    )


class Window(_Checked, frozen=True):
    start: UnixTime
    end: Annotated[float, msgspec.Meta(ge=0, le=1e11, extra={"unit": "unix seconds", "not_before": "start"})]
    samples: SampleCount


class Heartbeat(_Checked, kw_only=True, frozen=True):
    """One window of one node (DESIGN.md, "The heartbeat's summary"). Its
    fields in the order a body is checked, the first problem named."""

    _always_sent = ("backend_reason", "shards")

    node: NodeId
    seq: Seq
    backend: Literal["bpf", "proc"]
    backend_reason: Text | None = None
    window: Window
    machine: Machine
    shards: Annotated[tuple[Shard, ...], msgspec.Meta(max_length=MAX_SHARDS, extra=EACH)] = ()  # none measured: absent
    shards_left_out: Count | None = None
    gpus: Annotated[tuple[Gpu, ...], msgspec.Meta(max_length=MAX_GPUS, extra=EACH)] | None = None
    gpu_error: Text | None = None
    raw: msgspec.Raw | None = None  # the window's samples while someone watches live (wire/raw.py): read only then
    # The seconds of samples the agent's ring holds now (its --hindsight), and a
    # piece of the span the control plane asked for (wire/hindsight.py): read only then.
    hindsight_held_seconds: Annotated[float, _unit("seconds", ge=0, le=1e7)] | None = None
    hindsight: msgspec.Raw | None = None


class ProgramRuns(_Checked, frozen=True):
    """One BPF program's runs in the window, from the kernel's own statistics (--bpf-stats)."""

    _always_sent = ("ns_per_run",)

    runs: Count
    run_time_ns: Annotated[int, _unit("nanoseconds", ge=0, le=2**62)]
    ns_per_run: Annotated[float, _unit("nanoseconds", ge=0, le=1e12)] | None = None


class ProgramCost(_Checked, frozen=True):
    """The kernel backend's own cost in the window."""

    _always_sent = ("dropped_forks",)

    dropped_forks: Count | None = None  # forks it could not count (its table of tasks full)
    tickless_cpus: tuple[AffinityCpus, ...] | None = None  # a running task is learnt there at its next switch
    programs: dict[str, ProgramRuns] | None = None  # with --bpf-stats


class WindowSummary(Heartbeat, kw_only=True, frozen=True):
    """A heartbeat as the agent makes it, and as `nodesampler sample --json`
    prints it (docs/summary.md): with the agent's own costs, which the
    control plane does not read (it ignores the keys it does not know)."""

    gpu_read_seconds: Annotated[float, _unit("seconds", ge=0, le=1e6)] | None = None
    bpf: ProgramCost | None = None


class Registration(_Checked, frozen=True):
    """What does not change while the agent runs."""

    node: NodeId
    hostname: Text | None = None
    kernel: Text | None = None
    agent_version: Text | None = None
    backend: Text | None = None
    backend_reason: Text | None = None
    cpus: Cpus | None = None
    memory_bytes: Bytes | None = None
    disks: Annotated[tuple[Disk, ...], msgspec.Meta(max_length=MAX_DISKS, extra=EACH)] | None = None
    gpus: Annotated[tuple[Gpu, ...], msgspec.Meta(max_length=MAX_GPUS, extra=EACH)] | None = None


def _extra(t: msgspec.inspect.Type) -> dict[str, Any]:
    if isinstance(t, msgspec.inspect.UnionType):
        return next((_extra(u) for u in t.types if not isinstance(u, msgspec.inspect.NoneType)), {})
    return (t.extra or {}) if isinstance(t, msgspec.inspect.Metadata) else {}


def _find_checks() -> None:
    for cls in (Stats, PercentStats, CoreStats, Load, Stall, Pressure, Disk, Machine, RunqueueWait, Shard, Gpu,
                Window, Heartbeat, ProgramRuns, ProgramCost, WindowSummary, Registration):  # fmt: skip
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        cls._text_fields = tuple(f.name for f in info.fields if _extra(f.type).get("text"))
        cls._not_before = tuple((f.name, _extra(f.type)["not_before"]) for f in info.fields
                                if "not_before" in _extra(f.type))  # fmt: skip


_find_checks()


def json_values(struct: msgspec.Struct) -> dict[str, Any]:
    """A struct of the schema as JSON values, keyed as on the wire: a field not
    measured is absent, but those `_always_sent` are there as `null` (an
    empty list for `shards`). A raw block, and a hindsight piece, are left as
    they are (msgspec.Raw)."""
    blocks = {key: block for key in ("raw", "hindsight") if (block := getattr(struct, key, None)) is not None}
    if blocks:
        struct = msgspec.structs.replace(struct, **dict.fromkeys(blocks))
    out: dict[str, Any] = msgspec.to_builtins(struct)
    _fill(struct, out)
    out.update(blocks)
    return out


def _fill(struct: msgspec.Struct, out: dict[str, Any]) -> None:
    always, nested = _fill_plan(type(struct))
    for name, key in always:
        if key not in out:
            out[key] = [] if getattr(struct, name) == () else None
    for name, key, kind in nested:
        value = getattr(struct, name)
        if value is None:
            continue
        if kind == "one":
            _fill(value, out[key])
        elif kind == "each":
            for item, item_out in zip(value, out[key], strict=True):
                _fill(item, item_out)
        else:
            for k, item in value.items():
                _fill(item, out[key][k])


_FillPlan = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str, str], ...]]


@functools.cache
def _fill_plan(cls: type[msgspec.Struct]) -> _FillPlan:
    """A struct's keys always sent, and the fields (one struct, a list or a
    dict of them) that lead to more: read off the declarations once, so that
    `json_values` visits nothing else (a GPU node's heartbeat: 4 us, not the
    40 of a walk of every field; /api/nodes makes one a node)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    always = getattr(cls, "_always_sent", ())
    keys = tuple((f.name, f.encode_name) for f in info.fields if f.name in always)
    nested = []
    for f in info.fields:
        t = f.type
        if isinstance(t, msgspec.inspect.UnionType):
            t = next(u for u in t.types if not isinstance(u, msgspec.inspect.NoneType))
        if isinstance(t, msgspec.inspect.Metadata):
            t = t.type
        kind, inner = "one", t
        if isinstance(t, msgspec.inspect.VarTupleType):
            kind, inner = "each", t.item_type
        elif isinstance(t, msgspec.inspect.DictType):
            kind, inner = "values", t.value_type
        if isinstance(inner, msgspec.inspect.StructType) and any(_fill_plan(inner.cls)):
            nested.append((f.name, f.encode_name, kind))
    return keys, tuple(nested)
