"""Which process groups ran, as the kernel's tick saw them: what spares the
agent a walk of /proc every window.

The tick (bpf/sched_groups.bpf.c, count_group_tick) counts, per pgid, the
ticks that found one of the group's processes running, into a hash map the
agent takes whole once a window (read and deleted in one system call). A
group that runs is known within a window of its first tick, with its share
of the machine's time; the busiest groups are ranked from these counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

GROUP_TICKS_MAX = 16384  # the map's entries (bpf/sched_groups.bpf.c): groups that ran in one window


@dataclass(frozen=True)
class GroupsRun:
    """What the kernel saw since it was last asked, in place of a walk."""

    ticks: dict[int, int]  # pgid -> ticks that found one of its processes running
    complete: bool  # False: the map was full, some group that ran is missing
    following: bool  # the tick follows every watched group's joins and leaves (group_slot)
    follows_within_s: float  # how soon a running process's move is followed: a tick


class GroupTicks:
    def __init__(self, ticks_map: Any, full_map: Any) -> None:
        self._ticks, self._full = ticks_map, full_map
        self._full_seen = self._missed()

    def _missed(self) -> int:
        return int(np.frombuffer(self._full.lookup(0), dtype=np.uint64)[0])

    def take(self) -> tuple[dict[int, int], bool]:
        """The ticks counted since the last take, and whether every group's
        were (the map never full since then)."""
        keys, values = self._ticks.take_all(GROUP_TICKS_MAX)
        counts = np.frombuffer(values, dtype=np.uint32)
        missed = self._missed()
        complete, self._full_seen = missed == self._full_seen, missed
        return dict(zip(keys.tolist(), counts.tolist(), strict=True)), complete
