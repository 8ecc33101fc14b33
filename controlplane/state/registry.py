"""The fleet as the control plane knows it: one entry per registered node,
kept in memory, with the node's last heartbeat and when it arrived.

Freshness is judged by the control plane's own receive time (a monotonic
clock), never by the node's clock: a node with a wrong clock is still fresh
if it keeps talking, and a silent node goes stale whatever it claimed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controlplane.state.starvation import StarvationRules, judge_heartbeat

Json = dict[str, Any]
MAX_SHARDS_PER_NODE = 64  # engines of one node exported, charted and shown


def _keep_busiest_shards(heartbeat: Json, most: int) -> None:
    """A node with more engines than the cap keeps its busiest (by cores), and
    counts the rest with those its agent already left out: every series of a
    node is bounded, whatever its agent sends."""
    shards = heartbeat.get("shards") or []
    if len(shards) > most:
        busiest = sorted(shards, key=lambda s: -((s.get("cpu_cores") or {}).get("mean") or 0.0))
        heartbeat["shards"] = busiest[:most]
        heartbeat["shards_left_out"] = heartbeat.get("shards_left_out", 0) + len(shards) - most


class UnknownNode(KeyError):
    """A heartbeat for a node that has not registered (the control plane restarted)."""


@dataclass
class NodeState:
    node: str
    registration: Json
    registered_at: float
    heartbeat: Json | None = None
    received_at: float | None = None  # monotonic
    heartbeats: int = 0
    last_seq: int | None = None  # the last heartbeat's since this registration: a replay is refused

    def age(self, now: float) -> float | None:
        """Seconds since the last measurement arrived; None before the first."""
        return None if self.received_at is None else now - self.received_at

    def fresh(self, now: float, stale_after: float) -> bool:
        """Its measurements are current: none after a restart (controlplane/state/registry_state.py)."""
        age = self.age(now)
        return self.heartbeat is not None and age is not None and age <= stale_after


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
        # One more each time the set of nodes or a registration changes (not per
        # heartbeat): a view shared for a second is not one that shows a forgotten node.
        self.generation = 0

    def forget_gone(self) -> list[str]:
        now = self.clock()
        gone = [n for n, s in self._nodes.items() if now - (s.received_at or s.registered_at) > self.gone_after]
        for node in gone:
            del self._nodes[node]
        self.generation += bool(gone)
        return gone

    def forget(self, node: str) -> bool:
        gone = self._nodes.pop(node, None) is not None
        self.generation += gone
        return gone

    def register(self, registration: Json) -> NodeState:
        """(Re-)registration replaces what does not change; a heartbeat
        already received is kept until a newer one arrives."""
        node = registration["node"]
        old = self._nodes.get(node)
        state = NodeState(node, registration, self.clock())
        if old is not None:
            state.heartbeat, state.received_at, state.heartbeats = old.heartbeat, old.received_at, old.heartbeats
        self._nodes[node] = state
        self.generation += 1
        return state

    def heartbeat(self, heartbeat: Json) -> NodeState:
        state = self._nodes.get(heartbeat["node"])
        if state is None:
            raise UnknownNode(heartbeat["node"])
        _keep_busiest_shards(heartbeat, self.max_shards)
        judge_heartbeat(heartbeat, self.starvation)  # once, as it arrives: the exposition and pages read it
        state.heartbeat = heartbeat
        state.received_at = self.clock()
        state.heartbeats += 1
        return state

    def get(self, node: str) -> NodeState | None:
        return self._nodes.get(node)

    def nodes(self) -> list[NodeState]:
        return sorted(self._nodes.values(), key=lambda s: s.node)

    def __len__(self) -> int:
        return len(self._nodes)
