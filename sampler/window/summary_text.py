"""A window summary as text for a terminal: what `sample` prints.
A value that was not measured prints as a dash, never as 0."""

from __future__ import annotations

from collections.abc import Sequence

from wire.schema import Gpu, Pressure, Shard, Stall, Stats, WindowSummary

DASH = "—"


def _bytes(n: int | None) -> str:
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _stats(s: Stats | None, fmt: str) -> str:
    if s is None:
        return f"{DASH} mean  {DASH} p95  {DASH} max"
    return f"{s.mean:{fmt}} mean  {s.p95:{fmt}} p95  {s.max:{fmt}} max"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return DASH if value is None else f"{value:{fmt}}{unit}"


def _gpu_lines(summary: WindowSummary) -> list[str]:
    if summary.gpu_error is not None:
        return [f"GPU      {DASH} ({summary.gpu_error})"]
    if summary.gpus is None:
        return []
    if not summary.gpus:
        return ["GPU      none"]
    lines = []
    for g in summary.gpus:
        head = f"GPU {g.index}  {g.name or DASH}"
        if g.lost:
            lines.append(f"{head}  lost (NVML will be re-initialised)")
            continue
        clock = g.sm_clock_hz
        lines.append(
            f"{head}  util {_num(g.utilization_percent, '.0f', '%')}"
            f" (p95 {_num(g.utilization_p95_percent, '.0f')},"
            f" max {_num(g.utilization_max_percent, '.0f')})"
            f"  mem {_bytes(g.memory_used_bytes)} of {_bytes(g.memory_total_bytes)}"
            f"  bw {_num(g.memory_bandwidth_percent, '.0f', '%')}"
            f"  {_num(None if clock is None else clock / 1e6, '.0f', ' MHz')}"
            f"  {_num(g.temperature_celsius, '.0f', ' C')}  {_num(g.power_watts, '.0f', ' W')}"
            f"  ecc {_num(g.ecc_uncorrected, 'd')}"
        )
        lines += _sm_lines(g)
        if faults := _faults(g):
            lines.append("  faults " + ", ".join(faults))
        for i in g.mig_instances or ():
            line = (f"  MIG instance {i.gpu_instance_id}"
                    f"  mem {_bytes(i.memory_used_bytes)} / {_bytes(i.memory_total_bytes)}")  # fmt: skip
            if i.gpm_interval_seconds is not None:
                line += (f"  SMs active {_num(i.sm_activity_percent, '.0f', '%')}"
                         f" (p95 {_num(i.sm_activity_p95_percent, '.0f')},"
                         f" max {_num(i.sm_activity_max_percent, '.0f')})"
                         f"  tensor {_num(i.tensor_activity_percent, '.0f', '%')}")  # fmt: skip
            lines.append(line)
    return lines


def _faults(g: Gpu) -> list[str]:
    """What broke on the card in the window, or waits for its reset: nothing
    printed for a card that says nothing went wrong."""
    out = []
    if g.xid_errors:
        out.append(f"{g.xid_errors} XID error{'s' if g.xid_errors > 1 else ''} (the last {g.xid_last})")
    if g.pcie_replays:
        out.append(f"{g.pcie_replays} PCIe replay{'s' if g.pcie_replays > 1 else ''}")
    if g.row_remap_pending:
        out.append("a row remapping waits for a reset")
    if g.row_remap_failed:
        out.append("a row remapping failed")
    return out


# The clock events as a line names them (sampler/gpu/gpm.py's CLOCK_EVENTS).
HELD_BY = (("clock_event_sw_power_cap_ratio", "power cap"), ("clock_event_power_brake_ratio", "power brake"),
           ("clock_event_hw_slowdown_ratio", "hw slowdown"), ("clock_event_sw_thermal_slowdown_ratio", "thermal"),
           ("clock_event_hw_thermal_slowdown_ratio", "hw thermal"), ("clock_event_sync_boost_ratio", "sync boost"))


def _sm_lines(g: Gpu) -> list[str]:
    """What the card's SMs did (GPM) and what held its clocks back: only
    where the card says (a card without GPM has no such line)."""
    lines = []
    if g.gpm_interval_seconds is not None:
        lines.append(
            f"  SMs    active {_num(g.sm_activity_percent, '.0f', '%')}"
            f" (p95 {_num(g.sm_activity_p95_percent, '.0f')}, max {_num(g.sm_activity_max_percent, '.0f')})"
            f"  occupancy {_num(g.sm_occupancy_percent, '.0f', '%')}"
            f"  tensor {_num(g.tensor_activity_percent, '.0f', '%')}"
            f"  dram {_num(g.dram_bandwidth_percent, '.0f', '%')}"
            f"  (GPM every {g.gpm_interval_seconds:.1f} s)"
        )
    shares = [(name, getattr(g, key)) for key, name in HELD_BY if getattr(g, key) is not None]
    if shares:
        held = [f"{name} {share * 100:.0f}%" for name, share in shares if share > 0]
        lines.append("  clocks held back by " + (", ".join(held) if held else "nothing"))
    return lines


