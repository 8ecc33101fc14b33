"""The agent API and the registry, through real HTTP on loopback
(aiohttp's test server): authentication, validation, and that a rejected
request changes nothing."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import threading
from typing import Any, TypeAlias

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wire
from controlplane import pages_api
from controlplane.export.exposition import FleetExposition
from controlplane.history.backends import EmbeddedHistory
from controlplane.ingest import agent_api, tokens
from controlplane.ingest.node_identity import JwksSource, NodeAuthenticator, ServiceAccountRules, ServiceAccountVerifier
from controlplane.keys import METRICS
from controlplane.samples.live import LiveSamples
from controlplane.state.registry import NodeRegistry, UnknownNode
from tests.fakeproc import FakeClock
from tests.issuer import ISSUER, TestIssuer
from web import pages
from wire.schema import Registration

Client: TypeAlias = "TestClient[web.Request, web.Application]"

SECRET = b"a cluster secret of some length"


def heartbeat(node: str = "gpu-17", seq: int = 1) -> dict[str, Any]:
    return {
        "node": node, "seq": seq, "backend": "bpf", "backend_reason": None,
        "window": {"start": 1764445200.0, "end": 1764445205.0, "samples": 50},
        "machine": {"cpus": 64, "cpu_percent": {"mean": 37.5, "p95": 80.1, "max": 100.0},
                    "load": {"1m": 0.5, "5m": 0.4, "15m": 0.3},
                    "memory_bytes": 1000, "memory_used_bytes": 600, "memory_available_bytes": 400,
                    "disks": [{"mount": "/", "bytes": 100, "used_bytes": 50}],
                    "pressure": {"cpu": {"some": 0.02, "full": 0.0}}},
        "shards": [{"id": "s0", "model": "llama-70b <b>", "replica": "r1", "pgid": 1234, "pgids": [1234],
                    "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}, "memory_bytes": 10,
                    "gpu_memory_bytes": 20}],
        "gpus": [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "utilization_percent": 97.0,
                  "memory_used_bytes": 1, "memory_total_bytes": 2, "temperature_celsius": 61,
                  "power_watts": 512.3, "energy_joules": 123456.7, "ecc_uncorrected": 0},
                 {"index": 1, "uuid": "GPU-2", "lost": True}],
    }  # fmt: skip


def registration(node: str = "gpu-17") -> dict[str, Any]:
    return {"node": node, "hostname": "gpu-17.example", "kernel": "6.1.0", "agent_version": "0.1.0",
            "backend": "bpf", "cpus": 64, "memory_bytes": 1000,
            "gpus": [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "memory_total_bytes": 2}]}  # fmt: skip


def auth(node: str = "gpu-17") -> dict[str, str]:
    return {"Authorization": f"Bearer {tokens.node_token(SECRET, node)}"}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> NodeRegistry:
    return NodeRegistry(stale_after=60, clock=clock)


@pytest.fixture
async def agents(aiohttp_client: Any, registry: NodeRegistry) -> Client:
    client: Client = await aiohttp_client(agent_api.create_app(registry, SECRET))
    return client


async def post(client: Client, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(path, data=data, headers=auth() if headers is None else headers)
    return r.status, await r.json()


async def test_register_then_heartbeat(agents: Client, registry: NodeRegistry) -> None:
    assert await post(agents, "/v1/register", registration()) == (200, {"node": "gpu-17", "stale_after": 60,
                                                                      "max_heartbeats_per_second": 2})
    status, _ = await post(agents, "/v1/heartbeat", heartbeat())
    assert status == 200
    state = registry.get("gpu-17")
    assert state is not None and state.heartbeats == 1
    assert state.received is not None and state.received.heartbeat.shards[0].model == "llama-70b <b>"  # kept as given


async def test_heartbeat_from_an_unknown_node_is_404(agents: Client, registry: NodeRegistry) -> None:
    status, body = await post(agents, "/v1/heartbeat", heartbeat())
    assert status == 404 and "register" in body["error"]
    assert len(registry) == 0


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Basic abc"}, 401),
        ({"Authorization": "Bearer "}, 401),
        ({"Authorization": "Bearer gpu-17.0000"}, 401),
        ({"Authorization": "Bearer " + tokens.node_token(b"another cluster's secret!", "gpu-17")}, 401),
        ({"Authorization": "Bearer " + tokens.node_token(SECRET, "gpu-18")}, 403),  # speaks for another node
    ],
)
async def test_tokens(agents: Client, registry: NodeRegistry, headers: dict[str, str], status: int) -> None:
    got, _ = await post(agents, "/v1/register", registration(), headers)
    assert got == status
    assert len(registry) == 0


def test_token_names_one_node() -> None:
    t = tokens.node_token(SECRET, "n1")
    assert tokens.verify(SECRET, t) == "n1"
    assert tokens.verify(SECRET, t.replace("n1.", "n2.")) is None
    assert tokens.verify(SECRET, t[:-1] + ("0" if t[-1] != "0" else "1")) is None


BAD_HEARTBEATS: list[tuple[str, Any]] = [
    ("node", "../etc"), ("node", "a b"), ("node", ""), ("node", "x" * 300), ("node", 5),
    ("seq", -1), ("seq", 1.5), ("seq", True), ("backend", "ebpf"),
    ("window.start", "yesterday"), ("window.end", 1.0),  # before the start
    ("machine.cpus", 0), ("machine.memory_bytes", -5), ("machine.load.1m", -1.0),
    ("machine.cpu_percent.mean", 150.0), ("machine.disks", [{"mount": "/", "bytes": 1}] * 200),
    ("shards", [{"id": f"s{i}"} for i in range(10_000)]), ("gpus", [{"index": 0}] * 65), ("shards", {"id": "s"}),
]  # fmt: skip

# One bad entry of a list costs that entry alone.
BAD_ITEMS: list[tuple[str, Any]] = [
    ("shards[0].id", "tab\there"), ("shards[0].model", "x" * 129), ("shards[0].model", "\x1b[31mred"),
    ("shards[0].cpu_cores.max", -0.1), ("shards[0]", "not an object"),
    ("gpus[0].temperature_celsius", 1e9), ("gpus[0].lost", "yes"), ("machine.disks[0].mount", "a\nb"),
]  # fmt: skip


def with_field(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    parts = path.replace("[", ".").replace("]", "").split(".")
    target: Any = body
    for p in parts[:-1]:
        target = target[int(p)] if p.isdigit() else target[p]
    last = parts[-1]
    if last.isdigit():
        target[int(last)] = value
    else:
        target[last] = value
    return body


@pytest.mark.parametrize(("path", "value"), BAD_HEARTBEATS)
async def test_bad_field_is_400_naming_it_and_changes_nothing(
    agents: Client, registry: NodeRegistry, path: str, value: Any
) -> None:
    await post(agents, "/v1/register", registration())
    before = copy.deepcopy(registry.get("gpu-17"))
    status, body = await post(agents, "/v1/heartbeat", with_field(heartbeat(), path, value))
    assert status == 400, body
    assert body["field"].split(".")[0].split("[")[0] == path.split(".")[0].split("[")[0]
    assert registry.get("gpu-17") == before


@pytest.mark.parametrize(("path", "value"), BAD_ITEMS)
async def test_a_bad_entry_is_left_out_and_the_rest_accepted(
    agents: Client, registry: NodeRegistry, path: str, value: Any
) -> None:
    await post(agents, "/v1/register", registration())
    body = with_field(heartbeat(), path, value)
    body["shards"].append({"id": "s1", "cpu_cores": {"mean": 2.0, "p95": 2.0, "max": 2.0}})
    status, answer = await post(agents, "/v1/heartbeat", body)
    assert status == 200, answer
    [dropped] = answer["dropped"]
    assert dropped["field"].startswith(path.split(".")[0].split("[")[0]) and dropped["reason"]
    state = registry.get("gpu-17")
    assert state is not None and state.received is not None
    kept = state.received.as_json()
    which = path.split("[")[0]
    entries = kept["machine"]["disks"] if which == "machine.disks" else kept[which]
    assert len(entries) == len(body["machine"]["disks"] if which == "machine.disks" else body[which]) - 1
    assert [s["id"] for s in kept["shards"]] == (["s1"] if which == "shards" else ["s0", "s1"])
    [family] = agents.app[METRICS].items_dropped.collect()
    [sample] = [m for m in family.samples if m.name.endswith("_total")]
    assert sample.value == 1 and not re.search(r"\d", sample.labels["reason"])  # the index is not a label value


async def test_a_node_cannot_grow_the_control_planes_own_series(
    aiohttp_client: Any, registry: NodeRegistry, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid token, watched live (anyone may start that), sends raw blocks
    whose every reason carries new numbers: the counts stay on one label
    value, the answers say each reason whole, the log says it once."""
    live = LiveSamples()
    client = await aiohttp_client(agent_api.create_app(registry, SECRET, live=live))
    live.watch("gpu-17")
    await post(client, "/v1/register", registration())
    reasons = set()
    with caplog.at_level(logging.WARNING, logger="controlplane.ingest.agent_api"):
        for n in range(1, 301):
            clock.advance(1.0)  # within the node's heartbeat rate
            body = heartbeat(seq=n)
            series = {"start": 0, "us": [10000] * n, "v": [0.5] * (n + 1)}
            body["raw"] = {"shards": [{"id": "s0", "cpu_cores": series}]}
            status, answer = await post(client, "/v1/heartbeat", body)
            assert status == 200
            [dropped] = answer["dropped"]
            reasons.add(dropped["reason"])
    assert len(reasons) == 300 and f"{300} lengths but {301} values" in reasons  # each answer says its own
    [family] = client.app[METRICS].items_dropped.collect()
    labels = {m.labels["reason"] for m in family.samples if m.name.endswith("_total")}
    assert labels == {"raw.shards[].cpu_cores"}
    assert sum("left out" in r.getMessage() for r in caplog.records) == 1


