"""The CPU cost of one sample, by backend, as the machine's process count grows.

For 500, 2,000 and 5,000 processes on the machine (sleepers spawned here) and
one shard of 20 processes, measures in the same run the CPU time of:
- one kernel-backend sample (one per-CPU counter per shard);
- one /proc-backend sample (the group's members' /proc/<pid>/stat);
- one full walk of /proc (what a sample costs when every process is read).

Each figure is the median over several rounds of the mean of 100 calls, with
its spread. Needs root for the kernel backend. Not a test: no thresholds.

    .venv/bin/python bench/sample_cost_by_backend.py [--counts 500,2000,5000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc_sampler_cost import naive_walk, process_count, settle, spawn, stop  # noqa: E402

from sampler.kernel import sched  # noqa: E402
from sampler.shards.proc_shards import ProcShardSampler  # noqa: E402
from sampler.shards.selectors import ProcessTable, Selector, ShardSpec  # noqa: E402

PROC = Path("/proc")


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        cpu = time.process_time()
        for _ in range(calls):
            fn()
        out.append((time.process_time() - cpu) / calls * 1e6)
    return out


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} us ({min(values):.1f}..{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="500,2000,5000")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    bpf = sched.load(PROC)
    proc = ProcShardSampler(PROC)
    watched = spawn(19)
    base = process_count()
    spec = [ShardSpec("g", Selector.parse(f"pgid:{watched.pid}"))]
    print(f"one shard of 20 processes; {base} processes before sleepers; CPU time per call")
    print(f"{'processes':>9}  {'kernel backend':<28} {'/proc backend':<28} {'full /proc walk':<28} "
          f"{'walk/kernel':>11} {'proc/kernel':>11}")  # fmt: skip
    try:
        for target in (int(c) for c in args.counts.split(",")):
            sleepers = spawn(max(0, target - base))
            try:
                table = ProcessTable.walk(PROC)
                for g in (bpf, proc):
                    g.discover(spec, table)
                    g.sample()
                k = per_call_us(bpf.sample, 100, args.rounds)
                p = per_call_us(proc.sample, 100, args.rounds)
                w = per_call_us(naive_walk, 3, args.rounds)
                km = statistics.median(k)
                print(f"{process_count():>9}  {fmt(k):<28} {fmt(p):<28} {fmt(w):<28} "
                      f"{statistics.median(w) / km:10.0f}x {statistics.median(p) / km:10.1f}x", flush=True)  # fmt: skip
            finally:
                stop(sleepers)
                settle(base)
    finally:
        stop(watched)
        bpf.close()


if __name__ == "__main__":
    main()
