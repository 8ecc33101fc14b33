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
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from multidict import CIMultiDict

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


LANES = ("pages", "scrape")


@dataclass(frozen=True, slots=True)
class Answer:
    """A rendered answer, given to every request that shares it."""

    status: int
    headers: CIMultiDict[str]
    body: bytes

    def response(self) -> web.Response:
        return web.Response(status=self.status, headers=self.headers, body=self.body)


class SharedAnswers:
    """Requests for the same view (path and query) share one render: one that
    arrives while that view is being rendered waits for the render that starts
    after it (so it never gets figures older than itself), and every request
    waiting then shares that one. A loop of clients asking for a megabyte
    `/api/nodes` or cluster page costs one render at a time and one body per
    render, not one each; a client alone gets its own render as before. At
    most two renders of a view exist (the one under way and the next), and
    only while someone waits for them. An error is each request's own: it is
    raised to the request that rendered, and the others render again alone."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str, str], asyncio.Task[Answer]] = {}
        self._next: dict[tuple[str, str, str], asyncio.Task[Answer]] = {}
        self.renders = 0

    async def answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = (request.method, request.path, request.query_string)
        running, queued = self._running.get(key), self._next.get(key)
        if running is None:
            task = self._running[key] = asyncio.ensure_future(self._render(key, request, handler))
        elif queued is None:
            task = self._next[key] = asyncio.ensure_future(self._after(key, running, request, handler))
        else:
            task = queued
        if task is not queued and task is not running:  # new: its error is read even if its waiters all left
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            # Shielded: a client that leaves does not cancel the others' answer.
            return (await asyncio.shield(task)).response()
        except _NotShared as e:
            if e.request is not request:  # another's error or stream: this request asks alone
                return await handler(request)
            if e.error is not None:
                raise e.error from None
            assert e.response is not None
            return e.response

    async def _after(self, key: tuple[str, str, str], running: asyncio.Task[Answer], request: web.Request,
                     handler: Handler) -> Answer:  # fmt: skip
        with contextlib.suppress(Exception, _NotShared):
            await asyncio.shield(running)
        self._running[key] = self._next.pop(key)
        return await self._render(key, request, handler)

    async def _render(self, key: tuple[str, str, str], request: web.Request, handler: Handler) -> Answer:
        try:
            self.renders += 1
            try:
                response = await handler(request)
            except Exception as e:
                raise _NotShared(request, error=e) from None
            if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
                raise _NotShared(request, response=response)
            headers = CIMultiDict(response.headers)
            headers.popall("Content-Length", None)
            return Answer(response.status, headers, response.body)
        finally:
            if self._running.get(key) is asyncio.current_task():
                del self._running[key]


class _NotShared(Exception):
    """The render did not give an answer to share (an error, a stream): it is
    the rendering request's own, and each other request asks alone."""

    def __init__(self, request: web.Request, response: web.StreamResponse | None = None,
                 error: Exception | None = None) -> None:  # fmt: skip
        super().__init__()
        self.request, self.response, self.error = request, response, error


def shared(handler: Handler) -> Handler:
    """A view whose answer requests share (SharedAnswers), on an app with a PageWorker."""

    @functools.wraps(handler)
    async def view(request: web.Request) -> web.StreamResponse:
        return await request.app[PAGE_WORKER].answers.answer(request, handler)

    return view


class PageWorker:
    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self.answers = SharedAnswers()

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
