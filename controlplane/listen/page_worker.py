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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from multidict import CIMultiDict

T = TypeVar("T")
PIECE = 64 * 1024  # aiohttp drains its buffer past 64 KiB
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


LANES = ("pages", "scrape")


@dataclass(frozen=True, slots=True)
class Answer:
    """A rendered answer, given to every request that shares it."""

    status: int
    headers: CIMultiDict[str]
    body: bytes

    async def send(self, request: web.Request) -> web.StreamResponse:
        """Written in pieces, each after the last has left aiohttp's buffer (its
        drain): a reader that does not read holds about one piece and the TLS
        layer's 64 KiB, not a copy of the whole answer (4 x 250 sockets that
        asked for a 1,000-node /api/nodes and read nothing held 2.5 GiB when
        each answer was written whole); the request's deadline ends its wait."""
        response = web.StreamResponse(status=self.status, headers=self.headers)
        response.content_length = len(self.body)
        await response.prepare(request)
        view = memoryview(self.body)
        for start in range(0, len(view), PIECE):
            await response.write(view[start : start + PIECE])
        await response.write_eof()
        return response


Key = tuple[str, str, tuple[tuple[str, tuple[str, ...]], ...]]


class SharedAnswers:
    """Requests for the same view (its path, and the query parameters it reads)
    share one render, in two ways:

    - a render is reused by the requests that arrive within `period_s` of its
      start, while the registry's nodes stay the same ones (a node registered
      or forgotten is seen at once; a node's figures may be up to the period
      old, against heartbeats seconds apart). Requests that come one after
      another (250 sockets an address, each asking for a 1,000-node
      `/api/nodes` of 4.7 MB and reading nothing) rendered one body each,
      held for the request deadline: 3.6 MiB a socket;
    - past that, a request that arrives while the view is being rendered
      waits for the render that starts after it (so it never gets figures
      older than the period), and every request waiting then shares that one.

    So a loop of clients costs one render a period and one body, not one
    each. At most two renders of a view run or wait (the one under way and
    the next), and a rendered answer is kept for its period alone. An error
    is each request's own: it is raised to the request that rendered, and
    the others render again alone."""

    def __init__(self, period_s: float = 0.0, generation: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.period_s, self._generation, self._clock = period_s, generation, clock
        self._running: dict[Key, asyncio.Task[Answer]] = {}
        self._next: dict[Key, asyncio.Task[Answer]] = {}
        self._recent: dict[Key, tuple[float, int, Answer]] = {}  # rendered from (start, generation)
        self.renders = 0

    def _reusable(self, key: Key) -> Answer | None:
        now, generation = self._clock(), self._generation()
        for k, (started, _, _) in list(self._recent.items()):
            if now - started >= self.period_s:
                del self._recent[k]
        kept = self._recent.get(key)
        return kept[2] if kept is not None and kept[1] == generation else None

    async def answer(self, request: web.Request, handler: Handler, params: tuple[str, ...] = ()) -> web.StreamResponse:
        key: Key = (request.method, request.path, tuple((p, tuple(request.query.getall(p, ()))) for p in params))
        if (kept := self._reusable(key)) is not None:
            return await kept.send(request)
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
            answer = await asyncio.shield(task)
        except _NotShared as e:
            if e.request is not request:  # another's error or stream: this request asks alone
                return await handler(request)
            if e.error is not None:
                raise e.error from None
            assert e.response is not None
            return e.response
        return await answer.send(request)

    async def _after(self, key: Key, running: asyncio.Task[Answer], request: web.Request,
                     handler: Handler) -> Answer:  # fmt: skip
        with contextlib.suppress(Exception, _NotShared):
            await asyncio.shield(running)
        self._running[key] = self._next.pop(key)
        return await self._render(key, request, handler)

    async def _render(self, key: Key, request: web.Request, handler: Handler) -> Answer:
        started, generation = self._clock(), self._generation()
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
            answer = Answer(response.status, headers, response.body)
            if self.period_s > 0:
                self._recent[key] = (started, generation, answer)
            return answer
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


def shared(*params: str) -> Callable[[Handler], Handler]:
    """A view whose answer requests share (SharedAnswers), on an app with a
    PageWorker; `params`: the query parameters it reads (others do not make
    another view: `?nocache=N` buys no render)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def view(request: web.Request) -> web.StreamResponse:
            return await request.app[PAGE_WORKER].answers.answer(request, handler, params)

        return view

    return decorate


class PageWorker:
    def __init__(self, answers: SharedAnswers | None = None) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self.answers = answers or SharedAnswers()

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
