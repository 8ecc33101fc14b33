"""CFS bandwidth per engine: the CPU quota of the cgroups its processes run
in, how much of the window the kernel throttled them, and how many threads
they bring to that quota.

A container's quota is where "is my GPU waiting on the host?" is often
answered: a vLLM sized its thread pools from the host's 172 CPUs inside a
6-CPU quota and ran throttled in nearly every period. The kernel counts it
per cgroup: v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` and `cpu.stat`
(`nr_periods`, `nr_throttled`, `throttled_time` in ns); v2 `cpu.max` and
`cpu.stat` (`throttled_usec`). An engine's limit is the nearest cgroup on
its processes' path that has a quota (a container's, else its pod's).

Read once per window, not per sample: the counters are cumulative, and the
window's share comes from their growth. No quota, or no such files, is
absent; never 0 for "unknown".

The kernel prints cpu.stat without the lock its period timer holds while it
adds a period to `nr_periods` and then, for a throttled period, to
`nr_throttled`: a read between the two sees a throttled period that has not
yet run, and a window of throttled periods shows more throttled periods than
periods. So the file is read until two readings agree (a torn reading can
never be repeated), and a share above 1 that still gets through is logged
with its readings and left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sampler.sources import cgroup_view, procfs
from sampler.sources.cgroup_view import CGROUP_ROOT
from sampler.sources.cpu_lists import parse_cpu_list

log = logging.getLogger(__name__)

V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")  # how distributions mount v1's cpu controller


@dataclass(frozen=True)
class CpuStat:
    periods: int
    throttled: int
    throttled_seconds: float


def parse_cpu_stat(data: bytes) -> CpuStat:
    """v1 (`throttled_time`, ns) or v2 (`throttled_usec`) cpu.stat."""
    fields: dict[bytes, int] = {}
    for line in data.split(b"\n"):
        key, _, value = line.partition(b" ")
        if value.strip().isdigit():
            fields[key] = int(value)
    try:
        if b"throttled_usec" in fields:
            seconds = fields[b"throttled_usec"] / 1e6
        else:
            seconds = fields[b"throttled_time"] / 1e9
        return CpuStat(fields[b"nr_periods"], fields[b"nr_throttled"], seconds)
    except KeyError as e:
        raise procfs.ProcParseError(f"cpu.stat without {e.args[0]!r}: {data[:120]!r}") from None


CPU_STAT_READS = 4  # readings microseconds apart, periods 1 ms at the least: two agree at once but for a rare tear


def read_cpu_stat(path: Path, read: Callable[[Path], bytes] | None = None) -> CpuStat:
    """cpu.stat, read until two readings agree on the period counters (see
    the module's doc), or the last of CPU_STAT_READS readings."""
    read = read or procfs.read_bytes
    stat = parse_cpu_stat(read(path))
    for _ in range(CPU_STAT_READS - 1):
        again = parse_cpu_stat(read(path))
        if (again.periods, again.throttled) == (stat.periods, stat.throttled):
            return again
        stat = again
    log.debug("%s: cpu.stat changed across %d readings", path, CPU_STAT_READS)
    return stat


def parse_cpu_max(data: bytes) -> float | None:
    """v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD") as cores; None: no quota."""
    parts = data.split()
    if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) <= 0:
        raise procfs.ProcParseError(f"cpu.max: {data[:80]!r}")
    if parts[0] == b"max":
        return None
    if not parts[0].isdigit():
        raise procfs.ProcParseError(f"cpu.max: {data[:80]!r}")
    return int(parts[0]) / int(parts[1])


