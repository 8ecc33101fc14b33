"""A window of samples in numpy arrays, and its summary.

Rates (machine CPU percent, a shard's cores) are kept per sample with the
sample's length, so every figure is time-weighted: the mean is the total used
over the total time, and p95 is the value that the samples at or below it
cover 95% of the measured time with (a late sample that covers three slots
counts three times). p95 and max show the bursts that the mean hides.

A sample shorter than its counter's resolution (`min_seconds`: one clock tick
for /proc's counters) is not turned into a rate: one 10 ms tick seen in 50 us
would read as 200 cores. It is merged into the next sample (and the window's
last such one into the sample before it). A sample that measured nothing is
NaN and is left out of every statistic; a short sample followed by one that
measured nothing is part of that unmeasured stretch (its time kept, its value
too short to be a rate). A window with no measured sample has no statistic at
all. Whatever is merged, the samples' lengths always add up to the time added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from wire.raw import window_stats


@dataclass
class RateSeries:
    """Per-sample values of one rate and each sample's length in seconds."""

    capacity: int
    min_seconds: float = 0.0
    values: np.ndarray = field(init=False)
    seconds: np.ndarray = field(init=False)
    n: int = 0
    _carry: tuple[float, float] | None = field(default=None, init=False)  # a short sample's (amount, seconds)

    def __post_init__(self) -> None:
        self.values = np.full(self.capacity, np.nan)
        self.seconds = np.zeros(self.capacity)

    def add(self, value: float | None, seconds: float) -> None:
        self._store(*self._merged([math.nan if value is None else value], [seconds]))

    def extend(self, values: np.ndarray, seconds: np.ndarray) -> None:
        """`add` for each (value, seconds), NaN a value not measured: copied
        in one go, after the short samples are merged as `add` merges them."""
        if self.min_seconds > 0 or self._carry is not None:
            self._store(*self._merged(values.tolist(), seconds.tolist()))
        else:
            self._store(values, seconds)

    def _merged(self, values: list[float], seconds: list[float]) -> tuple[list[float], list[float]]:
        """What is kept of these samples, a sample shorter than min_seconds
        carried into the next: one loop over plain floats. The machine's
        series at 1000 samples a second merges ten into each, and a call and a
        numpy store per sample were most of what the agent's CPU grew by from
        10 a second (profiled: two series, 2 ms a second)."""
        kept_values: list[float] = []
        kept_seconds: list[float] = []
        carrying = self._carry is not None
        amount, carried = self._carry if self._carry is not None else (0.0, 0.0)
        shortest = self.min_seconds
        for value, length in zip(values, seconds, strict=True):
            measured = value == value  # NaN is not equal to itself
            if carrying:
                if measured:
                    value = (value * length + amount) / (length + carried)
                length += carried
                carrying = False
            if measured and 0 < length < shortest:
                amount, carried, carrying = value * length, length, True
                continue
            kept_values.append(value)
            kept_seconds.append(length)
        self._carry = (amount, carried) if carrying else None
        return kept_values, kept_seconds

    def _store(self, values: np.ndarray | list[float], seconds: np.ndarray | list[float]) -> None:
        while self.n + len(values) > self.capacity:  # a window that ran long: grow rather than drop
            self.values = np.concatenate([self.values, np.full(self.capacity, np.nan)])
            self.seconds = np.concatenate([self.seconds, np.zeros(self.capacity)])
            self.capacity *= 2
        self.values[self.n : self.n + len(values)] = values
        self.seconds[self.n : self.n + len(values)] = seconds
        self.n += len(values)

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's samples as the summary counts them: each value (NaN:
        not measured) and its length in seconds, a short last sample merged
        into the one before it. Copies: the series may go on."""
        v, w = self.values[: self.n].copy(), self.seconds[: self.n].copy()
        if self._carry is not None:  # the window's last sample was short: into the one before it
            amount, carried = self._carry
            if not self.n:
                v, w = np.array([amount / carried]), np.array([carried])
            else:  # into the one before it, measured or not (then the stretch is unmeasured)
                v[-1] = (v[-1] * w[-1] + amount) / (w[-1] + carried)
                w[-1] += carried
        return v, w

    def summary(self) -> dict[str, float] | None:
        return window_stats(*self.samples())
