"""The fleet as the control plane knows it: one entry per registered node,
kept in memory, with the node's last heartbeat and when it arrived.

Freshness is judged by the control plane's own receive time (a monotonic
clock), never by the node's clock: a node with a wrong clock is still fresh
if it keeps talking, and a silent node goes stale whatever it claimed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

import wire
from controlplane.state.starvation import StarvationRules, Verdict, judge_shards
from wire.schema import Heartbeat, Registration, Shard

Json = dict[str, Any]
MAX_FORGOTTEN = 60_000  # tombstones kept: a whole fleet forgotten at once (controlplane/fleet/peers.py's bound)
MAX_SHARDS_PER_NODE = 64  # engines of one node exported, charted and shown


class Received(msgspec.Struct, frozen=True, gc=False):
    """A node's heartbeat as the control plane holds it: as it came, and
    beside it what the control plane made of it. Replaced whole at each
    heartbeat, never edited: the page thread reads one while the loop takes
    the next (controlplane/listen/page_worker.py)."""

    heartbeat: Heartbeat
    # A node with more engines than `--max-shards` keeps its busiest: every
    # series of a node is bounded, whatever its agent sends.
    shards: tuple[Shard, ...]
    shards_left_out: int | None  # its agent's count and the registry's; None when neither left one out
    verdicts: tuple[Verdict | None, ...]  # one a kept shard: controlplane/state/starvation.py

    def as_json(self) -> Json:
        """As /api/nodes shows it: the heartbeat's JSON, its shards those
        kept, each with its verdict as `starved`."""
        out = wire.heartbeat_json(self.heartbeat)
        shards = []
        for shard, verdict in zip(self.shards, self.verdicts, strict=True):
            s = msgspec.to_builtins(shard)
            if verdict is not None:
                s["starved"] = verdict.as_json()
            shards.append(s)
        out["shards"] = shards
        if self.shards_left_out is not None:
            out["shards_left_out"] = self.shards_left_out
        return out


def received(heartbeat: Heartbeat, max_shards: int, rules: StarvationRules) -> Received:
    kept, left_out = wire.keep_busiest(heartbeat.shards, max_shards,
                                       lambda s: None if s.cpu_cores is None else s.cpu_cores.mean)  # fmt: skip
    shards = tuple(kept)
    total = (heartbeat.shards_left_out or 0) + left_out if left_out else heartbeat.shards_left_out
    return Received(heartbeat, shards, total, judge_shards(heartbeat, shards, rules))


class UnknownNode(KeyError):
    """A heartbeat for a node that has not registered (the control plane restarted)."""


@dataclass
class NodeState:
    node: str
    registration: Registration
    registered_at: float
    received: Received | None = None
    received_at: float | None = None  # monotonic
    heartbeats: int = 0
    last_seq: int | None = None  # the last heartbeat's since this registration: a replay is refused

    def hindsight_held_seconds(self) -> float | None:
        """How far back the node's agent keeps every sample (its --hindsight),
        as its last heartbeat said; None: it keeps none, or has not said."""
        return None if self.received is None else self.received.heartbeat.hindsight_held_seconds

    def age(self, now: float) -> float | None:
        """Seconds since the last measurement arrived; None before the first."""
        return None if self.received_at is None else now - self.received_at

    def fresh(self, now: float, stale_after: float) -> bool:
        """Its measurements are current: none after a restart (controlplane/state/registry_state.py)."""
        age = self.age(now)
        return self.received is not None and age is not None and age <= stale_after


class NodeRegistry:
    def __init__(self, stale_after: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 gone_after: float | None = None, starvation: StarvationRules | None = None,
                 max_shards: int = MAX_SHARDS_PER_NODE) -> None:  # fmt: skip
        self.stale_after = stale_after
        self.max_shards = max_shards
        self.starvation = starvation or StarvationRules()
        # A node silent this long is gone (decommissioned, renamed): forgotten. Long
        # (a week), so a node that is down alerts until someone sees to it.
        self.gone_after = gone_after if gone_after is not None else max(7 * 86400.0, 10 * stale_after)
        self.clock = clock
        self._nodes: dict[str, NodeState] = {}
        # Nodes forgotten (by an operator, or gone), and when (this clock): told to the peers in
        # their held lists, so a copy a replica kept (it was down, or cut off) is forgotten
        # too, and kept in the state file. Kept for `gone_after`: a copy older than that is
        # forgotten as gone anyway. Dropped when the node speaks again.
        self.forgotten: dict[str, float] = {}
        # One more each time the set of nodes or a registration changes (not per
        # heartbeat): a view shared for a second is not one that shows a forgotten node.
        self.generation = 0

    def forget_gone(self) -> list[str]:
        now = self.clock()
        gone = [n for n, s in self._nodes.items() if now - (s.received_at or s.registered_at) > self.gone_after]
        for node in gone:
            del self._nodes[node]
            self.remember_forgotten(node, now)
        self.generation += bool(gone)
        for node, at in list(self.forgotten.items()):
            if now - at > self.gone_after:
                del self.forgotten[node]
        return gone

    def forget(self, node: str) -> bool:
        """The node leaves this registry (moved to a peer: no tombstone; see `remember_forgotten`)."""
        gone = self._nodes.pop(node, None) is not None
        self.generation += gone
        return gone

    def remember_forgotten(self, node: str, at: float) -> None:
        """`node` was forgotten at `at` (this clock; at a peer, the moment it said): kept,
        the latest such moment, the oldest dropped first beyond MAX_FORGOTTEN."""
        if at > self.forgotten.get(node, -math.inf):
            self.forgotten.pop(node, None)
            self.forgotten[node] = at
        while len(self.forgotten) > MAX_FORGOTTEN:
            del self.forgotten[next(iter(self.forgotten))]

    def register(self, registration: Registration) -> NodeState:
        """(Re-)registration replaces what does not change; a heartbeat
        already received is kept until a newer one arrives."""
        node = registration.node
        old = self._nodes.get(node)
        state = NodeState(node, registration, self.clock())
        self.forgotten.pop(node, None)  # it speaks again: not forgotten
        if old is not None:
            state.received, state.received_at, state.heartbeats = old.received, old.received_at, old.heartbeats
        self._nodes[node] = state
        self.generation += 1
        return state

    def heartbeat(self, heartbeat: Heartbeat) -> NodeState:
        state = self._nodes.get(heartbeat.node)
        if state is None:
            raise UnknownNode(heartbeat.node)
        # Judged once, as it arrives: the exposition, history and pages read the verdicts.
        state.received = received(heartbeat, self.max_shards, self.starvation)
        state.received_at = self.clock()
        state.heartbeats += 1
        return state

    def get(self, node: str) -> NodeState | None:
        return self._nodes.get(node)

    def nodes(self) -> list[NodeState]:
        return sorted(self._nodes.values(), key=lambda s: s.node)

    def __len__(self) -> int:
        return len(self._nodes)
