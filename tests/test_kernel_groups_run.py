"""Windows without a walk of /proc: the tick says which groups ran
(sampler/kernel/groups_run.py) and follows the watched groups' members, so
a window reads only what the kernel names (sampler/window/process_view.py),
and the periodic walk finds nothing to correct.

Root (CI is root); NODESAMPLER_REQUIRE_BPF=1 fails instead of skipping.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sampler.backend import BackendChoice
from sampler.kernel import sched
from sampler.kernel.build import TICK_NS
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.conftest import AccuracyLog
from tests.heartbeats import cores_of
from tests.test_kernel_edges import FORK_STORM, LEAVE_AND_JOIN
from tests.workloads import BURN_ONE_CORE, PROC, group_members, process_cpu_seconds, start_group

pytestmark = pytest.mark.kernel

SLEEPS = """
import os, signal
for _ in range(200):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
print("ready", flush=True)
signal.pause()
"""
# Named by the kernel's comm, so that the busiest groups' shard is this one alone.
NAMED_BURNER = """
import ctypes
ctypes.CDLL(None).prctl(15, b"burner-engine", 0, 0, 0)  # PR_SET_NAME
print("ready", flush=True)
while True:
    pass
"""
# Children forked into the group that each leave it by setsid, run a little
# outside and exit: the kernel must take each out at its first tick outside.
SETSID_STORM = """
import os, time
print("ready", flush=True)
while True:
    if os.fork() == 0:
        os.setsid()
        end = time.monotonic() + 0.03
        while time.monotonic() < end:
            pass
        os._exit(0)
    os.wait()
"""


def spec(text: str, shard_id: str = "w") -> ShardSpec:
    return ShardSpec(shard_id, Selector.parse(text))


def window_truth(ws: WindowSampler, pid: int, seconds: float) -> tuple[float, float]:
    """The window's mean cores for its one shard, and the process's own CPU over the window."""
    s0, t0 = process_cpu_seconds(pid), time.monotonic()
    [shard] = ws.run_window(seconds).shards
    return cores_of(shard).mean, (process_cpu_seconds(pid) - s0) / (time.monotonic() - t0)


def test_the_tick_counts_each_group_that_runs(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    busy, idle = start_group(BURN_ONE_CORE), start_group(SLEEPS)
    group += [busy, idle]
    assert bpf_groups.groups_run() is not None, "the kernel's BTF says where a task's group is, 5.10 on"
    s0 = process_cpu_seconds(busy.pid)
    time.sleep(1.0)  # the span counted, not a wait for an event
    seen = bpf_groups.groups_run()
    used = process_cpu_seconds(busy.pid) - s0
    assert seen is not None and seen.complete
    # 201 processes asleep: found running at most as they settle into their
    # sleep (a child forked before "ready" may not have reached it yet).
    assert seen.ticks.get(idle.pid, 0) < 0.05 * seen.ticks[busy.pid]
    measured = seen.ticks[busy.pid] * TICK_NS / 1e9
    accuracy.record("a group's ticks against its CPU time, 1 s", measured, used, 0.25)
    assert measured == pytest.approx(used, rel=0.25)
    again = bpf_groups.groups_run()  # taken: counting starts over
    assert again is not None and again.ticks.get(busy.pid, 0) < seen.ticks[busy.pid]


def test_windows_between_walks_read_only_what_the_kernel_names(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    crowd, busy = start_group(SLEEPS), start_group(BURN_ONE_CORE)
    group += [crowd, busy]
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups, [spec(f"pgid:{busy.pid}")], hz=100)
    ws.prime(0)
    for _ in range(2):
        measured, truth = window_truth(ws, busy.pid, 1.0)
        accuracy.record("one core, a window without a walk", measured, truth, 0.05)
        assert measured == pytest.approx(truth, rel=0.05)
    assert ws.view.walks == 1  # at start only
    read = ws.view.table(by_group_only=True)[0].stats
    sleepers = set(group_members(crowd.pid)) - {crowd.pid}  # never a leader, never a member
    assert busy.pid in read and len(sleepers) == 200 and not sleepers & read.keys() and len(read) < 100


def test_a_group_that_starts_after_the_walk_is_found_when_it_first_runs(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups, [spec("cmdline:late-engine")], hz=100)
    ws.prime(0)
    [shard] = ws.run_window(0.2).shards
    assert not shard.pgids
    late = start_group(BURN_ONE_CORE, tag="late-engine")
    group.append(late)
    [shard] = ws.run_window(0.5).shards  # its first window: matched by the ticks of its start
    assert list(shard.pgids or ()) == [late.pid]
    measured, truth = window_truth(ws, late.pid, 1.0)
    accuracy.record("a group found by its ticks, its next window", measured, truth, 0.05)
    assert measured == pytest.approx(truth, rel=0.05)
    assert ws.view.walks == 1


def test_the_busiest_groups_are_ranked_by_the_kernels_ticks(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    busy = start_group(NAMED_BURNER)
    group.append(busy)
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups, None, hz=100)
    ws.prime(0.5)
    ws.run_window(0.5)  # the group named from the ticks of prime's half second
    s0, t0 = process_cpu_seconds(busy.pid), time.monotonic()
    summary = ws.run_window(1.0)
    truth = (process_cpu_seconds(busy.pid) - s0) / (time.monotonic() - t0)
    shard = next(s for s in summary.shards if s.id == "comm:burner-engine")
    accuracy.record("the busiest group, ranked by ticks", cores_of(shard).mean, truth, 0.05)
    assert cores_of(shard).mean == pytest.approx(truth, rel=0.05)
    assert ws.view.walks == 1


@pytest.mark.parametrize("storm", ["fork", "setsid", "leave and join"])
def test_the_periodic_walk_finds_nothing_to_correct(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], storm: str
) -> None:
    """Each window walks and checks the kernel's members against the walk's,
    while processes are born into the group, leave it and join it."""
    code = {"fork": FORK_STORM, "setsid": SETSID_STORM, "leave and join": LEAVE_AND_JOIN}[storm]
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         process_group=0)  # fmt: skip
    group.append(p)
    assert p.stdout is not None and p.stdin is not None and p.stdout.readline() == "ready\n"
    p.stdin.write("go\n")  # the one that waits for it
    p.stdin.flush()
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups, [spec(f"pgid:{p.pid}")], hz=100)
    ws.view.full_walk_every = 0.0  # every window's walk is the periodic one
    ws.prime(0)
    for _ in range(6):
        ws.run_window(0.5)
    assert ws.view.walks == 7 and ws.view.corrections == 0