async def test_duplicate_shard_ids_keep_the_first(agents: Client, registry: NodeRegistry) -> None:
    await post(agents, "/v1/register", registration())
    body = heartbeat()
    body["shards"].append(dict(body["shards"][0], memory_bytes=99))
    status, answer = await post(agents, "/v1/heartbeat", body)
    assert status == 200 and answer["dropped"] == [{"field": "shards", "reason": "shard ids must be unique"}]
    state = registry.get("gpu-17")
    assert state is not None and state.received is not None
    assert [(s.id, s.memory_bytes) for s in state.received.shards] == [("s0", 10)]


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'"x"', b"null", b'{"node": NaN}', b'{"seq": Infinity}'])
async def test_not_a_json_object_is_400(agents: Client, data: bytes) -> None:
    status, body = await post(agents, "/v1/register", data)
    assert status == 400 and body["field"] in ("body", "node")


async def test_nan_is_refused_naming_its_field() -> None:
    with pytest.raises(wire.WireError) as e:
        wire.parse_heartbeat(json.dumps(heartbeat()).replace("37.5", "NaN").encode())
    assert (e.value.field, e.value.reason) == ("machine.cpu_percent.mean", "must be finite")
    with pytest.raises(wire.WireError) as e:
        wire.parse_heartbeat(json.dumps(heartbeat()).replace("37.5", "-Infinity").encode())
    assert (e.value.field, e.value.reason) == ("machine.cpu_percent.mean", "must be finite")


