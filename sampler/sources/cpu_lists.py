"""Kernel CPU lists (`0-3,8,10-11`), as sysfs, the boot line and
/proc/PID/status (`Cpus_allowed_list`) write them; and sysfs' lists of the
CPUs that are possible, online, and kept free of ticks."""

from __future__ import annotations

from pathlib import Path


def parse_cpu_list(text: str | bytes) -> list[int]:
    """The CPUs of a list, sorted; ValueError for anything that is not one."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def format_cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def possible_cpus(sysfs: Path = Path("/sys")) -> int:
    """The highest possible CPU id + 1: the rows of the per-CPU arrays (a CPU
    brought online later has its row already)."""
    return max(parse_cpu_list((sysfs / "devices" / "system" / "cpu" / "possible").read_text())) + 1


def tick_cpus(sysfs: Path = Path("/sys")) -> tuple[list[int], list[int]]:
    """The online CPUs that get the cpu-clock tick, and those left without
    it: a CPU the operator keeps free of the kernel's own ticks (nohz_full)
    or of the scheduler (isolcpus) is not woken 100 times a second by us."""
    cpu_dir = sysfs / "devices" / "system" / "cpu"
    online = parse_cpu_list((cpu_dir / "online").read_text())
    quiet: set[int] = set()
    for name in ("nohz_full", "isolated"):
        try:
            text = (cpu_dir / name).read_text()
        except OSError:  # a kernel without the file: no such CPUs
            continue
        if text.strip() != "(null)":  # nohz_full says so when the feature is built but unused
            quiet.update(parse_cpu_list(text))
    return [c for c in online if c not in quiet], [c for c in online if c in quiet]
