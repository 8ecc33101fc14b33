"""Spans of hindsight fetched from the nodes after the fact: the samples an
agent keeps in its ring (its `--hindsight`), asked for through the answers
to its heartbeats and sent back a piece a heartbeat (wire/hindsight.py), as
the live view's samples are: no listener on the agent.

A fetch is one node's span. A node is asked for one span at a time; the
others wait their turn (`MAX_WAITING_PER_NODE`). Each piece is added as it
comes; what does not come is named, never filled:

- before the node's ring: "older than the node keeps";
- between two pieces: a piece lost on its way (a heartbeat not delivered);
- after the last piece, once `GRACE_S` has passed since the span's end: not
  received in time (the node was down, or sent its pieces too slowly).

Bounded under abuse: a span is at most `MAX_SPAN_S` and at most what the
node says its ring holds; new spans a node are rate-limited; a fetch holds
at most `MAX_BYTES_PER_FETCH` and all of them `MAX_BYTES` (asks beyond it
are refused); a finished fetch is kept `KEEP_S` for whoever asked (an
incident keeps its own copy on disk).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from controlplane.keys import REGISTRY
from controlplane.page_worker import PAGE_WORKER
from wire.checks import Json
from wire.hindsight import MAX_SPAN_S, SpanRequest
from wire.raw import window_stats

log = logging.getLogger(__name__)

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


class Refused(Exception):
    """Why a span cannot be asked of a node now (the answer is 429 or 400)."""


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
        """While pieces keep coming, a long span goes on; after the span's end
        and the last piece, its rest is given up."""
        return max(self.t_to, self.turn_at or self.asked_at, self.last_piece_at or 0.0) + GRACE_S

    def _missing(self, t_from: float, t_to: float, why: str) -> None:
        if t_to - t_from > GAP_S:
            self.missing.append({"from": round(t_from, 6), "to": round(t_to, 6), "why": why})

    def add(self, piece: Json, now: float, room: int = MAX_BYTES) -> None:
        """A piece that came; its samples kept if they fit the span's budget
        and the `room` every span's leave, else named missing."""
        t_from, t_to = piece["from"], piece["to"]
        self.last_piece_at = now
        if t_from < self.received_to - GAP_S:  # overlaps what came: a node resending, or confused
            return
        self._missing(self.received_to, t_from, "a piece lost on its way (a heartbeat not delivered)")
        held_from = piece.get("held_from")
        if held_from is not None:
            self._missing(t_from, min(held_from, t_to), "older than the node keeps (its --hindsight)")
        self.received_to = t_to
        self.pieces += 1
        self.windows += [(t_from + s, t_from + e) for s, e in piece["windows"]]
        chunks: list[tuple[str, _Chunk]] = []
        if (cpu := piece.get("machine", {}).get("cpu_percent")) is not None:
            chunks.append(("machine", _rates(cpu, t_from)))
        chunks += [(f"shard:{s['id']}", _rates(s["cpu_cores"], t_from)) for s in piece["shards"]]
        for g in piece["gpus"]:
            p = g["utilization_percent"]
            chunks.append((f"gpu:{g['index']}", _Chunk(t_from, None, t_from + np.array(p["t"], dtype=np.float64),
                                                       np.array(p["v"], dtype=np.float32))))  # fmt: skip
        size = sum(len(c.v) * HELD_BYTES_A_SAMPLE for _, c in chunks)
        if self.bytes + size > MAX_BYTES_PER_FETCH:
            self._missing(t_from, t_to, f"over the {MAX_BYTES_PER_FETCH >> 20} MiB a span may hold")
            return
        if size > room:
            self._missing(t_from, t_to, f"the control plane held {MAX_BYTES >> 20} MiB of spans, all it may")
            return
        self.bytes += size
        for key, chunk in chunks:
            self.series.setdefault(key, []).append(chunk)

    def finish(self, now: float) -> None:
        if self.finished_at is not None:
            return
        self._missing(self.received_to, self.t_to, f"not received within {GRACE_S:.0f} s of the span's end "
                                                   "and of the last piece")
        self.finished_at = now

    # --- what it gives back --------------------------------------------------------

    def describe(self) -> Json:
        """What a list shows: the span, its state and what is missing."""
        return {"id": self.id, "node": self.node, "why": self.why, "from": round(self.t_from, 6),
                "to": round(self.t_to, 6), "state": "done" if self.finished_at is not None else "fetching",
                "pieces": self.pieces, "missing": self.missing}  # fmt: skip

    def samples(self) -> Json:
        """The span's samples in the raw block's shapes (docs/wire-format.md),
        times in seconds from its `from`; a stretch between pieces is one
        sample not measured (`null`), never a zero."""
        out = self.describe()
        out["windows"] = [[round(s - self.t_from, 6), round(e - self.t_from, 6)] for s, e in self.windows]
        out["shards"], out["gpus"] = [], []
        for key in sorted(self.series):
            kind, _, name = key.partition(":")
            joined = _joined(self.series[key], self.t_from)
            if kind == "machine":
                out["machine"] = {"cpu_percent": joined}
            elif kind == "shard":
                out["shards"].append({"id": name, "cpu_cores": joined})
            else:
                out["gpus"].append({"index": int(name), "utilization_percent": joined})
        return out

    def window_events(self) -> list[Json]:
        """The span as the live view draws it (controlplane/live.py): an event a
        window, each series' samples that end in it with the window's mean, p95
        and max over them (wire/raw.py's `window_stats`: the definition the
        agent's summaries have)."""
        events = []
        for seq, (start, end) in enumerate(sorted(set(self.windows))):
            series = []
            for key in sorted(self.series):
                s = _in_window(key, self.series[key], start, end)
                if s is not None:
                    series.append(s)
            events.append({"seq": seq + 1, "start": start, "end": end, "samples": None, "series": series})
        return events


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


