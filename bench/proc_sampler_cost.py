"""What the /proc backend costs at 10 Hz as the machine's process count grows.

For 500, 2,000 and 5,000 processes on the machine (sleepers spawned here) and
one shard of 20 processes, measures in the same run:
- the sampler: CPU time this process spends running windows of the real
  `WindowSampler` (one /proc walk per window, the watched members at every
  sample), as a share of one core;
- the naive alternative: a walk of every process at every sample (what the Go
  sampler did), written the obvious way (open, read text, split), projected
  to 10 Hz from the median cost of one walk;
- the sampler's own walk (bytes, os.read, one parse) at every sample: how much
  of the saving is the faster walk and how much is walking once per window.

Prints the median and spread over several windows. Not a test: no thresholds.

    .venv/bin/python bench/proc_sampler_cost.py [--counts 500,2000,5000] [--windows 3] [--interval 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import ProcessTable, Selector, ShardSpec
from sampler.window.sampler import WindowSampler

PROC = Path("/proc")
HZ = 10.0

# Forks n children that sleep; prints "ready" when all exist. Its process group
# holds them all, so one killpg ends them.
SPAWNER = """
import os, signal, sys, time
n = int(sys.argv[1])
for _ in range(n):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
print("ready", flush=True)
signal.pause()
"""


def spawn(n: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", SPAWNER, str(n)], stdout=subprocess.PIPE, text=True,
                         process_group=0)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def stop(p: subprocess.Popen[str]) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def process_count() -> int:
    return sum(1 for n in os.listdir(PROC) if n.isdigit())


def sampler_share(pgid: int, windows: int, interval: float) -> list[float]:
    specs = [ShardSpec("g", Selector.parse(f"pgid:{pgid}"))]
    s = WindowSampler(PROC, BackendChoice("proc", None), ProcShardSampler(PROC), specs, hz=HZ)
    s.prime(0)
    shares = []
    for _ in range(windows):
        wall, cpu = time.monotonic(), time.process_time()
        summary = s.run_window(interval)
        shares.append((time.process_time() - cpu) / (time.monotonic() - wall))
        assert len(summary.shards[0].pgids or ()) == 1
    return shares


def naive_walk() -> dict[int, int]:
    groups: dict[int, int] = {}
    for name in os.listdir(PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = data[data.rindex(")") + 2 :].split()
        groups[int(fields[2])] = groups.get(int(fields[2]), 0) + int(fields[11]) + int(fields[12])
    return groups


def walk_seconds(walk: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        cpu = time.process_time()
        walk()
        out.append(time.process_time() - cpu)
    return out


def settle(count: int) -> None:
    """Wait until killed sleepers are reaped, so the next count is what it says."""
    deadline = time.monotonic() + 30
    while process_count() > count and time.monotonic() < deadline:
        time.sleep(0.1)


def fmt(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med * 100:7.1f}% ({min(values) * 100:.1f}..{max(values) * 100:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="500,2000,5000")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--interval", type=float, default=5.0)
    args = ap.parse_args()

    watched = spawn(19)  # a leader and 19 workers: a group of 20
    base = process_count()
    print(f"10 Hz, windows of {args.interval:g} s, one shard of 20 processes; {base} processes before sleepers")
    print(f"{'processes':>9}  {'sampler (share of a core)':<34} {'naive walk at 10 Hz':<34} "
          f"{'sampler walk at 10 Hz':<34} naive/sampler")
    try:
        for target in (int(c) for c in args.counts.split(",")):
            sleepers = spawn(max(0, target - base))
            try:
                n = process_count()
                ours = sampler_share(watched.pid, args.windows, args.interval)
                repeats = max(5, args.windows * 3)
                naive = [w * HZ for w in walk_seconds(naive_walk, repeats)]
                full = [w * HZ for w in walk_seconds(lambda: ProcessTable.walk(PROC).group_ticks(), repeats)]
                ratio = statistics.median(naive) / statistics.median(ours)
                print(f"{n:>9}  {fmt(ours):<34} {fmt(naive):<34} {fmt(full):<34} {ratio:5.0f}x", flush=True)
            finally:
                stop(sleepers)
                settle(base)
    finally:
        stop(watched)


if __name__ == "__main__":
    main()
