"""The live view: every sample of a node while someone watches it.

A viewer opens `GET /node/NODE/live` (server-sent events) on the pages
listener. From then until a minute after the last viewer of that node left
(`linger_s`), the answer to each of the node's heartbeats asks for raw
samples, and the agent adds its next windows' samples to its heartbeats
(wire/raw.py): no new connection, no listener on the agent,
and nothing sent while nobody watches.

Each window's samples become one event, serialised once for all of the
node's viewers: its series (machine CPU, each shard's cores, each GPU's
utilisation) with the window's summary (mean, p95, max) beside them. The
last minute of events is kept per node (and at most `MAX_BYTES_PER_NODE`),
so a new viewer starts with a minute of samples. At most `max_nodes` nodes
are live at once (a node counts while its viewers' minute lingers); a viewer
beyond it gets a `refused` event saying so, and the stream ends.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from controlplane.keys import REGISTRY
from controlplane.listen.page_access import USER, VIEWER
from wire.raw import gpu_key, gpu_label
from wire.schema import Heartbeat, Stats

log = logging.getLogger(__name__)

LINGER_S = 60.0  # raw samples go on this long after the last viewer left
KEEP_S = 60.0  # the minute a new viewer starts with
MAX_BYTES_PER_NODE = 8 * 1024 * 1024  # about two minutes of 1000 Hz samples of the machine and four shards
MAX_VIEWERS_PER_NODE = 32
MAX_VIEWERS_PER_PEER = 4  # live views one user (else one address) may hold open: ten viewers from one
#                           client took every slot; a user's views from ten addresses count as one's
VIEWER_QUEUE = 4  # windows a viewer may fall behind; one more and it is let go (it would only see gaps)
BEHIND = ""  # what a viewer's queue says when it has been let go
KEEPALIVE_S = 15.0  # a comment on a quiet stream, so a viewer that left is found out
WRITE_TIMEOUT_S = 10.0  # a viewer that reads nothing for this long is let go


class LiveRefused(Exception):
    """Why a viewer cannot watch a node live now."""


@dataclass
class _LiveNode:
    viewers: set[asyncio.Queue[str]] = field(default_factory=set)
    left_at: float | None = None  # when its last viewer left
    events: collections.deque[tuple[float, str]] = field(default_factory=collections.deque)  # (window end, event)
    bytes: int = 0
    missed: int = 0  # events a slow viewer did not get


class LiveSamples:
    """Which nodes are watched live, and their last minute of samples."""

    def __init__(self, max_nodes: int = 10, linger_s: float = LINGER_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.max_nodes, self.linger_s, self.keep_s = max_nodes, linger_s, keep_s
        self.clock = clock
        self._nodes: dict[str, _LiveNode] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()

    def _live(self, state: _LiveNode, now: float) -> bool:
        return bool(state.viewers) or (state.left_at is not None and now - state.left_at < self.linger_s)

    def wanted(self, node: str) -> bool:
        """Whether the node's heartbeats should carry raw samples now."""
        state = self._nodes.get(node)
        if state is None:
            return False
        if self._live(state, self.clock()):
            return True
        del self._nodes[node]  # its minute is over: nothing kept
        return False

    def live_nodes(self) -> list[str]:
        return [node for node in list(self._nodes) if self.wanted(node)]

    def watch(self, node: str, peer: str | None = None) -> tuple[asyncio.Queue[str], list[str]]:
        """A new viewer of `node` (`peer`: its user, else its address): its queue
        of events to come, and the last minute's events to start with.
        LiveRefused when it may not watch. A viewer from `peer` must `leave` with it."""
        if peer is not None and self._per_peer[peer] >= MAX_VIEWERS_PER_PEER:
            raise LiveRefused(f"{MAX_VIEWERS_PER_PEER} live views are open for this user or address already")
        state = self._nodes.get(node)
        if state is None or not self.wanted(node):
            if len(self.live_nodes()) >= self.max_nodes:
                raise LiveRefused(f"{self.max_nodes} nodes are live already, the most this control plane allows "
                                  "(--max-live-nodes): try again when a live view has been closed for a minute")
            state = self._nodes[node] = _LiveNode()
        if len(state.viewers) >= MAX_VIEWERS_PER_NODE:
            raise LiveRefused(f"{MAX_VIEWERS_PER_NODE} viewers watch this node live already")
        queue: asyncio.Queue[str] = asyncio.Queue(VIEWER_QUEUE + 1)  # room for BEHIND
        state.viewers.add(queue)
        state.left_at = None
        if peer is not None:
            self._per_peer[peer] += 1
        return queue, [event for _, event in state.events]

    def leave(self, node: str, queue: asyncio.Queue[str], peer: str | None = None) -> None:
        if peer is not None:
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]
        state = self._nodes.get(node)
        if state is not None and queue in state.viewers:
            state.viewers.discard(queue)
            if not state.viewers:
                state.left_at = self.clock()

    def record(self, node: str, heartbeat: Heartbeat, raw: dict[str, Any]) -> None:
        """A heartbeat's raw samples (checked: wire/raw.py) as
        one event, kept and sent to the node's viewers."""
        state = self._nodes.get(node)
        if state is None or not self.wanted(node):
            return
        event = json.dumps(_event(heartbeat, raw), separators=(",", ":"))
        end = heartbeat.window.end
        state.events.append((end, event))
        state.bytes += len(event)
        while state.events and (state.events[0][0] <= end - self.keep_s or state.bytes > MAX_BYTES_PER_NODE):
            state.bytes -= len(state.events.popleft()[1])
        for queue in state.viewers:
            if queue.qsize() < VIEWER_QUEUE:
                queue.put_nowait(event)
            elif queue.qsize() == VIEWER_QUEUE:  # one window too many behind: let go, not fed gaps
                queue.put_nowait(BEHIND)
                state.missed += 1

    def describe(self, node: str) -> dict[str, Any] | None:
        """For /api/nodes: viewers, kept windows, and whether raw samples are asked for."""
        state = self._nodes.get(node)
        if state is None or not self.wanted(node):
            return None
        return {"viewers": len(state.viewers), "windows_kept": len(state.events), "bytes_kept": state.bytes,
                "windows_missed_by_slow_viewers": state.missed}  # fmt: skip


