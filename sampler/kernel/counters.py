"""The kernel's counters, read at every sample: each CPU's on-CPU ns by
slot (`slot_ns`) and the slice it is running (`cpu_run`), both shared
memory, read without a system call. The CPUs' entries are guarded by a
sequence number (a seqlock the program writes at each switch)."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from sampler.kernel.build import MAX_SLOTS

log = logging.getLogger(__name__)

# The program's struct cpu_run, one per CPU: the slice a CPU is running for a slot.
CPU_RUN = np.dtype([("start", "<u8"), ("since", "<u8"), ("task", "<u8"), ("seq", "<u8"), ("slot", "<u4"),
                    ("learnt", "<u4"), ("spare", "<u8", 3)])  # fmt: skip
SNAPSHOT_TRIES = 3


class SlotCounters:
    def __init__(self, slot_ns_map: Any, cpu_run_map: Any, cpus: int, clock: Callable[[], float],
                 fence: Callable[[], None]) -> None:  # fmt: skip
        self._clock, self._fence = clock, fence
        self._slot_ns_map = mmap.mmap(slot_ns_map.fd, cpus * MAX_SLOTS * 16, mmap.MAP_SHARED, mmap.PROT_READ)
        self._slot_ns = np.frombuffer(self._slot_ns_map, dtype=np.uint64).reshape(cpus, MAX_SLOTS, 2)
        self._cpu_run_map = mmap.mmap(cpu_run_map.fd, cpus * CPU_RUN.itemsize, mmap.MAP_SHARED, mmap.PROT_READ)
        self._cpu_run = np.frombuffer(self._cpu_run_map, dtype=CPU_RUN)
        self._slots = np.zeros(0, dtype=np.int64)  # the slots read, in a fixed order
        self._index_of_slot = np.full(MAX_SLOTS, -1, dtype=np.int64)  # slot -> its place in _slots
        self.left_out = 0  # the CPUs the last reading left out, mid-switch after every try

    def read_slots(self, slots: np.ndarray) -> None:
        """The slots the readings are of, in this order, from now on."""
        self._slots = slots
        self._index_of_slot[:] = -1
        self._index_of_slot[slots] = np.arange(len(slots))

    def _credited(self) -> np.ndarray:
        """Each slot's on-CPU ns credited by the kernel (slices that have ended),
        and of those the ns credited late: [slot, (ns, late)]."""
        totals: np.ndarray = self._slot_ns[:, self._slots, :].sum(axis=0, dtype=np.uint64).astype(np.int64)
        return totals

    def totals(self) -> tuple[np.ndarray, float]:
        """Each slot's on-CPU ns up to now: what the kernel credited, and the
        slices still running on a CPU from when they were counted from; beside
        it, the part of those the kernel credited late. The CPUs' sequence
        numbers are read before their entries and the totals, and again after:
        a CPU whose number moved in between (a switch) or was odd is read
        again, and after a few tries left out: its slice began or ended within
        microseconds of the reading. The fences keep the reads in that
        order on a CPU that would reorder them (memory_order.py)."""
        for _ in range(SNAPSHOT_TRIES):
            seq = self._cpu_run["seq"].copy()
            self._fence()
            running = self._cpu_run.copy()
            now = self._clock()
            credited = self._credited()
            self._fence()
            steady = (self._cpu_run["seq"] == seq) & (seq % 2 == 0)
            if steady.all():
                break
        self.left_out = int(np.count_nonzero(~steady))
        busy = steady & (running["slot"] != 0)
        if busy.any():
            where = self._index_of_slot[running["slot"][busy]]
            ahead = np.maximum(0, round(now * 1e9) - running["since"][busy].astype(np.int64))
            known = where >= 0  # a slot given up since: its slice no longer counts
            credited[:, 0] += np.bincount(where[known], weights=ahead[known], minlength=len(credited)).astype(np.int64)
        return credited, now

    def close(self) -> None:
        """Unmapped; a view still held (a traceback's frame) is unmapped when it goes."""
        del self._slot_ns, self._cpu_run
        for name, mapping in (("slot_ns", self._slot_ns_map), ("cpu_run", self._cpu_run_map)):
            try:
                mapping.close()
            except BufferError:
                log.debug("%s still viewed at close: unmapped later", name)