async def test_oversized_body_is_413(agents: Client, registry: NodeRegistry) -> None:
    status, body = await post(agents, "/v1/register", b"{" + b" " * (10 * 1024 * 1024) + b"}")
    assert status == 413 and "larger" in body["error"]
    assert len(registry) == 0


async def test_unexpected_error_is_500_without_a_traceback(aiohttp_client: Any) -> None:
    class Broken(NodeRegistry):
        def register(self, registration: Registration) -> Any:
            raise RuntimeError("secret internals")

    client = await aiohttp_client(agent_api.create_app(Broken(), SECRET))
    r = await client.post("/v1/register", data=json.dumps(registration()), headers=auth())
    assert r.status == 500
    text = await r.text()
    assert "secret internals" not in text and "Traceback" not in text


async def test_staleness_is_the_control_plane_s_receive_time(
    aiohttp_client: Any, agents: Client, registry: NodeRegistry, clock: FakeClock
) -> None:
    pages = await aiohttp_client(pages_api.create_app(registry))
    await post(agents, "/v1/register", registration())
    hb = heartbeat()
    hb["window"] = {"start": 1.0, "end": 2.0, "samples": 1}  # a node clock in 1970
    await post(agents, "/v1/heartbeat", hb)
    [node] = (await (await pages.get("/api/nodes")).json())["nodes"]
    assert node["state"] == "fresh" and node["heartbeat"]["seq"] == 1
    clock.advance(61)
    [node] = (await (await pages.get("/api/nodes")).json())["nodes"]
    assert node["state"] == "stale" and node["heartbeat"] is None  # no stale measurement shown as current
    assert node["sample_age_seconds"] == 61.0
    assert (await (await pages.get("/health")).json()) == {"status": "ok", "nodes": 1}


