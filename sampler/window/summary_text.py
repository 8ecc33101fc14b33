"""A window summary as text for a terminal: what `sample` prints.
A value that was not measured prints as a dash, never as 0."""

from __future__ import annotations

from typing import Any

DASH = "—"


def _bytes(n: int | None) -> str:
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _stats(s: dict[str, float] | None, fmt: str) -> str:
    if s is None:
        return f"{DASH} mean  {DASH} p95  {DASH} max"
    return f"{s['mean']:{fmt}} mean  {s['p95']:{fmt}} p95  {s['max']:{fmt}} max"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return DASH if value is None else f"{value:{fmt}}{unit}"


def _gpu_lines(summary: dict[str, Any]) -> list[str]:
    if "gpu_error" in summary:
        return [f"GPU      {DASH} ({summary['gpu_error']})"]
    if "gpus" not in summary:
        return []
    if not summary["gpus"]:
        return ["GPU      none"]
    lines = []
    for g in summary["gpus"]:
        head = f"GPU {g['index']}  {g.get('name', DASH)}"
        if g.get("lost"):
            lines.append(f"{head}  lost (NVML will be re-initialised)")
            continue
        clock = g.get("sm_clock_hz")
        lines.append(
            f"{head}  util {_num(g.get('utilization_percent'), '.0f', '%')}"
            f" (p95 {_num(g.get('utilization_p95_percent'), '.0f')},"
            f" max {_num(g.get('utilization_max_percent'), '.0f')})"
            f"  mem {_bytes(g.get('memory_used_bytes'))} of {_bytes(g.get('memory_total_bytes'))}"
            f"  bw {_num(g.get('memory_bandwidth_percent'), '.0f', '%')}"
            f"  {_num(None if clock is None else clock / 1e6, '.0f', ' MHz')}"
            f"  {_num(g.get('temperature_celsius'), '.0f', ' C')}  {_num(g.get('power_watts'), '.0f', ' W')}"
            f"  ecc {_num(g.get('ecc_uncorrected'), 'd')}"
        )
    return lines


def render(summary: dict[str, Any]) -> str:
    m = summary.get("machine", {})
    w = summary["window"]
    backend = summary["backend"]
    if summary.get("backend_reason"):
        backend += f" ({summary['backend_reason']})"
    lines = [
        f"node {summary['node']}  backend {backend}  window {w['end'] - w['start']:.1f} s, {w['samples']} samples",
        f"cpu      {_stats(m.get('cpu_percent'), '6.1f')}  (%, {m.get('cpus', DASH)} CPUs)",
    ]
    load = m.get("load")
    lines.append("load     " + (f"{load['1m']:.2f} {load['5m']:.2f} {load['15m']:.2f}" if load else DASH))
    lines.append(
        f"memory   {_bytes(m.get('memory_used_bytes'))} used of {_bytes(m.get('memory_bytes'))}"
        f" ({_bytes(m.get('memory_available_bytes'))} available)"
    )
    for resource, kinds in (m.get("pressure") or {}).items():
        parts = [f"{k} {v * 100:.1f}%" for k, v in kinds.items()]
        lines.append(f"pressure {resource} " + ", ".join(parts) + " of the window")
    disks = m.get("disks")
    if disks is None:
        lines.append(f"disk     {DASH}")
    for d in disks or ():
        lines.append(f"disk     {d['mount']}  {_bytes(d['used_bytes'])} used of {_bytes(d['bytes'])}")
    if (bpf := summary.get("bpf")) and bpf.get("programs"):
        seconds = w["end"] - w["start"]
        runs = sum(p["runs"] for p in bpf["programs"].values())
        busy = sum(p["run_time_ns"] for p in bpf["programs"].values()) / 1e9
        share = f", {100 * busy / seconds:.3f}% of one CPU" if seconds > 0 else ""
        lines.append(f"kernel   programs ran {runs} times for {busy * 1e3:.2f} ms{share}")
    lines.extend(_gpu_lines(summary))
    shards = summary.get("shards", [])
    lines.append("")
    if not shards:
        lines.append("engines  none found")
        return "\n".join(lines)
    lines.append(f"{'ENGINE':<20} {'PGID':>8} {'COMMAND':<16} {'CORES':>6} {'p95':>6} {'max':>6} {'MEMORY':>10}"
                 f" {'GPU MEMORY':>10}")
    for s in shards:
        cores = s.get("cpu_cores")
        c = [f"{cores[k]:6.2f}" for k in ("mean", "p95", "max")] if cores else [f"{DASH:>6}"] * 3
        pgids = s.get("pgids") or []
        pgid = str(pgids[0]) if len(pgids) == 1 else (f"{len(pgids)} grps" if pgids else DASH)
        name = s["id"] if len(s["id"]) <= 20 else s["id"][:19] + "…"
        command = (s.get("command") or DASH)[:16]
        lines.append(f"{name:<20} {pgid:>8} {command:<16} {' '.join(c)} {_bytes(s.get('memory_bytes')):>10}"
                     f" {_bytes(s.get('gpu_memory_bytes')):>10}")
    lines.extend(_host_lines(shards))
    return "\n".join(lines)


# What holds an engine back, where any engine has a figure for it (the
# control plane judges starvation from these; `sample` shows the inputs).
_HOST_COLUMNS = (("QUOTA", "cpu_quota_cores", ".2f", 1.0), ("THROTTLED", "cpu_throttled_ratio", ".0%", 1.0),
                 ("THREADS", "threads", "d", 1.0), ("GPU BUSY", "gpu_utilization_percent", ".0%", 0.01),
                 ("WAITING", "requests_waiting", ".0f", 1.0), ("RUNNING", "requests_running", ".0f", 1.0),
                 ("KV CACHE", "kv_cache_usage_ratio", ".0%", 1.0))  # fmt: skip


def _host_lines(shards: list[dict[str, Any]]) -> list[str]:
    columns = [c for c in _HOST_COLUMNS if any(s.get(c[1]) is not None for s in shards)]
    if not columns:
        return []
    lines = ["", f"{'ENGINE':<20} " + " ".join(f"{title:>9}" for title, *_ in columns)]
    for s in shards:
        name = s["id"] if len(s["id"]) <= 20 else s["id"][:19] + "…"
        cells = []
        for _, key, fmt, scale in columns:
            value = s.get(key)
            cells.append(f"{DASH:>9}" if value is None else f"{value * scale if scale != 1.0 else value:>9{fmt}}")
        lines.append(f"{name:<20} " + " ".join(cells))
    return lines
