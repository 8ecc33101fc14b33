"""CFS bandwidth per engine: parsers and fake cgroup trees (v1 and v2). Real
cgroups, on this machine and in the VM guests: tests/test_starved_engines.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wire
from sampler.sources import procfs
from sampler.sources.cfs import (
    CPU_STAT_READS,
    CfsBandwidthReader,
    CpuStat,
    parse_cfs_quota,
    parse_cpu_max,
    parse_cpu_stat,
    parse_status_threads,
    read_cpu_stat,
)
from sampler.sources.procfs import ProcParseError
from tests.fakeproc import FakeProc
from tests.test_controlplane_api import heartbeat


def test_parsers() -> None:
    assert parse_cpu_max(b"50000 100000\n") == 0.5 and parse_cpu_max(b"max 100000\n") is None
    assert parse_cfs_quota(b"600000\n", b"100000\n") == 6.0 and parse_cfs_quota(b"-1\n", b"100000\n") is None
    v1 = parse_cpu_stat(b"nr_periods 46\nnr_throttled 44\nthrottled_time 2500000000\nnr_bursts 0\n")
    v2 = parse_cpu_stat(b"usage_usec 10\nuser_usec 5\nsystem_usec 5\nnr_periods 46\nnr_throttled 44\n"
                        b"throttled_usec 2500000\n")  # fmt: skip
    assert v1 == v2 == CpuStat(46, 44, 2.5)
    assert parse_status_threads(b"Name:\tx\nThreads:\t172\nCpus_allowed_list:\t0-63\n") == (172, set(range(64)))
    for bad in (b"", b"max", b"1 0", b"x 100000"):
        with pytest.raises(ProcParseError):
            parse_cpu_max(bad)
    with pytest.raises(ProcParseError):
        parse_cpu_stat(b"nr_periods 1\n")


def _cgroup(root: Path, path: str, cpu_max: str | None, stat: tuple[int, int, int]) -> Path:
    d = root / path.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (d / "cpu.max").write_text(cpu_max + "\n")
    (d / "cpu.stat").write_text(f"usage_usec 0\nnr_periods {stat[0]}\nnr_throttled {stat[1]}\n"
                                f"throttled_usec {stat[2]}\n")  # fmt: skip
    return d


def _engine(proc: FakeProc, pid: int, cgroup: str, threads: int) -> None:
    proc.add(pid, cgroup=cgroup)
    (proc.root / str(pid) / "status").write_text(f"Name:\tvllm\nThreads:\t{threads}\nCpus_allowed_list:\t0-63\n")


def test_a_capped_container_on_cgroup_v2(tmp_path: Path) -> None:
    proc, root = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    pod = "/kubepods.slice/pod1"
    _cgroup(root, pod, "max 100000", (0, 0, 0))  # the pod: no limit of its own here
    container = _cgroup(root, f"{pod}/cri-containerd-abc.scope", "600000 100000", (1000, 100, 5_000_000))
    _engine(proc, 100, f"{pod}/cri-containerd-abc.scope", 100)
    _engine(proc, 101, f"{pod}/cri-containerd-abc.scope", 72)
    proc.add(200, cgroup="/system.slice/sshd.service")  # no quota anywhere up its path
    reader = CfsBandwidthReader(proc.root, root)
    members = {"engine": {100, 101}, "sshd": {200}}
    first = reader.read(members)
    assert first["engine"] == {"threads": 172, "cpu_affinity_cores": 64, "cpu_quota_cores": 6.0,
                               "cpu_throttled_seconds_total": 5.0, "threads_per_quota_core": 28.67}  # fmt: skip
    assert "cpu_quota_cores" not in first["sshd"] and "cpu_throttled_ratio" not in first["sshd"]  # absent, not 0
    _cgroup(root, f"{pod}/cri-containerd-abc.scope", "600000 100000", (1050, 140, 7_500_000))
    second = reader.read(members)["engine"]
    assert second["cpu_throttled_ratio"] == 0.8 and second["cpu_throttled_seconds"] == 2.5
    assert second["cpu_throttled_seconds_total"] == 7.5
    (container / "cpu.stat").write_text("nr_periods 3\nnr_throttled 1\nthrottled_usec 10\n")  # recreated: backwards
    third = reader.read(members)["engine"]
    assert "cpu_throttled_ratio" not in third and third["cpu_quota_cores"] == 6.0


def test_a_limit_on_the_pod_applies_to_its_containers(tmp_path: Path) -> None:
    proc, root = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    (root / "cpu").mkdir(parents=True)  # v1: the cpu hierarchy
    d = root / "cpu" / "kubepods" / "pod1"
    (d / "c1").mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("200000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    (d / "cpu.stat").write_text("nr_periods 10\nnr_throttled 0\nthrottled_time 0\n")
    (d / "c1" / "cpu.cfs_quota_us").write_text("-1\n")
    (d / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    proc.add(100)
    (proc.root / "100" / "cgroup").write_text("4:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/\n")
    (proc.root / "100" / "status").write_text("Threads:\t4\n")
    assert CfsBandwidthReader(proc.root, root).read({"e": {100}})["e"]["cpu_quota_cores"] == 2.0


class PeriodTimer:
    """A cgroup's cpu.stat as the kernel keeps it: each period adds to
    `nr_periods` and then, throttled, to `nr_throttled`, while a reader prints
    them without the timer's lock. `tear_at` holds the readings (by count from
    0) that the timer's next period lands in the middle of."""

    def __init__(self, periods: int, throttled: int, tear_at: set[int]) -> None:
        self.periods, self.throttled, self.tear_at, self.reads = periods, throttled, tear_at, 0

    def period(self, throttled: bool = True) -> None:
        self.periods += 1
        self.throttled += throttled

    def read(self, path: Path) -> bytes:
        assert path.name == "cpu.stat"
        periods = self.periods
        if self.reads in self.tear_at:
            self.period()  # between the two counters' loads
        self.reads += 1
        return f"usage_usec 0\nnr_periods {periods}\nnr_throttled {self.throttled}\nthrottled_usec 0\n".encode()


