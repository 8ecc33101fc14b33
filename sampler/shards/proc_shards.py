"""The /proc backend for engines: CPU cores and resident memory per watched
process group, many times a second, reading only the groups' own members.

Membership comes from a full walk of /proc (`ProcessTable`), run at most once
per window by `discover`. Between walks, `sample` reads /proc/<pid>/stat of the
members alone: 20 members cost 20 reads whether the machine runs 50 processes
or 50,000.

What one sample credits to a group:
- each member's CPU time since the previous sample (all its threads): read
  from the process's CPU clock (`clock_gettime` of the pid's
  CPUCLOCK_SCHED clock), the scheduler's runtime in nanoseconds, up to date
  at each scheduler tick (not to the moment of the read: the kernel brings a
  running thread's runtime up to date only for the caller's own process).
  Where that clock names other processes than the procfs read (a procfs of
  another pid namespace, a test tree), utime + stime in clock ticks;
- each member's cutime + cstime since the previous sample: the CPU time of
  children it reaped, so a group that forks short-lived workers is not
  under-reported;
- never more than its threads (or the machine's CPUs) could use in the
  sample's time: the counters move in scheduler ticks (a running thread's
  runtime is brought up to date at each tick of CONFIG_HZ, 1 to 10 ms, and
  utime + stime in 10 ms clock ticks), so a sample shorter than a few ticks
  can see more than it could have used. The excess is time of the samples
  around it: it is carried into the next sample, not dropped. At
  `finest_hz` (10 a second) and below a sample holds at least ten ticks, so
  a tick early or late is at most 10% of a busy thread;
- less what was already credited: when a member that we were reading exits
  and its parent (also a member) reaps it, the parent's cutime jumps by the
  child's whole lifetime, most of which we counted while the child lived. The
  child's last reading is held as a credit against its parent's next cutime
  increase, so a worker that ran for an hour does not show up as an hour of
  CPU in one sample when it exits.

A process is its pid and its start time: a pid that comes back with another
start time is a new process, not the old one's continuation.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from sampler.shards.selectors import ProcessTable, ShardSpec
from sampler.sources import procfs
from sampler.sources.cfs import parse_status_threads

log = logging.getLogger(__name__)

USER_HZ = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# The counters move in ticks of at most 10 ms (USER_HZ clock ticks, or the
# scheduler tick that brings a running thread's runtime up to date): a
# sample sees each running thread's time up to a tick early or late. Ten
# ticks a sample keep that within 10% of a busy thread.
FINEST_HZ = USER_HZ / 10


def process_cpu_ns(pid: int) -> int:
    """The process's CPU time (every thread, ended ones too) up to now, in ns.
    OSError (EINVAL, ESRCH) when there is no such process."""
    return time.clock_gettime_ns((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def own_pid_namespace(proc: Path) -> bool:
    """Whether pids in this procfs are the pids this process's clocks name."""
    try:
        return int(os.readlink(proc / "self")) == os.getpid()
    except (OSError, ValueError):
        return False


@dataclass(slots=True)
class _Member:
    start_ticks: int
    ppid: int
    pgrp: int
    self_s: float  # its CPU time at the last reading, seconds
    child_ticks: int


@dataclass
class _ShardState:
    spec: ShardSpec
    members: dict[int, _Member] = field(default_factory=dict)
    # pid of a member parent -> seconds of its exited children already credited
    reap_credit: dict[int, float] = field(default_factory=dict)
    pgids: list[int] = field(default_factory=list)
    command: str | None = None
    # Members' first readings came from the walk, not from the previous
    # sample: the next sample has no interval to divide by.
    fresh: bool = True
    carried: float = 0.0  # seconds counted by the counters that its threads could not have used yet
    cpus: int = 1  # the CPUs its members may run on, at the walk (cpus_allowed)


