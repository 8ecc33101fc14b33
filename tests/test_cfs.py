"""CFS bandwidth per engine: parsers, fake cgroup trees (v1 and v2), and real
cgroups on this machine (v1's cpu hierarchy, root) with a busy engine capped
at half a core, against the kernel's own cpu.stat."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sampler.cfs import (
    CfsBandwidthReader,
    CpuStat,
    parse_cfs_quota,
    parse_cpu_list,
    parse_cpu_max,
    parse_cpu_stat,
    parse_status_threads,
)
from sampler.procfs import ProcParseError
from tests.fakeproc import FakeProc
from tests.workloads import start_group


def test_parsers() -> None:
    assert parse_cpu_max(b"50000 100000\n") == 0.5 and parse_cpu_max(b"max 100000\n") is None
    assert parse_cfs_quota(b"600000\n", b"100000\n") == 6.0 and parse_cfs_quota(b"-1\n", b"100000\n") is None
    v1 = parse_cpu_stat(b"nr_periods 46\nnr_throttled 44\nthrottled_time 2500000000\nnr_bursts 0\n")
    v2 = parse_cpu_stat(b"usage_usec 10\nuser_usec 5\nsystem_usec 5\nnr_periods 46\nnr_throttled 44\n"
                        b"throttled_usec 2500000\n")  # fmt: skip
    assert v1 == v2 == CpuStat(46, 44, 2.5)
    assert parse_cpu_list(b"0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
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


# --- real cgroups -------------------------------------------------------------------

THREE_BUSY_THREADS = """
import threading
def burn():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=burn, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture
def v1_cpu_cgroup() -> Iterator[Path]:
    root = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (root / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and cgroup v1's cpu hierarchy (the VM guests run the v2 case)")
    d = root / f"nodesampler-test-{os.getpid()}"
    d.mkdir()
    yield d
    for pid in (d / "cgroup.procs").read_text().split():
        (root / "cgroup.procs").write_text(pid)
    deadline = time.monotonic() + 10
    while True:
        try:
            d.rmdir()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _measure(cgroup: Path, pid: int, window: float = 3.0) -> tuple[dict[str, float], float]:
    reader = CfsBandwidthReader(Path("/proc"))
    members = {"engine": {pid}}
    reader.read(members)
    before = parse_cpu_stat((cgroup / "cpu.stat").read_bytes())
    time.sleep(window)  # the window itself: the kernel throttles meanwhile
    shard = reader.read(members)["engine"]
    after = parse_cpu_stat((cgroup / "cpu.stat").read_bytes())
    return shard, after.throttled_seconds - before.throttled_seconds


@pytest.mark.live
def test_an_engine_capped_at_half_a_core_is_throttled(v1_cpu_cgroup: Path,
                                                     group: list[subprocess.Popen[str]]) -> None:  # fmt: skip
    (v1_cpu_cgroup / "cpu.cfs_period_us").write_text("100000")
    (v1_cpu_cgroup / "cpu.cfs_quota_us").write_text("50000")
    p = start_group(THREE_BUSY_THREADS)
    group.append(p)
    (v1_cpu_cgroup / "cgroup.procs").write_text(str(p.pid))
    shard, kernel = _measure(v1_cpu_cgroup, p.pid)
    assert shard["cpu_quota_cores"] == 0.5
    assert shard["threads"] == 4 and shard["threads_per_quota_core"] == 8.0  # the main thread and three burners
    assert shard["cpu_throttled_ratio"] > 0.9, shard
    assert shard["cpu_throttled_seconds"] == pytest.approx(kernel, rel=0.05), (shard, kernel)


@pytest.mark.live
def test_the_same_engine_uncapped_reports_no_quota(v1_cpu_cgroup: Path, group: list[subprocess.Popen[str]]) -> None:
    p = start_group(THREE_BUSY_THREADS)
    group.append(p)
    (v1_cpu_cgroup / "cgroup.procs").write_text(str(p.pid))
    shard, _ = _measure(v1_cpu_cgroup, p.pid, window=1.0)
    assert shard["threads"] == 4
    for key in ("cpu_quota_cores", "cpu_throttled_ratio", "cpu_throttled_seconds", "threads_per_quota_core"):
        assert key not in shard  # no quota: absent, never 0
