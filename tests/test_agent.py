"""The agent: its config, its mailbox and backoff, and its delivery against a
real control-plane app on loopback (not a patched aiohttp)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from controlplane.ingest import agent_api, tokens
from controlplane.state.registry import NodeRegistry
from sampler.agent.config import ConfigError, ConfigFile, parse_config
from sampler.agent.delivery import Backoff, NewestSummary
from sampler.agent.run import Agent
from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.window.sampler import WindowSampler
from tests.fakeproc import FakeProc
from tests.heartbeats import window_summary
from wire.schema import Heartbeat, Registration

SECRET = b"a cluster secret of some length"

CONFIG = b"""
[[shard]]
id = "s0"
model = "llama-70b"
replica = "r1"
select = "cmdline:vllm serve .*llama-70b"

[[shard]]
id = "s1"
select = "pgid:42"
"""


def test_config_parses() -> None:
    s0, s1 = parse_config(CONFIG)
    assert (s0.id, s0.model, s0.replica) == ("s0", "llama-70b", "r1")
    assert str(s0.selector) == "cmdline:vllm serve .*llama-70b"
    assert (s1.id, s1.model, s1.replica) == ("s1", None, None)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b"[[shard]\n", "Expected"),
        (b'[[shard]]\nid = "a"\n', "select"),
        (b'[[shard]]\nid = "a"\nselect = "pgid:x"\n', "positive integer"),
        (b'[[shard]]\nid = "a\\u0007"\nselect = "pgid:1"\n', "printable"),
        (b'[[shard]]\nid = "a"\nselect = "pgid:1"\n[[shard]]\nid = "a"\nselect = "pgid:2"\n', "unique"),
        (b'shard = "no"\n', "list"),
        # Unknown tables and keys: refused with the line and the nearest known name.
        (b'[[shards]]\nid = "a"\nselect = "pgid:1"\n',
         r"line 1: unknown table or key 'shards' \(did you mean 'shard'\?\)"),
        (b'[[shard]]\nid = "a"\nselect = "pgid:1"\n\n[[shard]]\nid = "b"\nselect = "pgid:2"\nmodle = "x"\n',
         r"shard 2: line 8: unknown key 'modle' \(did you mean 'model'\?\)"),
        (b'[[shard]]\nid = "a"\nselect = "pgid:1"\nmetrics-url = "http://h/m"\n',
         r"line 4: unknown key 'metrics-url' \(did you mean 'metrics_url'\?\)"),
        (b'interval = 5\n', r"unknown table or key 'interval' \(known: shard\)"),
    ],
)
def test_bad_config_says_why(text: bytes, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_config(text)


def test_config_change_is_picked_up_and_a_bad_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(CONFIG)
    cfg = ConfigFile(path)
    assert not cfg.changed()  # unchanged
    path.write_bytes(b'[[shard]]\nid = "only"\nselect = "pid:1"\n')
    os.utime(path, ns=(1, 1))  # a distinct stamp whatever the filesystem's time resolution
    assert cfg.changed()
    assert cfg.specs is not None and [w.id for w in cfg.specs] == ["only"]
    path.write_bytes(b"[[shard]\n")
    os.utime(path, ns=(2, 2))
    assert not cfg.changed()
    assert [w.id for w in cfg.specs] == ["only"]


def test_a_reload_naming_an_unknown_key_is_refused_said_once_and_the_last_good_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "agent.toml"
    path.write_bytes(b'[[shard]]\nid = "only"\nselect = "pid:1"\n')
    cfg = ConfigFile(path)
    path.write_bytes(b'[[shard]]\nid = "only"\nselect = "pid:1"\nmodle = "llama"\n')
    os.utime(path, ns=(3, 3))
    with caplog.at_level(logging.ERROR):
        assert not cfg.changed()
        assert not cfg.changed()  # the same file: not said again
    assert cfg.specs is not None and [(w.id, w.model) for w in cfg.specs] == [("only", None)]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "keeping 1 shards" in said[0] and "did you mean 'model'" in said[0]


async def test_mailbox_keeps_only_the_newest() -> None:
    box = NewestSummary()
    for seq in range(1000):
        box.put(window_summary(seq=seq))
    assert (await box.get()).seq == 999
    assert box.replaced == 999
    assert box.newer() is None


def test_backoff_is_capped_and_jittered() -> None:
    b = Backoff(start=1.0, cap=30.0)
    delays = [b.next_delay() for _ in range(20)]
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0
    assert all(15.0 <= d <= 30.0 for d in delays[6:])
    assert len(set(delays)) > 1
    assert b.reset() == 20 and b.failures == 0


class Watched(NodeRegistry):
    """A registry that tells the test when it is written to."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def register(self, registration: Registration) -> Any:
        self.changed.set()
        return super().register(registration)

    def heartbeat(self, heartbeat: Heartbeat) -> Any:
        state = super().heartbeat(heartbeat)
        self.changed.set()
        return state


async def until(registry: Watched, done: Any) -> None:
    async def wait() -> None:
        while not done():
            registry.changed.clear()
            await registry.changed.wait()

    await asyncio.wait_for(wait(), timeout=30)


async def test_agent_registers_heartbeats_and_registers_again_after_a_restart(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100)
    registry = Watched()
    server = TestServer(agent_api.create_app(registry, SECRET))
    await server.start_server()
    stopping = threading.Event()

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    sampler = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root), None, hz=20,
                            node="n1", sleep=sleep)  # fmt: skip
    agent = Agent(sampler, str(server.make_url("/")), tokens.node_token(SECRET, "n1"), "n1", 0.2, stopping)
    run = asyncio.create_task(agent.run())
    try:
        await until(registry, lambda: (s := registry.get("n1")) is not None and s.heartbeats >= 2)
        # The control plane restarts: it forgets every node.
        registry._nodes.clear()
        await until(registry, lambda: (s := registry.get("n1")) is not None and s.heartbeats >= 1)
        state = registry.get("n1")
        assert state is not None and state.registration.backend == "proc"
    finally:
        stopping.set()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await server.close()


async def test_an_interval_shorter_than_the_control_plane_takes_is_lengthened_and_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """`--interval 0.2` against a control plane taking 2 heartbeats a second
    met 429 after 429 (an endless unreachable / reachable-again log): the
    agent learns the rate at registration and its windows fit it."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100)
    registry = Watched()
    server = TestServer(agent_api.create_app(registry, SECRET, heartbeat_rate=2))
    await server.start_server()
    stopping = threading.Event()

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    sampler = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root), None, hz=10,
                            node="n1", sleep=sleep)  # fmt: skip
    agent = Agent(sampler, str(server.make_url("/")), tokens.node_token(SECRET, "n1"), "n1", 0.2, stopping)
    run = asyncio.create_task(agent.run())
    try:
        with caplog.at_level(logging.INFO):
            await until(registry, lambda: (s := registry.get("n1")) is not None and s.heartbeats >= 4)
        state = registry.get("n1")
        assert state is not None and state.received is not None
        assert agent.interval == 0.5
        window = state.received.heartbeat.window
        assert window.end - window.start == pytest.approx(0.5, abs=0.1)  # a window after the first
        said = [r.getMessage() for r in caplog.records if "heartbeats a second" in r.getMessage()]
        assert said == ["the control plane takes at most 2 heartbeats a second from a node: windows of 0.5 s, "
                        "not --interval 0.2 (its --max-heartbeats-per-second)"]
        assert not [r for r in caplog.records if "refused" in r.getMessage() or "unreachable" in r.getMessage()]
    finally:
        stopping.set()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await server.close()
