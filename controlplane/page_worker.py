"""The thread that renders pages and /metrics, so heartbeats never wait for one.

A cluster page or a scrape of a thousand nodes is 100 ms or more of Python;
on the event loop it held every heartbeat arriving meanwhile (p99 130 ms at
1,000 nodes with a page and /metrics fetched every second). Rendered here,
the loop gets the interpreter back at each switch interval (5 ms) and
answers heartbeats between.

Two threads, one a lane: `/metrics` has a lane of its own, so that a loop
of page views (anonymous, cheap to ask for, 100 ms each to render) never
queues Prometheus' scrape behind it until it times out and NodeDown cannot
fire. In a lane renders are not run side by side (the exposition's label
cache is the scrape lane's alone, and the history's readers need no more),
and page views queue rather than multiply their memory. What a render reads, the loop may change
meanwhile: the registry replaces a node's heartbeat whole, never edits one,
and the embedded history is read under its lock.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


LANES = ("pages", "scrape")


class PageWorker:
    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}

    async def run(self, fn: Callable[..., T], *args: Any, lane: str = "pages") -> T:
        assert lane in LANES, lane
        executor = self._executors.get(lane)
        if executor is None:  # made on first use: an app may serve without starting (tests, bench)
            executor = self._executors[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=lane)
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        self._executors.clear()


PAGE_WORKER = web.AppKey("page_worker", PageWorker)


async def page_worker_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[PAGE_WORKER].close()