def render(summary: WindowSummary) -> str:
    m = summary.machine
    w = summary.window
    backend: str = summary.backend
    if summary.backend_reason:
        backend += f" ({summary.backend_reason})"
    lines = [
        f"node {summary.node}  backend {backend}  window {w.end - w.start:.1f} s, {w.samples} samples",
        f"cpu      {_stats(m.cpu_percent, '6.1f')}  (%, {m.cpus or DASH} CPUs)",
    ]
    load = m.load
    lines.append("load     " + (f"{load.one:.2f} {load.five:.2f} {load.fifteen:.2f}" if load else DASH))
    lines.append(
        f"memory   {_bytes(m.memory_used_bytes)} used of {_bytes(m.memory_bytes)}"
        f" ({_bytes(m.memory_available_bytes)} available)"
    )
    if m.pressure is not None:
        for resource in Pressure.__struct_fields__:
            if (stall := getattr(m.pressure, resource)) is None:
                continue
            parts = [f"{k} {v * 100:.1f}%" for k in Stall.__struct_fields__ if (v := getattr(stall, k)) is not None]
            lines.append(f"pressure {resource} " + ", ".join(parts) + " of the window")
    if m.disks is None:
        lines.append(f"disk     {DASH}")
    for d in m.disks or ():
        lines.append(f"disk     {d.mount}  {_bytes(d.used_bytes)} used of {_bytes(d.bytes)}")
    if summary.bpf is not None and summary.bpf.programs:
        seconds = w.end - w.start
        runs = sum(p.runs for p in summary.bpf.programs.values())
        busy = sum(p.run_time_ns for p in summary.bpf.programs.values()) / 1e9
        share = f", {100 * busy / seconds:.3f}% of one CPU" if seconds > 0 else ""
        lines.append(f"kernel   programs ran {runs} times for {busy * 1e3:.2f} ms{share}")
    lines.extend(_gpu_lines(summary))
    shards = summary.shards
    lines.append("")
    if not shards:
        lines.append("engines  none found")
        return "\n".join(lines)
    lines.append(f"{'ENGINE':<20} {'PGID':>8} {'COMMAND':<16} {'CORES':>6} {'p95':>6} {'max':>6} {'MEMORY':>10}"
                 f" {'GPU MEMORY':>10}")
    for s in shards:
        cores = s.cpu_cores
        c = [f"{v:6.2f}" for v in (cores.mean, cores.p95, cores.max)] if cores else [f"{DASH:>6}"] * 3
        pgids = s.pgids or ()
        pgid = str(pgids[0]) if len(pgids) == 1 else (f"{len(pgids)} grps" if pgids else DASH)
        name = s.id if len(s.id) <= 20 else s.id[:19] + "…"
        command = (s.command or DASH)[:16]
        lines.append(f"{name:<20} {pgid:>8} {command:<16} {' '.join(c)} {_bytes(s.memory_bytes):>10}"
                     f" {_bytes(s.gpu_memory_bytes):>10}")
    lines.extend(_host_lines(shards))
    return "\n".join(lines)


# What holds an engine back, where any engine has a figure for it (the
# control plane judges starvation from these; `sample` shows the inputs).
_HOST_COLUMNS = (("QUOTA", "cpu_quota_cores", ".2f", 1.0), ("THROTTLED", "cpu_throttled_ratio", ".0%", 1.0),
                 ("THREADS", "threads", "d", 1.0), ("GPU BUSY", "gpu_utilization_percent", ".0%", 0.01),
                 ("WAITING", "requests_waiting", ".0f", 1.0), ("RUNNING", "requests_running", ".0f", 1.0),
                 ("KV CACHE", "kv_cache_usage_ratio", ".0%", 1.0))  # fmt: skip


def _host_lines(shards: Sequence[Shard]) -> list[str]:
    columns = [c for c in _HOST_COLUMNS if any(getattr(s, c[1]) is not None for s in shards)]
    if not columns:
        return []
    lines = ["", f"{'ENGINE':<20} " + " ".join(f"{title:>9}" for title, *_ in columns)]
    for s in shards:
        name = s.id if len(s.id) <= 20 else s.id[:19] + "…"
        cells = []
        for _, key, fmt, scale in columns:
            value = getattr(s, key)
            cells.append(f"{DASH:>9}" if value is None else f"{value * scale if scale != 1.0 else value:>9{fmt}}")
        lines.append(f"{name:<20} " + " ".join(cells))
    return lines