# --- fuzz ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
FIELDS = ["node", "seq", "backend", "window", "window.start", "window.end", "window.samples", "machine",
          "machine.cpus", "machine.cpu_percent", "machine.load", "machine.disks", "shards", "shards[0]",
          "shards[0].id", "shards[0].model", "shards[0].cpu_cores", "shards[0].pgids", "gpus", "gpus[0]",
          "gpus[0].index", "gpus[0].utilization_percent", "gpus[1].lost"]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_fuzzed_heartbeats_are_refused_cleanly_or_accepted_whole(field: str, value: Any) -> None:
    """Any body: either valid (200) or a 4xx naming a field; never a crash, and a
    refused one leaves the registry as it was."""
    registry = NodeRegistry(clock=FakeClock())
    registry.register(wire.decode_registration(json.dumps(registration()).encode()))
    before = copy.deepcopy(registry.get("gpu-17"))
    body = json.dumps(with_field(heartbeat(), field, value)).encode()
    try:
        hb = wire.decode_heartbeat(body).heartbeat
    except wire.WireError as e:
        assert e.field and e.reason
        assert registry.get("gpu-17") == before
        return
    if hb.node != "gpu-17":  # a valid name, but no node registered it: refused whole (the API's 404)
        with pytest.raises(UnknownNode):
            registry.heartbeat(hb)
        assert registry.get("gpu-17") == before and registry.get(hb.node) is None
        return
    state = registry.heartbeat(hb)  # accepted: it must be storable and re-encodable
    assert state.received is not None
    wire.dumps(state.received.as_json())


async def test_server_stays_up_through_garbage(agents: Client) -> None:
    for data in (b"\xff\xfe", b"{" * 100_000, b'{"node": "' + b"a" * 400_000 + b'"}'):
        status, _ = await post(agents, "/v1/register", data)
        assert 400 <= status < 500
    status, _ = await post(agents, "/v1/register", registration())
    assert status == 200


def test_create_app_uses_typed_keys(registry: NodeRegistry) -> None:
    app = agent_api.create_app(registry, SECRET)
    assert isinstance(app, web.Application)
    from controlplane.keys import REGISTRY

    assert app[REGISTRY] is registry


async def test_a_slow_client_does_not_hold_up_the_others(agents: Client) -> None:
    """A client sends its request headers a byte at a time; the others are
    served while its headers are half sent, and it is answered in the end."""
    assert agents.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", agents.server.port)
    slow = b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    half = len(slow) // 2
    for byte in slow[:half]:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.01)
    for i in range(20):
        status, _ = await post(agents, "/v1/register", registration(), auth())
        assert status == 200, i
    for byte in slow[half:]:
        writer.write(bytes([byte]))
        await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=30)
    assert status_line.startswith(b"HTTP/1.1 401")  # no token: refused, and not before it finished
    writer.close()


def test_duplicates_keep_their_order() -> None:
    body = heartbeat()
    body["shards"] = [dict(body["shards"][0], id=i) for i in ("a", "b", "a", "c")]
    dropped: wire.Dropped = []
    assert [s["id"] for s in wire.parse_heartbeat(wire.dumps(body), dropped)["shards"]] == ["a", "b", "c"]
    assert len(dropped) == 1


async def _agents_and_viewer(aiohttp_client: Any, registry: NodeRegistry) -> tuple[Client, Client]:
    """Both listeners' apps over one registry and embedded history, as the control plane serves them."""
    history = EmbeddedHistory(interval=5)
    agents = await aiohttp_client(agent_api.create_app(registry, SECRET, history=history))
    app = pages_api.create_app(registry, history=history)
    pages.add_pages(app, history)
    return agents, await aiohttp_client(app)


