"""Fail loudly, recover alone: each way the agent could stop working without
saying so, injected, with its exit status, its one log line and its recovery."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.ingest import tokens
from nodesampler import cli
from sampler.agent import run as agent_module
from sampler.agent.run import Agent, AgentFailed
from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.sources.machine import MountProbe
from sampler.window.sampler import WindowSampler
from tests.fakeproc import FakeProc
from tests.heartbeats import window_summary
from wire.schema import Machine, WindowSummary

SECRET = b"a cluster secret of some length"


def make_agent(tmp_path: Path, url: str = "http://127.0.0.1:9/") -> Agent:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100)
    stopping = threading.Event()

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    sampler = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root), None, hz=20,
                            node="n1", sleep=sleep)  # fmt: skip
    return Agent(sampler, url, tokens.node_token(SECRET, "n1"), "n1", 0.5, stopping)  # the default rate: 2 a second


async def test_a_sampler_that_dies_at_its_first_step_ends_the_agent(tmp_path: Path, caplog: Any) -> None:
    agent = make_agent(tmp_path)

    def broken(seconds: float) -> None:
        raise RuntimeError("a bug in the first step")

    agent.sampler.prime = broken  # type: ignore[method-assign]
    with pytest.raises(AgentFailed, match="sampling thread died"):
        await asyncio.wait_for(agent.run(), 30)
    assert "a bug in the first step" in caplog.text and "Traceback" in caplog.text


async def test_three_failed_windows_in_a_row_end_the_agent_one_is_retried(tmp_path: Path, caplog: Any) -> None:
    agent = make_agent(tmp_path)
    run_window, calls = agent.sampler.run_window, 0

    def flaky(seconds: float) -> WindowSummary:
        nonlocal calls
        calls += 1
        if calls == 1 or calls >= 3:  # one failure, one good window, then failures for good
            raise OSError("a broken read")
        return run_window(seconds)

    agent.sampler.run_window = flaky  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING)
    with pytest.raises(AgentFailed):
        await asyncio.wait_for(agent.run(), 30)
    assert calls == 2 + agent_module.WINDOW_FAILURES_BEFORE_EXIT
    assert caplog.text.count("window failed") == 1 + agent_module.WINDOW_FAILURES_BEFORE_EXIT - 1


async def test_a_sender_that_dies_ends_the_agent(tmp_path: Path, caplog: Any, monkeypatch: Any) -> None:
    def broken(*args: Any) -> dict[str, Any]:
        raise TypeError("a bug in the sender")

    monkeypatch.setattr(agent_module, "registration_body", broken)
    with pytest.raises(AgentFailed, match="sender died"):
        await asyncio.wait_for(make_agent(tmp_path).run(), 30)
    assert "a bug in the sender" in caplog.text and "Traceback" in caplog.text


def test_the_command_exits_1_when_the_agent_fails(tmp_path: Path, monkeypatch: Any) -> None:
    async def fails(self: Agent) -> None:
        raise AgentFailed("the sampling thread died: RuntimeError()")

    monkeypatch.setattr(Agent, "run", fails)
    token = tmp_path / "token"
    token.write_text(tokens.node_token(SECRET, "n1"))
    code = cli.main(["agent", "--control-plane", "http://127.0.0.1:9", "--token-file", str(token), "--node", "n1",
                     "--backend", "proc"])  # fmt: skip
    assert code == 1


async def test_a_404_right_after_registering_backs_off(tmp_path: Path, caplog: Any) -> None:
    """A control plane that restarted answers 404 once: register again at once.
    One that answers 404 to every heartbeat (a proxy, a bug) gets backoff."""
    registrations = 0

    async def register(request: web.Request) -> web.Response:
        nonlocal registrations
        registrations += 1
        return web.json_response({"node": "n1", "stale_after": 60})

    async def heartbeat(request: web.Request) -> web.Response:
        return web.json_response({"error": "unknown node: register again"}, status=404)

    app = web.Application()
    app.router.add_post("/v1/register", register)
    app.router.add_post("/v1/heartbeat", heartbeat)
    server = TestServer(app)
    await server.start_server()
    agent = make_agent(tmp_path, str(server.make_url("/")))
    waits = _count_waits(agent, 5)
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(_deliver_once(agent), 30)
    finally:
        await server.close()
    assert registrations == len(waits) + 1  # the first 404: at once; every one after: after a wait
    assert waits == sorted(waits) and waits[-1] > waits[0]  # growing
    assert caplog.text.count("registering again") == 1


def _count_waits(agent: Agent, stop_after: int) -> list[float]:
    """The sender's waits, recorded instead of waited; the sender ends at the `stop_after`th."""
    waits: list[float] = []

    async def recorded(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) >= stop_after:
            raise asyncio.CancelledError

    agent.sleep = recorded
    return waits