def _event(hb: Heartbeat, raw: dict[str, Any]) -> dict[str, Any]:
    """One window for the page: each series with its summary lines."""
    series: list[dict[str, Any]] = []
    if (cpu := (raw.get("machine") or {}).get("cpu_percent")) is not None:
        series.append({"key": "machine", "label": "machine CPU", "unit": "%", **cpu,
                       "summary": _stats(hb.machine.cpu_percent)})  # fmt: skip
    shards = {s.id: s for s in hb.shards}
    for s in raw.get("shards", []):
        shard = shards.get(s["id"])
        series.append({"key": f"shard:{s['id']}", "label": s["id"], "unit": "cores", **s["cpu_cores"],
                       "summary": None if shard is None else _stats(shard.cpu_cores)})  # fmt: skip
    gpus = {g.index: g for g in hb.gpus or ()}
    for g in raw.get("gpus", []):
        card = gpus.get(g["index"])
        for figure, points in g.items():
            if figure == "index":
                continue
            stem = figure.removesuffix("_percent")  # its summary: the card's mean, p95 and max fields of it
            summary = None
            if card is not None and getattr(card, figure) is not None:
                summary = {"mean": getattr(card, figure), "p95": getattr(card, f"{stem}_p95_percent"),
                           "max": getattr(card, f"{stem}_max_percent")}  # fmt: skip
            series.append({"key": gpu_key(g["index"], figure), "label": gpu_label(g["index"], figure), "unit": "%",
                           **points, "summary": summary})  # fmt: skip
    w = hb.window
    out = {"seq": hb.seq, "start": w.start, "end": w.end, "samples": w.samples, "series": series}
    if raw.get("shards_left_out"):
        out["shards_left_out"] = raw["shards_left_out"]
    return out


def _stats(stats: Stats | None) -> dict[str, float | None] | None:
    return None if stats is None else {"mean": stats.mean, "p95": stats.p95, "max": stats.max}


# --- the stream ------------------------------------------------------------------

LIVE = web.AppKey("live", LiveSamples)


def streams(handler: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
    """Marks a handler whose answer lasts as long as its reader: the request
    deadline stops once it has started (controlplane/listen/connection_limits.py)."""
    handler.streams = True  # type: ignore[attr-defined]
    return handler


async def _send(response: web.StreamResponse, text: str) -> None:
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await response.write(text.encode())


@streams
async def live_stream(request: web.Request) -> web.StreamResponse:
    """GET /node/NODE/live: `window` events as the node's heartbeats bring
    them (the last minute's first), or one `refused` event and the end."""
    node = request.match_info["node"]
    if request.app[REGISTRY].get(node) is None:
        raise web.HTTPNotFound(text="no such node\n")
    live = request.app[LIVE]
    user = request.get(USER)
    viewer = f"user {user}" if user is not None else request.get(VIEWER, request.remote)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})  # fmt: skip
    await response.prepare(request)
    try:
        queue, backlog = live.watch(node, viewer)
    except LiveRefused as e:
        await _send(response, f"event: refused\ndata: {json.dumps({'error': str(e)})}\n\n")
        return response
    log.info("live view of %s opened", node)
    try:
        await _send(response, "retry: 5000\n\n")
        for event in backlog:
            await _send(response, f"event: window\ndata: {event}\n\n")
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    event = await queue.get()
            except TimeoutError:
                await _send(response, ": still here\n\n")
                continue
            if event == BEHIND:
                await _send(response, f"event: behind\ndata: {json.dumps({'error': 'this viewer fell behind'})}\n\n")
                break
            await _send(response, f"event: window\ndata: {event}\n\n")
    except (ConnectionError, TimeoutError):
        pass  # the viewer left, or stopped reading
    finally:
        live.leave(node, queue, viewer)
        log.info("live view of %s closed", node)
    return response
