"""How long each engine's threads waited for a CPU: the /proc fallback.

`/proc/<pid>/task/<tid>/schedstat` holds, per thread, the time spent on a
CPU, the time spent runnable but waiting on a run queue, and the number of
times it ran (Linux 2.6.x with CONFIG_SCHED_INFO). Summed over a group's
threads and differenced between windows, it gives the group's total wait in
the window and its mean wait per timeslice. It cannot give percentiles: that
needs the kernel-side histogram.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sampler import procfs

log = logging.getLogger(__name__)


def parse_schedstat(data: bytes) -> tuple[int, int]:
    """(run-queue wait ns, timeslices) from a schedstat line."""
    parts = data.split()
    if len(parts) < 3:
        raise procfs.ProcParseError(f"schedstat: {data[:80]!r}")
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        raise procfs.ProcParseError(f"schedstat: {data[:80]!r}") from None


@dataclass
class _GroupWait:
    threads: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (pid, tid) -> (wait, slices)
    cumulative_ns: int = 0
    primed: bool = False


class RunQueueWaitSampler:
    def __init__(self, proc: Path) -> None:
        self.proc = proc
        self._groups: dict[str, _GroupWait] = {}
        self._warned = False

    def _threads(self, pids: set[int]) -> dict[tuple[int, int], tuple[int, int]]:
        out = {}
        for pid in pids:
            try:
                tids = os.listdir(f"{self.proc}/{pid}/task")
            except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
                continue  # gone
            for tid in tids:
                try:
                    out[(pid, int(tid))] = parse_schedstat(procfs.read_bytes(f"{self.proc}/{pid}/task/{tid}/schedstat"))
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    continue  # the thread exited
                except procfs.ProcParseError as e:
                    log.debug("%s", e)
                except OSError as e:
                    if not self._warned:
                        log.info("run-queue wait not measured (no schedstat: CONFIG_SCHED_INFO?): %s", e)
                        self._warned = True
        return out

    def read(self, members: dict[str, set[int]]) -> dict[str, dict[str, Any] | None]:
        """Per watch: the window's total wait and mean wait per timeslice, and the
        wait since this sampler started. None where nothing could be compared yet."""
        out: dict[str, dict[str, Any] | None] = {}
        for wid in list(self._groups):
            if wid not in members:
                del self._groups[wid]
        for wid, pids in members.items():
            group = self._groups.setdefault(wid, _GroupWait())
            now = self._threads(pids)
            waited = slices = 0
            for key, (wait, count) in now.items():
                before = group.threads.get(key)
                if before is not None and wait >= before[0] and count >= before[1]:
                    waited += wait - before[0]
                    slices += count - before[1]
            primed, group.primed, group.threads = group.primed, bool(now), now
            if not primed or not now:
                out[wid] = None  # a first reading, or no thread to read: nothing measured
                continue
            group.cumulative_ns += waited
            result: dict[str, Any] = {"total": round(waited / 1e9, 6),
                                      "cumulative": round(group.cumulative_ns / 1e9, 6)}  # fmt: skip
            if slices > 0:
                result["mean"] = round(waited / slices / 1e9, 9)
            out[wid] = result
        return out
