"""Spans of hindsight fetched from the nodes after the fact: the samples an
agent keeps in its ring (its `--hindsight`), asked for through the answers
to its heartbeats and sent back a piece a heartbeat (wire/hindsight.py), as
the live view's samples are: no listener on the agent.

A fetch is one node's span. A node is asked for one span at a time; the
others wait their turn (`MAX_WAITING_PER_NODE` of each kind). An
incident's spans go before a viewer's: the node is asked for the first
incident span waiting, and a viewer's span it was sending resumes where its
pieces ended once no incident's is left. Each piece is added as it comes;
what does not come is named, never filled:

- before the node's ring: "older than the node keeps";
- between two pieces: a piece lost on its way (a heartbeat not delivered);
- after the last piece, once `GRACE_S` has passed since the span's end: not
  received in time (the node was down, or sent its pieces too slowly).

Bounded under abuse, as a hostile node would push (tests/test_hindsight_abuse.py):
- a span is at most `MAX_SPAN_S`, at most what the node says its ring
  holds, and ends at most `ahead_s` after now (a viewer's `AROUND_S`);
- a piece must advance the span (its end past the last piece's) or it is
  refused, and it does not put the span's deadline off;
- a span has a hard end, `GRACE_S` plus its own length after its end (or
  its turn, if later), that no piece extends;
- what a piece holds counts in full against the budgets: its samples
  (`HELD_BYTES_A_SAMPLE`), its windows (`HELD_BYTES_A_WINDOW`) and the piece
  itself (`HELD_BYTES_A_PIECE`);
- a fetch holds at most `MAX_BYTES_PER_FETCH`; viewers' fetches together
  half of `MAX_BYTES` and of `MAX_SPANS`, so incidents always have the
  other half; new spans a node are rate-limited per kind;
- a finished fetch is kept `KEEP_S` for whoever asked (an incident keeps
  its own copy on disk).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from controlplane.keys import REGISTRY
from controlplane.listen.bodies import request_body
from controlplane.listen.page_worker import PAGE_WORKER
from wire.checks import Json
from wire.hindsight import MAX_SPAN_S, SpanRequest
from wire.raw import gpu_key, gpu_key_parts, gpu_label, window_stats

log = logging.getLogger(__name__)

AROUND_S = 30.0  # "every sample around here": this long either side of the moment; and how far ahead a span may end
MAX_WAITING_PER_NODE = 4  # spans a node is asked for one after another
ASK_EVERY_S = 10.0  # a node's new spans, sustained: one each 10 s ...
ASK_BURST = 6  # ... after a burst of six (an incident of a few alerts, and an operator's looks)
GRACE_S = 120.0  # after a span's end (or its asking, if later), the time its pieces have to come
KEEP_S = 600.0  # a finished fetch stays this long for the page or script that asked
# 12 bytes a sample held: 1.4 million samples, 7 minutes of 33 series at 100 a second; a span's
# JSON is made from them whole (about 70 bytes a sample while it is made: ~100 MiB at the most).
MAX_BYTES_PER_FETCH = 16 * 2**20
MAX_BYTES = 128 * 2**20  # every fetch held, finished or not
MAX_SPANS = 2000  # spans held, finished or not: a fleet's incident, and its operators' looks
GAP_S = 1e-3  # pieces further apart than this left a gap (the ring's own rounding is 1 us a sample)
HELD_BYTES_A_SAMPLE = 12  # an int64 length and a float32 value
HELD_BYTES_A_WINDOW = 72  # a (start, end) tuple of two floats, and the list's pointer to it
# A piece's own objects (the chunks, their arrays' headers, the list entries): measured with
# tracemalloc at about 600 bytes a series, so a piece of 50 empty series is not free.
HELD_BYTES_A_PIECE = 1024
HELD_BYTES_A_SERIES = 640
MAX_VIEW_WINDOWS = 4000  # windows drawn by ?view=windows: an hour of 1 s windows (the page draws fewer)
PIECE_REFUSALS = ("not_asked", "bad", "no_advance", "span_budget", "all_budget")


class Refused(Exception):
    """Why a span cannot be asked of a node: `status` is the answer its cause
    deserves. 429 only for "later" (a budget or a rate); a span that can never
    be fetched is 400; a node that keeps no samples is 503, naming the flag."""

    def __init__(self, why: str, status: int = 429) -> None:
        super().__init__(why)
        self.status = status

    def answer(self) -> web.HTTPException:
        kinds: dict[int, type[web.HTTPException]] = {400: web.HTTPBadRequest, 503: web.HTTPServiceUnavailable}
        return kinds.get(self.status, web.HTTPTooManyRequests)(text=f"{self}\n")


@dataclass
class _Chunk:
    """One piece's samples of one series: a rate's lengths (us) from `begin`,
    or a GPU's points at `t`; wall times."""

    begin: float
    us: np.ndarray | None
    t: np.ndarray | None
    v: np.ndarray


