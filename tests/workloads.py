"""Workloads with a known CPU appetite, each its own process group, and the
kernel's own account of a group's CPU time to measure them against."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

PROC = Path("/proc")
HZ = os.sysconf("SC_CLK_TCK")

BURN_ONE_CORE = """
print("ready", flush=True)
while True:
    pass
"""


def busy_threads(n: int, cpu: int | None = None, duty: float = 1.0, nice: int = 0) -> str:
    """An engine of n threads, each busy `duty` of every 100 ms (on a CPU of
    its own where there are enough); pinned to `cpu` when given; at `nice`
    (a negative one needs root: where it is refused, the engine runs at its
    own). sha256 of a large buffer releases the GIL: the threads run at
    once, as an engine's do."""
    setup = f"os.sched_setaffinity(0, {{{cpu}}})\n" if cpu is not None else ""
    # Set before the threads start: a nice is a thread's own, and new threads take their maker's.
    if nice:
        setup += f"try:\n    os.setpriority(os.PRIO_PROCESS, 0, {nice})\nexcept PermissionError:\n    pass\n"
    return (f"import hashlib, os, threading, time\n{setup}data = bytes(1 << 20)\n"
            "def burn():\n    while True:\n"
            f"        end = time.monotonic() + {0.1 * duty}\n"
            "        while time.monotonic() < end:\n            hashlib.sha256(data).digest()\n"
            f"        time.sleep({0.1 * (1 - duty)})\n"
            f"for _ in range({n}):\n    threading.Thread(target=burn, daemon=True).start()\n"
            "print('ready', flush=True)\nthreading.Event().wait()\n")  # fmt: skip


# One thread busy 10 ms of every 20 ms: a mean of 0.5 core in bursts of 1.0.
HALF_OF_20MS = """
import time
print("ready", flush=True)
t = time.monotonic()
while True:
    while time.monotonic() < t + 0.010:
        pass
    t += 0.020
    time.sleep(max(0.0, t - time.monotonic()))
"""

