"""Which control-plane replica holds this node: rendezvous (highest random
weight) hashing of the node's name over the replicas the agent is given.

Each replica's weight for a node is a hash of the pair; the node's order
is the replicas by weight, highest first, and it is held by the first in
that order that answers. Every agent computes the same order for its node
from the same list, without talking to anyone: adding a replica moves only
the nodes that rank it first (about 1/N of them), and losing one moves only
its own nodes, each to its next. The tokens are checked without state, so
any replica takes any node.

While the node's first choice does not answer, it is held by the next; the
agent tries its way back up every `return_every_s` (a minute at most) and
stays where a heartbeat is taken. A replica the node left soon after it
came back waits twice as long before the next try, up to `MAX_RETURN_S`:
a replica that comes and goes does not take its nodes with it each time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

MAX_RETURN_S = 600.0  # the longest a flapping replica waits for its nodes to try it again
SETTLED_S = 120.0  # a replica that held its node this long after a return is trusted again


def weight(node: str, replica: str) -> int:
    """The pair's weight: the same in every process (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{replica}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(node: str, replicas: Sequence[str]) -> list[str]:
    """The replicas in the node's order: highest weight first, ties by name."""
    return sorted(dict.fromkeys(replicas), key=lambda r: (-weight(node, r), r))


class ReplicaChoice:
    """The replica a node's heartbeats go to, and when to try a better one."""

    def __init__(self, node: str, replicas: Sequence[str], return_every_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not replicas:
            raise ValueError("no control-plane replicas")
        self.node = node
        self.order = ranked(node, replicas)
        self.return_every_s = return_every_s
        self.clock = clock
        self.current = 0  # the index in `order` heartbeats go to
        self._tried_back_at = clock()
        self._wait_s = return_every_s  # before the next try of a better replica
        self._returned_at: float | None = None  # when the node last came back up the order
        self.trying_back = False  # heartbeats go to the first choice again, none taken there yet

    @property
    def url(self) -> str:
        return self.order[self.current]

    def replace(self, replicas: Sequence[str]) -> None:
        """The replicas a DNS record names now (wire/discovery.py): heartbeats
        stay where they go if it is still named, and a replica added above it
        is tried as a first choice come back is (`worth_trying_back`)."""
        if not replicas:
            raise ValueError("no control-plane replicas")
        url, self.order = self.url, ranked(self.node, replicas)
        self.current = self.order.index(url) if url in self.order else 0
        if self.current:
            self._tried_back_at = self.clock()

    def failed(self) -> bool:
        """The current replica did not answer: the next in order, if any is
        left (True), else the first again, after the caller's backoff (False)."""
        now = self.clock()
        if self._returned_at is not None and now - self._returned_at < SETTLED_S:
            self._wait_s = min(MAX_RETURN_S, self._wait_s * 2)  # it went again soon after we came back
        self._returned_at = None
        self.trying_back = False
        if self.current + 1 < len(self.order):
            self.current += 1
            self._tried_back_at = now
            return True
        self.current = 0
        return False

    def worth_trying_back(self) -> bool:
        """Whether to send the next heartbeat to the node's first choice,
        the node being held by a later one and its wait being over."""
        if self.current == 0 or self.clock() - self._tried_back_at < self._wait_s:
            return False
        self._tried_back_at = self.clock()
        return True

    def back_to_first(self) -> int:
        """Heartbeats go to the first choice again; the index they came from."""
        came_from, self.current = self.current, 0
        self.trying_back = True
        return came_from

    def taken(self) -> None:
        """A heartbeat was taken by the current replica."""
        now = self.clock()
        if self.trying_back:  # back up the order
            self._returned_at = now
            self.trying_back = False
        elif self._returned_at is not None and now - self._returned_at >= SETTLED_S:
            self._returned_at = None
            self._wait_s = self.return_every_s  # it stayed: trusted again
