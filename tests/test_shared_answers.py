"""Requests for the same view share one render (controlplane/listen/page_worker.py):
a loop of clients costs one render at a time, never an answer older than
the request it answers."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from controlplane.listen.page_worker import PAGE_WORKER, Handler, PageWorker, SharedAnswers, shared

ARRIVED = web.AppKey("arrived", list[str])


def app_with(view: Any, answers: SharedAnswers | None = None) -> web.Application:
    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        request.app[ARRIVED].append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[count])
    app[PAGE_WORKER] = PageWorker(answers)
    app[ARRIVED] = []
    app.router.add_get("/view", shared("q")(view))
    return app


async def arrived(app: web.Application, n: int) -> None:
    """Until n requests have reached the view (each then joins a render at once, on the loop)."""
    while len(app[ARRIVED]) < n:
        await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_requests_during_a_render_share_the_next_one_and_none_is_older_than_itself(aiohttp_client: Any) -> None:
    version = [0]
    gates: list[asyncio.Event] = []

    async def view(request: web.Request) -> web.Response:
        seen = version[0]  # what the render reads, at its start
        gate = asyncio.Event()
        gates.append(gate)
        await gate.wait()
        return web.json_response({"seen": seen, "q": request.query.get("q")})

    app = app_with(view)
    client = await aiohttp_client(app)

    async def wait_for_renders(n: int) -> None:
        while len(gates) < n:
            await asyncio.sleep(0)  # the renders start on the loop; no clock involved

    first = asyncio.ensure_future(client.get("/view"))
    await wait_for_renders(1)
    version[0] = 1  # the state changes after the first render read it
    later = [asyncio.ensure_future(client.get("/view")) for _ in range(50)]
    other = asyncio.ensure_future(client.get("/view?q=x"))  # another view: its own render
    await arrived(app, 52)
    await wait_for_renders(2)
    assert len(gates) == 2  # the fifty wait for the render after the first, not fifty renders
    gates[0].set()
    await wait_for_renders(3)  # the next render starts once the first is done
    for g in gates:
        g.set()
    assert await (await first).json() == {"seen": 0, "q": None}
    bodies = [await (await r).json() for r in later]
    assert bodies == [{"seen": 1, "q": None}] * 50  # never the first render's (older than them)
    assert await (await other).json() == {"seen": 1, "q": "x"}
    assert app[PAGE_WORKER].answers.renders == 3
    # Alone, a request renders on its own, as before.
    gates.clear()
    alone = asyncio.ensure_future(client.get("/view"))
    await wait_for_renders(1)
    gates[0].set()
    assert (await alone).status == 200 and app[PAGE_WORKER].answers.renders == 4


async def test_an_error_is_the_rendering_requests_own(aiohttp_client: Any) -> None:
    calls: list[str] = []
    gate = asyncio.Event()

    async def view(request: web.Request) -> web.Response:
        calls.append(request.headers.get("X-Who", ""))
        if len(calls) == 1:
            await gate.wait()
            raise web.HTTPNotFound(text="gone\n")
        return web.Response(text="here\n")

    app = app_with(view)
    client = await aiohttp_client(app)
    first = asyncio.ensure_future(client.get("/view", headers={"X-Who": "a"}))
    while not calls:
        await asyncio.sleep(0)
    second = asyncio.ensure_future(client.get("/view", headers={"X-Who": "b"}))
    await arrived(app, 2)
    gate.set()
    a, b = await first, await second
    assert a.status == 404 and await a.text() == "gone\n"
    assert b.status == 200 and await b.text() == "here\n"


async def test_one_after_another_within_the_period_share_a_render_until_the_nodes_change(aiohttp_client: Any) -> None:
    """Requests one after another (none under way together) share the render
    of the period's start; a node registered or forgotten, or the period
    past, makes the next request render again. Parameters the view does not
    read make no other view."""
    now, generation, renders = [100.0], [7], [0]

    async def view(request: web.Request) -> web.Response:
        renders[0] += 1
        return web.Response(text=f"render {renders[0]} q={request.query.get('q')}")

    app = app_with(view, SharedAnswers(1.0, lambda: generation[0], lambda: now[0]))
    client = await aiohttp_client(app)

    async def get(path: str = "/view") -> str:
        r = await client.get(path)
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return str(await r.text())

    assert await get() == "render 1 q=None"
    now[0] += 0.5
    assert [await get("/view?nocache=" + str(i)) for i in range(3)] == ["render 1 q=None"] * 3
    assert await get("/view?q=a") == "render 2 q=a"  # a parameter it reads: another view
    generation[0] += 1  # a node registered or forgotten
    assert await get() == "render 3 q=None"
    now[0] += 0.99
    assert await get() == "render 3 q=None"
    now[0] += 0.02  # the period of render 3 is past
    assert await get() == "render 4 q=None"
