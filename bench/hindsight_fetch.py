"""What fetching a span of hindsight costs, and how long it takes: an
incident's span (5 minutes before, a minute after) of a node whose ring
holds the machine and 16 shards at each of --rates, cut into pieces as the
agent cuts them (beside a heartbeat's summary of 16 shards), each checked
and added as the control plane does, then written out whole as an
incident's file.

Printed per rate: the pieces and their sizes (the heartbeats' bodies
within their 512 KiB), the transfer time (a piece a heartbeat, at the
default --interval of 5 s), the agent's time to cut a piece beside the time
it takes to encode one window's raw block for the live view (the reference,
measured in the same run: our machines' speed varies several-fold from day
to day), the control plane's time per piece, and the incident file's size
and time to write. Not a test: no thresholds.

    .venv/bin/python bench/hindsight_fetch.py [--rates 10,100,1000] [--shards 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wire  # noqa: E402
from controlplane.samples.hindsight import HindsightFetches  # noqa: E402
from sampler.window.hindsight import HindsightRing  # noqa: E402
from sampler.window.span_sender import SpanSender  # noqa: E402
from wire.hindsight import parse_piece  # noqa: E402
from wire.raw import BODY_ROOM, fit_raw, rate_series  # noqa: E402

T0 = 1_764_000_000.0
WINDOW_S = 5.0
SUMMARY_BYTES = 9_000  # a heartbeat of 16 shards with their pods and queues (measured: 8.6 KB)


def filled(rate: float, shards: int, seconds: float) -> HindsightRing:
    rng = np.random.default_rng(1)
    ring = HindsightRing(minutes=15, mib=16, hz=rate)
    n = int(WINDOW_S * rate)
    lengths = np.full(n, 1 / rate) * rng.uniform(0.95, 1.05, n)
    lengths *= WINDOW_S / lengths.sum()
    for w in range(int(seconds / WINDOW_S)):
        end = T0 + (w + 1) * WINDOW_S
        ring.keep("machine", end, lengths, rng.uniform(0, 100, n))
        for s in range(shards):
            ring.keep(f"shard:engine-{s}", end, lengths, rng.uniform(0, 8, n))
        ring.keep_window(end - WINDOW_S, end)
    return ring


def one_rate(rate: float, shards: int) -> None:
    ring = filled(rate, shards, 15 * 60)
    held_from = ring.held_from()
    assert held_from is not None
    at = T0 + 15 * 60 - 90
    now = T0 + 15 * 60
    fetches = HindsightFetches(wall=lambda: now)
    fetch = fetches.ask("n1", at - 300, at + 60, "bench", held_seconds=now - held_from)
    sender = SpanSender()
    room = wire.MAX_BODY_BYTES - SUMMARY_BYTES - BODY_ROOM
    cut, took, sizes = [], [], []
    while True:
        sender.asked = fetches.asked("n1")
        if sender.asked is None:
            break
        started = time.perf_counter()
        body = sender.next_piece(ring, room)
        cut.append(time.perf_counter() - started)
        if body is None:
            break
        sizes.append(len(body) + SUMMARY_BYTES)
        started = time.perf_counter()
        piece = parse_piece(json.loads(body), sender.asked, None)
        assert piece is not None
        fetches.received("n1", piece)
        took.append(time.perf_counter() - started)
    # The reference: one window's raw block for the live view, encoded as the agent does.
    n = int(WINDOW_S * rate)
    values, seconds = np.random.default_rng(2).uniform(0, 8, n), np.full(n, 1 / rate)
    started = time.perf_counter()
    for _ in range(5):
        wire.dumps(fit_raw(SUMMARY_BYTES, rate_series(0.0, values * 12, seconds, 4), [],
                           [(f"engine-{s}", rate_series(0.0, values, seconds, 5)) for s in range(shards)]))  # fmt: skip
    raw_s = (time.perf_counter() - started) / 5
    started = time.perf_counter()
    body = json.dumps(fetch.samples(), separators=(",", ":")).encode()
    written_s = time.perf_counter() - started
    samples = sum(len(c.v) for chunks in fetch.series.values() for c in chunks)
    print(f"{rate:6g} Hz: a 6-minute span of {shards + 1} series ({samples:,} samples) in {len(sizes)} pieces, "
          f"heartbeats of {min(sizes) / 1024:.0f}-{max(sizes) / 1024:.0f} KiB (limit 512): "
          f"{len(sizes) * WINDOW_S:.0f} s at a piece each {WINDOW_S:g} s heartbeat; missing {fetch.missing or 'none'}")
    print(f"         agent: {statistics.median(cut) * 1e3:.1f} ms to cut a piece (median; the live view's raw "
          f"block of one window: {raw_s * 1e3:.1f} ms, ratio {statistics.median(cut) / raw_s:.1f}); "
          f"control plane: {statistics.median(took) * 1e3:.1f} ms a piece; the incident file "
          f"{len(body) / 2**20:.1f} MiB in {written_s * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,100,1000")
    parser.add_argument("--shards", type=int, default=16)
    args = parser.parse_args()
    for rate in (float(r) for r in args.rates.split(",")):
        one_rate(rate, args.shards)


if __name__ == "__main__":
    main()
