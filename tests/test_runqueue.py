"""Run-queue wait per engine from schedstat: on fake trees, and two busy
groups sharing one real CPU against the same group alone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.sources import procfs
from sampler.sources.runqueue import RunQueueWaitSampler, parse_schedstat
from sampler.window.sampler import WindowSampler
from tests.workloads import PROC, busy_threads, start_group


def write_threads(root: Path, pid: int, threads: dict[int, tuple[int, int, int]]) -> None:
    for tid, (run, wait, slices) in threads.items():
        d = root / str(pid) / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "schedstat").write_text(f"{run} {wait} {slices}\n")


def test_parse_schedstat() -> None:
    assert parse_schedstat(b"877409 1200 2\n") == (1200, 2)
    with pytest.raises(procfs.ProcParseError):
        parse_schedstat(b"877409\n")


def test_wait_per_window_from_every_thread(tmp_path: Path) -> None:
    s = RunQueueWaitSampler(tmp_path)
    write_threads(tmp_path, 100, {100: (0, 1_000_000, 10), 101: (0, 0, 0)})
    assert s.read({"w": {100}}) == {"w": None}  # nothing to compare with yet
    write_threads(tmp_path, 100, {100: (0, 3_000_000, 12), 101: (0, 2_000_000, 2)})
    assert s.read({"w": {100}}) == {"w": {"total": 0.004, "cumulative": 0.004, "mean": 0.001}}
    # A thread exits, another starts: neither counts in this window.
    (tmp_path / "100" / "task" / "101" / "schedstat").unlink()
    (tmp_path / "100" / "task" / "101").rmdir()
    write_threads(tmp_path, 100, {100: (0, 3_000_000, 12), 102: (0, 9_000_000, 5)})
    assert s.read({"w": {100}}) == {"w": {"total": 0.0, "cumulative": 0.004}}  # no timeslice: no mean
    assert s.read({"w": {999}}) == {"w": None}  # the group is gone: not measured


def pinned_burner(cpu: int) -> subprocess.Popen[str]:
    """A busy process on `cpu` at nice -20: ahead of whatever else runs there
    (a CPU hog of `make test-stress`, a neighbour on CI), which then takes
    about 1% of it (CFS weights 88761 to 1024), so that alone it waits next
    to nothing (at nice 0 beside the hog it waited 1.0 s of a 2 s window)."""
    return start_group(busy_threads(1, cpu=cpu, nice=-20))


def wait_of(p: subprocess.Popen[str]) -> dict[str, float]:
    ws = WindowSampler(PROC, BackendChoice("proc", None), ProcShardSampler(PROC),
                       [ShardSpec("w", Selector.parse(f"pgid:{p.pid}"))], hz=10)  # fmt: skip
    ws.prime(0)
    [shard] = ws.run_window(2.0).shards
    wait: dict[str, float] = msgspec.to_builtins(shard.runqueue_wait_seconds)
    return wait


@pytest.mark.live
def test_two_busy_groups_on_one_cpu_wait_and_one_alone_does_not(group: list[subprocess.Popen[str]]) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: one to share, one for the test")
    cpu = max(os.sched_getaffinity(0))
    a = pinned_burner(cpu)
    group.append(a)
    alone = wait_of(a)
    b = pinned_burner(cpu)
    group.append(b)
    shared_a, shared_b = wait_of(a), wait_of(b)
    # Sharing one CPU, each waits about half the window; alone, next to nothing.
    assert alone["total"] < 0.1, alone
    for shared in (shared_a, shared_b):
        assert shared["total"] > 0.5, shared  # of a 2 s window
        # Each wait is of the order of the other's slice (milliseconds). Not
        # compared with the lone one's mean: a task of anyone's on that CPU
        # makes each of its rare waits a slice long too (4 ms beside the hog).
        assert shared["mean"] > 0.001, (shared, alone)


@pytest.mark.live
def test_taskstats_stands_in_where_schedstat_is_missing(
    group: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """A procfs whose threads have no schedstat file: the same waits come from
    taskstats over netlink, and agree with schedstat's over the same window."""
    cpu = max(os.sched_getaffinity(0))
    a, b = pinned_burner(cpu), pinned_burner(cpu)
    group += [a, b]
    bare = tmp_path / "proc"
    for p in (a, b):
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            (bare / str(p.pid) / "task" / tid).mkdir(parents=True)
    members = {"a": {a.pid}, "b": {b.pid}}
    fallback, real = RunQueueWaitSampler(bare), RunQueueWaitSampler(PROC)
    try:
        fallback.read(members)
        real.read(members)
        time.sleep(2.0)  # the window: the two share the CPU meanwhile
        got, want = fallback.read(members), real.read(members)
        assert fallback.source == "taskstats"
    finally:
        fallback.close()
    for wid in ("a", "b"):
        g, w = got[wid], want[wid]
        assert g is not None and w is not None
        assert g["total"] > 0.5
        assert g["total"] == pytest.approx(w["total"], rel=0.2), (g, w)
        assert g["mean"] == pytest.approx(w["mean"], rel=0.2), (g, w)
