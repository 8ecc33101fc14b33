"""Reading and parsing /proc.

Every reader takes the proc root (`proc: Path`), so a test points it at a tree
it wrote, and the agent in a container at the host's /proc. Reading (I/O) and
parsing (pure, on bytes) are apart, as in psutil's `_pslinux.py`.

Two errors leave this module:
- `ProcessGone`: the process exited (or its pid now belongs to another
  process). Normal and frequent; callers skip it.
- `ProcParseError`: a file that is not what the kernel writes (half-written
  fixture, a virtualised /proc that lies). Callers report nothing for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class ProcessGone(Exception):
    """The process vanished between listing and reading, or its pid was reused."""


class ProcParseError(ValueError):
    """A /proc file whose content is not in the kernel's format."""


# --- reading -----------------------------------------------------------------


def read_bytes(path: str | Path, limit: int | None = None) -> bytes:
    """The whole file, to its end, or its first `limit` bytes. A seq_file
    (mountinfo, a long cmdline) hands out a page or so per read, so a short
    read is not the end: only an empty one is (as psutil reads). os.open/os.read
    on a str path: no buffered file object and no Path joining, which together
    cost more than the read itself (8 us against 2.3 us a /proc/<pid>/stat here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, 8192 if limit is None else min(8192, limit))
        if not data:
            return data
        chunks, size = [data], len(data)
        while limit is None or size < limit:
            chunk = os.read(fd, 65536 if limit is None else min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return data if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def read_pid_file(proc: Path, pid: int, name: str, limit: int | None = None) -> bytes:
    """Read /proc/<pid>/<name> (its first `limit` bytes), turning every way a
    process can vanish into `ProcessGone` (ENOENT; ESRCH from a read racing the exit)."""
    try:
        return read_bytes(f"{proc}/{pid}/{name}", limit)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ProcessGone(pid) from e


def list_pids(proc: Path) -> list[int]:
    try:
        names = os.listdir(proc)
    except FileNotFoundError:
        return []
    return [int(n) for n in names if n.isdigit()]


# --- /proc/stat ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The aggregate `cpu` line of /proc/stat, in USER_HZ ticks."""

    busy: int  # user nice system irq softirq
    idle: int  # idle + iowait: a core waiting on the disk is not doing work
    steal: int  # time the hypervisor ran someone else: neither busy nor idle here
    fields: tuple[int, ...]  # the first eight counters, to spot any going backwards

    @property
    def total(self) -> int:
        return self.busy + self.idle + self.steal


def parse_cpu_times(data: bytes) -> CpuTimes:
    line = data.split(b"\n", 1)[0]
    parts = line.split()
    if len(parts) < 5 or parts[0] != b"cpu":
        raise ProcParseError(f"/proc/stat: first line is not the aggregate cpu line: {line[:80]!r}")
    try:
        # user nice system idle iowait irq softirq steal [guest guest_nice].
        # guest and guest_nice are already inside user and nice: not added again.
        # iowait, irq, softirq and steal arrived in 2.5/2.6 kernels; missing = 0.
        values = tuple(int(v) for v in parts[1:9])
    except ValueError:
        raise ProcParseError(f"/proc/stat: non-numeric cpu counter: {line[:80]!r}") from None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    steal = values[7] if len(values) > 7 else 0
    return CpuTimes(busy=sum(values) - idle - steal, idle=idle, steal=steal, fields=values)


def count_cpus(data: bytes) -> int:
    """Online CPUs: the `cpuN` lines of /proc/stat."""
    return sum(1 for line in data.split(b"\n") if line[:3] == b"cpu" and line[3:4].isdigit())


# --- /proc/loadavg, /proc/meminfo, /proc/pressure ------------------------------------


def parse_loadavg(data: bytes) -> tuple[float, float, float]:
    parts = data.split()
    try:
        return float(parts[0]), float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise ProcParseError(f"/proc/loadavg: {data[:80]!r}") from None


