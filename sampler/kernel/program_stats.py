"""The programs' own cost, as the kernel counts it: BPF_ENABLE_STATS and
each program's fdinfo."""

from __future__ import annotations

import ctypes

from sampler.kernel import tp_btf
from sampler.sources import procfs


def enable_bpf_stats() -> int | None:
    """Turn on the kernel's per-program run time and count for as long as the
    returned fd is open (BPF_ENABLE_STATS, Linux 5.8), so that the agent's own
    cost is measured without leaving the kernel.bpf_stats_enabled sysctl on."""
    attr = (ctypes.c_uint32 * 32)()  # union bpf_attr, zeroed; enable_stats.type = BPF_STATS_RUN_TIME (0)
    try:
        return tp_btf.bpf(32, attr)  # BPF_ENABLE_STATS
    except OSError:
        return None


def program_stats(fd: int) -> tuple[int, int] | None:
    """run_time_ns and run_cnt of a loaded program, from its fd's fdinfo (Linux 5.1)."""
    values = {}
    try:
        for line in procfs.read_bytes(f"/proc/self/fdinfo/{fd}").split(b"\n"):
            key, _, value = line.partition(b":")
            if key in (b"run_time_ns", b"run_cnt"):
                values[key] = int(value)
    except (OSError, ValueError):
        return None
    if len(values) != 2:
        return None
    return values[b"run_time_ns"], values[b"run_cnt"]