def within_capacity(used: float, capacity: float, slack: float = math.inf) -> tuple[float, float]:
    """What a sample credits of `used` seconds when its group's threads could
    have used at most `capacity` in its time, and what is carried into the
    next sample: counters that move in steps place time a little late or
    early, never more of it than there was. An excess over `slack` is not a
    counter's step but threads the capacity did not know of (born since it
    was counted): credited as measured."""
    excess = used - capacity
    if excess <= 0 or excess > slack:
        return used, 0.0
    return capacity, excess


def cpus_allowed(proc: Path, pids: list[int], machine: int) -> int:
    """How many CPUs a group's processes may run on: the union of their
    `Cpus_allowed_list` (each main thread's affinity, which a cpuset or
    `taskset` sets for the whole process), at most the machine's; the
    machine's where none can be read (every process gone). A thread that
    widened its own mask past its main thread's is not seen: its time past
    the bound is carried, not lost."""
    allowed: set[int] = set()
    for pid in pids:
        try:
            _, cpus = parse_status_threads(procfs.read_pid_file(proc, pid, "status"))
        except (procfs.ProcessGone, ValueError, IndexError):
            continue
        allowed |= cpus or set()
    return min(len(allowed), machine) if allowed else machine


@dataclass(frozen=True, slots=True)
class ShardReading:
    """One sample of one shard. None: not measured in this sample."""

    cores: float | None
    memory_bytes: int | None
    # The time the rate covers, by the shard sampler's own clock: the weight
    # of this sample, whatever delayed it (a stall inside the read included).
    seconds: float | None = None


