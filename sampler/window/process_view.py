"""Which processes a window resolves its selectors against: the whole of
/proc, or only what the kernel says matters.

A full walk reads every process's stat: about 25 us a process, a quarter of
a second a window on a node of 10,000 processes (issue #34 measured the
agent at 1.64 times its cost with 100). Where the kernel keeps membership
(the kernel backend, every selector by process group, the tick following
joins and leaves), a window reads instead:
- the leaders of the groups that ran since the last window (the tick's
  counts, sampler/kernel/groups_run.py): a new group is matched when it
  first runs, a leader's exec is seen at its next run;
- the processes the kernel counts for a shard now (their memory and threads);
- the leaders of the groups watched until now, and the processes `pid:`
  selectors name (an idle engine stays watched).
Its cost grows with the groups that run and the watched processes, not
with the machine's processes.

Where every selector names cgroups (`cgroup:`, `containers:`, `k8s:`
pods) on the unified hierarchy, a window reads the watched cgroups'
processes from the cgroups themselves (sampler/sources/cgroup_members.py),
on either backend.

The full walk remains at start, every FULL_WALK_EVERY_S, and whenever
neither can say (the /proc backend or a kernel without a task's group in
its BTF for selectors by group, the tick's map full, a v1 cgroup tree,
selectors of both kinds). For selectors by group the periodic walk is a
check as well: it must find no process the kernel placed wrong
(`corrections`, logged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from sampler.backend import ShardSampler
from sampler.shards.selectors import ProcessTable
from sampler.sources import cgroup_members, cgroup_view, procfs
from sampler.sources.cgroup_view import CGROUP_ROOT

log = logging.getLogger(__name__)

# Often enough that a process the kernel could not place (a sleeping one
# moved by another's setpgid never runs to be seen) is counted within
# minutes; rare enough that its cost, a quarter of a second at 10,000
# processes, is 0.08% of a core.
FULL_WALK_EVERY_S = 300.0
# The rounds of two ticks the check waits for the kernel to agree on a
# process it differs on. One round once counted a leaver of CI's
# leave-and-join storm as placed wrong: on two CPUs shared with four
# burners, a process runs at a given tick about half the time, so the tick
# missed it for two. Ten leave it unseen for 20 ticks (about one in a
# million); the wait, at most 0.2 s, is paid only where the kernel and the
# walk differ, once in FULL_WALK_EVERY_S.
CHECK_ROUNDS = 10


class ProcessView:
    def __init__(self, proc: Path, shards: ShardSampler, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, cgroup_root: Path = CGROUP_ROOT,
                 full_walk_every: float = FULL_WALK_EVERY_S) -> None:  # fmt: skip
        self.proc, self._shards, self._clock, self._sleep = proc, shards, clock, sleep
        self.cgroup_root = cgroup_root  # the host's cgroup tree, where a table finds a process's cgroup
        self.full_walk_every = full_walk_every
        self.cgroup_dirs_max = cgroup_members.MAX_DIRS  # read a window in place of a walk, at most
        self._table: ProcessTable | None = None
        self._walked_at: float | None = None
        self._watched: set[int] = set()  # the groups the shards watched at the last window
        self._containers_seen: set[str] | None = None  # the node's containers, where the cgroup tree was read
        self.walks = 0  # full walks so far
        self.corrections = 0  # processes a periodic walk found the kernel had placed wrong

    def table(self, by_group_only: bool, named: Iterable[int] = (), by_cgroup_only: bool = False,
              cgroups: Iterable[str] = (), containers: Collection[str] | None = None,
              ) -> tuple[ProcessTable, dict[int, int] | None]:  # fmt: skip
        """This window's table, and each group's ticks since the last call
        (None: the kernel cannot say). `by_group_only`: every selector names
        whole groups; `named`: pids the selectors name (`pid:N`).
        `by_cgroup_only`: every selector names whole cgroups, the paths
        `cgroups` and the containers `containers` (None: no selector names a
        container or a pod, and the node's containers are not looked for)."""
        seen = self._shards.groups_run()
        now = self._clock()
        self._containers_seen = None
        in_cgroups: set[int] | None = None
        reason = None
        if by_group_only:
            if seen is None:
                reason = "the kernel does not say which groups ran"
            elif not seen.following:
                reason = "the kernel does not follow the watched groups"
            elif not seen.complete:
                reason = "more groups ran than the kernel's map holds"
        elif by_cgroup_only:
            in_cgroups, reason = self._cgroup_members(list(cgroups), containers)
        else:
            reason = "a selector by neither process group nor cgroup"
        if reason is None and (self._walked_at is None or now - self._walked_at >= self.full_walk_every):
            reason = "periodic"
        if reason is None:
            if in_cgroups is not None:
                # With the kernel's members: one that left the watched cgroups
                # while the tick did not follow (past the cgroups its map
                # holds) is read outside them, and the sync takes it out.
                pids = in_cgroups | self._shards.member_pids() | set(named)
            else:
                assert seen is not None
                pids = self._shards.member_pids() | seen.ticks.keys() | self._watched | set(named)
            self._table = ProcessTable.of(self.proc, sorted(pids), self._table, self.cgroup_root)
        else:
            checking = reason == "periodic" and self._walked_at is not None and by_group_only
            self._table = ProcessTable.walk(self.proc, self._table, self.cgroup_root)
            self._walked_at, self.walks = now, self.walks + 1
            if checking:
                assert seen is not None
                self._check(self._table, seen.follows_within_s)
        return self._table, None if seen is None else seen.ticks

    def containers_on_node(self) -> set[str]:
        """The containers on the node, as this window found them: the
        cgroup tree's containers where it was read instead of /proc, else
        those of the table's processes."""
        if self._containers_seen is not None:
            return self._containers_seen
        return set() if self._table is None else set(self._table.container_ids().values())

    def _cgroup_members(self, cgroups: list[str],
                        containers: Collection[str] | None) -> tuple[set[int] | None, str | None]:  # fmt: skip
        """The processes of the watched cgroups and containers, read from
        the cgroups (sampler/sources/cgroup_members.py), or why they cannot be."""
        if not cgroup_view.unified(self.cgroup_root):
            return None, "a cgroup v1 tree: a process's cgroups, one a hierarchy, are read from /proc"
        tops = list(cgroups)
        if containers is not None:
            dirs = cgroup_members.container_dirs(self.cgroup_root, self.cgroup_dirs_max)
            if dirs is None:
                return None, f"more than {self.cgroup_dirs_max} cgroups outside containers"
            self._containers_seen = set(dirs)
            tops += [dirs[cid] for cid in sorted(containers) if cid in dirs]
        pids = cgroup_members.procs_below(tops, self.cgroup_root, self.cgroup_dirs_max)
        if pids is None:
            return None, f"more than {self.cgroup_dirs_max} watched cgroups"
        return pids, None

    def watched(self, groups: Iterable[int]) -> None:
        """The groups the shards watch from now on (the discover's)."""
        self._watched = set(groups)

    def _check(self, walked: ProcessTable, follows_within_s: float) -> None:
        """The kernel's members against the walk's, for the groups watched
        since the last window. A process differs where the walk put it in a
        watched group and the kernel not, or the other way. It counts as
        placed wrong only where it stays in the group it is read in again,
        and the kernel still disagrees after rounds of two ticks from that
        read: a process the tick has not yet seen since its move (it moved
        just before the read, or waits for a CPU on a crowded node) is not."""
        walk = {pid for pid, st in walked.stats.items() if st.pgrp in self._watched}
        differ = (walk ^ self._shards.member_pids()) & walked.stats.keys()
        if not differ:
            return
        pending = {pid: walked.stats[pid].start_ticks for pid in differ}
        groups: dict[int, int] = {}  # pid -> its group when first read again
        for _ in range(CHECK_ROUNDS):
            for pid, started in list(pending.items()):
                try:
                    st = procfs.read_pid_stat(self.proc, pid)
                except (procfs.ProcessGone, procfs.ProcParseError):
                    st = None
                if st is None or st.start_ticks != started or st.state in ("Z", "X") \
                        or groups.setdefault(pid, st.pgrp) != st.pgrp:  # fmt: skip
                    del pending[pid]  # gone, or moved again: the next walk sees where it settles
            self._sleep(2 * follows_within_s)
            members = self._shards.member_pids()
            pending = {pid: started for pid, started in pending.items()
                       if (groups[pid] in self._watched) != (pid in members)}  # fmt: skip
            if not pending:
                return
        self.corrections += len(pending)
        log.warning("the periodic walk of /proc found %d processes the kernel placed wrong (e.g. %s): "
                    "the walk corrects them", len(pending), sorted(pending)[:5])  # fmt: skip