async def test_heartbeats_are_answered_while_a_page_and_a_scrape_are_rendered(
    aiohttp_client: Any, registry: NodeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages and /metrics are rendered off the loop, each in its own lane:
    while a scrape is held mid-render, heartbeats are still answered and
    recorded and a page is served, and the scrape then finishes with what it
    read."""
    agents, viewer = await _agents_and_viewer(aiohttp_client, registry)
    entered, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    render = FleetExposition.render

    def held_render(self: FleetExposition) -> str:
        loop.call_soon_threadsafe(entered.set)
        assert release.wait(timeout=60), "never released"
        return render(self)

    monkeypatch.setattr(FleetExposition, "render", held_render)
    assert (await post(agents, "/v1/register", registration()))[0] == 200
    scrape = asyncio.create_task(viewer.get("/metrics"))
    await entered.wait()
    for seq in range(1, 4):
        assert (await post(agents, "/v1/heartbeat", heartbeat(seq=seq)))[0] == 200
    state = registry.get("gpu-17")
    assert state is not None and state.heartbeats == 3
    shown = await viewer.get("/")  # the pages' lane is not behind the scrape's
    assert shown.status == 200 and "gpu-17" in await shown.text()
    assert not scrape.done()
    release.set()
    scraped = await scrape
    assert scraped.status == 200 and 'llmgw_node_up{node="gpu-17"} 1' in await scraped.text()


async def test_a_scrape_never_waits_behind_page_renders(
    aiohttp_client: Any, registry: NodeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop of anonymous page views (here: one page held mid-render, and
    more queued behind it) does not hold Prometheus' scrape: /metrics has a
    lane of its own, and NodeDown can fire."""
    agents, viewer = await _agents_and_viewer(aiohttp_client, registry)
    entered, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    rows = pages._cluster_rows

    def held_rows(*args: Any) -> Any:
        loop.call_soon_threadsafe(entered.set)
        assert release.wait(timeout=60), "never released"
        return rows(*args)

    monkeypatch.setattr(pages, "_cluster_rows", held_rows)
    assert (await post(agents, "/v1/register", registration()))[0] == 200
    assert (await post(agents, "/v1/heartbeat", heartbeat()))[0] == 200
    views = [asyncio.create_task(viewer.get("/")) for _ in range(20)]
    await entered.wait()
    scraped = await viewer.get("/metrics")
    assert scraped.status == 200 and 'llmgw_node_up{node="gpu-17"} 1' in await scraped.text()
    assert not any(v.done() for v in views)
    release.set()
    assert all(r.status == 200 for r in await asyncio.gather(*views))


async def test_a_node_keeps_its_busiest_engines_up_to_the_cap(aiohttp_client: Any, clock: FakeClock) -> None:
    """However many engines an agent sends (up to the wire's 256), the control
    plane keeps the node's busiest up to its cap and counts the rest."""
    registry = NodeRegistry(stale_after=60, clock=clock, max_shards=3)
    agents = await aiohttp_client(agent_api.create_app(registry, SECRET))
    assert (await post(agents, "/v1/register", registration()))[0] == 200
    body = heartbeat()
    body["shards"] = [dict(body["shards"][0], id=f"s{i}", cpu_cores={"mean": i / 10, "p95": 1.0, "max": 1.0})
                      for i in range(10)]  # fmt: skip
    body["shards_left_out"] = 5  # the agent's own cut
    assert (await post(agents, "/v1/heartbeat", body))[0] == 200
    state = registry.get("gpu-17")
    assert state is not None and state.received is not None
    assert [s.id for s in state.received.shards] == ["s9", "s8", "s7"]
    text = FleetExposition(registry).render()
    assert 'llmgw_node_shards_left_out{node="gpu-17"} 12\n' in text
    assert {line.split('shard="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("llmgw_shard_cpu_cores{")} == {"s9", "s8", "s7"}  # fmt: skip


@pytest.mark.parametrize("token", [b"eyJ\xff\xfe.\xc3(.x", b"eyJhbGciOiJSUzI1NiJ9.\xe2\x82\xac.x", b"gpu-\xe9.ab"])
async def test_a_token_of_other_bytes_is_401_never_a_500(aiohttp_client: Any, registry: NodeRegistry,
                                                         tmp_path: Any, token: bytes) -> None:  # fmt: skip
    """Bytes that are not printable ASCII, sent raw as a client can, against
    both kinds of token verification: one 401 with a reason, no traceback."""
    issuer = TestIssuer()
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(issuer.jwks()))
    verifier = ServiceAccountVerifier(JwksSource(str(jwks)), ServiceAccountRules(ISSUER))
    client = await aiohttp_client(agent_api.create_app(registry, NodeAuthenticator(SECRET, verifier)))
    body = json.dumps(registration()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(b"POST /v1/register HTTP/1.1\r\nHost: cp\r\nAuthorization: Bearer " + token +
                 b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                 + body)  # fmt: skip
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401 ") and b'"malformed bearer token"' in answer, answer[:200]
    assert len(registry) == 0


async def test_a_replayed_heartbeat_is_refused_until_the_node_registers_again(
    agents: Client, registry: NodeRegistry, clock: FakeClock
) -> None:
    await post(agents, "/v1/register", registration())
    assert (await post(agents, "/v1/heartbeat", heartbeat(seq=5)))[0] == 200
    before = registry.get("gpu-17")
    assert before is not None and before.received is not None
    for seq in (5, 4):  # the same window again, an older one: a replay
        clock.advance(1)
        status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=seq))
        assert status == 409 and answer["field"] == "seq" and "replay" in answer["error"]
    state = registry.get("gpu-17")
    assert state is not None and state.heartbeats == 1 and state.received is before.received  # nothing changed
    clock.advance(1)
    assert (await post(agents, "/v1/heartbeat", heartbeat(seq=6)))[0] == 200
    # A restarted agent registers and counts from 1 again.
    await post(agents, "/v1/register", registration())
    clock.advance(1)
    assert (await post(agents, "/v1/heartbeat", heartbeat(seq=1)))[0] == 200
    [family] = agents.app[METRICS].rejected.collect()
    replays = [m.value for m in family.samples if m.labels == {"kind": "heartbeat", "reason": "replay"}
               and m.name.endswith("_total")]  # fmt: skip
    assert replays == [2]


async def test_a_node_flooding_heartbeats_gets_429s_and_its_rate_back(
    agents: Client, registry: NodeRegistry, clock: FakeClock
) -> None:
    """A valid token used to flood: a burst (ten) goes through, then
    HEARTBEAT_RATE a second; the rest is 429, counted, and changes nothing."""
    await post(agents, "/v1/register", registration())
    statuses = [(await post(agents, "/v1/heartbeat", heartbeat(seq=n)))[0] for n in range(1, 51)]
    burst = 10
    assert statuses == [200] * burst + [429] * (50 - burst)
    state = registry.get("gpu-17")
    assert state is not None and state.heartbeats == burst
    clock.advance(1.0)  # a second later: HEARTBEAT_RATE more
    statuses = [(await post(agents, "/v1/heartbeat", heartbeat(seq=100 + n)))[0] for n in range(5)]
    assert statuses == [200] * int(agent_api.HEARTBEAT_RATE) + [429] * (5 - int(agent_api.HEARTBEAT_RATE))
    [family] = agents.app[METRICS].rejected.collect()
    limited = [m.value for m in family.samples if m.labels == {"kind": "heartbeat", "reason": "rate_limited"}
               and m.name.endswith("_total")]  # fmt: skip
    assert limited == [50 - burst + 5 - int(agent_api.HEARTBEAT_RATE)]
    # Another node is not held back by this one.
    await post(agents, "/v1/register", registration("gpu-18"), auth("gpu-18"))
    assert (await post(agents, "/v1/heartbeat", heartbeat("gpu-18"), auth("gpu-18")))[0] == 200


async def test_no_heartbeat_rate_is_no_limit(aiohttp_client: Any, registry: NodeRegistry) -> None:
    """--max-heartbeats-per-second 0, for the benchmarks' floods of one fleet's heartbeats."""
    client = await aiohttp_client(agent_api.create_app(registry, SECRET, heartbeat_rate=0))
    await post(client, "/v1/register", registration())
    assert {(await post(client, "/v1/heartbeat", heartbeat(seq=n)))[0] for n in range(1, 51)} == {200}