class ProcShardSampler:
    def __init__(self, proc: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self._clock = clock
        # The processes' own CPU clocks where they name this procfs's processes; else ticks.
        self._cpu_ns = process_cpu_ns if own_pid_namespace(proc) else None
        self.finest_hz: float | None = FINEST_HZ
        self.agent_samples_why: str | None = None  # the backend's own reason says it
        self.tickless_cpus: list[int] = []  # /proc needs no tick of ours
        self._cpus = os.cpu_count() or 1
        self._states: dict[str, _ShardState] = {}
        self._last_at: float | None = None
        self._memory: dict[str, int | None] = {}

    @property
    def specs(self) -> list[ShardSpec]:
        return [s.spec for s in self._states.values()]

    def discover(self, specs: list[ShardSpec], table: ProcessTable) -> None:
        """Point each shard at the members the walk found. Members already
        watched keep their last reading; new ones start from the walk's."""
        states = {}
        for w in specs:
            old = self._states.get(w.id)
            state = _ShardState(w) if old is None or old.spec != w else old
            members = {}
            for pid in table.resolve(w.selector):
                st = table.stats[pid]
                prev = state.members.get(pid)
                if prev is not None and prev.start_ticks == st.start_ticks:
                    members[pid] = prev
                    continue
                self_s = st.self_ticks / USER_HZ
                if self._cpu_ns is not None:
                    try:
                        self_s = self._cpu_ns(pid) / 1e9
                    except OSError:
                        continue  # gone since the walk
                members[pid] = _Member(st.start_ticks, st.ppid, st.pgrp, self_s, st.child_ticks)
            state.members = members
            state.cpus = cpus_allowed(self.proc, list(members), self._cpus)
            # Credits for parents no longer watched can never be used.
            state.reap_credit = {p: c for p, c in state.reap_credit.items() if p in members}
            state.pgids = sorted({m.pgrp for m in members.values() if m.pgrp > 0})
            state.command = None
            if len(state.pgids) == 1 and state.pgids[0] in table.stats:
                state.command = table.stats[state.pgids[0]].comm
            states[w.id] = state
        self._states = states

    def describe(self, shard_id: str) -> tuple[list[int], str | None]:
        """The process groups a shard found, and their leader's command name."""
        s = self._states[shard_id]
        return s.pgids, s.command

    def sample(self) -> dict[str, ShardReading]:
        now = self._clock()
        elapsed = None if self._last_at is None else now - self._last_at
        self._last_at = now
        readings = {wid: self._sample_one(state, elapsed) for wid, state in self._states.items()}
        self._memory = {wid: r.memory_bytes for wid, r in readings.items()}
        return readings

    def memory(self) -> dict[str, int | None]:
        """Each shard's resident memory at the last sample (read with its CPU time)."""
        return {wid: self._memory.get(wid) for wid in self._states}

    def close(self) -> None:
        pass

    def program_stats(self) -> dict[str, tuple[int, int]]:
        return {}  # no kernel programs

    def dropped_forks(self) -> int | None:
        return None

    def groups_run(self) -> None:
        return None  # no kernel to say: every window walks /proc

    def member_pids(self) -> set[int]:
        return {pid for state in self._states.values() for pid in state.members}

    def runqueue_waits(self) -> dict[str, dict[str, float] | None] | None:
        return None  # no kernel histogram: the window sampler reads schedstat

    def samples_in_kernel(self, hz: float) -> bool:
        return False  # the window sampler's loop takes every sample (the backend says why: agent_samples_why is None)

    def take_kernel_samples(self) -> NoReturn:
        raise RuntimeError("the /proc backend takes no samples in the kernel")

    def _sample_one(self, state: _ShardState, elapsed: float | None) -> ShardReading:
        used = 0.0
        valid = elapsed is not None and elapsed > 0 and not state.fresh
        state.fresh = False
        rss_pages = 0
        alive = threads = 0
        child_growth: dict[int, float] = {}
        for pid, m in list(state.members.items()):
            try:
                # The clock first: a stat read after it with the member's start
                # time says the clock was that process's.
                self_s = self._cpu_ns(pid) / 1e9 if self._cpu_ns is not None else None
                st = procfs.read_pid_stat(self.proc, pid)
            except (procfs.ProcessGone, OSError):
                self._member_gone(state, pid, m)
                continue
            except procfs.ProcParseError as e:
                log.debug("shard %s: %s", state.spec.id, e)
                valid = False  # a member unread: the shard's sum would be short
                continue
            if st.start_ticks != m.start_ticks:
                self._member_gone(state, pid, m)  # pid reused: the member exited
                continue
            if st.pgrp != m.pgrp and state.spec.selector.kind not in ("cgroup", "containers"):
                del state.members[pid]  # left the group (setpgid/setsid): no longer ours
                continue
            alive += 1
            threads += st.threads
            rss_pages += st.rss_pages
            if self_s is None:
                self_s = st.self_ticks / USER_HZ
            d_self, d_child = self_s - m.self_s, st.child_ticks - m.child_ticks
            if d_self < 0 or d_child < 0:
                log.debug("shard %s: pid %d counters went backwards", state.spec.id, pid)
                valid = False
            else:
                used += d_self
                child_growth[pid] = d_child / USER_HZ
            m.self_s, m.child_ticks, m.ppid = self_s, st.child_ticks, st.ppid
        for pid, grown in child_growth.items():
            credit = state.reap_credit.pop(pid, 0)
            if credit > grown:
                state.reap_credit[pid] = credit - grown  # the reap is still to come
            used += max(0, grown - credit)
        if alive == 0:
            return ShardReading(None, None)
        memory = rss_pages * PAGE_SIZE
        if not valid:
            return ShardReading(None, memory)
        assert elapsed is not None
        credit, state.carried = within_capacity(used + state.carried, min(max(threads, 1), state.cpus) * elapsed)
        return ShardReading(credit / elapsed, memory, elapsed)

    @staticmethod
    def _member_gone(state: _ShardState, pid: int, m: _Member) -> None:
        del state.members[pid]
        if m.ppid in state.members:
            state.reap_credit[m.ppid] = state.reap_credit.get(m.ppid, 0.0) + m.self_s + m.child_ticks / USER_HZ