@dataclass
class Fetch:
    id: str
    node: str
    t_from: float
    t_to: float
    why: str
    asked_at: float
    received_to: float = field(init=False)  # the end of the last piece that came (before any: the first asked)
    last_piece_at: float | None = None
    turn_at: float | None = None  # when it came first in its node's queue: a span waiting its turn is not late
    missing: list[dict[str, Any]] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)
    series: dict[str, list[_Chunk]] = field(default_factory=dict)
    bytes: int = 0
    pieces: int = 0
    finished_at: float | None = None
    for_incident: bool = False  # an incident's span goes before a viewer's

    def __post_init__(self) -> None:
        self.received_to = self.t_from

    @property
    def request(self) -> SpanRequest:
        """What the node is asked for: the span from where the pieces that came
        end (an agent that restarted resumes there; one that goes on keeps its
        own place, past a piece lost)."""
        return SpanRequest(self.id, self.received_to, self.t_to)

    @property
    def deadline(self) -> float:
        """While pieces that advance it keep coming, a long span goes on; after
        the span's end and the last such piece, its rest is given up; and at
        its hard end (`hard_end`) whatever comes."""
        soft = max(self.t_to, self.turn_at or self.asked_at, self.last_piece_at or 0.0) + GRACE_S
        return min(soft, self.hard_end)

    @property
    def hard_end(self) -> float:
        """`GRACE_S` and the span's own length after its end or its turn:
        bench/hindsight_fetch.py sends 6 minutes at 100 Hz in 100 s, a third
        of its length; no piece puts this off."""
        return max(self.t_to, self.turn_at or self.asked_at) + GRACE_S + (self.t_to - self.t_from)

    def _missing(self, t_from: float, t_to: float, why: str) -> None:
        if t_to - t_from > GAP_S:
            self.missing.append({"from": round(t_from, 6), "to": round(t_to, 6), "why": why})

    def add(self, piece: Json, now: float, room: int = MAX_BYTES) -> str | None:
        """A piece that came; its samples kept if they fit the span's budget
        and the `room` every span's leave, else named missing. Returns why it
        was refused (one of `PIECE_REFUSALS`), or None when taken. A piece
        that does not advance the span (its end not past the last piece's,
        unless it says the span is done) is refused whole, and does not put
        the deadline off: a node that sends the same piece forever holds
        nothing and keeps nothing waiting."""
        t_from, t_to = piece["from"], piece["to"]
        if t_from < self.received_to - GAP_S:  # overlaps what came: a node resending, or confused
            return "no_advance"
        if t_to <= self.received_to + GAP_S and not piece["done"]:
            return "no_advance"
        self.last_piece_at = now
        self._missing(self.received_to, t_from, "a piece lost on its way (a heartbeat not delivered)")
        held_from = piece.get("held_from")
        if held_from is not None:
            self._missing(t_from, min(held_from, t_to), "older than the node keeps (its --hindsight)")
        self.received_to = t_to
        self.pieces += 1
        chunks: list[tuple[str, _Chunk]] = []
        if (cpu := piece.get("machine", {}).get("cpu_percent")) is not None:
            chunks.append(("machine", _rates(cpu, t_from)))
        chunks += [(f"shard:{s['id']}", _rates(s["cpu_cores"], t_from)) for s in piece["shards"]]
        for g in piece["gpus"]:
            for name, p in g.items():
                if name != "index":
                    chunks.append((gpu_key(g["index"], name),
                                   _Chunk(t_from, None, t_from + np.array(p["t"], dtype=np.float64),
                                          np.array(p["v"], dtype=np.float32))))  # fmt: skip
        size = (sum(len(c.v) * HELD_BYTES_A_SAMPLE + HELD_BYTES_A_SERIES for _, c in chunks)
                + len(piece["windows"]) * HELD_BYTES_A_WINDOW + HELD_BYTES_A_PIECE)  # fmt: skip
        if self.bytes + size > MAX_BYTES_PER_FETCH:
            self._missing(t_from, t_to, f"over the {MAX_BYTES_PER_FETCH >> 20} MiB a span may hold")
            return "span_budget"
        if size > room:
            self._missing(t_from, t_to, f"the control plane held {MAX_BYTES >> 20} MiB of spans, all it may")
            return "all_budget"
        self.bytes += size
        self.windows += [(t_from + s, t_from + e) for s, e in piece["windows"]]
        for key, chunk in chunks:
            self.series.setdefault(key, []).append(chunk)
        return None

    def finish(self, now: float, why: str | None = None) -> None:
        """Done: what did not come is missing, for `why` (default: it did not come in time)."""
        if self.finished_at is not None:
            return
        self._missing(self.received_to, self.t_to, why or f"not received within {GRACE_S:.0f} s of the span's "
                                                          "end and of the last piece")  # fmt: skip
        self.finished_at = now

    # --- what it gives back --------------------------------------------------------

    def describe(self) -> Json:
        """What a list shows: the span, its state and what is missing."""
        return {"id": self.id, "node": self.node, "why": self.why, "from": round(self.t_from, 6),
                "to": round(self.t_to, 6), "state": "done" if self.finished_at is not None else "fetching",
                "pieces": self.pieces, "missing": self.missing, "bytes": self.bytes,
                "deadline": round(self.deadline, 3), "hard_end": round(self.hard_end, 3)}  # fmt: skip

    def samples(self) -> Json:
        """The span's samples in the raw block's shapes (docs/wire-format.md),
        times in seconds from its `from`; a stretch between pieces is one
        sample not measured (`null`), never a zero."""
        out = self.describe()
        out["windows"] = [[round(s - self.t_from, 6), round(e - self.t_from, 6)] for s, e in self.windows]
        out["shards"], gpus = [], dict[int, Json]()
        for key in sorted(self.series):
            kind, _, name = key.partition(":")
            joined = _joined(self.series[key], self.t_from)
            if kind == "machine":
                out["machine"] = {"cpu_percent": joined}
            elif kind == "shard":
                out["shards"].append({"id": name, "cpu_cores": joined})
            else:
                index, field = gpu_key_parts(key)
                gpus.setdefault(index, {"index": index})[field] = joined
        out["gpus"] = [gpus[index] for index in sorted(gpus)]
        return out

    def window_events(self) -> tuple[list[Json], bool]:
        """The span as the live view draws it (controlplane/samples/live.py): an event a
        window, each series' samples that end in it with the window's mean, p95
        and max over them (wire/raw.py's `window_stats`: the definition the
        agent's summaries have). Linear in what it returns: each series is
        joined once and cut at the windows it reaches by bisection; windows
        that overlap one before them are a node's confusion and not drawn
        twice; at most `MAX_VIEW_WINDOWS` (the second value says more were
        left out)."""
        windows: list[tuple[float, float]] = []
        for start, end in sorted(set(self.windows)):
            if not windows or start >= windows[-1][1] - GAP_S:
                windows.append((start, end))
        truncated = len(windows) > MAX_VIEW_WINDOWS
        windows = windows[:MAX_VIEW_WINDOWS]
        events: list[Json] = [{"seq": seq + 1, "start": start, "end": end, "samples": None, "series": []}
                              for seq, (start, end) in enumerate(windows)]  # fmt: skip
        if not windows:
            return events, truncated
        starts = np.array([w[0] for w in windows])
        ends = np.array([w[1] for w in windows])
        for key in sorted(self.series):
            kind, _, name = key.partition(":")
            label, unit = {"machine": ("machine CPU", "%"), "shard": (name, "cores")}.get(kind) or \
                (gpu_label(*gpu_key_parts(key)), "%")  # fmt: skip
            chunks = self.series[key]
            if chunks[0].us is None:  # a GPU's points
                t = np.concatenate([c.t for c in chunks if c.t is not None])
                v = np.concatenate([c.v for c in chunks]).astype(np.float64)
                us = None
            else:
                us, v = _flat(chunks)
                t = chunks[0].begin + np.cumsum(us) / 1e6
            if not len(t):
                continue
            # The windows (start, end] that can hold one of its samples, and where each cuts it.
            w0, w1 = int(np.searchsorted(ends, t[0], "left")), int(np.searchsorted(starts, t[-1], "left"))
            firsts = np.searchsorted(t, starts[w0:w1], "right")
            lasts = np.searchsorted(t, ends[w0:w1], "right")
            for w, first, last in zip(range(w0, w1), firsts.tolist(), lasts.tolist(), strict=True):
                if last <= first:
                    continue
                start = windows[w][0]
                out: Json = {"key": key, "label": label, "unit": unit}
                if us is None:
                    # Each point covers the time since the one before it, as the agent weighs NVML's samples.
                    tt, vv = t[first:last], v[first:last]
                    out.update(t=np.round(tt - start, 4).tolist(), v=np.round(vv, 2).tolist(),
                               summary=window_stats(vv, np.diff(tt, prepend=start)))  # fmt: skip
                else:
                    cut_us, vv = us[first:last], v[first:last]
                    begin = float(t[first]) - int(cut_us[0]) / 1e6
                    out.update(start=round(begin - start, 6), us=cut_us.tolist(),
                               v=[None if x != x else round(x, 5) for x in vv.tolist()],
                               summary=window_stats(vv, cut_us / 1e6))  # fmt: skip
                events[w]["series"].append(out)
        return events, truncated


