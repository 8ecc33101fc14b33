"""The /proc backend on this machine's real /proc, against the kernel's own
account of each workload measured in the same run.

The truth for a process group over an interval is the growth of utime +
stime of its processes plus cutime + cstime (the children they reaped),
read here with a parser of the test's own, at the interval's two ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sampler.backend import BackendChoice
from sampler.proc_groups import ProcGroupSampler
from sampler.selectors import GroupSelector, GroupWatch
from sampler.window_sampler import WindowSampler

pytestmark = pytest.mark.live

PROC = Path("/proc")
HZ = os.sysconf("SC_CLK_TCK")
WINDOW_S = 3.0

BURN_ONE_CORE = """
print("ready", flush=True)
while True:
    pass
"""

# An idle leader with three workers, each busy a quarter of the time.
QUARTER_WORKERS = """
import os, signal, time
for _ in range(3):
    if os.fork() == 0:
        while True:
            t = time.monotonic()
            end = time.thread_time() + 0.025
            while time.thread_time() < end:
                pass
            time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))
print("ready", flush=True)
signal.pause()
"""

# A leader that forks a child every 20 ms; the child burns 15 ms and exits.
FORKER = """
import os, time
print("ready", flush=True)
while True:
    t = time.monotonic()
    pid = os.fork()
    if pid == 0:
        end = time.process_time() + 0.015
        while time.process_time() < end:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(max(0.0, 0.02 - (time.monotonic() - t)))
"""


def start_group(code: str, tag: str = "workload") -> subprocess.Popen[str]:
    # The tag is an argument of its own, for `cmdline:` selectors to find.
    p = subprocess.Popen([sys.executable, "-c", code, tag], stdout=subprocess.PIPE, text=True, process_group=0)
    assert p.stdout is not None
    assert p.stdout.readline() == "ready\n"  # its workers are forked: the group is complete
    return p


@pytest.fixture
def group() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def group_ticks(pgid: int) -> int:
    """The kernel's account of a group's CPU: its own parser, not the sampler's."""
    total = 0
    for name in os.listdir(PROC):
        if not name.isdigit():
            continue
        try:
            data = (PROC / name / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = data[data.rindex(")") + 2 :].split(" ")
        if int(fields[2]) == pgid:
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total


def measure(pgid: int, selector: str) -> tuple[float, float]:
    """The sampler's window mean and the truth over the same interval, in cores."""
    watches = [GroupWatch("w", GroupSelector.parse(selector))]
    sampler = WindowSampler(PROC, BackendChoice("proc", None), ProcGroupSampler(PROC), watches)
    sampler.prime(0)
    t0, ticks0 = time.monotonic(), group_ticks(pgid)
    summary = sampler.run_window(WINDOW_S)
    t1, ticks1 = time.monotonic(), group_ticks(pgid)
    [shard] = summary["shards"]
    assert shard["pgid"] == pgid
    return shard["cpu_cores"]["mean"], (ticks1 - ticks0) / HZ / (t1 - t0)


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
    assert truth > 0.6  # fork costs CPU too, so on an idle machine this is above 0.75
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
