"""A fake /proc tree, written the way the kernel writes it, for edge cases the
real /proc cannot be made to show on demand."""

from __future__ import annotations

import shutil
from pathlib import Path


def pid_stat_line(
    pid: int,
    comm: str = "python3",
    *,
    ppid: int = 1,
    pgrp: int | None = None,
    utime: int = 0,
    stime: int = 0,
    cutime: int = 0,
    cstime: int = 0,
    start: int = 1000,
    rss: int = 100,
    threads: int = 1,
    flags: int = 4194304,
) -> bytes:
    pgrp = pid if pgrp is None else pgrp
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime vsize rss ...
    fields = [
        "S", ppid, pgrp, pgrp, 0, -1, flags, 10, 0, 0, 0,
        utime, stime, cutime, cstime, 20, 0, threads, 0, start, 123456789, rss,
        "18446744073709551615", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 0, 0, 0, 0, 0,
    ]  # fmt: skip
    return f"{pid} ({comm}) ".encode() + " ".join(str(f) for f in fields).encode() + b"\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.set_cpu(user=0, idle=0)
        (root / "loadavg").write_text("0.50 0.40 0.30 2/300 4242\n")
        (root / "meminfo").write_text(
            "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"
        )

    def set_cpu(self, *, user: int, idle: int, system: int = 0, iowait: int = 0, guest: int = 0, cpus: int = 2,
                steal: int = 0) -> None:  # fmt: skip
        # guest time is inside user already; the kernel repeats it in the guest column.
        lines = [f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} {guest} 0"]
        lines += [f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(cpus)]
        lines += ["intr 12345 0 0", "ctxt 999", "btime 1700000000", "processes 4242"]
        (self.root / "stat").write_text("\n".join(lines) + "\n")

    def add(self, pid: int, comm: str = "python3", cmdline: str | None = None, cgroup: str = "/", **kw: int) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        (d / "stat").write_bytes(pid_stat_line(pid, comm, **kw))
        argv = (cmdline if cmdline is not None else comm).split(" ")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "cgroup").write_text(f"0::{cgroup}\n")

    def set(self, pid: int, comm: str = "python3", **kw: int) -> None:
        (self.root / str(pid) / "stat").write_bytes(pid_stat_line(pid, comm, **kw))

    def write_raw(self, pid: int, data: bytes) -> None:
        (self.root / str(pid) / "stat").write_bytes(data)

    def remove(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
