"""Bursts at every rate: what each backend reports for workloads of a known
shape, at 10 to 1000 samples a second.

    PYTHONPATH=. .venv/bin/python bench/burst_accuracy.py [--window 3] [--rates 10,50,100,200,500,1000]

Workloads (each its own process group):
- half: one thread busy 10 ms of every 20 ms (mean 0.5, bursts of 1.0);
- burst3: three threads busy together 30 ms of every 505 ms (bursts of 3.0,
  or as many cores as the machine has);
- busy: one thread that never sleeps (1.0 throughout).

For each backend and rate, one window after a priming one: the window's
mean against the kernel's own account of the group (schedstat), its p95
and max, and the burst level the max should reach where a sample is
shorter than a burst. The kernel backend needs root.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sampler.backend import BackendChoice  # noqa: E402
from sampler.backend_unavailable import BackendUnavailable  # noqa: E402
from sampler.shards.proc_shards import ProcShardSampler  # noqa: E402
from sampler.shards.selectors import Selector, ShardSpec  # noqa: E402
from sampler.window.sampler import WindowSampler  # noqa: E402
from tests.workloads import BURST_PERIOD_S, BURST_THREE, HALF_OF_20MS, PROC, process_cpu_seconds, start_group  # noqa: E402

BUSY = "print('ready', flush=True)\nwhile True:\n    pass\n"
# name, code, threads, burst level, burst length (s)
WORKLOADS = (("half", HALF_OF_20MS, 1, 1.0, 0.010), ("burst3", BURST_THREE, 3, 3.0, 0.030),
             ("busy", BUSY, 1, 1.0, float("inf")))  # fmt: skip


def measure(groups, backend: str, pgid: int, hz: float, window: float) -> tuple[dict[str, float], float]:  # type: ignore[no-untyped-def]
    ws = WindowSampler(PROC, BackendChoice(backend, None), groups,
                       [ShardSpec("w", Selector.parse(f"pgid:{pgid}"))], hz=hz, node="bench")  # fmt: skip
    ws.prime(0)
    before = process_cpu_seconds(pgid)
    t0 = time.monotonic()
    [shard] = ws.run_window(window).shards
    truth = (process_cpu_seconds(pgid) - before) / (time.monotonic() - t0)
    return msgspec.to_builtins(shard.cpu_cores), truth


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--rates", default="10,50,100,200,500,1000")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    backends: list[tuple[str, object]] = [("proc", ProcShardSampler(PROC))]
    try:
        from sampler.kernel import sched

        backends.insert(0, ("bpf", sched.load(PROC)))
    except BackendUnavailable as e:
        print(f"kernel backend not measured: {e}")
    print(f"{'workload':<8} {'backend':<7} {'hz':>5} {'mean':>6} {'truth':>6} {'err%':>6} {'p95':>6} {'max':>6}"
          f" {'burst':>6} {'max err%':>8}")  # fmt: skip
    cpus = len(os.sched_getaffinity(0))
    for name, code, threads, level, length in WORKLOADS:
        level = min(level, cpus)
        p = start_group(code)
        try:
            for backend, groups in backends:
                for hz in rates:
                    finest = groups.finest_hz  # type: ignore[attr-defined]
                    if finest is not None and hz > finest:
                        print(f"{name:<8} {backend:<7} {hz:5.0f}  refused: finer than the backend's {finest:g} Hz")
                        continue
                    if name == "burst3":  # edges where no thread runs: schedstat lags a running one
                        time.sleep((BURST_PERIOD_S / 2 - time.monotonic()) % BURST_PERIOD_S)
                    cores, truth = measure(groups, backend, p.pid, hz, args.window)
                    short = 1.0 / hz < length
                    burst = f"{level:6.2f}" if short else f"{'—':>6}"
                    max_err = f"{100 * (cores['max'] - level) / level:+8.1f}" if short else f"{'':>8}"
                    print(f"{name:<8} {backend:<7} {hz:5.0f} {cores['mean']:6.3f} {truth:6.3f}"
                          f" {100 * (cores['mean'] - truth) / truth:+6.1f} {cores['p95']:6.2f} {cores['max']:6.2f}"
                          f" {burst} {max_err}{'  ABOVE ITS THREADS' if cores['max'] > threads * 1.001 else ''}",
                          flush=True)  # fmt: skip
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    main()
