"""The /proc backend for engines: CPU cores and resident memory per watched
process group, many times a second, reading only the groups' own members.

Membership comes from a full walk of /proc (`ProcessTable`), run at most once
per window by `discover`. Between walks, `sample` reads /proc/<pid>/stat of the
members alone: 20 members cost 20 reads whether the machine runs 50 processes
or 50,000.

What one sample credits to a group:
- each member's utime + stime since the previous sample (all its threads);
- each member's cutime + cstime since the previous sample: the CPU time of
  children it reaped, so a group that forks short-lived workers is not
  under-reported;
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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sampler import procfs
from sampler.selectors import GroupWatch, ProcessTable

log = logging.getLogger(__name__)

USER_HZ = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class _Member:
    start_ticks: int
    ppid: int
    pgrp: int
    self_ticks: int
    child_ticks: int


@dataclass
class _WatchState:
    watch: GroupWatch
    members: dict[int, _Member] = field(default_factory=dict)
    # pid of a member parent -> ticks of its exited children already credited
    reap_credit: dict[int, int] = field(default_factory=dict)
    pgids: list[int] = field(default_factory=list)
    command: str | None = None
    # Members' first readings came from the walk, not from the previous
    # sample: the next sample has no interval to divide by.
    fresh: bool = True


@dataclass(frozen=True, slots=True)
class GroupReading:
    """One sample of one watched group. None: not measured in this sample."""

    cores: float | None
    memory_bytes: int | None
    # The time the rate covers, by the group sampler's own clock: the weight
    # of this sample, whatever delayed it (a stall inside the read included).
    seconds: float | None = None


class ProcGroupSampler:
    def __init__(self, proc: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self._clock = clock
        self._states: dict[str, _WatchState] = {}
        self._last_at: float | None = None
        self._memory: dict[str, int | None] = {}

    @property
    def watches(self) -> list[GroupWatch]:
        return [s.watch for s in self._states.values()]

    def discover(self, watches: list[GroupWatch], table: ProcessTable) -> None:
        """Point each watch at the members the walk found. Members already
        watched keep their last reading; new ones start from the walk's."""
        states = {}
        for w in watches:
            old = self._states.get(w.id)
            state = _WatchState(w) if old is None or old.watch != w else old
            members = {}
            for pid in table.resolve(w.selector):
                st = table.stats[pid]
                prev = state.members.get(pid)
                if prev is not None and prev.start_ticks == st.start_ticks:
                    members[pid] = prev
                else:
                    members[pid] = _Member(st.start_ticks, st.ppid, st.pgrp, st.self_ticks, st.child_ticks)
            state.members = members
            # Credits for parents no longer watched can never be used.
            state.reap_credit = {p: c for p, c in state.reap_credit.items() if p in members}
            state.pgids = sorted({m.pgrp for m in members.values() if m.pgrp > 0})
            state.command = None
            if len(state.pgids) == 1 and state.pgids[0] in table.stats:
                state.command = table.stats[state.pgids[0]].comm
            states[w.id] = state
        self._states = states

    def describe(self, watch_id: str) -> tuple[list[int], str | None]:
        """The process groups a watch found, and their leader's command name."""
        s = self._states[watch_id]
        return s.pgids, s.command

    def sample(self) -> dict[str, GroupReading]:
        now = self._clock()
        elapsed = None if self._last_at is None else now - self._last_at
        self._last_at = now
        readings = {wid: self._sample_one(state, elapsed) for wid, state in self._states.items()}
        self._memory = {wid: r.memory_bytes for wid, r in readings.items()}
        return readings

    def memory(self) -> dict[str, int | None]:
        """Each group's resident memory at the last sample (read with its CPU time)."""
        return {wid: self._memory.get(wid) for wid in self._states}

    def close(self) -> None:
        pass

    def program_stats(self) -> dict[str, tuple[int, int]]:
        return {}  # no kernel programs

    def dropped_forks(self) -> int | None:
        return None

    def runqueue_waits(self) -> dict[str, dict[str, float] | None] | None:
        return None  # no kernel histogram: the window sampler reads schedstat

    def _sample_one(self, state: _WatchState, elapsed: float | None) -> GroupReading:
        used = 0
        valid = elapsed is not None and elapsed > 0 and not state.fresh
        state.fresh = False
        rss_pages = 0
        alive = 0
        child_growth: dict[int, int] = {}
        for pid, m in list(state.members.items()):
            try:
                st = procfs.read_pid_stat(self.proc, pid)
            except procfs.ProcessGone:
                self._member_gone(state, pid, m)
                continue
            except procfs.ProcParseError as e:
                log.debug("group %s: %s", state.watch.id, e)
                valid = False  # a member unread: the group's sum would be short
                continue
            if st.start_ticks != m.start_ticks:
                self._member_gone(state, pid, m)  # pid reused: the member exited
                continue
            if st.pgrp != m.pgrp and state.watch.selector.kind != "cgroup":
                del state.members[pid]  # left the group (setpgid/setsid): no longer ours
                continue
            alive += 1
            rss_pages += st.rss_pages
            d_self, d_child = st.self_ticks - m.self_ticks, st.child_ticks - m.child_ticks
            if d_self < 0 or d_child < 0:
                log.debug("group %s: pid %d counters went backwards", state.watch.id, pid)
                valid = False
            else:
                used += d_self
                child_growth[pid] = d_child
            m.self_ticks, m.child_ticks, m.ppid = st.self_ticks, st.child_ticks, st.ppid
        for pid, grown in child_growth.items():
            credit = state.reap_credit.pop(pid, 0)
            if credit > grown:
                state.reap_credit[pid] = credit - grown  # the reap is still to come
            used += max(0, grown - credit)
        if alive == 0:
            return GroupReading(None, None)
        memory = rss_pages * PAGE_SIZE
        if not valid:
            return GroupReading(None, memory)
        assert elapsed is not None
        return GroupReading(used / USER_HZ / elapsed, memory, elapsed)

    @staticmethod
    def _member_gone(state: _WatchState, pid: int, m: _Member) -> None:
        del state.members[pid]
        if m.ppid in state.members:
            state.reap_credit[m.ppid] = state.reap_credit.get(m.ppid, 0) + m.self_ticks + m.child_ticks
