"""Choosing the backend that counts engines' CPU time.

`bpf` counts on-CPU time in the kernel (sampler/kernel/sched.py); `proc` reads
/proc (sampler/shards/proc_shards.py). `auto` uses the kernel backend when it loads
and falls back to /proc otherwise, saying why once in the log and in every
summary's `backend_reason`. `bpf` asked for and unable to load is an error
carrying the same reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sampler.backend_unavailable import BackendUnavailable
from sampler.shards.proc_shards import ProcShardSampler, ShardReading
from sampler.shards.selectors import ProcessTable, ShardSpec

if TYPE_CHECKING:
    from sampler.kernel.groups_run import GroupsRun
    from sampler.kernel.sched import KernelSamples

CHOICES = ("auto", "bpf", "proc")

log = logging.getLogger(__name__)


class ShardSampler(Protocol):
    # The most samples a second whose figures mean something (None: any rate
    # the command line allows): a counter in clock ticks cannot place time
    # finer than a tick.
    finest_hz: float | None
    # CPUs without the kernel backend's cpu-clock tick (nohz_full, isolated).
    tickless_cpus: list[int]

    @property
    def specs(self) -> list[ShardSpec]: ...
    def discover(self, specs: list[ShardSpec], table: ProcessTable) -> None: ...
    def sample(self) -> dict[str, ShardReading]: ...
    def memory(self) -> dict[str, int | None]: ...
    def describe(self, shard_id: str) -> tuple[list[int], str | None]: ...
    def close(self) -> None: ...
    def program_stats(self) -> dict[str, tuple[int, int]]: ...
    def dropped_forks(self) -> int | None: ...
    # Which groups ran since the last call, as the kernel saw them (None: it
    # cannot say, and every window walks /proc); the processes counted now.
    def groups_run(self) -> GroupsRun | None: ...
    def member_pids(self) -> set[int]: ...
    def runqueue_waits(self) -> dict[str, dict[str, float] | None] | None: ...
    # Why the caller's loop takes the samples where the kernel backend cannot
    # (None: the kernel takes them, or the backend's own reason says why not).
    agent_samples_why: str | None

    # The kernel takes the samples where it can (the kernel backend's ring):
    # started at `hz`, and read by take_kernel_samples; False, the caller's loop samples.
    def samples_in_kernel(self, hz: float) -> bool: ...
    def take_kernel_samples(self) -> KernelSamples: ...


@dataclass(frozen=True)
class BackendChoice:
    name: str  # the backend in use: "bpf" or "proc"
    reason: str | None  # why the kernel backend is not in use, when it is not


def open_backend(
    asked: str,
    proc: Path,
    kernel_headers: Path | str | None = None,
    clock: Callable[[], float] = time.monotonic,
    bpf_stats: bool = False,
) -> tuple[BackendChoice, ShardSampler]:
    if asked not in CHOICES:
        raise ValueError(f"backend {asked!r}: expected one of {', '.join(CHOICES)}")
    if asked == "proc":
        return BackendChoice("proc", "asked for proc"), ProcShardSampler(proc, clock)
    from sampler.kernel import sched

    try:
        return BackendChoice("bpf", None), sched.load(proc, kernel_headers, clock=clock, bpf_stats=bpf_stats)
    except BackendUnavailable as e:
        if asked == "bpf":
            raise
        log.warning("kernel backend unavailable, counting from /proc: %s", e)
        return BackendChoice("proc", str(e)), ProcShardSampler(proc, clock)