def test_a_cpu_stat_torn_by_the_period_timer_is_read_again() -> None:
    timer = PeriodTimer(30, 30, tear_at={0})
    torn = parse_cpu_stat(timer.read(Path("cpu.stat")))
    assert torn.throttled > torn.periods  # what the kernel can print: 30 periods, 31 throttled
    timer = PeriodTimer(30, 30, tear_at={0})
    assert read_cpu_stat(Path("cpu.stat"), timer.read) == CpuStat(31, 31, 0.0) and timer.reads == 3
    timer = PeriodTimer(30, 30, tear_at={0, 1, 2, 3, 4})  # a timer in every reading: the last one, after 4
    assert read_cpu_stat(Path("cpu.stat"), timer.read) == CpuStat(33, 34, 0.0) and timer.reads == CPU_STAT_READS


# Per window: the periods that ran, and which of the edge's readings (if any) the next period lands in.
windows = st.lists(st.tuples(st.integers(1, 40), st.one_of(st.none(), st.integers(0, CPU_STAT_READS - 1))),
                   min_size=1, max_size=30)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 5), first_tear=st.one_of(st.none(), st.integers(0, CPU_STAT_READS - 1)), drawn=windows)
def test_a_throttled_share_is_never_above_one_whatever_the_timer_tears(
    tmp_path: Path, start: int, first_tear: int | None, drawn: list[tuple[int, int | None]]
) -> None:  # fmt: skip
    """An engine throttled in every period, its cpu.stat read at each window's
    edge with the period timer landing inside one of the edge's readings (at
    most one: they are microseconds apart, the periods 100 ms): every
    window's share is 1.0, as many periods throttled as ran. (The fake tree
    is only read, so one per test serves every example.)"""
    proc, root = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    if not root.exists():
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpu\n")
        _cgroup(root, "/pod", "50000 100000", (0, 0, 0))
        _engine(proc, 100, "/pod", 4)
    timer = PeriodTimer(start, start, tear_at=set())
    read_bytes = procfs.read_bytes

    def read(path: str | Path, limit: int | None = None) -> bytes:
        return timer.read(Path(path)) if Path(path).name == "cpu.stat" else read_bytes(path, limit)

    def edge(tear: int | None) -> dict[str, Any]:
        timer.tear_at = set() if tear is None else {timer.reads + tear}
        return reader.read({"e": {100}})["e"]

    reader = CfsBandwidthReader(proc.root, root)
    with mock.patch.object(procfs, "read_bytes", read):
        edge(first_tear)
        for periods, tear in drawn:
            for _ in range(periods):
                timer.period()
            assert edge(tear)["cpu_throttled_ratio"] == 1.0


def test_more_throttled_periods_than_periods_is_logged_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    proc, root = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu\n")
    _cgroup(root, "/pod", "50000 100000", (10, 8, 100))
    _engine(proc, 100, "/pod", 4)
    reader = CfsBandwidthReader(proc.root, root)
    reader.read({"e": {100}})
    _cgroup(root, "/pod", "50000 100000", (20, 19, 200))  # 10 periods, 11 throttled
    with caplog.at_level(logging.WARNING, logger="sampler.sources.cfs"):
        shard = reader.read({"e": {100}})["e"]
    assert "cpu_throttled_ratio" not in shard and shard["cpu_throttled_seconds"] == 0.0001
    assert shard["cpu_quota_cores"] == 0.5  # the rest of the reading stands
    assert "more throttled periods than periods" in caplog.text and "CpuStat(periods=20, throttled=19" in caplog.text


def test_the_largest_quota_the_kernel_takes_reaches_the_control_plane(tmp_path: Path) -> None:
    """`unlimited` written as a number: 2^44-1 us per 1 ms period (the kernel
    refuses one microsecond more) is a quota like any other, not a shard the
    control plane refuses."""
    proc, root = FakeProc(tmp_path / "proc"), tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu\n")
    _cgroup(root, "/pod", f"{2**44 - 1} 1000", (5, 0, 0))
    _engine(proc, 100, "/pod", 4)
    reader = CfsBandwidthReader(proc.root, root)
    reader.read({"e": {100}})
    _cgroup(root, "/pod", f"{2**44 - 1} 1000", (15, 0, 0))
    shard = {"id": "e", **reader.read({"e": {100}})["e"]}
    hb = heartbeat()
    hb["shards"] = [shard]
    [kept] = wire.parse_heartbeat(json.dumps(hb).encode())["shards"]
    assert kept["cpu_quota_cores"] == round((2**44 - 1) / 1000, 4) and kept["cpu_throttled_ratio"] == 0.0
