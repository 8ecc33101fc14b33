"""The machine as a whole, from /proc: CPU utilisation, CPU count, load,
memory, disks and CPU pressure.

CPU utilisation is a rate, read at every sample; the rest are gauges, read once
per window (their last value is what a window reports). Anything that cannot
be read is absent from the result, never 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sampler.sources import procfs

log = logging.getLogger(__name__)


class _LogOnce:
    """One log line per distinct problem, not one per sample."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, level: int, msg: str) -> None:
        if msg not in self._seen:
            self._seen.add(msg)
            log.log(level, msg)


class MachineCpuSampler:
    """CPU utilisation across all cores between two readings of /proc/stat,
    and the share stolen by the hypervisor (`steal`, apart: a guest's CPU
    that the host gave to someone else was not busy with our work).

    The first reading has nothing to compare with and yields None; so does a
    reading where a busy counter went backwards (CPU hot-unplug, a
    virtualised /proc), rather than a negative or a made-up value. iowait
    alone may go backwards (the kernel documents it: a CPU's idle time is
    moved between idle and iowait after the fact), so idle and iowait are
    judged as their sum; steal going backwards costs the steal figure only.
    """

    # user nice system irq softirq: the busy counters, each must not go backwards
    BUSY_FIELDS = (0, 1, 2, 5, 6)

    def __init__(self, proc: Path) -> None:
        self._path = proc / "stat"
        self._prev: procfs.CpuTimes | None = None
        self._log = _LogOnce()
        self.steal: float | None = None  # the last sample's stolen share, percent

    def sample(self) -> float | None:
        self.steal = None
        try:
            cur = procfs.parse_cpu_times(procfs.read_bytes(self._path))
        except (OSError, procfs.ProcParseError) as e:
            self._log(logging.WARNING, f"machine CPU not measured: {e}")
            self._prev = None
            return None
        prev, self._prev = self._prev, cur
        if prev is None:
            return None
        if len(cur.fields) != len(prev.fields) or cur.idle < prev.idle or any(
            c < p for i, (c, p) in enumerate(zip(cur.fields, prev.fields, strict=True)) if i in self.BUSY_FIELDS
        ):
            log.debug("/proc/stat counters went backwards; no CPU value for this sample")
            return None
        d_steal = cur.steal - prev.steal
        d_total = (cur.busy - prev.busy) + (cur.idle - prev.idle) + max(0, d_steal)
        if d_total <= 0:
            return None  # no tick elapsed: nothing measured, not 0% busy
        if d_steal >= 0:
            self.steal = 100.0 * d_steal / d_total
        return 100.0 * (cur.busy - prev.busy) / d_total


class MountProbe:
    """statvfs of mount points, each on a thread of its own with one deadline
    for them all: statvfs on a hung network mount blocks (uninterruptibly)
    until the server answers, and must cost neither the sampling thread nor
    the event loop more than the deadline. A mount that did not answer is said
    once, and skipped (its call still waiting) until it answers; then said again."""

    def __init__(self, statvfs: Callable[[str], os.statvfs_result] = os.statvfs, deadline: float = 1.0) -> None:
        self._statvfs, self.deadline = statvfs, deadline
        self._waiting: dict[str, threading.Event] = {}  # mount -> its call, still not returned

    def measure(self, paths: list[str]) -> dict[str, os.statvfs_result | OSError]:
        """Each path's statvfs or its error; a path that did not answer in time is absent."""
        calls: dict[str, tuple[threading.Event, list[Any]]] = {}
        for path in paths:
            if (waiting := self._waiting.get(path)) is not None and not waiting.is_set():
                continue  # still hung: skipped until it answers
            done, result = threading.Event(), list[Any]()
            # A daemon thread: one stuck in a hung mount must not hold the process at exit.
            threading.Thread(target=self._call, args=(path, done, result), name="statvfs", daemon=True).start()
            calls[path] = (done, result)
        deadline = time.monotonic() + self.deadline
        out: dict[str, os.statvfs_result | OSError] = {}
        for path, (done, result) in calls.items():
            if done.wait(max(0.0, deadline - time.monotonic())):
                if self._waiting.pop(path, None) is not None:
                    log.warning("disk %s answers again", path)
                out[path] = result[0]
            elif path not in self._waiting:
                log.warning("disk %s did not answer within %.1f s: left out until it does", path, self.deadline)
                self._waiting[path] = done
            else:
                self._waiting[path] = done
        return out

    def _call(self, path: str, done: threading.Event, result: list[Any]) -> None:
        try:
            result.append(self._statvfs(path))
        except OSError as e:
            result.append(e)
        finally:
            done.set()


