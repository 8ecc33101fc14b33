"""A window of samples in numpy arrays, and its summary.

Rates (machine CPU percent, a group's cores) are kept per sample with the
sample's length, so the window's mean is time-weighted (the total used over
the total time, even if a sample came late), and p95 and max show the bursts
that the mean hides. A sample that measured nothing is NaN and is left out of
every statistic; a window with no measured sample has no statistic at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RateSeries:
    """Per-sample values of one rate and each sample's length in seconds."""

    capacity: int
    values: np.ndarray = field(init=False)
    seconds: np.ndarray = field(init=False)
    n: int = 0

    def __post_init__(self) -> None:
        self.values = np.full(self.capacity, np.nan)
        self.seconds = np.zeros(self.capacity)

    def add(self, value: float | None, seconds: float) -> None:
        if self.n == self.capacity:  # a window that ran long: grow rather than drop
            self.values = np.concatenate([self.values, np.full(self.capacity, np.nan)])
            self.seconds = np.concatenate([self.seconds, np.zeros(self.capacity)])
            self.capacity *= 2
        self.values[self.n] = np.nan if value is None else value
        self.seconds[self.n] = seconds
        self.n += 1

    def summary(self) -> dict[str, float] | None:
        v, w = self.values[: self.n], self.seconds[: self.n]
        ok = ~np.isnan(v) & (w > 0)
        if not ok.any():
            return None
        v, w = v[ok], w[ok]
        return {
            "mean": round(float(np.average(v, weights=w)), 4),
            "p95": round(float(np.percentile(v, 95)), 4),
            "max": round(float(v.max()), 4),
        }
