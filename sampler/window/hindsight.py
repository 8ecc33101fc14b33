"""Hindsight: every sample of the last minutes, kept on the node for the
question asked after an incident ("what happened at 14:03?"), as Rezolus
keeps a ring of recent samples on each host.

Each series the windows are summarised from (the machine's CPU, each
shard's cores, each GPU's utilisation and SM activity) has a row of two fixed arrays,
allocated once: each sample's length in microseconds (uint32) and its value
(float32; NaN: not measured), the raw block's shapes (docs/wire-format.md).
A row's samples follow one another without a gap, so its end (the wall time
its newest sample ends) dates them all. A series that was absent a while (a
shard that came back) has the absence as one unmeasured sample, never
zeros.

Eight bytes a sample: the budget (`--hindsight-mib`) over the rows bounds
how many a row keeps, and at high rates the minutes kept fall below
`--hindsight` (`minutes_held` says how many). The arrays are mapped, not
filled, when made: the kernel gives their pages as rows first use them, so
the resident memory grows with the series kept, up to the budget.

A row whose series has been gone longer than the ring holds is given to a
new one; with none, a new series is not kept (said once). Keeping a
window's samples is a copy of its arrays into the rows: nothing is done per
sample in Python.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

BYTES_A_SAMPLE = 8  # a uint32 length and a float32 value
MACHINE = "machine"  # the machine CPU's row; a shard's is "shard:<id>", a GPU's wire/raw.py's gpu_key
# Rows, the machine's among them: the budget is shared by the rows, used or
# not. 32: at 100 Hz 16 MiB keeps 10.9 minutes of each series, at 10 Hz the
# 15 of the default; a node of more than 31 shards and GPU series keeps the first.
SERIES_ROWS = 32
# A card's point series kept: its utilisation and its SM activity (GPM),
# two rows a card. The live view also has occupancy, tensor activity and
# DRAM bandwidth; kept here too, an 8-card node would leave 31 rows less
# 40 for the machine's shards, or each row a third of the minutes.
HINDSIGHT_GPU_POINTS = ("utilization_percent", "sm_activity_percent")
WINDOWS_KEPT = 4096  # windows' bounds kept, for a fetched span's per-window lines (64 KiB)
GAP_S = 1e-3  # a series' absence shorter than this is the rounding of its lengths to microseconds, not an absence


def _zeroed_as_used(shape: tuple[int, int], dtype: type[np.generic]) -> np.ndarray:
    """Zeroed memory the kernel gives a page at a time as it is first written:
    an anonymous mapping of its own. numpy's zeros goes through calloc, which
    clears a block it reuses from the heap itself, and glibc had raised its
    threshold for mapping large blocks after the agent's earlier large
    arrays: the ring was resident whole from the start (8 MiB more at
    100 Hz within 30 s, bench/hindsight_cost.py)."""
    count = shape[0] * shape[1]
    mapped = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))
    return np.frombuffer(mapped, dtype=dtype, count=count).reshape(shape)  # the array holds the mapping


@dataclass(frozen=True)
class Span:
    """A series' samples over a span: `start`, the wall time the first
    begins; each one's length (microseconds) and value (NaN: not measured)."""

    start: float
    us: np.ndarray
    values: np.ndarray