async def _deliver_once(agent: Agent) -> None:
    agent.mailbox.put(window_summary())
    async with aiohttp.ClientSession() as session:
        await agent._deliver(agent.clients(session))


def test_a_hung_mount_is_said_once_skipped_and_taken_back(caplog: Any) -> None:
    release = threading.Event()
    calls: list[str] = []

    def statvfs(path: str) -> os.statvfs_result:
        calls.append(path)
        if path == "/hung":
            release.wait(60)
        return os.statvfs("/")

    probe = MountProbe(statvfs, deadline=2.0)
    caplog.set_level(logging.WARNING)
    assert probe.measure(["/", "/hung"]).keys() == {"/"}
    assert probe.measure(["/", "/hung"]).keys() == {"/"}  # still hung: not asked again, not waited for
    assert calls.count("/hung") == 1
    assert caplog.text.count("did not answer") == 1
    release.set()
    assert probe._waiting["/hung"].wait(30)  # the hung call returns: the event to await
    assert probe.measure(["/", "/hung"]).keys() == {"/", "/hung"}
    assert caplog.text.count("answers again") == 1


def test_registration_reads_no_disk_on_the_event_loop(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)

    def no_reads() -> dict[str, Any]:
        raise AssertionError("registration read the gauges")

    agent.sampler.gauges.read = no_reads  # type: ignore[method-assign]
    agent.sampler.last_gauges = Machine(cpus=2, memory_bytes=10, disks=())
    body = agent_module.registration_body(agent.sampler, "n1")
    assert body.cpus == 2 and body.memory_bytes == 10 and body.disks == ()



async def test_a_refusal_is_said_as_a_refusal_not_unreachable(tmp_path: Path, caplog: Any) -> None:
    from controlplane.ingest import agent_api
    from controlplane.state.registry import NodeRegistry

    server = TestServer(agent_api.create_app(NodeRegistry(60), b"another cluster's secret, long"))
    await server.start_server()
    agent = make_agent(tmp_path, str(server.make_url("/")))
    _count_waits(agent, 3)
    caplog.set_level(logging.WARNING)
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(_deliver_once(agent), 30)
    finally:
        await server.close()
    said = [r.message for r in caplog.records if "control plane" in r.message]
    assert len(said) == 1 and "refused the request" in said[0] and "401" in said[0], said


async def test_a_resent_window_the_control_plane_has_is_not_a_failure(tmp_path: Path, caplog: Any) -> None:
    """The answer to a heartbeat is lost and the agent sends it again: the
    real control plane refuses the replay (409), and the agent takes that for
    delivered: no warning, no backoff, the next window goes on."""
    from controlplane.ingest import agent_api
    from controlplane.keys import METRICS
    from controlplane.state.registry import NodeRegistry

    registry = NodeRegistry(60)
    server = TestServer(agent_api.create_app(registry, SECRET))
    await server.start_server()
    agent = make_agent(tmp_path, str(server.make_url("/")))
    waits = _count_waits(agent, 1)
    caplog.set_level(logging.DEBUG, logger="sampler.agent")

    def window(seq: int) -> WindowSummary:
        return window_summary(seq=seq)

    app = server.app
    assert app is not None

    async def replays(n: int) -> None:
        while app[METRICS].rejected.labels("heartbeat", "replay")._value.get() < n:
            await asyncio.sleep(0.01)

    async def heartbeats(n: int) -> None:
        while (state := registry.get("n1")) is None or state.heartbeats < n:
            await asyncio.sleep(0.01)

    try:
        async with aiohttp.ClientSession() as session:
            sender = asyncio.create_task(agent._deliver(agent.clients(session)))
            agent.mailbox.put(window(1))
            await asyncio.wait_for(heartbeats(1), 10)
            agent.mailbox.put(window(1))  # again: its answer was lost
            await asyncio.wait_for(replays(1), 10)
            agent.mailbox.put(window(2))
            await asyncio.wait_for(heartbeats(2), 10)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    finally:
        await server.close()
    state = registry.get("n1")
    assert state is not None and state.last_seq == 2 and waits == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