def _in_window(key: str, chunks: list[_Chunk], start: float, end: float) -> Json | None:
    """A series' samples that end in (start, end], as a live event's series."""
    kind, _, name = key.partition(":")
    label, unit = {"machine": ("machine CPU", "%"), "shard": (name, "cores"), "gpu": (f"GPU {name}", "%")}[kind]
    out: Json = {"key": key, "label": label, "unit": unit}
    if chunks[0].us is None:
        t = np.concatenate([c.t for c in chunks if c.t is not None])
        v = np.concatenate([c.v for c in chunks]).astype(np.float64)
        inside = (t > start) & (t <= end)
        if not inside.any():
            return None
        # Each point covers the time since the one before it, as the agent weighs NVML's samples.
        out.update(t=np.round(t[inside] - start, 4).tolist(), v=np.round(v[inside], 2).tolist(),
                   summary=window_stats(v[inside], np.diff(t[inside], prepend=start)))  # fmt: skip
        return out
    cut = []
    for c in chunks:
        assert c.us is not None
        ends = c.begin + np.cumsum(c.us) / 1e6
        at = np.flatnonzero((ends > start) & (ends <= end))
        if len(at):
            first, last = int(at[0]), int(at[-1]) + 1
            cut.append(_Chunk(float(ends[first] - c.us[first] / 1e6), c.us[first:last], None, c.v[first:last]))
    if not cut:
        return None
    values = np.concatenate([c.v for c in cut]).astype(np.float64)
    seconds = np.concatenate([c.us for c in cut if c.us is not None]) / 1e6
    out.update(_joined(cut, start), summary=window_stats(values, seconds))
    return out


