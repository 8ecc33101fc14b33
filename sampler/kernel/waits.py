"""Waits for a CPU, from the kernel's log2 histogram per slot
(bpf/sched_groups.bpf.c's wait_log, where the kernel keeps run_delay):
per shard, p50 and p99 interpolated within a bucket, total and mean."""

from __future__ import annotations

from typing import Any

import numpy as np

WAIT_BUCKETS = 32  # log2 buckets of a wait in ns, as in the program


def log2_quantile(counts: np.ndarray, q: float) -> float:
    """The q-quantile of a log2 histogram (bucket b holds [2^b, 2^(b+1)) ns,
    bucket 0 also 0..1), interpolated linearly by rank within its bucket."""
    cumulative = np.cumsum(counts)
    rank = q * cumulative[-1]
    b = int(np.searchsorted(cumulative, rank))
    before = cumulative[b - 1] if b > 0 else 0.0
    lo, hi = (0.0 if b == 0 else 2.0**b), 2.0 ** (b + 1)
    within = (rank - before) / counts[b] if counts[b] else 0.0
    return lo + (hi - lo) * within


class WaitHistograms:
    """The wait_log map read once a window: each shard's waits since the last read."""

    def __init__(self, wait_log: Any) -> None:
        self._wait_log = wait_log
        self._prev: dict[int, tuple[np.ndarray, Any]] = {}  # slot -> its histogram and total at the last read

    def since_last(self, slots: list[int], member_of: np.ndarray, shard_ids: list[str],
                   has_processes: list[bool]) -> dict[str, dict[str, float] | None]:  # fmt: skip
        """`member_of[shard, slot]` is 1 where the slot counts for the shard;
        a shard with a slot not read before, or without processes, has None."""
        hist = np.zeros((len(slots), WAIT_BUCKETS), dtype=np.uint64)
        total = np.zeros(len(slots), dtype=np.uint64)
        for j, slot in enumerate(slots):
            # Every CPU's struct wait_log: ns waited, then the counts by log2(ns).
            log = np.frombuffer(self._wait_log.lookup(slot), dtype=np.uint64).reshape(-1, 1 + WAIT_BUCKETS).sum(axis=0)
            total[j], hist[j] = log[0], log[1:]
        prev = self._prev
        known = np.array([s in prev for s in slots], dtype=bool)
        d_hist = hist.astype(np.float64) - np.array([prev[s][0] if s in prev else h for s, h in zip(slots, hist,
                                                     strict=True)], dtype=np.float64).reshape(hist.shape)  # fmt: skip
        d_total = total.astype(np.float64) - np.array([prev[s][1] if s in prev else t for s, t in zip(slots, total,
                                                       strict=True)], dtype=np.float64)  # fmt: skip
        self._prev = {s: (h, t) for s, h, t in zip(slots, hist, total, strict=True)}
        out: dict[str, dict[str, float] | None] = {}
        shard_hist = member_of @ d_hist
        shard_total = member_of @ d_total
        shard_known = (member_of @ (~known).astype(np.float64)) == 0
        for i, sid in enumerate(shard_ids):
            if not shard_known[i] or not has_processes[i]:
                out[sid] = None
                continue
            counts = shard_hist[i]
            n = counts.sum()
            result: dict[str, float] = {"total": round(float(shard_total[i]) / 1e9, 6)}
            if n > 0:
                result["mean"] = round(float(shard_total[i] / n) / 1e9, 9)
                result["p50"] = round(float(log2_quantile(counts, 0.5)) / 1e9, 9)
                result["p99"] = round(float(log2_quantile(counts, 0.99)) / 1e9, 9)
            out[sid] = result
        return out
