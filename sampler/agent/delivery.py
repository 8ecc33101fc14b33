"""Between the sampling thread and the sender: the newest summary waiting
(an unreachable control plane costs old summaries, never memory), and the
backoff between tries."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from wire.schema import WindowSummary

BACKOFF_START_S = 1.0
BACKOFF_CAP_S = 30.0


class NewestSummary:
    """A one-slot mailbox: a new summary replaces one not yet sent."""

    def __init__(self) -> None:
        self._summary: WindowSummary | None = None
        self._ready = asyncio.Event()
        self.replaced = 0

    def put(self, summary: WindowSummary) -> None:
        if self._summary is not None:
            self.replaced += 1
        self._summary = summary
        self._ready.set()

    async def get(self) -> WindowSummary:
        await self._ready.wait()
        summary, self._summary = self._summary, None
        self._ready.clear()
        assert summary is not None
        return summary

    def newer(self) -> WindowSummary | None:
        """A summary that arrived while the last was being sent, if any."""
        if self._summary is None:
            return None
        summary, self._summary = self._summary, None
        self._ready.clear()
        return summary


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter over its upper half."""

    start: float = BACKOFF_START_S
    cap: float = BACKOFF_CAP_S
    failures: int = 0
    rand: Callable[[float, float], float] = random.uniform

    def next_delay(self) -> float:
        self.failures += 1
        top = min(self.cap, self.start * 2 ** (self.failures - 1))
        return self.rand(top / 2, top)

    def reset(self) -> int:
        failures, self.failures = self.failures, 0
        return failures
