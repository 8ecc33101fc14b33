"""The /proc backend on this machine's real /proc, against the kernel's own
account of each workload measured in the same run.

The truth for a process group over an interval is the growth of its live
threads' on-CPU time (schedstat, in ns) plus cutime + cstime (the children
its processes reaped), read here with a parser of the test's own, at the
interval's two ends (tests/workloads.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.heartbeats import cores_of
from tests.workloads import (
    BURN_ONE_CORE,
    FORKER,
    PROC,
    QUARTER_WORKERS,
    GroupTruth,
    group_cpu_at,
    group_members,
    start_group,
    then_after_each_reading,
)

pytestmark = pytest.mark.live

WINDOW_S = 3.0

def measure(pgid: int, selector: str) -> tuple[float, float]:
    """The sampler's window mean and the truth over the same interval, in cores."""
    specs = [ShardSpec("w", Selector.parse(selector))]
    sampler = WindowSampler(PROC, BackendChoice("proc", None), ProcShardSampler(PROC), specs)
    sampler.prime(0)
    truth = GroupTruth(pgid)
    summary = sampler.run_window(WINDOW_S)
    cores = truth.cores()
    [shard] = summary.shards
    assert shard.pgid == pgid
    return cores_of(shard).mean, cores


def test_group_burning_one_core(group: list[subprocess.Popen[str]]) -> None:
    p = start_group(BURN_ONE_CORE)
    group.append(p)
    measured, truth = measure(p.pid, f"pgid:{p.pid}")
    assert truth > 0.8
    assert measured == pytest.approx(truth, rel=0.10)


def test_idle_leader_with_three_quarter_busy_workers(group: list[subprocess.Popen[str]]) -> None:
    p = start_group(QUARTER_WORKERS)
    group.append(p)
    measured, truth = measure(p.pid, f"pid:{p.pid}")
    assert 0.5 < truth < 1.0
    assert measured == pytest.approx(truth, rel=0.10)


def test_leader_forking_short_lived_children(group: list[subprocess.Popen[str]]) -> None:
    tag = f"forker-{os.getpid()}"
    p = start_group(FORKER, tag)
    group.append(p)
    measured, truth = measure(p.pid, f"cmdline: {tag}$")
    assert truth > 0.2  # it ran: above 0.75 on an idle machine (forks cost CPU too), less on a loaded one
    assert measured == pytest.approx(truth, rel=0.10)


def test_sample_command_reports_the_busy_group(group: list[subprocess.Popen[str]]) -> None:
    p = start_group(BURN_ONE_CORE)
    group.append(p)
    r = subprocess.run(
        [sys.executable, "-m", "nodesampler", "sample", "--json", "--duration", "2",
         "--group", f"burner=pgid:{p.pid}", "--group", f"same=pid:{p.pid}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    for shard in summary["shards"]:
        assert shard["pgid"] == p.pid
        assert shard["cpu_cores"]["mean"] > 0.8
        assert shard["cpu_cores"]["max"] <= 1.2
        assert shard["memory_bytes"] > 0
    # One of two cores busy at least.
    assert summary["machine"]["cpu_percent"]["mean"] > 40


def window_with_a_stall(groups: Any, backend: str, pgid: int) -> tuple[dict[str, float], float]:
    """One window in which the sampler's reading of its groups stalls once
    for 300 ms, for real (a GC pause, a slow walk), and the kernel's account
    over the same interval: read right after the sampler's own readings at
    the window's two edges (the priming sample, and the last reading, at or
    after the final slot). This process's loop skips the slots it missed;
    samples the kernel takes are all there."""
    edges: list[tuple[float, float]] = []
    final_slot, stall_at, stalled = 0.0, math.inf, False
    members = group_members(pgid)

    def truth() -> None:
        if time.monotonic() >= final_slot:
            edges.append(group_cpu_at(pgid, members))

    def stalling(read: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            nonlocal stalled
            if not stalled and time.monotonic() >= stall_at:
                stalled = True
                time.sleep(0.3)
            return read()

        return call

    sample, take = then_after_each_reading(groups, truth)
    groups.sample, groups.take_kernel_samples = stalling(sample), stalling(take)
    try:
        specs = [ShardSpec("w", Selector.parse(f"pgid:{pgid}"))]
        sampler = WindowSampler(PROC, BackendChoice(backend, None), groups, specs, hz=10)
        sampler.prime(0)
        final_slot = time.monotonic() + WINDOW_S
        stall_at = time.monotonic() + 1.15
        summary = sampler.run_window(WINDOW_S)
    finally:
        del groups.sample, groups.take_kernel_samples
    assert stalled
    (t0, s0), (t1, s1) = edges[0], edges[-1]
    [shard] = summary.shards
    ring = getattr(groups, "ring", None)
    if ring is not None and ring.hz is not None:
        assert summary.window.samples >= WINDOW_S * 10 - 1  # the kernel's samples: none lost to the stall
    else:
        assert summary.window.samples < WINDOW_S * 10  # slots skipped, not bunched
    figures: dict[str, float] = msgspec.to_builtins(cores_of(shard))
    return figures, (s1 - s0) / (t1 - t0)


def test_a_300_ms_stall_on_the_real_clock(group: list[subprocess.Popen[str]]) -> None:
    """Three workers each busy a quarter of the time: no sample may read more
    than they can use; the mean stays the kernel's account."""
    p = start_group(QUARTER_WORKERS)
    group.append(p)
    stats, truth = window_with_a_stall(ProcShardSampler(PROC), "proc", p.pid)
    assert stats["mean"] == pytest.approx(truth, rel=0.10)
    assert_within_what_quarter_workers_can_use(stats)


def assert_within_what_quarter_workers_can_use(stats: dict[str, float]) -> None:
    """0.75 cores a 100 ms sample, give or take the ticks, for most of the
    window (p95). Not for every sample: the three burst at once each period,
    so a sample a late timer left short can hold only their bursts, and in a
    slow guest they fall behind and burn without sleeping: either way they
    use every CPU they can (bookworm's emulated guest read 1.53 once). No
    sample may read more than that."""
    assert stats["p95"] <= 1.5, stats
    assert stats["max"] <= min(3, os.cpu_count() or 1) * 1.01, stats
