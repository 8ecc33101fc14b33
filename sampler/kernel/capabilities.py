"""Whether this process may load BPF programs: its effective capabilities."""

from __future__ import annotations

from pathlib import Path

from sampler.backend_unavailable import BackendUnavailable
from sampler.sources import procfs

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def effective_capabilities(proc: Path) -> int:
    for line in procfs.read_bytes(proc / "self" / "status").split(b"\n"):
        if line.startswith(b"CapEff:"):
            return int(line.split()[1], 16)
    raise procfs.ProcParseError("no CapEff in /proc/self/status")


def check_capabilities(proc: Path) -> None:
    """BackendUnavailable unless this process holds CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN."""
    try:
        caps = effective_capabilities(proc)
    except (OSError, procfs.ProcParseError) as e:
        raise BackendUnavailable(f"cannot read this process's capabilities: {e}") from None
    if not (caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1)):
        raise BackendUnavailable("missing capabilities: needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN (run as root)")
