"""The samples the kernel takes (`on_sample` in bpf/sched_groups.bpf.c): a
cpu-clock perf event on one CPU fires at each sample boundary and writes
each watched slot's on-CPU totals and the machine's busy and stolen time
into a ring, which the agent maps and reads once a second. A sample's time
is the kernel's: an agent that stalls loses none while the ring holds them
(RING_LEN samples: 4 s at 1000 a second).

The agent says which slots to sample, in which order, through
`sample_config` (a generation number, odd while it writes, then the list);
each sample says which generation it was taken under. A ring entry is read
only once the kernel counted it written, and dropped if the kernel may have
written over it while it was read; fences keep the reads and the agent's
writes of the list in their order on a CPU that would reorder them
(memory_order.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sampler.kernel.build import MAX_SLOTS, PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_PERIOD

log = logging.getLogger(__name__)

SAMPLE_TIME = np.dtype([("at", "<u8"), ("busy", "<u8"), ("steal", "<u8"), ("gen", "<u4"), ("cpus", "<u4")])
HEAD_BYTES = 64
GENERATIONS_KEPT = 8  # the slot lists of the last few generations: enough for the entries not yet read


@dataclass
class RingSamples:
    """The samples written since the last read, oldest first: cumulative
    figures, as the kernel counts them. A sample may not hold a slot (taken
    before it was sampled, or while the list was rewritten)."""

    at: np.ndarray  # float64 seconds, CLOCK_MONOTONIC
    busy: np.ndarray  # float64 ns: every CPU's busy time (user, nice, system, irq, softirq)
    steal: np.ndarray  # float64 ns: every CPU's stolen time
    cpus: np.ndarray  # the CPUs whose time each sample holds
    totals: np.ndarray  # int64 [sample, slot, (ns, late ns)], the slots in the order asked for
    held: np.ndarray  # bool [sample, slot]: False where the sample does not hold the slot (its totals are 0)
    lost: int  # samples the kernel wrote over before they were read


class SampleRing:
    def __init__(self, maps: dict[str, Any], event_fd: int, ring_len: int, ring_slots: int,
                 fence: Callable[[], None]) -> None:  # fmt: skip
        self.ring_len, self.ring_slots = ring_len, ring_slots
        self._fence = fence
        self._event = event_fd
        config_bytes = 8 + ring_slots + MAX_SLOTS
        self._config_map = mmap.mmap(maps["sample_config"].fd, config_bytes, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        self._head_map = mmap.mmap(maps["sample_head"].fd, HEAD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        self._time_map = mmap.mmap(maps["sample_time"].fd, ring_len * SAMPLE_TIME.itemsize, mmap.MAP_SHARED,
                                   mmap.PROT_READ)  # fmt: skip
        # A column (one slot's samples) mapped when first read: the kernel maps
        # every page of a BPF array's mapping at once, all of them resident (4
        # MiB for the whole ring; 64 KiB a column).
        self._slots_fd = maps["sample_slots"].fd
        self._column_maps: dict[int, mmap.mmap] = {}
        self._column_views: dict[int, np.ndarray] = {}
        self._gen = np.frombuffer(self._config_map, dtype=np.uint32, count=2)  # gen, count
        self._list = np.frombuffer(self._config_map, dtype=np.uint8, count=ring_slots, offset=8)
        self._position = np.frombuffer(self._config_map, dtype=np.uint8, count=MAX_SLOTS, offset=8 + ring_slots)
        self._head_words = np.frombuffer(self._head_map, dtype=np.uint64, count=8)
        self._head = self._head_words[:1]
        self._time = np.frombuffer(self._time_map, dtype=SAMPLE_TIME)
        self._lists: dict[int, np.ndarray] = {int(self._gen[0]): self._list[: self._gen[1]].astype(np.int64)}
        self._read = int(self._head[0])  # what was written before is no one's
        self.hz: float | None = None

    def start(self, hz: float) -> None:
        """Samples taken `hz` times a second from now on."""
        period = max(10_000, round(1e9 / hz))  # the kernel's floor for a cpu-clock period: 10 us
        self._read = int(self._head[0])  # samples from before a stop are not this run's; from now on, all are
        fcntl.ioctl(self._event, PERF_EVENT_IOC_PERIOD, struct.pack("<Q", period))
        fcntl.ioctl(self._event, PERF_EVENT_IOC_ENABLE, 0)
        self.hz = hz

    def stop(self) -> None:
        """No sample written once this returns (the kernel waits for one being taken)."""
        fcntl.ioctl(self._event, PERF_EVENT_IOC_DISABLE, 0)
        self.hz = None

    def written(self) -> int:
        """The samples the kernel has written since it loaded."""
        return int(self._head[0])

    def machine_misses(self) -> dict[str, int]:
        """Why the kernel's samples could not read CPUs' busy time, as it
        counted: by the step of the way to a CPU's run queue that failed, and
        the reads of its counters that did."""
        counts = self._head_words[1:8].tolist()
        steps = ("task's cfs_rq", "its group", "the group's per-CPU cfs_rq", "the CPU's cfs_rq", "its rq", "rq.cpu",
                 "kernel_cpustat read")  # fmt: skip
        return {step: int(n) for step, n in zip(steps, counts, strict=True) if n}

    def sample_slots(self, slots: list[int]) -> bool:
        """The kernel samples these slots, in this order, from its next
        sample on; False (nothing changed) where they are more than it can."""
        if len(slots) > self.ring_slots:
            return False
        gen = int(self._gen[0])
        if self._lists.get(gen) is not None and self._lists[gen].tolist() == slots:
            return True  # the same list: no sample need go without its slots while it is written again
        self._gen[0] = gen + 1  # odd: a sample taken now holds no slot
        self._fence()  # the odd gen seen before any of the list's new bytes
        self._position[:] = 0
        self._list[: len(slots)] = slots
        self._position[slots] = np.arange(1, len(slots) + 1, dtype=np.uint8)
        self._gen[1] = len(slots)
        self._fence()  # the whole list seen before the even gen
        self._gen[0] = gen + 2
        self._lists[gen + 2] = np.array(slots, dtype=np.int64)
        for old in sorted(self._lists)[:-GENERATIONS_KEPT]:
            del self._lists[old]
        return True

    def take(self, slots: np.ndarray) -> RingSamples:
        """The samples written since the last call, each slot of `slots` in
        that order."""
        written = int(self._head[0])
        self._fence()  # the count read before the entries it counts
        start = max(self._read, written - self.ring_len + 1)
        index = np.arange(start, written) % self.ring_len
        times = self._time[index].copy()
        totals = np.zeros((len(index), len(slots), 2), dtype=np.int64)
        held = np.zeros((len(index), len(slots)), dtype=bool)
        gens = times["gen"]
        for gen in np.unique(gens).tolist():
            listed = self._lists.get(gen)
            if gen % 2 or listed is None:
                continue  # taken while the list was written, or under one too old to know
            rows = np.flatnonzero(gens == gen)
            where = {slot: j for j, slot in enumerate(listed.tolist())}
            for k, slot in enumerate(slots.tolist()):
                if (j := where.get(slot)) is not None:
                    totals[rows, k, :] = self._column(j)[index[rows], :]
                    held[rows, k] = True
        # An entry the kernel may have begun to write again while it was read is dropped.
        self._fence()  # the entries read before the count again
        after = int(self._head[0])
        keep = np.arange(start, written) > after - self.ring_len
        lost = start - self._read + int(np.count_nonzero(~keep))
        self._read = written
        return RingSamples(times["at"][keep] / 1e9, times["busy"][keep].astype(np.float64),
                           times["steal"][keep].astype(np.float64), times["cpus"][keep], totals[keep], held[keep],
                           lost)  # fmt: skip

    def _column(self, position: int) -> np.ndarray:
        """The samples of the slot at `position` of a list: [sample, (ns, late ns)]."""
        if (view := self._column_views.get(position)) is None:
            size = self.ring_len * 16
            mapping = mmap.mmap(self._slots_fd, size, mmap.MAP_SHARED, mmap.PROT_READ, offset=position * size)
            self._column_maps[position] = mapping
            view = self._column_views[position] = np.frombuffer(mapping, dtype=np.uint64).reshape(self.ring_len, 2)
        return view

    def close(self) -> None:
        """Stopped and unmapped; a view still held is unmapped when it goes."""
        with contextlib.suppress(OSError):
            self.stop()
        del self._gen, self._list, self._position, self._head, self._head_words, self._time
        self._column_views.clear()
        for mapping in (self._config_map, self._head_map, self._time_map, *self._column_maps.values()):
            try:
                mapping.close()
            except BufferError:
                log.debug("a sample ring map still viewed at close: unmapped later")
