"""The thread that renders pages and /metrics, so heartbeats never wait for one.

A cluster page or a scrape of a thousand nodes is 100 ms or more of Python;
on the event loop it held every heartbeat arriving meanwhile (p99 130 ms at
1,000 nodes with a page and /metrics fetched every second). Rendered here,
the loop gets the interpreter back at each switch interval (5 ms) and
answers heartbeats between.

One thread: renders are not run side by side (the exposition's label cache
and the history's readers need no more than that), and page views queue
rather than multiply their memory. What a render reads, the loop may change
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


class PageWorker:
    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:  # made on first use: an app may serve without starting (tests, bench)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pages")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


PAGE_WORKER = web.AppKey("page_worker", PageWorker)


async def page_worker_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[PAGE_WORKER].close()