class HindsightRing:
    def __init__(self, minutes: float, mib: float, hz: float, rows: int = SERIES_ROWS) -> None:
        """`rows` series at most, the machine's among them, each keeping at
        most `minutes` of samples at `hz`, all of them within `mib`."""
        if minutes <= 0 or mib <= 0 or hz <= 0 or rows < 1:
            raise ValueError("hindsight needs positive minutes, MiB, rate and rows")
        wanted = max(1, int(minutes * 60 * hz))
        self.capacity = max(1, min(wanted, int(mib * 2**20) // (rows * BYTES_A_SAMPLE)))
        self.hz = hz
        self.us = _zeroed_as_used((rows, self.capacity), np.uint32)
        self.values = _zeroed_as_used((rows, self.capacity), np.float32)
        self._written = np.zeros(rows, dtype=np.int64)  # samples ever written to each row
        self._end = np.full(rows, np.nan)  # the wall time each row's newest sample ends
        self._row_of: dict[str, int] = {}
        self.not_kept: set[str] = set()  # series no row was free for, since the last said
        # The windows' bounds: 4,096 windows is 5.7 hours at the default 5 s, 68 minutes at 1 s.
        self._window_bounds = np.full((WINDOWS_KEPT, 2), np.nan)
        self._windows_written = 0

    @property
    def minutes_held(self) -> float:
        """The minutes a row holds at the rate the ring was sized for."""
        return self.capacity / self.hz / 60

    def describe(self, minutes_asked: float) -> str:
        """What the agent says at start: the minutes it keeps, and why fewer than asked."""
        said = (f"hindsight: the last {self.minutes_held:.1f} minutes of every sample at {self.hz:g} a second, "
                f"{len(self._written)} series at most, in {(self.us.nbytes + self.values.nbytes) / 2**20:.1f} MiB")
        if self.minutes_held < minutes_asked - 0.05:
            said += f" (fewer than --hindsight's {minutes_asked:g}: --hindsight-mib bounds them)"
        return said

    def keep(self, key: str, end: float, seconds: np.ndarray, values: np.ndarray) -> bool:
        """A series' new samples (each one's length in seconds, its value;
        NaN: not measured), the last ending at wall time `end`. Samples of no
        length are left out, as the raw block leaves them. False where no row
        is free for a new series: it is not kept."""
        row = self._row(key, end)
        if row is None:
            if key not in self.not_kept:
                self.not_kept.add(key)
                log.warning("hindsight keeps %d series: %s is not kept", len(self._written), key)
            return False
        held = seconds > 0
        us = np.maximum(1, np.rint(seconds[held] * 1e6)).astype(np.uint32)
        if not len(us):
            return True
        begins = end - float(np.sum(us, dtype=np.int64)) / 1e6
        gap = begins - self._end[row]
        if gap > GAP_S:  # absent a while: one sample not measured (NaN > x is False for a new row)
            self._put(row, np.array([min(round(gap * 1e6), 2**32 - 1)], dtype=np.uint32), np.array([np.nan]))
        self._put(row, us, values[held])
        self._end[row] = end
        return True

    def keep_points(self, key: str, times: np.ndarray, values: np.ndarray) -> bool:
        """A series of point samples (a GPU's utilisation, NVML's times in
        seconds): each covers the time since the one before it. The first a
        row is given only dates the next; points not after the row's end are
        ones it has."""
        row = self._row_of.get(key)
        end = self._end[row] if row is not None else np.nan
        newer = ~(times <= end)  # NaN end: every point is newer
        times, values = times[newer], values[newer]
        if not len(times):
            return True
        previous = times[0] if np.isnan(end) else end
        seconds = np.diff(times, prepend=previous)
        return self.keep(key, float(times[-1]), seconds, values.astype(np.float64))

    def _put(self, row: int, us: np.ndarray, values: np.ndarray) -> None:
        n = len(us)
        if n > self.capacity:  # more than a row holds: its newest
            us, values = us[-self.capacity :], values[-self.capacity :]
            self._written[row] += n - self.capacity
            n = self.capacity
        start = int(self._written[row] % self.capacity)
        first = min(n, self.capacity - start)  # up to the row's end, the rest from its start
        self.us[row, start : start + first] = us[:first]
        self.values[row, start : start + first] = values[:first]
        self.us[row, : n - first] = us[first:]
        self.values[row, : n - first] = values[first:]
        self._written[row] += n

    def _row(self, key: str, now: float) -> int | None:
        row = self._row_of.get(key)
        if row is not None:
            return row
        used = set(self._row_of.values())
        free = next((r for r in range(len(self._written)) if r not in used), None)
        if free is None:  # a row whose series has been gone longer than the ring holds
            gone = [(k, r) for k, r in self._row_of.items()
                    if k != MACHINE and now - self._end[r] > self.capacity / self.hz]  # fmt: skip
            if not gone:
                return None
            old, free = min(gone, key=lambda kr: self._end[kr[1]])
            del self._row_of[old]
        self._row_of[key] = free
        self._written[free] = 0
        self._end[free] = np.nan
        return free

    def series_kept(self) -> list[str]:
        """The series kept, by key."""
        return sorted(self._row_of)

    def _held(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A row's samples, oldest first: lengths (us), values, and each one's end (wall time)."""
        written = int(self._written[row])
        if written <= self.capacity:
            us, values = self.us[row, :written], self.values[row, :written]
        else:  # two slices, not an index array: 0.6 ms a row of 65,536 samples, not 1.1 (bench/hindsight_fetch.py)
            oldest = written % self.capacity
            us = np.concatenate([self.us[row, oldest:], self.us[row, :oldest]])
            values = np.concatenate([self.values[row, oldest:], self.values[row, :oldest]])
        # Each sample's end: the row's end less the lengths of those after it.
        covered = np.cumsum(us, dtype=np.int64)
        return us, values, self._end[row] - (covered[-1] - covered) / 1e6

    def span(self, key: str, t_from: float, t_to: float) -> Span | None:
        """The samples of a series that overlap [t_from, t_to) (wall times),
        whole; None where the series is not kept."""
        row = self._row_of.get(key)
        if row is None or not self._written[row]:
            return None
        us, values, ends = self._held(row)
        ends_us = _whole_us(ends)
        return _cut(us, values, ends, (ends_us > round(t_from * 1e6)) & (ends_us - us < round(t_to * 1e6)), t_from)

    def ending_in(self, key: str, after: float, until: float) -> Span | None:
        """The samples of a series that end in (after, until]: consecutive
        slices of time give each sample once (the pieces of a fetched span)."""
        row = self._row_of.get(key)
        if row is None or not self._written[row]:
            return None
        us, values, ends = self._held(row)
        ends_us = _whole_us(ends)
        return _cut(us, values, ends, (ends_us > round(after * 1e6)) & (ends_us <= round(until * 1e6)), after)

    def count_ending_in(self, after: float, until: float) -> int:
        """How many samples of every series end in (after, until]: what a
        piece of that slice would carry, without reading them out."""
        total = 0
        for row in self._row_of.values():
            if self._written[row]:
                ends_us = _whole_us(self._held(row)[2])
                total += int(np.count_nonzero((ends_us > round(after * 1e6)) & (ends_us <= round(until * 1e6))))
        return total

    def held_from(self) -> float | None:
        """The wall time the machine's oldest sample begins: what the ring
        holds of the node goes back this far (None: nothing yet)."""
        row = self._row_of.get(MACHINE)
        if row is None or not self._written[row]:
            return None
        held = int(min(self._written[row], self.capacity))  # in any order: their sum is all that counts
        return float(self._end[row] - np.sum(self.us[row, :held], dtype=np.int64) / 1e6)

    def held_seconds(self) -> float | None:
        """How far back the ring holds the node now (None: nothing yet)."""
        held_from, newest = self.held_from(), self.newest_end()
        return None if held_from is None or newest is None else round(newest - held_from, 3)

    def newest_end(self) -> float | None:
        """The wall time the machine's newest sample ends (None: nothing yet)."""
        row = self._row_of.get(MACHINE)
        return None if row is None or not self._written[row] else float(self._end[row])

    def keep_window(self, start: float, end: float) -> None:
        """A window's bounds (wall times), for the per-window lines of a fetched span."""
        at = self._windows_written % len(self._window_bounds)
        self._window_bounds[at] = (start, end)
        self._windows_written += 1

    def windows_ending_in(self, after: float, until: float) -> np.ndarray:
        """The windows (start, end) that end in (after, until], oldest first."""
        held = min(self._windows_written, len(self._window_bounds))
        at = (self._windows_written - held + np.arange(held)) % len(self._window_bounds)
        bounds = self._window_bounds[at]
        return bounds[(bounds[:, 1] > after) & (bounds[:, 1] <= until)]


def _whole_us(ends: np.ndarray) -> np.ndarray:
    """Wall times (s) as whole microseconds, the unit of the samples'
    lengths: a span's bounds are compared there. In float seconds, a sample
    beginning exactly at a span's end could compare below it (at 1.8e9 s a
    float64 resolves 0.24 us: hypothesis found one at 220 us)."""
    return np.rint(ends * 1e6).astype(np.int64)


def _cut(us: np.ndarray, values: np.ndarray, ends: np.ndarray, inside: np.ndarray, empty_at: float) -> Span:
    """The samples `inside` marks (a run of them: the ends are in order), as a Span."""
    at = np.flatnonzero(inside)
    if not len(at):
        return Span(empty_at, us[:0], values[:0])
    first, last = int(at[0]), int(at[-1]) + 1
    return Span(float(ends[first] - us[first] / 1e6), us[first:last], values[first:last])
