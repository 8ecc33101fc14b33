"""Fixtures shared by the live and kernel tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

from sampler.backend_unavailable import BackendUnavailable
from sampler.sources.cfs import parse_cpu_stat
from tests.workloads import PROC

if TYPE_CHECKING:
    from sampler.kernel.sched import KernelShardSampler

# CI sets it: a kernel test that cannot run is a failure, not a skip.
REQUIRE_BPF = os.environ.get("NODESAMPLER_REQUIRE_BPF") == "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--repeat-timing", type=int, default=1, metavar="N",
                     help="run each test marked `timing` N times (make test-stress: tests/stress.sh)")  # fmt: skip


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A `timing` test N times over under --repeat-timing N: a race it could lose shows in N tries."""
    count = metafunc.config.getoption("repeat_timing")
    if count > 1 and metafunc.definition.get_closest_marker("timing") is not None:
        metafunc.fixturenames.append("timing_round")
        metafunc.parametrize("timing_round", range(1, count + 1), indirect=True, ids=lambda n: f"round-{n}")


@pytest.fixture
def timing_round(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def group() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError):  # a test may have ended it itself
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture(scope="session")
def shared_bpf_groups() -> Iterator[KernelShardSampler]:
    """One kernel backend for the whole run: a load is a compile (12-20 s in
    an emulated guest of `make vm-test`, over half its time when each test
    loaded its own, a minute a line when each module did), and the agent
    itself keeps one loaded while its shards change from window to window.
    Where NODESAMPLER_BACKEND_REPORT names a file (the VM harness's guests),
    which backend `--backend auto` would take here, and how long the load
    took, are written to it: the guest's table reads them, and the guest
    loads no backend of its own to learn it."""
    yield from _bpf_groups(bpf_stats=False, report=os.environ.get("NODESAMPLER_BACKEND_REPORT"))


@pytest.fixture
def bpf_groups(shared_bpf_groups: KernelShardSampler) -> Iterator[KernelShardSampler]:
    """The kernel backend loaded into this kernel, shared by every test that
    asks for it: each starts watching nothing and leaves nothing watched."""
    from sampler.shards.selectors import ProcessTable

    shared_bpf_groups.discover([], ProcessTable.walk(PROC))
    yield shared_bpf_groups
    shared_bpf_groups.discover([], ProcessTable.walk(PROC))


@pytest.fixture(scope="module")
def bpf_groups_with_stats() -> Iterator[KernelShardSampler]:
    """A kernel backend with the kernel's BPF statistics on (--bpf-stats),
    for a module's tests that read its programs' statistics: on until the
    module ends (a test that needs them off comes before the first of those),
    or until the module's last test that asks for it closes it."""
    yield from _bpf_groups(bpf_stats=True)


@pytest.fixture(scope="module")
def bpf_groups_fallbacks() -> Iterator[KernelShardSampler]:
    """The fallbacks: sched_switch attached as a raw tracepoint (where tp_btf
    cannot load), and each CPU's run queue found by its tick for the
    kernel's samples (where a task group's cfs_rq is one per-CPU pointer).
    A module's, not the run's: held for the run, its programs ran beside
    every later test's, and the one arm64 guest run that held it so was the
    one whose kernel skipped a sixth of its 1000 Hz periods (a 5 s stall
    overwrote 55 ms of samples, where a ring of 4.1 s leaves 0.9 s)."""
    yield from _bpf_groups(bpf_stats=False, raw_switch=True, rq_from_tick=True)


def _bpf_groups(bpf_stats: bool, raw_switch: bool = False, rq_from_tick: bool = False,
                report: str | None = None) -> Iterator[KernelShardSampler]:  # fmt: skip
    from sampler.kernel import sched

    started = time.monotonic()
    try:
        sampler = sched.load(PROC, bpf_stats=bpf_stats, raw_switch=raw_switch, rq_from_tick=rq_from_tick)
        if report:  # as open_backend("auto") says it: the name, or "proc: why"
            Path(report).write_text(f"bpf ({time.monotonic() - started:.0f} s to load)\n")
    except BackendUnavailable as e:
        if report:
            Path(report).write_text(f"proc: {e}\n")
        if REQUIRE_BPF:
            pytest.fail(f"NODESAMPLER_REQUIRE_BPF=1 and the kernel backend cannot load: {e}")
        pytest.skip(f"kernel backend unavailable: {e}")
    yield sampler
    sampler.close()


class AccuracyLog:
    """Each accuracy comparison a kernel test makes, appended as a JSON line to
    the file NODESAMPLER_ACCURACY_LOG names (the VM harness prints them in its
    table); nothing when it is unset. Recorded before the assertion, so a
    failing comparison is in the log too."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def record(self, check: str, measured: float, truth: float, bound: float) -> None:
        if self.path is None:
            return
        error = abs(measured - truth) / truth if truth else float("inf")
        line = {"check": check, "measured": measured, "truth": truth, "error": round(error, 5), "bound": bound}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.fixture
def accuracy() -> AccuracyLog:
    path = os.environ.get("NODESAMPLER_ACCURACY_LOG")
    return AccuracyLog(Path(path) if path else None)


CGROUP = Path("/sys/fs/cgroup")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unavailable(reason: str) -> NoReturn:
    """A kernel test that cannot run here: skipped, or failed under NODESAMPLER_REQUIRE_BPF=1."""
    if REQUIRE_BPF:
        pytest.fail(f"NODESAMPLER_REQUIRE_BPF=1 and {reason}")
    pytest.skip(reason)


@pytest.fixture
def cpu_cgroup() -> Iterator[CpuCgroup]:
    if os.geteuid() != 0:
        unavailable("making cgroups needs root")
    if (CGROUP / "cgroup.controllers").exists():  # the unified tree (v2)
        if "cpu" not in (CGROUP / "cgroup.controllers").read_text().split():
            unavailable("cgroup v2 without the cpu controller")
        if "cpu" not in (CGROUP / "cgroup.subtree_control").read_text().split():
            (CGROUP / "cgroup.subtree_control").write_text("+cpu")
        root, v2 = CGROUP, True
    elif (CGROUP / "cpu" / "cpu.cfs_quota_us").exists():
        root, v2 = CGROUP / "cpu", False
    else:
        unavailable(f"no cpu controller mounted at {CGROUP}")
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
