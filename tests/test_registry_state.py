"""The registry kept across control-plane restarts, and nodes forgotten only
when an operator says so or after a long silence."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import stat
from pathlib import Path
from typing import Any
from unittest import mock

import bcrypt
import pytest

import wire
from controlplane import pages_api, server
from controlplane.history.backends import ChartSpec, EmbeddedHistory
from controlplane.ingest import agent_api
from controlplane.listen.page_access import PageAccess
from controlplane.listen.web_config import ReloadingWebConfig
from controlplane.state.registry import NodeRegistry
from tests.test_controlplane_api import SECRET, auth, heartbeat, post, registration


def operator(tmp_path: Path) -> tuple[PageAccess, dict[str, str]]:
    """The pages' access with one user, `ops`, and the header that says so."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  ops: {bcrypt.hashpw(b'pw', bcrypt.gensalt(4)).decode()}\n")
    return PageAccess(ReloadingWebConfig(config)), basic("ops", "pw")


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def register(registry: NodeRegistry, node: str) -> None:
    registry.register(wire.decode_registration(json.dumps(registration(node)).encode()))


async def metrics(client: Any) -> str:
    r = await client.get("/metrics")
    assert r.status == 200
    text: str = await r.text()
    return text


async def test_a_restart_keeps_every_node_known_and_stale_until_it_speaks(aiohttp_client: Any, tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    before = NodeRegistry(stale_after=60)
    pages = await aiohttp_client(pages_api.create_app(before, state_file=path))
    register(before, "up-1")
    register(before, "down-2")  # registered, never heartbeat: down since
    before.heartbeat(wire.decode_heartbeat(json.dumps(heartbeat("up-1")).encode()).heartbeat)
    await pages.close()  # the control plane stops: the state is written
    assert not (tmp_path / "registry.json.tmp").exists()

    after = NodeRegistry(stale_after=60)
    pages = await aiohttp_client(pages_api.create_app(after, state_file=path))
    agents = await aiohttp_client(agent_api.create_app(after, SECRET))
    text = await metrics(pages)
    # Both known, neither fresh: their measurements are not current after a restart.
    assert 'llmgw_node_up{node="up-1"} 0\n' in text and 'llmgw_node_up{node="down-2"} 0\n' in text
    assert 'llmgw_node_info{node="down-2",hostname="gpu-17.example"' in text
    assert "llmgw_node_cpus{" not in text
    listed = {n["node"]: n for n in (await (await pages.get("/api/nodes")).json())["nodes"]}
    assert listed["up-1"]["heartbeats"] == 1 and listed["up-1"]["sample_age_seconds"] >= 0
    assert listed["down-2"]["sample_age_seconds"] is None and listed["down-2"]["state"] == "stale"
    # The agent goes on heartbeating, without registering again: fresh at once.
    status, _ = await post(agents, "/v1/heartbeat", heartbeat("up-1"), auth("up-1"))
    assert status == 200
    assert 'llmgw_node_up{node="up-1"} 1\n' in await metrics(pages)


@pytest.mark.parametrize("body", [b"{not json", b'{"version": 99, "nodes": []}', b"[]", b"\xff\xfe"])
async def test_a_state_file_that_cannot_be_read_is_set_aside(aiohttp_client: Any, tmp_path: Path, body: bytes,
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "registry.json"
    path.write_bytes(body)
    registry = NodeRegistry(stale_after=60)
    with caplog.at_level(logging.ERROR):
        pages = await aiohttp_client(pages_api.create_app(registry, state_file=path))
    assert len(registry) == 0
    assert (tmp_path / "registry.json.bad").read_bytes() == body
    assert any("cannot be read" in r.getMessage() and "set aside" in r.getMessage() for r in caplog.records)
    register(registry, "n1")
    await pages.close()
    assert [n["registration"]["node"] for n in json.loads(path.read_bytes())["nodes"]] == ["n1"]


async def test_the_state_file_is_private_and_follows_no_link(aiohttp_client: Any, tmp_path: Path) -> None:
    """0600, written through a temporary name of its own (O_EXCL|O_NOFOLLOW): a
    link planted at the old fixed `.tmp` name, or at the state file itself,
    makes the control plane neither read nor write what it points to."""
    victim = tmp_path / "victim"
    victim.write_text('{"version": 1, "nodes": [{"registration": {"node": "planted"}}]}')
    path = tmp_path / "registry.json"
    (tmp_path / "registry.json.tmp").symlink_to(victim)
    path.symlink_to(victim)
    registry = NodeRegistry(stale_after=60)
    pages = await aiohttp_client(pages_api.create_app(registry, state_file=path))
    assert len(registry) == 0  # the link was not read
    register(registry, "n1")
    await pages.close()
    assert victim.read_text().count("planted") == 1 and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [n["registration"]["node"] for n in json.loads(path.read_bytes())["nodes"]] == ["n1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["registry.json", "registry.json.bad", "registry.json.tmp",
                                                          "victim"]  # fmt: skip


async def test_a_bad_entry_is_left_out_alone(aiohttp_client: Any, tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    good = {"registration": {"node": "n1"}, "last_heartbeat": 1.7e9, "heartbeats": 3}
    bad = [{"registration": {"node": "\x1b[31mred"}}, {"registration": {"node": "n2"}, "heartbeats": -1},
           {"registration": {"node": "n3"}, "last_heartbeat": "yesterday"}, {"nothing": 1}, "n4"]  # fmt: skip
    path.write_text(json.dumps({"version": 1, "nodes": [*bad, good]}))
    registry = NodeRegistry(stale_after=60)
    await aiohttp_client(pages_api.create_app(registry, state_file=path))
    assert [s.node for s in registry.nodes()] == ["n1"]
    state = registry.get("n1")
    assert state is not None and state.heartbeats == 3 and not state.fresh(registry.clock(), 60)


async def test_an_operator_forgets_a_node_a_loopback_peer_does_not(aiohttp_client: Any, tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    registry = NodeRegistry(stale_after=60)
    history = EmbeddedHistory(interval=5)
    access, ops = operator(tmp_path)
    app = pages_api.create_app(registry, history=history, state_file=path, access=access)
    pages = await aiohttp_client(app)
    for node in ("gone-1", "kept-2"):
        register(registry, node)
        state = registry.heartbeat(wire.decode_heartbeat(json.dumps(heartbeat(node)).encode()).heartbeat)
        assert state.received is not None
        history.record(node, state.received)

    # From loopback (a sidecar, a port-forward) without a user: refused, nothing changes.
    assert (await pages.delete("/api/nodes/gone-1")).status == 401
    assert (await pages.delete("/api/nodes/gone-1", headers=basic("ops", "guess"))).status == 401
    assert registry.get("gone-1") is not None

    # Heard from within --stale-after: refused, saying when, unless forced.
    r = await pages.delete("/api/nodes/gone-1", headers=ops)
    assert r.status == 409 and "gone-1 last heartbeat 0 s ago, within --stale-after (60 s)" in await r.text()
    assert registry.get("gone-1") is not None
    r = await pages.delete("/api/nodes/gone-1?force=1", headers=ops)
    assert r.status == 200 and await r.json() == {"forgotten": "gone-1"}
    assert (await pages.delete("/api/nodes/gone-1", headers=ops)).status == 404
    text = (await (await pages.get("/metrics", headers=ops)).text())
    assert 'node="gone-1"' not in text and 'llmgw_node_up{node="kept-2"} 1\n' in text
    assert history.query_now(ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "gone-1"),)), 0, 1e10, 1) == []
    # Written at once: a restart does not bring it back.
    assert [n["registration"]["node"] for n in json.loads(path.read_bytes())["nodes"]] == ["kept-2"]


async def test_without_users_no_client_of_the_pages_listener_forgets(aiohttp_client: Any) -> None:
    registry = NodeRegistry(stale_after=60)
    pages = await aiohttp_client(pages_api.create_app(registry, access=PageAccess()))
    register(registry, "n1")
    r = await pages.delete("/api/nodes/n1")
    assert r.status == 403 and "nodesampler forget" in await r.text()
    assert registry.get("n1") is not None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.2"])
def test_loopback_addresses(host: str) -> None:
    assert server.is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "::ffff:10.0.0.1", "localhost.example", "", "fe80::1"])
