"""Time per heartbeat spent in NVML: one GPU reading of every card (all
fields, utilisation samples, compute processes), for 8 fake H200s and, where
the machine has an NVML library and a card, for the real cards.

The fake's calls cost next to nothing: its figure is nodesampler's own
overhead around NVML. Target: the whole read under 20 ms per card.

    PYTHONPATH=. .venv/bin/python bench/nvml_read_cost.py [--readings 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sampler.gpu.nvml import GpuReader  # noqa: E402
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
        cards = len(reading.gpus)
    return times, cards


def report(label: str, times: list[float], cards: int) -> None:
    med = statistics.median(times)
    per_card = f"{med / cards:.3f} ms per card" if cards else "no cards"
    print(f"{label:<26} {med:8.3f} ms per reading ({min(times):.3f}..{max(times):.3f}), {cards} cards, {per_card}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readings", type=int, default=50)
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

    real = GpuReader()
    try:
        times, cards = measure(real, args.readings, members)
        if cards:
            report("this machine's GPUs", times, cards)
        else:
            print("this machine's GPUs: none (no NVML library or no card)")
    finally:
        real.close()


if __name__ == "__main__":
    main()