def parse_meminfo(data: bytes) -> dict[str, int]:
    """Every `Key: N kB` line, in bytes."""
    out: dict[str, int] = {}
    for line in data.split(b"\n"):
        key, sep, rest = line.partition(b":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1] == b"kB":
            value *= 1024
        out[key.decode("ascii", "replace")] = value
    return out


def parse_pressure(data: bytes) -> dict[str, int]:
    """`some`/`full` stall totals in microseconds from /proc/pressure/<res>
    (PSI, Linux 4.20; `full` for cpu since 5.13)."""
    out: dict[str, int] = {}
    for line in data.split(b"\n"):
        parts = line.split()
        if not parts or parts[0] not in (b"some", b"full"):
            continue
        for p in parts[1:]:
            if p.startswith(b"total="):
                try:
                    out[parts[0].decode()] = int(p[6:])
                except ValueError:
                    raise ProcParseError(f"pressure: {line[:80]!r}") from None
    if not out:
        raise ProcParseError(f"pressure: no totals in {data[:80]!r}")
    return out


# --- mounts --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mount:
    device: str  # major:minor
    mount_point: str
    fstype: str


def _unescape_mount(field: bytes) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out = bytearray()
    i = 0
    while i < len(field):
        if field[i : i + 1] == b"\\" and field[i + 1 : i + 4].isdigit():
            out.append(int(field[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def parse_mountinfo(data: bytes) -> list[Mount]:
    mounts = []
    for line in data.split(b"\n"):
        if not line:
            continue
        left, sep, right = line.partition(b" - ")
        # Single spaces part the fields: the kernel escapes only space, tab,
        # newline and backslash in a path, so a \v, \f or \r is part of a name.
        lf, rf = left.split(b" "), right.split(b" ")
        if not sep or len(lf) < 5 or not rf:
            raise ProcParseError(f"mountinfo: {line[:120]!r}")
        mounts.append(Mount(device=lf[2].decode(), mount_point=_unescape_mount(lf[4]), fstype=rf[0].decode()))
    return mounts


def parse_nodev_filesystems(data: bytes) -> set[str]:
    """The filesystem types /proc/filesystems marks `nodev`: those backed by no
    block device (proc, sysfs, tmpfs, cgroup, overlay, ...)."""
    out = set()
    for line in data.split(b"\n"):
        parts = line.split()
        if len(parts) == 2 and parts[0] == b"nodev":
            out.add(parts[1].decode())
    return out


def real_mounts(mounts: list[Mount], nodev: set[str]) -> list[Mount]:
    """Mounts of block-device filesystems, each device once (bind mounts and
    repeated mounts of one device are one disk): the first mount seen wins,
    which in mountinfo order is the one closest to the root."""
    seen: set[str] = set()
    out = []
    for m in mounts:
        if m.fstype in nodev or m.device in seen:
            continue
        seen.add(m.device)
        out.append(m)
    return out


# --- /proc/<pid>/stat ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PidStat:
    pid: int
    comm: str
    ppid: int
    pgrp: int
    self_ticks: int  # utime + stime: every thread of the process
    child_ticks: int  # cutime + cstime: reaped children, at the moment they were reaped
    start_ticks: int  # start time since boot: with the pid, names the process
    rss_pages: int
    threads: int = 1
    state: str = "R"  # R, S, D, ...; Z: exited, not yet reaped (no longer runs)
    flags: int = 0  # the kernel's PF_* flags of its main thread (PF_EXITING: its exit has begun)


def parse_pid_stat(data: bytes) -> PidStat:
    # The command name is in parentheses and may hold spaces and parentheses:
    # everything after the last ')' is fields.
    lpar, rpar = data.find(b"("), data.rfind(b")")
    if lpar < 0 or rpar < lpar:
        raise ProcParseError(f"pid stat without a command name: {data[:80]!r}")
    f = data[rpar + 1 :].split()
    # After the name: state(0) ppid(1) pgrp(2) ... flags(6) ... utime(11) stime(12)
    # cutime(13) cstime(14) ... num_threads(17) starttime(19) vsize(20) rss(21)
    if len(f) < 22:
        raise ProcParseError(f"pid stat with {len(f)} fields after the name: {data[:80]!r}")
    try:
        return PidStat(
            pid=int(data[:lpar]),
            comm=data[lpar + 1 : rpar].decode("utf-8", "replace"),
            ppid=int(f[1]),
            pgrp=int(f[2]),
            self_ticks=int(f[11]) + int(f[12]),
            child_ticks=int(f[13]) + int(f[14]),
            start_ticks=int(f[19]),
            rss_pages=int(f[21]),
            threads=int(f[17]),
            state=f[0].decode("ascii", "replace"),
            flags=int(f[6]),
        )
    except ValueError:
        raise ProcParseError(f"pid stat with a non-numeric field: {data[:80]!r}") from None


def read_pid_stat(proc: Path, pid: int) -> PidStat:
    return parse_pid_stat(read_pid_file(proc, pid, "stat"))


def parse_cmdline(data: bytes) -> str:
    return data.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def parse_cgroup_lines(data: bytes) -> list[tuple[bytes, bytes, str]]:
    """Each line of /proc/<pid>/cgroup: hierarchy id, controllers (empty for
    v2's `0::` line) and path, as the reader's cgroup namespace names it."""
    out = []
    for line in data.split(b"\n"):
        parts = line.split(b":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2].decode("utf-8", "replace")))
    return out