def _flat(chunks: list[_Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """A rate series' chunks as one array of lengths (us) and one of values,
    a stretch between chunks one sample not measured (NaN)."""
    us: list[np.ndarray] = []
    v: list[np.ndarray] = []
    end = chunks[0].begin
    for c in chunks:
        assert c.us is not None
        if c.begin - end > GAP_S:
            us.append(np.array([round((c.begin - end) * 1e6)], dtype=np.int64))
            v.append(np.array([np.nan]))
        us.append(c.us)
        v.append(c.v.astype(np.float64))
        end = c.begin + int(c.us.sum()) / 1e6
    return np.concatenate(us), np.concatenate(v)


def _rates(series: Json, t_from: float) -> _Chunk:
    v = np.array([np.nan if x is None else x for x in series["v"]], dtype=np.float32)
    return _Chunk(t_from + series["start"], np.array(series["us"], dtype=np.int64), None, v)


def _joined(chunks: list[_Chunk], t_from: float) -> Json:
    if chunks[0].us is None:  # a GPU's points: a gap is the points' own
        return {"t": np.round(np.concatenate([c.t for c in chunks if c.t is not None]) - t_from, 4).tolist(),
                "v": np.round(np.concatenate([c.v for c in chunks]).astype(np.float64), 2).tolist()}  # fmt: skip
    us: list[int] = []
    v: list[float | None] = []
    end = chunks[0].begin
    for c in chunks:
        assert c.us is not None
        if c.begin - end > GAP_S:  # a piece lost, or a series absent a while: not measured
            us.append(round((c.begin - end) * 1e6))
            v.append(None)
        us += c.us.tolist()
        v += [None if x != x else round(x, 5) for x in c.v.astype(np.float64).tolist()]
        end = c.begin + int(c.us.sum()) / 1e6
    return {"start": round(chunks[0].begin - t_from, 6), "us": us, "v": v}


class _NodeSpans:
    """A node's spans waiting, an incident's before a viewer's."""

    def __init__(self) -> None:
        self.incident: collections.deque[Fetch] = collections.deque()
        self.viewer: collections.deque[Fetch] = collections.deque()

    def of(self, for_incident: bool) -> collections.deque[Fetch]:
        return self.incident if for_incident else self.viewer

    def head(self) -> Fetch | None:
        return self.incident[0] if self.incident else self.viewer[0] if self.viewer else None

    def pop_head(self) -> Fetch:
        return self.incident.popleft() if self.incident else self.viewer.popleft()

    def __bool__(self) -> bool:
        return bool(self.incident or self.viewer)

    def __iter__(self) -> Iterator[Fetch]:
        return itertools.chain(self.incident, self.viewer)


class HindsightFetches:
    """The spans asked of each node, and those fetched."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self._queues: dict[str, _NodeSpans] = {}
        self._by_id: dict[str, Fetch] = {}
        self._asks: dict[tuple[str, bool], tuple[float, float]] = {}  # (node, for an incident) -> (tokens, when)
        self._ids = itertools.count(1)
        self.held_bytes = 0  # what every span holds
        self.viewer_bytes = 0  # ... of it, viewers' spans
        # Counted for /metrics (controlplane/samples/surface_metrics.py), fixed label sets.
        self.asks = {"incident": 0, "viewer": 0}
        self.asks_refused = {"incident": 0, "viewer": 0}
        self.given_up = {"incident": 0, "viewer": 0}
        self.pieces_taken = 0
        self.pieces_refused = dict.fromkeys(PIECE_REFUSALS, 0)

    def ask(self, node: str, t_from: float, t_to: float, why: str, held_seconds: float | None,
            for_incident: bool = False, ahead_s: float = 0.0) -> Fetch:  # fmt: skip
        """A new span of `node`'s samples, fetched in its turn. `held_seconds`:
        what the node said its ring holds (None: it keeps none). Its end is
        brought back to `ahead_s` (at least `AROUND_S`) after now: a span
        that ends an hour ahead held its node's turn for an hour. Refused
        when the node keeps nothing, or is asked too often, or memory is
        spent."""
        kind = "incident" if for_incident else "viewer"
        self.asks[kind] += 1
        try:
            return self._ask(node, t_from, t_to, why, held_seconds, for_incident, ahead_s)
        except Refused:
            self.asks_refused[kind] += 1
            raise

    def _ask(self, node: str, t_from: float, t_to: float, why: str, held_seconds: float | None,
             for_incident: bool, ahead_s: float) -> Fetch:  # fmt: skip
        now = self.wall()
        self.sweep(now)
        t_to = min(t_to, now + max(ahead_s, AROUND_S))
        t_from, t_to = round(t_from, 6), round(t_to, 6)  # as the wire writes them
        if held_seconds is None:
            raise Refused(f"{node} keeps no samples to fetch (its agent runs with --hindsight 0, or has not "
                          "said yet)", 503)  # fmt: skip
        if not t_from < t_to or t_to - t_from > MAX_SPAN_S:
            raise Refused(f"a span is longer than 0 and at most {MAX_SPAN_S:.0f} s, and begins before now", 400)
        spans = self._queues.setdefault(node, _NodeSpans())
        if len(spans.of(for_incident)) >= MAX_WAITING_PER_NODE:
            raise Refused(f"{MAX_WAITING_PER_NODE} spans of {node} are being fetched already")
        # Viewers may hold half of what spans may: the other half is the incidents'.
        share = 1.0 if for_incident else 0.5
        spans_held = len(self._by_id) if for_incident else sum(not f.for_incident for f in self._by_id.values())
        held = self.held_bytes if for_incident else self.viewer_bytes
        if held >= MAX_BYTES * share or spans_held >= MAX_SPANS * share:
            raise Refused(f"the spans held take the {MAX_BYTES * share / 2**20:.0f} MiB, or are the "
                          f"{MAX_SPANS * share:.0f}, allowed: try again when some are older than "
                          f"{KEEP_S:.0f} s")  # fmt: skip
        if not self._may_ask((node, for_incident), now):
            raise Refused(f"{node} is asked for a span more often than once each {ASK_EVERY_S:.0f} s")
        fetch = Fetch(f"{next(self._ids)}-{secrets.token_hex(4)}", node, t_from, t_to, why[:200], now,
                      for_incident=for_incident)  # fmt: skip
        oldest = min(round(now - held_seconds, 6), t_to)
        if t_from < oldest:  # the part before the ring is missing from the start; the node is asked for the rest
            fetch._missing(t_from, oldest, "older than the node keeps (its --hindsight)")
            fetch.received_to = oldest
        self._by_id[fetch.id] = fetch
        if fetch.received_to >= t_to:  # all of it before the ring: nothing to ask
            fetch.finish(now)
            return fetch
        spans.of(for_incident).append(fetch)
        log.info("hindsight: %.0f s of %s asked for (%s)", t_to - t_from, node, why[:200])
        return fetch

    def _may_ask(self, key: tuple[str, bool], now: float) -> bool:
        tokens, then = self._asks.get(key, (float(ASK_BURST), now))
        tokens = min(float(ASK_BURST), tokens + (now - then) / ASK_EVERY_S)
        if len(self._asks) > 100_000:
            self._asks.clear()
        self._asks[key] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    def asked(self, node: str) -> SpanRequest | None:
        """The span a node's next heartbeats should carry pieces of (None: none)."""
        spans = self._queues.get(node)
        if not spans:
            return None
        now = self.wall()
        while (head := spans.head()) is not None:
            if head.turn_at is None:
                head.turn_at = now
            if now <= head.deadline:
                break
            spans.pop_head()
            self._finish(head, now)
        if head is None:
            del self._queues[node]
            return None
        return head.request

    def _finish(self, fetch: Fetch, now: float) -> None:
        if fetch.finished_at is None and fetch.received_to < fetch.t_to - GAP_S:
            self.given_up["incident" if fetch.for_incident else "viewer"] += 1
        fetch.finish(now)

    def received(self, node: str, piece: Json) -> None:
        """A checked piece of the span the node was asked for (wire/hindsight.py)."""
        spans = self._queues.get(node)
        fetch = spans.head() if spans else None
        if spans is None or fetch is None or fetch.id != piece["id"]:
            self.pieces_refused["not_asked"] += 1
            return
        before = fetch.bytes
        room = MAX_BYTES - self.held_bytes if fetch.for_incident else MAX_BYTES // 2 - self.viewer_bytes
        refused = fetch.add(piece, self.wall(), room)
        self.held_bytes += fetch.bytes - before
        if not fetch.for_incident:
            self.viewer_bytes += fetch.bytes - before
        if refused is None:
            self.pieces_taken += 1
        else:
            self.pieces_refused[refused] += 1
        if piece["done"] and refused != "no_advance":
            spans.pop_head()
            self._finish(fetch, self.wall())
            if not spans:
                del self._queues[node]

    def refused_piece(self, why: str) -> None:
        """A piece the heartbeat's checks left out whole: `not_asked` (no span
        is asked of the node, or it is of another span) or `bad` (not a piece)."""
        self.pieces_refused[why] += 1

    def get(self, fetch_id: str) -> Fetch | None:
        self.sweep(self.wall())
        return self._by_id.get(fetch_id)

    def sweep(self, now: float | None = None) -> None:
        """Spans past their deadline finished; finished ones kept past `KEEP_S` forgotten."""
        now = self.wall() if now is None else now
        for node in list(self._queues):
            self.asked(node)
        for fetch_id, fetch in list(self._by_id.items()):
            if fetch.finished_at is not None and now - fetch.finished_at > KEEP_S:
                del self._by_id[fetch_id]
                self.held_bytes -= fetch.bytes
                if not fetch.for_incident:
                    self.viewer_bytes -= fetch.bytes

    def forget(self, node: str, why: str = "the node was forgotten") -> None:
        """The node's spans end: the rest of each is missing, for `why`, never filled."""
        for fetch in self._queues.pop(node, ()):
            fetch.finish(self.wall(), why)


HINDSIGHT = web.AppKey("hindsight", HindsightFetches)


# --- the pages' routes -------------------------------------------------------------

MAX_ASK_BODY = 1024
SPAN_BODY = '{"at": T} or {"from": T0, "to": T1}'


async def ask_span(request: web.Request) -> web.Response:
    """POST /api/nodes/NODE/hindsight, a JSON body `{"at": T}` (every sample
    `AROUND_S` either side of wall time T) or `{"from": T0, "to": T1}`: 202
    with the fetch's id and where to read it. JSON only: a form another site
    posts is not one (a browser asks before it sends JSON across sites, and
    this listener answers no such question)."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text=f"a span is asked for with a JSON body: {SPAN_BODY}\n")
    node = request.match_info["node"]
    state = request.app[REGISTRY].get(node)
    if state is None:
        raise web.HTTPNotFound(text="no such node\n")
    fetches = request.app[HINDSIGHT]
    held = state.hindsight_held_seconds()
    try:
        body = json.loads(await request_body(request, MAX_ASK_BODY))
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        if "at" in body:
            at = float(body["at"])
            t_from, t_to = at - AROUND_S, at + AROUND_S
        else:
            t_from, t_to = float(body["from"]), float(body["to"])
        if not (math.isfinite(t_from) and math.isfinite(t_to)):
            raise ValueError("not finite")
        # A span all ahead of now is no span; one all before the node's ring
        # (`{"at": 1}`, 1970) can never be fetched. An incident's, for many
        # nodes, keeps such a node's part as missing instead.
        now = fetches.wall()
        if t_from >= now + AROUND_S:
            raise ValueError("it begins ahead of now")
        if not t_from < t_to:
            raise ValueError("from is not before to")
        if min(t_to, now + AROUND_S) - t_from > MAX_SPAN_S:
            raise ValueError(f"a span is at most {MAX_SPAN_S:.0f} s")
        if held is not None and t_to < now - held:
            raise ValueError(f"it ends before what {node}'s ring holds: its last {held:.0f} s, from "
                             f"{now - held:.0f}")  # fmt: skip
    except (ValueError, TypeError, KeyError) as e:
        raise web.HTTPBadRequest(text=f"a span is {SPAN_BODY}, wall times: {e}\n") from None
    try:
        fetch = fetches.ask(node, t_from, t_to, "asked for on the node page", held)
    except Refused as e:
        raise e.answer() from None
    return web.json_response({**fetch.describe(), "url": f"/api/hindsight/{fetch.id}"}, status=202)


async def read_span(request: web.Request) -> web.Response:
    """GET /api/hindsight/ID: the fetch's samples so far (`?view=windows`:
    an event a window, as the live view draws them)."""
    fetch = request.app[HINDSIGHT].get(request.match_info["id"])
    if fetch is None:
        raise web.HTTPNotFound(text=f"no such span (a finished one is kept {KEEP_S:.0f} s)\n")
    # Drawn on the page thread: an hour of a node's samples is a second of numpy and JSON.
    if request.query.get("view") == "windows":

        def drawn() -> str:
            events, truncated = fetch.window_events()
            return json.dumps({**fetch.describe(), "windows": events, "truncated": truncated})

        body = await request.app[PAGE_WORKER].run(drawn)
    else:
        body = await request.app[PAGE_WORKER].run(lambda: json.dumps(fetch.samples()))
    return web.Response(text=body, content_type="application/json")


def add_routes(app: web.Application, fetches: HindsightFetches) -> None:
    app[HINDSIGHT] = fetches
    app.router.add_post("/api/nodes/{node}/hindsight", ask_span)
    app.router.add_get("/api/hindsight/{id}", read_span)