def parse_cfs_quota(quota: bytes, period: bytes) -> float | None:
    """v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` as cores; None: no quota (-1)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        raise procfs.ProcParseError(f"cfs quota/period: {quota[:40]!r} / {period[:40]!r}") from None
    if q < 0:
        return None
    if p <= 0:
        raise procfs.ProcParseError(f"cfs period {p}")
    return q / p


def parse_status_threads(data: bytes) -> tuple[int | None, set[int] | None]:
    """`Threads:` and the CPUs of `Cpus_allowed_list:` in /proc/<pid>/status."""
    threads: int | None = None
    cpus: set[int] | None = None
    for line in data.split(b"\n"):
        if line.startswith(b"Threads:"):
            threads = int(line.split()[1])
        elif line.startswith(b"Cpus_allowed_list:"):
            cpus = set(parse_cpu_list(line.split(b":", 1)[1]))
    return threads, cpus


class CfsBandwidthReader:
    def __init__(self, proc: Path, cgroup_root: Path = CGROUP_ROOT) -> None:
        self._proc, self._root = proc, cgroup_root
        self._v2 = (cgroup_root / "cgroup.controllers").exists()  # the unified tree at the root
        self._prev: dict[Path, CpuStat] = {}
        self._limit_of: dict[int, Path | None] = {}  # pid -> its limiting cgroup, learnt once

    def _cpu_cgroup(self, pid: int) -> Path | None:
        """The cgroup directory of the pid's cpu controller."""
        try:
            data = procfs.read_pid_file(self._proc, pid, "cgroup")
        except procfs.ProcessGone:
            return None
        for hierarchy, controllers, path in cgroup_view.lines(data):
            if path.startswith("/.."):
                continue  # outside the agent's cgroup namespace, its root unknown: not a directory to read
            rel = path.lstrip("/")
            if hierarchy == b"0" and controllers == b"" and self._v2:
                return self._root / rel
            if b"cpu" in controllers.split(b","):
                for name in V1_CPU_DIRS:
                    if (self._root / name).is_dir():
                        return self._root / name / rel
        return None

    def _quota(self, d: Path) -> float | None:
        try:
            if self._v2:
                return parse_cpu_max(procfs.read_bytes(d / "cpu.max"))
            return parse_cfs_quota(procfs.read_bytes(d / "cpu.cfs_quota_us"),
                                   procfs.read_bytes(d / "cpu.cfs_period_us"))
        except (OSError, procfs.ProcParseError):
            return None

    def _limiting(self, d: Path) -> Path | None:
        """The nearest cgroup up from `d` with a quota: the engine's effective limit."""
        while d != self._root and self._root in d.parents:
            if self._quota(d) is not None:
                return d
            d = d.parent
        return None

    def read(self, members: dict[str, set[int]]) -> dict[str, dict[str, Any]]:
        """Per shard: quota in cores, the window's throttled share of periods and
        seconds, the kernel's cumulative throttled seconds, threads and the CPUs
        its processes may run on. A key is absent where it is not known."""
        live = set().union(*members.values()) if members else set()
        self._limit_of = {pid: d for pid, d in self._limit_of.items() if pid in live}
        stats: dict[Path, tuple[float, CpuStat, CpuStat | None]] = {}
        out: dict[str, dict[str, Any]] = {}
        for sid, pids in members.items():
            shard: dict[str, Any] = {}
            limits: set[Path] = set()
            threads, cpus, known = 0, set[int](), False
            for pid in pids:
                if pid not in self._limit_of:
                    d = self._cpu_cgroup(pid)
                    self._limit_of[pid] = self._limiting(d) if d is not None else None
                if (d := self._limit_of[pid]) is not None:
                    limits.add(d)
                try:
                    n, allowed = parse_status_threads(procfs.read_pid_file(self._proc, pid, "status"))
                except (procfs.ProcessGone, ValueError, IndexError):
                    continue
                if n is not None:
                    threads, known = threads + n, True
                if allowed is not None:
                    cpus |= allowed
            if known:
                shard["threads"] = threads
            if cpus:
                shard["cpu_affinity_cores"] = len(cpus)
            for d in limits:
                if d not in stats:
                    stats[d] = self._read_limit(d)
            self._shard_bandwidth(shard, [stats[d] for d in limits if stats[d][0] > 0])
            out[sid] = shard
        for d, (_, now, _) in stats.items():
            self._prev[d] = now
        return out

    def _read_limit(self, d: Path) -> tuple[float, CpuStat, CpuStat | None]:
        quota = self._quota(d)
        try:
            now = read_cpu_stat(d / "cpu.stat")
        except (OSError, procfs.ProcParseError) as e:
            log.debug("%s: cpu.stat unreadable: %s", d, e)
            return 0.0, CpuStat(0, 0, 0.0), None
        return quota or 0.0, now, self._prev.get(d)

    @staticmethod
    def _shard_bandwidth(shard: dict[str, Any], limits: list[tuple[float, CpuStat, CpuStat | None]]) -> None:
        """The shard's quota and throttling, summed over the cgroups that limit it."""
        if not limits:
            return  # no quota: nothing to be throttled by, and nothing to report
        quota = sum(q for q, _, _ in limits)
        shard["cpu_quota_cores"] = round(quota, 4)
        shard["cpu_throttled_seconds_total"] = round(sum(now.throttled_seconds for _, now, _ in limits), 6)
        if "threads" in shard:
            shard["threads_per_quota_core"] = round(shard["threads"] / quota, 2)
        deltas = [(now.periods - prev.periods, now.throttled - prev.throttled,
                   now.throttled_seconds - prev.throttled_seconds)
                  for _, now, prev in limits if prev is not None]  # fmt: skip
        if len(deltas) != len(limits) or any(p < 0 or t < 0 or s < 0 for p, t, s in deltas):
            return  # the first reading, or a counter that went backwards (a recreated cgroup)
        periods = sum(p for p, _, _ in deltas)
        shard["cpu_throttled_seconds"] = round(sum(s for _, _, s in deltas), 6)
        if periods <= 0:
            return  # no period ran (an idle engine): no share to speak of
        if any(t > p for p, t, _ in deltas):  # more throttled periods than periods: a reading the kernel tore
            log.warning("cpu.stat: more throttled periods than periods in a window, share left out: %s",
                        [(prev, now) for _, now, prev in limits])  # fmt: skip
            return
        shard["cpu_throttled_ratio"] = round(sum(t for _, t, _ in deltas) / periods, 4)
