"""How long each engine's threads waited for a CPU: the /proc fallback.

`/proc/<pid>/task/<tid>/schedstat` holds, per thread, the time spent on a
CPU, the time spent runnable but waiting on a run queue, and the number of
times it ran (Linux 2.6.x with CONFIG_SCHED_INFO). Summed over a group's
threads and differenced between windows, it gives the shard's total wait in
the window and its mean wait per timeslice. It cannot give percentiles: that
needs the kernel-side histogram.

Where the kernel has no schedstat files, the same two figures come from
taskstats over netlink (pyroute2): a thread's `cpu_delay_total` and
`cpu_count` are the scheduler's run_delay and pcount.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sampler.sources import procfs

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
class _ShardWait:
    threads: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (pid, tid) -> (wait, slices)
    cumulative_ns: int = 0
    primed: bool = False


class RunQueueWaitSampler:
    def __init__(self, proc: Path) -> None:
        self.proc = proc
        self._shards: dict[str, _ShardWait] = {}
        self._taskstats: Any = None  # a pyroute2 TaskStats socket, once schedstat is found missing
        self._unavailable = False

    def _schedstat(self, pid: int, tid: str) -> tuple[int, int] | None:
        try:
            return parse_schedstat(procfs.read_bytes(f"{self.proc}/{pid}/task/{tid}/schedstat"))
        except (FileNotFoundError, ProcessLookupError):
            if os.path.isdir(f"{self.proc}/{pid}/task/{tid}"):
                self._use_taskstats()  # the thread is there, its schedstat is not
            return None
        except procfs.ProcParseError as e:
            log.debug("%s", e)
            return None

    def _use_taskstats(self) -> None:
        if self._taskstats is not None or self._unavailable:
            return
        try:
            from pyroute2 import TaskStats

            ts = TaskStats()
            ts.bind()
        except Exception as e:  # no taskstats family, no permission
            log.info("run-queue wait not measured: no schedstat and no taskstats (%s)", e)
            self._unavailable = True
            return
        log.info("no schedstat files: run-queue wait from taskstats")
        self._taskstats = ts

    def _from_taskstats(self, tid: int) -> tuple[int, int] | None:
        try:
            [msg] = self._taskstats.get_pid_stat(tid)
            stats = msg.get_attr("TASKSTATS_TYPE_AGGR_PID").get_attr("TASKSTATS_TYPE_STATS")
            return int(stats["cpu_delay_total"]), int(stats["cpu_count"])
        except Exception:  # the thread exited (ESRCH), or an answer without stats
            return None

    def _threads(self, pids: set[int]) -> dict[tuple[int, int], tuple[int, int]]:
        out = {}
        for pid in pids:
            try:
                tids = os.listdir(f"{self.proc}/{pid}/task")
            except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
                continue  # gone
            for tid in tids:
                if not tid.isdigit():
                    continue
                value = self._schedstat(pid, tid) if self._taskstats is None else None
                if value is None and self._taskstats is not None:
                    value = self._from_taskstats(int(tid))
                if value is not None:
                    out[(pid, int(tid))] = value
        return out

    @property
    def source(self) -> str:
        return "taskstats" if self._taskstats is not None else "schedstat"

    def close(self) -> None:
        if self._taskstats is not None:
            self._taskstats.close()
            self._taskstats = None

    def read(self, members: dict[str, set[int]]) -> dict[str, dict[str, Any] | None]:
        """Per shard: the window's total wait and mean wait per timeslice, and the
        wait since this sampler started. None where nothing could be compared yet."""
        out: dict[str, dict[str, Any] | None] = {}
        for wid in list(self._shards):
            if wid not in members:
                del self._shards[wid]
        for wid, pids in members.items():
            shard = self._shards.setdefault(wid, _ShardWait())
            now = self._threads(pids)
            waited = slices = 0
            for key, (wait, count) in now.items():
                before = shard.threads.get(key)
                if before is not None and wait >= before[0] and count >= before[1]:
                    waited += wait - before[0]
                    slices += count - before[1]
            primed, shard.primed, shard.threads = shard.primed, bool(now), now
            if not primed or not now:
                out[wid] = None  # a first reading, or no thread to read: nothing measured
                continue
            shard.cumulative_ns += waited
            result: dict[str, Any] = {"total": round(waited / 1e9, 6),
                                      "cumulative": round(shard.cumulative_ns / 1e9, 6)}  # fmt: skip
            if slices > 0:
                result["mean"] = round(waited / slices / 1e9, 9)
            out[wid] = result
        return out