class MachineGaugeReader:
    """Load, memory, CPU count and disks: each read on its own, each absent
    when its file is missing or malformed."""

    def __init__(self, proc: Path, host_root: Path | None = None, mounts: MountProbe | None = None) -> None:
        self._proc = proc
        self._host_root = host_root
        self._log = _LogOnce()
        self.mounts = mounts or MountProbe()

    def _read(self, name: str) -> bytes | None:
        try:
            return procfs.read_bytes(self._proc / name)
        except OSError as e:
            self._log(logging.INFO, f"{self._proc / name} unreadable, left out: {e.strerror}")
            return None

    def read(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        stat = self._read("stat")
        if stat is not None and (n := procfs.count_cpus(stat)) > 0:
            out["cpus"] = n
        if (data := self._read("loadavg")) is not None:
            try:
                l1, l5, l15 = procfs.parse_loadavg(data)
                out["load"] = {"1m": l1, "5m": l5, "15m": l15}
            except procfs.ProcParseError as e:
                self._log(logging.WARNING, str(e))
        if (data := self._read("meminfo")) is not None:
            mem = procfs.parse_meminfo(data)
            # MemAvailable: Linux 3.14. Without it "used" would be a guess.
            if "MemTotal" in mem:
                out["memory_bytes"] = mem["MemTotal"]
                if "MemAvailable" in mem:
                    out["memory_available_bytes"] = mem["MemAvailable"]
                    out["memory_used_bytes"] = mem["MemTotal"] - mem["MemAvailable"]
            else:
                self._log(logging.WARNING, f"{self._proc / 'meminfo'}: no MemTotal, memory left out")
        disks = self.read_disks()
        if disks is not None:
            out["disks"] = disks
        return out

    def _mount_table(self) -> tuple[bytes | None, str]:
        """The host's mount table and the prefix that reaches its mount points.

        Pid 1 of the proc root is the host's init (the agent is in the host's
        PID namespace), so its mount table is the host's, not the container's
        overlay. Its mount points are reached through `host_root` (the host's
        / mounted into the container, as node_exporter's `--path.rootfs`) or,
        without one, through `/proc/1/root`. Where neither can be entered
        (not root, a fake tree, a protected pid 1), the agent's own table,
        reached directly: on a host that is the host's."""
        root = self._host_root if self._host_root is not None else self._proc / "1" / "root"
        try:
            os.statvfs(root)
            info = procfs.read_bytes(self._proc / "1" / "mountinfo")
        except OSError as e:
            if self._host_root is not None:
                self._log(logging.WARNING, f"host disks not read through {root} ({e}): the agent's own mounts")
            return self._read("self/mountinfo"), ""
        return info, str(root).rstrip("/")

    def read_disks(self) -> list[dict[str, Any]] | None:
        info, prefix = self._mount_table()
        fs = self._read("filesystems")
        if info is None or fs is None:
            return None
        try:
            mounts = procfs.real_mounts(procfs.parse_mountinfo(info), procfs.parse_nodev_filesystems(fs))
        except procfs.ProcParseError as e:
            self._log(logging.WARNING, str(e))
            return None
        disks = []
        measured = self.mounts.measure([prefix + m.mount_point for m in mounts])
        for m in mounts:
            st = measured.get(prefix + m.mount_point)
            if st is None:
                continue  # did not answer in time (said once by the probe)
            if isinstance(st, OSError):
                self._log(logging.INFO, f"disk {m.mount_point} left out: {st.strerror}")
                continue
            total = st.f_blocks * st.f_frsize
            if total == 0:
                continue
            # used as df counts it: blocks not free, reserved blocks included.
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            disks.append({"mount": m.mount_point, "bytes": total, "used_bytes": used})
        return disks


class PressureReader:
    """Share of a window in which some (or all) tasks stalled on a resource
    (cpu, memory, io), from the PSI stall totals (microseconds) at the
    window's start and end: exact over the window, where the kernel's avg10
    is a decaying average over ten seconds. A resource the kernel does not
    report is absent."""

    RESOURCES = ("cpu", "memory", "io")

    def __init__(self, proc: Path) -> None:
        self._dir = proc / "pressure"
        self._log = _LogOnce()

    def read(self) -> dict[str, dict[str, int]] | None:
        out: dict[str, dict[str, int]] = {}
        for resource in self.RESOURCES:
            try:
                out[resource] = procfs.parse_pressure(procfs.read_bytes(self._dir / resource))
            except (OSError, procfs.ProcParseError) as e:
                # No PSI: CONFIG_PSI unset, psi=0 on the command line, or a kernel before 4.20.
                self._log(logging.INFO, f"{resource} pressure not measured: {e}")
        return out or None

    @staticmethod
    def share(
        start: dict[str, dict[str, int]] | None, end: dict[str, dict[str, int]] | None, seconds: float
    ) -> dict[str, dict[str, float]] | None:
        if start is None or end is None or seconds <= 0:
            return None
        out: dict[str, dict[str, float]] = {}
        for resource in start.keys() & end.keys():
            a, b = start[resource], end[resource]
            kinds: dict[str, float] = {k: round(min(1.0, (b[k] - a[k]) / 1e6 / seconds), 4)
                                       for k in ("some", "full") if k in a and k in b and b[k] >= a[k]}  # fmt: skip
            if kinds:
                out[resource] = kinds
        return out or None
