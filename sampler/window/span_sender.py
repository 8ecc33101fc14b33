"""The span of hindsight the control plane asked for, sent a piece a window
(wire/hindsight.py): on the sampling thread, which alone writes the ring.

Each window's heartbeat carries the next slice of the span that fits the
room its body has left, from where the last piece ended, up to the span's
end or the ring's newest sample, whichever comes first; a span that ends
ahead of the ring is sent as the windows bring it. A piece lost on its way
(a heartbeat not delivered) is not sent again: the control plane sees the
gap between the pieces that came and names it missing.
"""

from __future__ import annotations

import logging

import numpy as np

import wire
from sampler.window.hindsight import MACHINE, HindsightRing, Span
from wire import raw as raw_samples
from wire.hindsight import SpanRequest
from wire.raw import MAX_OFFSET_S

log = logging.getLogger(__name__)

# What a sample costs in a piece, for a first cut of a slice before it is
# encoded: a length of 4-6 digits and a value of up to 7 characters, with
# their commas (an 8-hour ring at 100 Hz measured 13.8).
BYTES_A_SAMPLE_SENT = 16
MIN_ROOM = 4096  # below this a piece waits for a heartbeat with more room
SHRINK_TRIES = 4


class SpanSender:
    def __init__(self) -> None:
        # Set by the agent's sender as each answer comes (one reference, so the
        # sampling thread reads either the old request or the new, whole).
        self.asked: SpanRequest | None = None
        self._id: str | None = None
        self._cursor = 0.0  # where the next piece begins (a wall time)
        self._done = False
        self.pieces_sent = 0

    def next_piece(self, ring: HindsightRing, room: int) -> bytes | None:
        """The next piece of the span asked for, within `room` bytes; None
        when nothing is asked, the span is sent, or nothing new is held."""
        asked = self.asked
        if asked is None:
            return None
        if asked.id != self._id:
            self._id, self._cursor, self._done = asked.id, asked.t_from, False
            log.info("hindsight: sending %.0f s of samples from %.3f, asked for by the control plane (span %s)",
                     asked.t_to - asked.t_from, asked.t_from, asked.id)  # fmt: skip
        newest = ring.newest_end()
        if self._done or newest is None or room < MIN_ROOM:
            return None
        end = min(asked.t_to, newest)
        if end <= self._cursor:
            return None
        estimate = ring.count_ending_in(self._cursor, end) * BYTES_A_SAMPLE_SENT + 512
        if estimate > room:
            end = self._cursor + (end - self._cursor) * room / estimate
        for _ in range(SHRINK_TRIES):
            body = wire.dumps(piece(ring, asked, self._cursor, end))
            if len(body) <= room:
                self._cursor, self._done = end, end >= asked.t_to
                self.pieces_sent += 1
                return body
            end = self._cursor + (end - self._cursor) * 0.9 * room / len(body)
        return None  # a slice this short still too large: the next window's room tries again


def piece(ring: HindsightRing, asked: SpanRequest, t_from: float, t_to: float) -> dict[str, object]:
    """Every kept sample that ends in (t_from, t_to], in the raw block's
    shapes, times from `t_from` (wire/hindsight.py)."""
    held_from = ring.held_from()
    out: dict[str, object] = {
        "id": asked.id, "from": round(t_from, 6), "to": round(t_to, 6), "done": t_to >= asked.t_to,
        "held_from": None if held_from is None else round(held_from, 6),
        "windows": [[round(s - t_from, 6), round(e - t_from, 6)] for s, e in ring.windows_ending_in(t_from, t_to)
                    if e - t_from <= MAX_OFFSET_S and s - t_from >= -MAX_OFFSET_S],
    }  # fmt: skip
    shards, gpus = [], dict[int, dict[str, object]]()
    for key in ring.series_kept():
        span = ring.ending_in(key, t_from, t_to)
        if span is None or not len(span.us):
            continue
        span = _from(span, asked.t_from)
        if key == MACHINE:
            out["machine"] = {"cpu_percent": _rates(span, t_from, 4)}
        elif key.startswith("shard:"):
            shards.append({"id": key.removeprefix("shard:"), "cpu_cores": _rates(span, t_from, 5)})
        elif key.startswith("gpu:"):
            ends = span.start - t_from + np.cumsum(span.us, dtype=np.int64) / 1e6
            measured = ~np.isnan(span.values)  # a GPU's absence is no point: the points have a gap there
            ends, values = ends[measured], np.round(span.values[measured].astype(np.float64), 2)
            index, field = raw_samples.gpu_key_parts(key)
            gpus.setdefault(index, {"index": index})[field] = {"t": np.round(ends, 4).tolist(), "v": values.tolist()}
    out["shards"], out["gpus"] = shards, [gpus[index] for index in sorted(gpus)]
    return out


def _from(span: Span, t_from: float) -> Span:
    """A first sample that began before the span and measured nothing (a
    series' absence, as long as it was) cut to begin at the span's start:
    a span says nothing of the time before it."""
    if len(span.us) and span.start < t_from and np.isnan(span.values[0]):
        us = span.us.copy()
        us[0] = max(1, us[0] - round((t_from - span.start) * 1e6))
        return Span(t_from, us, span.values)
    return span


def _rates(span: Span, t_from: float, digits: int) -> dict[str, object]:
    values = np.round(span.values.astype(np.float64), digits).tolist()
    return {"start": round(span.start - t_from, 6), "us": span.us.astype(np.int64).tolist(),
            "v": [None if x != x else x for x in values]}  # fmt: skip
