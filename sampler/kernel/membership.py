"""Membership in the kernel: the `task_slot` map, a byte per tgid saying
which slot (set of shards) counts it. Shared memory: reading and writing it
costs no system call. The walk of /proc writes it once a window; processes
forked inside a group join it in the kernel, at fork, and leave at exit.
Where the watched groups alone decide the slots (`group_slot`, a byte per
pgid), the tick moves a process that joined or left one (setpgid, setsid)
within a tick of its running."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any

import numpy as np

from sampler.kernel.build import MAX_SLOTS
from sampler.shards.selectors import ProcessTable
from sampler.sources import procfs

log = logging.getLogger(__name__)

CGROUP_SLOTS_MAX = 4096  # cgroup_slot's entries (bpf/sched_groups.bpf.c)
PF_EXITING = 0x00000004  # include/linux/sched.h: set as do_exit begins, before sched_process_exit


PAGE = 4096  # task_slot's bytes a page: 4,096 pids


def nonzero_bytes(shared: np.ndarray) -> np.ndarray:
    """The indices of a shared byte array's nonzero bytes, in order, read
    page by page: a page's 512 words are tested at once, and only the pages
    holding one are searched byte by byte. task_slot is pid_max bytes (4 MiB
    where pid_max is 4,194,304, as on the guests' kernels): np.flatnonzero
    over its bytes took 6.9 ms here and, under the VM lines' emulated CPUs,
    about 0.3 s a window; this takes 0.6 ms with 50 pages holding members.
    Each page is copied before it is searched: the kernel writes the array
    at every fork and exit, and flatnonzero refuses one that changes under
    it."""
    pages = len(shared) // PAGE
    words = shared[: pages * PAGE].view(np.uint64).reshape(pages, PAGE // 8)
    found = [page * PAGE + np.flatnonzero(shared[page * PAGE : (page + 1) * PAGE].copy())
             for page in np.flatnonzero(words.any(axis=1)).tolist()]  # fmt: skip
    tail = pages * PAGE + np.flatnonzero(shared[pages * PAGE :].copy())
    return np.concatenate([*found, tail])


def _shared_bytes(array_map: Any, length: int) -> tuple[mmap.mmap, np.ndarray]:
    """An mmapable array map of u64 words, as bytes this process writes in place."""
    mapped = mmap.mmap(array_map.fd, (length + 7) // 8 * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return mapped, np.frombuffer(mapped, dtype=np.uint8)


class TaskSlots:
    def __init__(self, task_slot_map: Any, pid_max: int, proc: Path, group_slot_map: Any = None,
                 group_keyed_map: Any = None, cgroup_slot_map: Any = None,
                 cgroup_keyed_map: Any = None) -> None:  # fmt: skip
        self.proc = proc
        self._map, self.task_slot = _shared_bytes(task_slot_map, pid_max)
        # Compiled out where the kernel's BTF does not say where a task's group is.
        self._group_maps: list[mmap.mmap] = []
        self.group_slot: np.ndarray | None = None
        self._group_keyed: np.ndarray | None = None
        if group_slot_map is not None and group_keyed_map is not None:
            mapped, self.group_slot = _shared_bytes(group_slot_map, pid_max)
            keyed_map, self._group_keyed = _shared_bytes(group_keyed_map, MAX_SLOTS)
            self._group_maps = [mapped, keyed_map]
        self._groups_written = np.zeros(0, dtype=np.int64)
        self._cgroup_slot = cgroup_slot_map
        self._cgroup_keyed: np.ndarray | None = None
        if cgroup_slot_map is not None and cgroup_keyed_map is not None:
            keyed_map, self._cgroup_keyed = _shared_bytes(cgroup_keyed_map, MAX_SLOTS)
            self._group_maps.append(keyed_map)
        self._cgroups_written: dict[int, int] = {}

    def follow_groups(self, slot_of_group: dict[int, int] | None) -> bool:
        """The tick's rule from now on: a process running in a group of
        `slot_of_group` (pgid -> slot) takes that slot, one in such a slot
        outside those groups loses it. None: the walk alone decides (a
        selector other than by group is in use). False where the kernel cannot
        follow groups."""
        if self.group_slot is None or self._group_keyed is None:
            return False
        groups = slot_of_group or {}
        pgids = np.fromiter(groups.keys(), dtype=np.int64, count=len(groups))
        slots = np.fromiter(groups.values(), dtype=np.uint8, count=len(groups))
        keep = pgids < len(self.group_slot)
        pgids, slots = pgids[keep], slots[keep]
        # While the groups are rewritten, the tick takes processes out only of
        # slots followed both before and after: none leaves a slot whose
        # groups are not written yet.
        keyed = np.zeros(MAX_SLOTS, dtype=np.uint8)
        keyed[slots] = 1
        self._group_keyed &= keyed
        self.group_slot[np.setdiff1d(self._groups_written, pgids)] = 0
        self.group_slot[pgids] = slots
        self._group_keyed[:] = keyed
        self._groups_written = pgids
        return True

    def follow_cgroups(self, slot_of_cgroup: dict[int, int] | None) -> bool:
        """The tick's rule from now on, by cgroup (id -> slot) as
        follow_groups's is by group. None: the walk alone decides. False
        where the kernel cannot follow cgroups."""
        if self._cgroup_slot is None or self._cgroup_keyed is None:
            return False
        cgroups = slot_of_cgroup or {}
        keyed = np.zeros(MAX_SLOTS, dtype=np.uint8)
        keyed[list(set(cgroups.values()))] = 1
        self._cgroup_keyed &= keyed  # as follow_groups: shrink first, grow last
        for cgroup in self._cgroups_written.keys() - cgroups.keys():
            self._cgroup_slot.delete(cgroup.to_bytes(8, "little"))
        for cgroup, slot in cgroups.items():
            if self._cgroups_written.get(cgroup) != slot:
                self._cgroup_slot.update(cgroup.to_bytes(8, "little"), bytes([slot]))
        self._cgroup_keyed[:] = keyed
        self._cgroups_written = cgroups
        return True

    def sync(self, table: ProcessTable, want: dict[int, int]) -> bool:
        """Make task_slot say what the walk found. Entries the kernel added at
        fork for processes the walk has not seen are kept: they are members
        born since. Processes the walk saw outside every shard are cleared
        (they left their group, or their shard went), as are entries of slots
        no longer in use. True when a process was given a slot it lacked."""
        slots = self.task_slot
        live = np.zeros(MAX_SLOTS, dtype=bool)
        live[list(set(want.values()))] = True
        have = nonzero_bytes(slots)
        # Read once: the kernel may clear one since (an exit), which reads as 0, a slot not live.
        snapshot = slots[have]
        seen = np.fromiter(table.stats.keys(), dtype=np.int64)
        wanted = np.fromiter(want.keys(), dtype=np.int64, count=len(want))
        stale = have[~live[snapshot] | (np.isin(have, seen) & ~np.isin(have, wanted))]
        slots[stale] = 0
        pids = np.fromiter(want.keys(), dtype=np.int64, count=len(want))
        values = np.fromiter(want.values(), dtype=np.uint8, count=len(want))
        in_range = pids < len(slots)
        if not in_range.all():
            log.warning("pids above pid_max at load time not counted: %s", pids[~in_range][:5].tolist())
        pids, values = pids[in_range], values[in_range]
        # Only the slots that change are written: a member whose slot was right
        # when read may exit before a write of every wanted pid, and that write
        # would put back the slot its exit cleared, unchecked (CI's fork storm
        # left one so: a pid in the map no process had).
        differ = slots[pids] != values
        added = pids[differ]
        slots[added] = values[differ]
        # A process that exited between the walk and this write had its exit
        # seen while it had no slot: clear it ourselves, or a new process given
        # that pid would be credited to this shard. Its exit is under way from
        # PF_EXITING on: the kernel's exit tracepoint (which clears the slot)
        # comes after that flag, and /proc says "R" until the exit is done, so
        # a write between the two would be kept (CI's fork storm under a CPU
        # hog left one so, once in three: a pid in the map no process had).
        for pid in added.tolist():
            try:
                st = procfs.read_pid_stat(self.proc, pid)
                # A zombie has exited: its exit was seen, and its pid may be reused once it is reaped.
                alive = (st.start_ticks == table.stats[pid].start_ticks and st.state not in ("Z", "X")
                         and not st.flags & PF_EXITING)  # fmt: skip
            except (procfs.ProcessGone, procfs.ProcParseError):
                alive = False
            if not alive:
                slots[pid] = 0
        return bool(len(added))

    def pids(self) -> set[int]:
        """The processes the kernel now counts for some shard."""
        return set(nonzero_bytes(self.task_slot).tolist())

    def size(self) -> int:
        return int(np.count_nonzero(self.task_slot))

    def close(self) -> None:
        """Unmapped; a view still held (a traceback's frame) is unmapped when it goes."""
        del self.task_slot
        self.group_slot = self._group_keyed = self._cgroup_keyed = None
        for mapped in [self._map, *self._group_maps]:
            try:
                mapped.close()
            except BufferError:
                log.debug("a membership map still viewed at close: unmapped later")
