"""A span of hindsight on the wire: samples the agent kept (its `--hindsight`
ring), fetched after the fact (docs/wire-format.md, "Hindsight").

The control plane asks for a span in its answer to a heartbeat, as it asks
for the live view's raw samples: `"hindsight": {"id", "from", "to"}` (wall
times). The agent sends the span in the heartbeats that follow, a piece
each, cut in time to the room the body has left, until a piece reaches the
span's end (`done`). A piece is a slice of time `(from, to]` and carries
every sample that ends in it, in the raw block's shapes (wire/raw.py) with
its times counted from the piece's `from`:

    {"id", "from", "to", "done", "held_from",
     "windows": [[start, end], ...],
     "machine": {"cpu_percent": {"start", "us", "v"}},
     "shards": [{"id", "cpu_cores": {"start", "us", "v"}}],
     "gpus": [{"index", "utilization_percent": {"t", "v"}}]}

`held_from` is the wall time the agent's oldest sample begins: before it,
the node keeps nothing. Consecutive pieces abut: a piece whose `from` is
after the last one's `to` says that one was lost (a heartbeat not
delivered). The control plane reads a piece only for the span it asked that
node for, and checks it item by item, like the raw block: a bad series costs
that series alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wire.checks import Dropped, Json, WireError, items, number, obj
from wire.raw import MAX_OFFSET_S, checked_series_of, kept

SPAN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SPAN_S = 3600.0  # a span asked for: no ring is kept longer by the defaults (15 minutes at 16 MiB)
MAX_PIECE_SAMPLES = 100_000  # one series of one piece: the body's limit keeps a piece below ~40,000 samples in all
MAX_WINDOWS = 10_000
EARLIEST = 1e9  # 2001: a wall time before it is a clock that was never set


@dataclass(frozen=True)
class SpanRequest:
    """A span the control plane asked a node for."""

    id: str
    t_from: float
    t_to: float

    def as_json(self) -> Json:
        return {"id": self.id, "from": round(self.t_from, 6), "to": round(self.t_to, 6)}


def parse_request(value: Any) -> SpanRequest | None:
    """The answer's `hindsight`, as the agent reads it: None when there is
    none; WireError when it is not a span (the agent logs it and sends
    nothing)."""
    if value is None:
        return None
    r = obj(value, "hindsight")
    span_id = r.get("id")
    if not isinstance(span_id, str) or not SPAN_ID.fullmatch(span_id):
        raise WireError("hindsight.id", "must be 1-64 letters, digits, '-' or '_'")
    t_from = number(r.get("from"), "hindsight.from", EARLIEST, 1e11)
    t_to = number(r.get("to"), "hindsight.to", t_from, t_from + MAX_SPAN_S)
    return SpanRequest(span_id, t_from, t_to)


# --- what the control plane accepts ------------------------------------------------


def parse_piece(value: Any, asked: SpanRequest, dropped: Dropped | None) -> Json | None:
    """A heartbeat's piece of the span `asked`, checked: None (and named in
    `dropped`) when it is not one, or is of another span, or lies outside
    it; a bad series within is left out alone."""
    try:
        p = obj(value, "hindsight")
        if p.get("id") != asked.id:
            raise WireError("hindsight.id", "not the span asked for")
        # Times cross the wire to the microsecond: a piece may round past the span's ends by one.
        t_from = number(p.get("from"), "hindsight.from", asked.t_from - 1e-6, asked.t_to + 1e-6)
        t_to = number(p.get("to"), "hindsight.to", t_from, asked.t_to + 1e-6)
        done = p.get("done", False)
        if not isinstance(done, bool):
            raise WireError("hindsight.done", "must be true or false")
        held = p.get("held_from")
        held_from = None if held is None else number(held, "hindsight.held_from", EARLIEST, 1e11)
    except WireError as e:
        if dropped is None:
            raise
        dropped.append({"field": e.field, "reason": e.reason})
        return None
    out: Json = {"id": asked.id, "from": t_from, "to": t_to, "done": done, "held_from": held_from}
    out["windows"] = kept(dropped, _windows, p.get("windows", []), t_to - t_from) or []
    out.update(checked_series_of(p, "hindsight", dropped, None, MAX_PIECE_SAMPLES))
    return out


def _windows(value: Any, length: float) -> list[tuple[float, float]]:
    length += 1e-5  # times are written to the microsecond: a window's end may round past the piece's
    out = []
    for i, w in enumerate(items(value, ("hindsight", "windows"), MAX_WINDOWS)):
        pair = items(w, ("hindsight", "windows", i), 2)
        if len(pair) != 2:
            raise WireError(("hindsight", "windows", i), "must be [start, end]")
        start = number(pair[0], ("hindsight", "windows", i, 0), -MAX_OFFSET_S, length)
        end = number(pair[1], ("hindsight", "windows", i, 1), max(start, 0.0), length)
        out.append((start, end))
    return out
