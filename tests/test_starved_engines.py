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

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controlplane.starvation import StarvationRules, judge_heartbeat
from nodesampler import wire
from sampler import bpf_sched
from sampler.backend import BackendChoice
from sampler.cfs import parse_cpu_stat
from sampler.selectors import GroupSelector, GroupWatch
from sampler.window_sampler import WindowSampler
from tests.conftest import REQUIRE_BPF, AccuracyLog
from tests.workloads import PROC, start_group

pytestmark = pytest.mark.kernel

WINDOW_S = 3.0
CGROUP = Path("/sys/fs/cgroup")


def busy_threads(n: int, cpu: int | None = None) -> str:
    """An engine of n threads each busy on a CPU of its own. sha256 of a large
    buffer releases the GIL: the threads run at once, as an engine's do."""
    pin = f"os.sched_setaffinity(0, {{{cpu}}})\n" if cpu is not None else ""
    return (f"import hashlib, os, threading\n{pin}data = bytes(1 << 20)\n"
            "def burn():\n    while True:\n        hashlib.sha256(data).digest()\n"
            f"for _ in range({n}):\n    threading.Thread(target=burn, daemon=True).start()\n"
            "print('ready', flush=True)\nthreading.Event().wait()\n")  # fmt: skip


@dataclass
class CpuCgroup:
    """A cgroup of the cpu controller made for the test, on either version."""

    path: Path
    v2: bool

    def cap(self, cores: float) -> None:
        period = 100_000
        if self.v2:
            (self.path / "cpu.max").write_text(f"{int(cores * period)} {period}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(cores * period)))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # the whole process, every thread

    def throttled_seconds(self) -> float:
        return parse_cpu_stat((self.path / "cpu.stat").read_bytes()).throttled_seconds


def _unavailable(reason: str) -> None:
    if REQUIRE_BPF:
        pytest.fail(f"NODESAMPLER_REQUIRE_BPF=1 and {reason}")
    pytest.skip(reason)


@pytest.fixture
def cpu_cgroup() -> Iterator[CpuCgroup]:
    if os.geteuid() != 0:
        _unavailable("making cgroups needs root")
    if (CGROUP / "cgroup.controllers").exists():  # the unified tree (v2)
        if "cpu" not in (CGROUP / "cgroup.controllers").read_text().split():
            _unavailable("cgroup v2 without the cpu controller")
        if "cpu" not in (CGROUP / "cgroup.subtree_control").read_text().split():
            (CGROUP / "cgroup.subtree_control").write_text("+cpu")
        root, v2 = CGROUP, True
    elif (CGROUP / "cpu" / "cpu.cfs_quota_us").exists():
        root, v2 = CGROUP / "cpu", False
    else:
        _unavailable(f"no cpu controller mounted at {CGROUP}")
    d = root / f"nodesampler-test-{os.getpid()}"
    d.mkdir()
    yield CpuCgroup(d, v2)
    for pid in (d / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            (root / "cgroup.procs").write_text(pid)
    deadline = time.monotonic() + 10
    while True:
        try:
            d.rmdir()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def judged_window(groups: bpf_sched.BpfGroupSampler, engines: dict[str, int],
                  after_cfs: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One window of the agent's loop over the engines (id -> pgid), through
    the wire format, judged as the control plane judges it. `after_cfs` runs
    right after each of the sampler's cgroup readings (its window's two edges)."""
    watches = [GroupWatch(sid, GroupSelector.parse(f"pgid:{pgid}")) for sid, pgid in engines.items()]
    ws = WindowSampler(PROC, BackendChoice("bpf", None), groups, watches, hz=10)
    if after_cfs is not None:
        read = ws.cfs.read

        def read_then(members: dict[str, set[int]]) -> dict[str, dict[str, Any]]:
            out = read(members)
            after_cfs()
            return out

        ws.cfs.read = read_then  # type: ignore[method-assign]
    ws.prime(0)
    hb = wire.parse_heartbeat(json.dumps(ws.run_window(WINDOW_S)).encode())
    judge_heartbeat(hb, StarvationRules())
    return {s["id"]: s for s in hb["shards"]}


def test_an_engine_capped_at_half_a_core_is_throttled_and_starved(
    bpf_groups: bpf_sched.BpfGroupSampler, cpu_cgroup: CpuCgroup, group: list[subprocess.Popen[str]],
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
    bpf_groups: bpf_sched.BpfGroupSampler, cpu_cgroup: CpuCgroup, group: list[subprocess.Popen[str]]
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
    bpf_groups: bpf_sched.BpfGroupSampler, group: list[subprocess.Popen[str]]
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        _unavailable("needs two CPUs: one to share, one for the test")
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
