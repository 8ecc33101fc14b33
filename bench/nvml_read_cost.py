"""Time per heartbeat spent in NVML: one GPU reading of every card (all
fields, utilisation samples, compute processes), for 8 fake H200s and, where
the machine has an NVML library and a card, for the real cards. Then GPM's
and the clock events' own clock (sampler/gpu/gpm.py): one tick per card
(a GPM sample, the metrics over the pair, the clock-event mask), and the
process's CPU with the reader ticking at 10 Hz against the same reader
with GPM off, over the same seconds (the reference: the ratio is the
figure).

The fake's calls cost next to nothing: its figure is nodesampler's own
overhead around NVML. Target: the whole read under 20 ms per card.

    PYTHONPATH=. .venv/bin/python bench/nvml_read_cost.py [--readings 50] [--seconds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sampler.gpu.gpm import CardMonitor  # noqa: E402
from sampler.gpu.nvml import GpuReader  # noqa: E402
from sampler.off_thread import Said  # noqa: E402
from tests.fakenvml import GiB, h200_node  # noqa: E402


def measure(
    reader: GpuReader, readings: int, members: dict[str, set[int]], before: Callable[[int], None] | None = None
) -> tuple[list[float], int]:
    if not reader.wait_ready(120):
        raise SystemExit("NVML did not initialise in 120 s")
    times, cards = [], 0
    for i in range(readings):
        if before is not None:
            before(i)
        reader.request(members)
        assert reader.wait(60)
        reading = reader.take()
        assert reading is not None
        times.append(reading.seconds * 1e3)
        cards = len(reading.gpus or ())  # None: NVML not loaded here
    return times, cards


def report(label: str, times: list[float], cards: int) -> None:
    med = statistics.median(times)
    per_card = f"{med / cards:.3f} ms per card" if cards else "no cards"
    print(f"{label:<26} {med:8.3f} ms per reading ({min(times):.3f}..{max(times):.3f}), {cards} cards, {per_card}")


def tick_cost(nvml: Any, ticks: int) -> None:
    """One GPM and clock-event tick of every card, on this thread (as the NVML thread runs it)."""
    nvml.nvmlInit()
    monitor = CardMonitor(nvml, time.monotonic, Said().first)
    monitor.follow([(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())])
    cards = nvml.nvmlDeviceGetCount()
    times = []
    for _ in range(ticks):
        started = time.perf_counter()
        monitor.tick()
        times.append((time.perf_counter() - started) * 1e3)
        time.sleep(0.1)  # GPM's pairs are 100 ms apart at the closest
    med = statistics.median(times)
    print(f"{'GPM + clock-event tick':<26} {med:8.3f} ms per tick ({min(times):.3f}..{max(times):.3f}), {cards} cards,"
          f" {med / max(1, cards):.3f} ms per card")  # fmt: skip
    monitor.close()


def cpu_with_ticks(make: Callable[[float | None], GpuReader], seconds: float, label: str) -> None:
    """The process's CPU seconds a second with the reader's 10 Hz ticks on,
    beside the same with them off (one reading a second in both, as an agent's
    windows ask)."""
    used = {}
    for every in (None, 0.1):
        reader = make(every)
        try:
            reader.wait_ready(120)
            started, cpu = time.monotonic(), time.process_time()
            while time.monotonic() - started < seconds:
                reader.request({})
                reader.wait(10)
                reader.take()
                time.sleep(1.0)
            used[every] = (time.process_time() - cpu) / (time.monotonic() - started)
        finally:
            reader.close()
    off, on = used[None], used[0.1]
    print(f"{label:<26} CPU {on * 100:.3f}% of a core with GPM at 10 Hz, {off * 100:.3f}% without"
          f" (reference, same run): {on / off if off else float('inf'):.2f}x, +{(on - off) * 100:.3f} points")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readings", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0, help="each of the two CPU runs")
    args = ap.parse_args()
    members = {f"shard{i}": {1000 + 10 * i + j for j in range(4)} for i in range(4)}

    nvml: Any = h200_node(8)
    for k, card in enumerate(nvml.cards):
        card.processes = [(1000 + 10 * (k % 4) + j, 10 * GiB) for j in range(2)]
    fake = GpuReader(nvml)

    def five_seconds_of_samples(i: int) -> None:  # NVML buffers about 6 a second
        for card in nvml.cards:
            card.samples.extend((i * 5_000_000 + s * 166_000 + 1, 90 + s % 10) for s in range(30))

    try:
        report("8 fake H200s", *measure(fake, args.readings, members, five_seconds_of_samples))
    finally:
        fake.close()

    tick_cost(h200_node(8), 50)
    cpu_with_ticks(lambda every: GpuReader(h200_node(8), gpm_every_s=every), args.seconds, "8 fake H200s")

    real = GpuReader()
    try:
        times, cards = measure(real, args.readings, members)
        if cards:
            report("this machine's GPUs", times, cards)
        else:
            print("this machine's GPUs: none (no NVML library or no card)")
    finally:
        real.close()
    if cards:
        import pynvml

        tick_cost(pynvml, 50)
        cpu_with_ticks(lambda every: GpuReader(gpm_every_s=every), args.seconds, "this machine's GPUs")


if __name__ == "__main__":
    main()
