"""Starved engines, live: real busy engines in real cgroups (v1's cpu
hierarchy on this machine, v2 in the VM guests), sampled by the agent's
window loop with the kernel backend, shipped through the wire format and
judged by the control plane's rules.

- capped at half a core, three busy threads are throttled in nearly every
  period, for as long as the kernel's own cpu.stat says, and starved;
- the same engine sized to the machine, in a cgroup without a quota, has no
  quota or throttled share (absent) and is not starved;
- an engine sharing one CPU with a busier one waits on the run queue and is
  starved by that rule alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

import wire
from controlplane.state.registry import MAX_SHARDS_PER_NODE, received
from controlplane.state.starvation import StarvationRules
from sampler.backend import BackendChoice
from sampler.kernel import sched
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.conftest import AccuracyLog, CpuCgroup, unavailable
from tests.workloads import PROC, busy_threads, start_group

pytestmark = pytest.mark.kernel

WINDOW_S = 3.0


def judged_window(groups: sched.KernelShardSampler, engines: dict[str, int],
                  after_cfs: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One window of the agent's loop over the engines (id -> pgid), through
    the wire format, judged as the control plane judges it. `after_cfs` runs
    right after each of the sampler's cgroup readings (its window's two edges)."""
    specs = [ShardSpec(sid, Selector.parse(f"pgid:{pgid}")) for sid, pgid in engines.items()]
    ws = WindowSampler(PROC, BackendChoice("bpf", None), groups, specs, hz=10, node="starved-test")
    if after_cfs is not None:
        read = ws.cfs.read

        def read_then(members: dict[str, set[int]]) -> dict[str, dict[str, Any]]:
            out = read(members)
            after_cfs()
            return out

        ws.cfs.read = read_then  # type: ignore[method-assign]
    ws.prime(0)
    hb = wire.decode_heartbeat(wire.encode(ws.run_window(WINDOW_S))).heartbeat
    judged = received(hb, MAX_SHARDS_PER_NODE, StarvationRules()).as_json()  # as /api/nodes shows it
    return {s["id"]: s for s in judged["shards"]}


def test_an_engine_capped_at_half_a_core_is_throttled_and_starved(
    bpf_groups: sched.KernelShardSampler, cpu_cgroup: CpuCgroup, group: list[subprocess.Popen[str]],
    accuracy: AccuracyLog,
) -> None:  # fmt: skip
    cpu_cgroup.cap(0.5)
    p = start_group(busy_threads(3))
    group.append(p)
    cpu_cgroup.add(p.pid)
    edges: list[float] = []
    engines = judged_window(bpf_groups, {"engine": p.pid}, lambda: edges.append(cpu_cgroup.throttled_seconds()))
    engine = engines["engine"]
    kernel = edges[-1] - edges[-2]
    accuracy.record(f"throttled seconds, cgroup v{2 if cpu_cgroup.v2 else 1}", engine["cpu_throttled_seconds"],
                    kernel, 0.05)  # fmt: skip
    assert engine["cpu_quota_cores"] == 0.5
    assert engine["threads"] == 4 and engine["threads_per_quota_core"] == 8.0  # the main thread and three burners
    assert engine["cpu_throttled_ratio"] > 0.9, engine
    assert engine["cpu_throttled_seconds"] == pytest.approx(kernel, rel=0.05), (engine, kernel)
    assert engine["cpu_cores"]["mean"] == pytest.approx(0.5, rel=0.1), engine  # the quota, and no more
    assert engine["starved"]["cpu_starved"] == 1, engine
    assert "throttled in" in engine["starved"]["why"] and "quota 0.5 cores, 4 threads" in engine["starved"]["why"]
    assert "host_bound" not in engine["starved"]  # no GPU: not judged


def test_the_same_engine_sized_to_the_machine_and_uncapped_is_not_starved(
    bpf_groups: sched.KernelShardSampler, cpu_cgroup: CpuCgroup, group: list[subprocess.Popen[str]]
) -> None:
    # One CPU left for the test and the kernel's own work: the engine fits.
    p = start_group(busy_threads(max(1, len(os.sched_getaffinity(0)) - 1)))
    group.append(p)
    cpu_cgroup.add(p.pid)
    engine = judged_window(bpf_groups, {"engine": p.pid})["engine"]
    for key in ("cpu_quota_cores", "cpu_throttled_ratio", "cpu_throttled_seconds", "threads_per_quota_core"):
        assert key not in engine  # no quota: absent, never 0
    assert engine["runqueue_wait_seconds"]["total"] is not None
    assert engine["starved"] == {"cpu_starved": 0}, engine  # judged by the run queue alone: fed


def test_an_engine_sharing_one_cpu_with_a_busier_one_waits_and_is_starved(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]]
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        unavailable("needs two CPUs: one to share, one for the test")
    cpu = max(os.sched_getaffinity(0))
    small, busier = start_group(busy_threads(1, cpu)), start_group(busy_threads(2, cpu))
    group += [small, busier]
    engines = judged_window(bpf_groups, {"small": small.pid, "busier": busier.pid})
    s = engines["small"]
    # Three threads on one CPU: the small engine runs about a third of the time and waits the rest.
    assert s["cpu_cores"]["mean"] < 0.5, s
    assert s["runqueue_wait_seconds"]["total"] > s["cpu_cores"]["mean"] * WINDOW_S, s
    assert "cpu_throttled_ratio" not in s  # no quota: the run queue is the only rule that can fire
    assert s["starved"]["cpu_starved"] == 1 and s["starved"]["why"].startswith("waited "), s
    assert engines["busier"]["starved"]["cpu_starved"] == 1  # it shares the CPU too