# Three threads busy together 30 ms of every 505 ms: bursts of 3.0 cores.
# sha256 of a buffer releases the GIL: the threads run at once. 505, not 500:
# the bursts drift 5 ms against a sampler's 10, 20 or 50 ms grid, so within
# four bursts one holds a whole sample of any period under 30 ms.
BURST_PERIOD_S = 0.505
BURST_THREE = f"""
import hashlib, math, sys, threading, time
data = bytes(1 << 16)
said = threading.Lock()
def burst():
    while True:
        start = math.ceil(time.monotonic() / {BURST_PERIOD_S}) * {BURST_PERIOD_S}
        time.sleep(max(0.0, start - time.monotonic()))
        used = time.thread_time()
        while time.monotonic() < start + 0.030:
            hashlib.sha256(data).digest()
        with said:  # the CPU this thread had in the burst: what a loaded machine gave it
            sys.stdout.write(f"burst {{start:.6f}} {{time.thread_time() - used:.6f}}\\n")
            sys.stdout.flush()
for _ in range(3):
    threading.Thread(target=burst, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


class BurstReports:
    """BURST_THREE's account of its bursts, read from its output by a thread
    (the output would otherwise fill the pipe): each burst's start (monotonic
    seconds) -> the CPU seconds each of its threads had in it."""

    THREADS = 3

    def __init__(self, p: subprocess.Popen[str]) -> None:
        self._got: dict[float, list[float]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            _, start, seconds = line.split()
            with self._changed:
                self._got.setdefault(round(float(start), 3), []).append(float(seconds))
                self._changed.notify_all()

    def between(self, t0: float, t1: float, burst_s: float) -> list[float]:
        """The CPU seconds of each burst wholly between t0 and t1, once every
        thread has said its part."""
        first = math.ceil(t0 / BURST_PERIOD_S)
        starts = [round(k * BURST_PERIOD_S, 3) for k in range(first, int(t1 // BURST_PERIOD_S) + 1)
                  if k * BURST_PERIOD_S + burst_s <= t1]  # fmt: skip
        with self._changed:
            told = self._changed.wait_for(
                lambda: all(len(self._got.get(s, ())) == self.THREADS for s in starts), timeout=60)
            assert told, f"bursts {starts} not all said: {self._got}"
            return [sum(self._got[s]) for s in starts]


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


def group_members(pgid: int) -> list[int]:
    """The pids of a process group's live processes: a walk of all of /proc."""
    pids = []
    for name in os.listdir(PROC):
        if not name.isdigit():
            continue
        try:
            data = (PROC / name / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(data[data.rindex(")") + 2 :].split(" ")[2]) == pgid:
            pids.append(int(name))
    return pids


def members_cpu_seconds(pgid: int, pids: list[int]) -> float:
    """The kernel's account of these processes' CPU (those still in the group:
    a pid reused since is another's), read with the test's own parser: each
    live thread's on-CPU nanoseconds (`process_cpu_seconds`), plus the cutime
    and cstime of children they reaped (clock ticks). utime and stime alone
    come in 10 ms ticks per process: over a 2 s window of four processes that
    quantisation alone is up to 2.7% of three quarters of a core."""
    total = 0.0
    for pid in pids:
        try:
            data = (PROC / str(pid) / "stat").read_text()
            fields = data[data.rindex(")") + 2 :].split(" ")
            if int(fields[2]) != pgid:
                continue
            total += (int(fields[13]) + int(fields[14])) / HZ  # cutime cstime
            total += process_cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def stamped(read: Callable[[], float], clock: Callable[[], float] = time.monotonic) -> tuple[float, float]:
    """(when, what `read` returned), stamped with the middle of its reads."""
    before = clock()
    value = read()
    return (before + clock()) / 2, value


def group_cpu_at(pgid: int, pids: list[int], clock: Callable[[], float] = time.monotonic) -> tuple[float, float]:
    """(when, the group's CPU seconds) over members found by an earlier walk
    (`group_members`): the clock and their counters read together, in a
    handful of reads. Stamped before a walk of /proc, the counters were read
    140-280 ms after their stamp under emulation, a different delay at each
    edge: up to 3% of a 0.75-core group over 5 s. A member forked since the
    walk is missed until a member reaps it (a slice, at most)."""
    return stamped(partial(members_cpu_seconds, pgid, pids), clock)


def process_cpu_seconds(pid: int) -> float:
    """The kernel's account of one process that forks nothing: its threads'
    on-CPU nanoseconds (schedstat), in a handful of reads. A burst's edge
    moves by milliseconds: a truth that walks all of /proc first reads it
    tens of milliseconds late. A running thread's schedstat is brought up to
    date only at a tick or a switch, so it can be a tick behind (4 ms at
    HZ=250): exact only while the process's threads are off CPU."""
    total = 0.0
    for tid in os.listdir(PROC / str(pid) / "task"):
        try:
            total += int((PROC / str(pid) / "task" / tid / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class GroupTruth:
    """The kernel's account of a group's cores between two calls of `cores()`,
    over the members it found when made (children they fork and reap are
    counted when reaped)."""

    def __init__(self, pgid: int) -> None:
        self.pgid, self.pids = pgid, group_members(pgid)
        self.at, self.seconds = group_cpu_at(pgid, self.pids)

    def cores(self) -> float:
        at, seconds = group_cpu_at(self.pgid, self.pids)
        cores = (seconds - self.seconds) / (at - self.at)
        self.at, self.seconds = at, seconds
        return cores



def then_after_each_reading(groups: Any, then: Callable[[], None]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A group sampler's `sample` and `take_kernel_samples`, each calling
    `then` right at the sampler's own reading of its groups: after each
    sample of the window sampler's loop, and where the kernel takes the
    samples, as soon as the kernel has written a new one, before they are
    read, so that the last sample read is as fresh as the loop's own. A
    truth read in `then` covers what the samples do."""
    sample, take = groups.sample, groups.take_kernel_samples

    def sample_then() -> Any:
        readings = sample()
        then()
        return readings

    def take_then() -> Any:
        ring, waited_since = groups.ring, time.monotonic()
        written = ring.written()
        # The kernel's next sample: written into shared memory, with no
        # descriptor to wait on; at most one period away.
        while ring.written() == written and time.monotonic() - waited_since < 2.0:
            pass
        # The truth at once, the reading's own work after it: read after that
        # work, the truth covered a stretch past the window's last sample, and
        # on CI a busy engine off its CPU there read 0.965 cores by the truth
        # against the samples' 0.995.
        then()
        return take()

    return sample_then, take_then


@contextmanager
def after_each_reading(groups: Any, then: Callable[[], None]) -> Iterator[None]:
    """`then` called after each reading (then_after_each_reading) while the block runs."""
    groups.sample, groups.take_kernel_samples = then_after_each_reading(groups, then)
    try:
        yield
    finally:
        del groups.sample, groups.take_kernel_samples  # the instance's attributes go: the class's methods again