class HindsightFetches:
    """The spans asked of each node, and those fetched."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self._queues: dict[str, collections.deque[Fetch]] = {}
        self._by_id: dict[str, Fetch] = {}
        self._asks: dict[str, tuple[float, float]] = {}  # node -> (tokens, when)
        self._ids = itertools.count(1)
        self.held_bytes = 0  # the samples every span holds

    def ask(self, node: str, t_from: float, t_to: float, why: str, held_seconds: float | None) -> Fetch:
        """A new span of `node`'s samples, fetched in its turn. `held_seconds`:
        what the node said its ring holds (None: it keeps none). Refused when
        the node keeps nothing, or is asked too often, or memory is spent."""
        now = self.wall()
        self.sweep(now)
        t_from, t_to = round(t_from, 6), round(t_to, 6)  # as the wire writes them
        if held_seconds is None:
            raise Refused(f"{node} keeps no samples to fetch (its agent runs without --hindsight, or has not "
                          "said yet)")  # fmt: skip
        if not t_from < t_to or t_to - t_from > MAX_SPAN_S:
            raise Refused(f"a span is longer than 0 and at most {MAX_SPAN_S:.0f} s")
        queue = self._queues.setdefault(node, collections.deque())
        if len(queue) >= MAX_WAITING_PER_NODE:
            raise Refused(f"{MAX_WAITING_PER_NODE} spans of {node} are being fetched already")
        if self.held_bytes >= MAX_BYTES or len(self._by_id) >= MAX_SPANS:
            raise Refused(f"the spans held take the {MAX_BYTES >> 20} MiB, or are the {MAX_SPANS}, allowed: try again "
                          f"when some are older than {KEEP_S:.0f} s")  # fmt: skip
        if not self._may_ask(node, now):
            raise Refused(f"{node} is asked for a span more often than once each {ASK_EVERY_S:.0f} s")
        fetch = Fetch(f"{next(self._ids)}-{secrets.token_hex(4)}", node, t_from, t_to, why[:200], now)
        oldest = min(round(now - held_seconds, 6), t_to)
        if t_from < oldest:  # the part before the ring is missing from the start; the node is asked for the rest
            fetch._missing(t_from, oldest, "older than the node keeps (its --hindsight)")
            fetch.received_to = oldest
        self._by_id[fetch.id] = fetch
        if fetch.received_to >= t_to:  # all of it before the ring: nothing to ask
            fetch.finish(now)
            return fetch
        queue.append(fetch)
        log.info("hindsight: %.0f s of %s asked for (%s)", t_to - t_from, node, why[:200])
        return fetch

    def _may_ask(self, node: str, now: float) -> bool:
        tokens, then = self._asks.get(node, (float(ASK_BURST), now))
        tokens = min(float(ASK_BURST), tokens + (now - then) / ASK_EVERY_S)
        if len(self._asks) > 100_000:
            self._asks.clear()
        self._asks[node] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    def asked(self, node: str) -> SpanRequest | None:
        """The span a node's next heartbeats should carry pieces of (None: none)."""
        queue = self._queues.get(node)
        if not queue:
            return None
        now = self.wall()
        while queue:
            if queue[0].turn_at is None:
                queue[0].turn_at = now
            if now <= queue[0].deadline:
                break
            queue.popleft().finish(now)
        if not queue:
            del self._queues[node]
            return None
        return queue[0].request

    def received(self, node: str, piece: Json) -> None:
        """A checked piece of the span the node was asked for (wire/hindsight.py)."""
        queue = self._queues.get(node)
        if not queue or queue[0].id != piece["id"]:
            return
        fetch = queue[0]
        before = fetch.bytes
        fetch.add(piece, self.wall(), MAX_BYTES - self.held_bytes)
        self.held_bytes += fetch.bytes - before
        if piece["done"]:
            queue.popleft()
            fetch.finish(self.wall())
            if not queue:
                del self._queues[node]

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

    def forget(self, node: str) -> None:
        for fetch in self._queues.pop(node, ()):
            fetch.finish(self.wall())


HINDSIGHT = web.AppKey("hindsight", HindsightFetches)


# --- the pages' routes -------------------------------------------------------------

AROUND_S = 30.0  # "every sample around here": this long either side of the moment
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
    try:
        body = json.loads(await request.content.read(MAX_ASK_BODY))
        if "at" in body:
            at = float(body["at"])
            t_from, t_to = at - AROUND_S, at + AROUND_S
        else:
            t_from, t_to = float(body["from"]), float(body["to"])
        if not (math.isfinite(t_from) and math.isfinite(t_to)):
            raise ValueError("not finite")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise web.HTTPBadRequest(text=f"a span is {SPAN_BODY}, wall times: {e}\n") from None
    try:
        fetch = request.app[HINDSIGHT].ask(node, t_from, t_to, "asked for on the node page",
                                           state.hindsight_held_seconds())  # fmt: skip
    except Refused as e:
        raise web.HTTPTooManyRequests(text=f"{e}\n") from None
    return web.json_response({**fetch.describe(), "url": f"/api/hindsight/{fetch.id}"}, status=202)


async def read_span(request: web.Request) -> web.Response:
    """GET /api/hindsight/ID: the fetch's samples so far (`?view=windows`:
    an event a window, as the live view draws them)."""
    fetch = request.app[HINDSIGHT].get(request.match_info["id"])
    if fetch is None:
        raise web.HTTPNotFound(text=f"no such span (a finished one is kept {KEEP_S:.0f} s)\n")
    # Drawn on the page thread: an hour of a node's samples is a second of numpy and JSON.
    if request.query.get("view") == "windows":
        body = await request.app[PAGE_WORKER].run(lambda: json.dumps({**fetch.describe(),
                                                                       "windows": fetch.window_events()}))  # fmt: skip
    else:
        body = await request.app[PAGE_WORKER].run(lambda: json.dumps(fetch.samples()))
    return web.Response(text=body, content_type="application/json")


def add_routes(app: web.Application, fetches: HindsightFetches) -> None:
    app[HINDSIGHT] = fetches
    app.router.add_post("/api/nodes/{node}/hindsight", ask_span)
    app.router.add_get("/api/hindsight/{id}", read_span)
