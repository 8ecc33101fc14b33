"""Kernel CPU lists (`0-3,8,10-11`), as sysfs, the boot line and
/proc/PID/status (`Cpus_allowed_list`) write them."""

from __future__ import annotations


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