def test_other_addresses(host: str) -> None:
    assert not server.is_loopback(host)


def test_a_silent_node_stays_known_for_a_week_by_default() -> None:
    clock = mock.Mock(return_value=1000.0)
    registry = NodeRegistry(stale_after=60, clock=clock)
    register(registry, "n1")
    clock.return_value = 1000.0 + 6 * 86400
    assert registry.forget_gone() == [] and registry.get("n1") is not None
    clock.return_value = 1000.0 + 7 * 86400 + 1
    assert registry.forget_gone() == ["n1"]


async def test_saves_take_turns_and_the_last_state_is_what_stays(aiohttp_client: Any, tmp_path: Path) -> None:
    """The period's save, DELETEs' and the exit's, all at once: never two
    writers of `PATH.tmp`, and the file ends as the registry ends (a node
    forgotten meanwhile does not come back)."""
    from controlplane.state import registry_state

    path = tmp_path / "registry.json"
    registry = NodeRegistry(stale_after=60)
    for i in range(200):
        register(registry, f"n-{i}")
    access, ops = operator(tmp_path)
    app = pages_api.create_app(registry, state_file=path, access=access)
    pages = await aiohttp_client(app)
    writing, overlaps = [0], [0]
    real_write = registry_state.write

    def write(p: Path, body: bytes) -> None:
        writing[0] += 1
        overlaps[0] += writing[0] > 1
        try:
            real_write(p, body)
        finally:
            writing[0] -= 1

    with mock.patch.object(registry_state, "write", write):
        for i in range(0, 200, 10):
            registry.forget(f"n-{i}")
            deletes = [pages.delete(f"/api/nodes/n-{j}", headers=ops) for j in range(i + 1, i + 4)]
            await asyncio.gather(registry_state.save(app), *deletes, registry_state.save(app))
        await pages.close()  # the exit's save
    assert overlaps[0] == 0
    kept = {n["registration"]["node"] for n in json.loads(path.read_text())["nodes"]}
    assert kept == {n.registration.node for n in registry.nodes()} and len(kept) == 120
