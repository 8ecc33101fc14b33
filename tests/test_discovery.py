"""The control plane's replicas named by a DNS SRV record (wire/discovery.py),
read from a real DNS exchange with a server the test runs: each record a
URL, the same in every process; a record that changes is seen at the next
read; a server's bad minute keeps what the record named; an agent given the
record heartbeats to its node's first choice among what it names, and
moves to a replica added above it; the CLIs refuse what is no URL nor record."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import ResolveResult
from aiohttp.test_utils import TestServer

from sampler.agent.replicas import ranked
from tests.fake_dns import FakeDns
from tests.heartbeats import window_summary
from wire import discovery
from wire.discovery import Replicas

RECORD = "_agents._tcp.nodesampler-controlplane.nodesampler.svc.cluster.local"
PODS = "nodesampler-controlplane.nodesampler.svc.cluster.local"


def test_a_url_or_a_record_and_nothing_else() -> None:
    for good in ("https://cp:8081", "http://127.0.0.1:8081/", f"dnssrv+https://{RECORD}", "dnssrv+http://cp.svc",
                 f"dnssrv+{RECORD}"):  # fmt: skip
        assert discovery.check(good) is None, good
    for bad in ("cp:8081", "dnssrv+cp.svc:8081", "dnssrv+https://cp.svc:8081", "dnssrv+https://cp.svc/v1",
                "ftp://cp", "dnssrv+ftp://cp.svc", "https://", "dnssrv+"):  # fmt: skip
        assert discovery.check(bad) is not None, bad


async def test_a_record_names_the_replicas_and_is_read_again() -> None:
    dns_server = FakeDns()
    resolver = await dns_server.start()
    try:
        dns_server.records[RECORD] = [(f"nodesampler-controlplane-{i}.{PODS}", 8081) for i in (2, 0, 1)]
        replicas = Replicas([f"dnssrv+{RECORD}", "https://extra:8081/"], resolver)  # dnssrv+NAME: https
        assert replicas.discovered and replicas.urls == ["https://extra:8081"]  # nothing read yet
        assert await replicas.refresh()
        three = [f"https://nodesampler-controlplane-{i}.{PODS}:8081" for i in range(3)]
        assert replicas.urls == [*three, "https://extra:8081"]  # sorted: every process makes the same list
        assert not await replicas.refresh()
        # Scaled to four: seen at the next read.
        dns_server.records[RECORD].append((f"nodesampler-controlplane-3.{PODS}", 8081))
        assert await replicas.refresh() and len(replicas.urls) == 5
        # The server's bad minute, or a record gone: what it named is kept.
        dns_server.failing.add(RECORD)
        assert not await replicas.refresh() and len(replicas.urls) == 5
        dns_server.failing.clear()
        del dns_server.records[RECORD]
        assert not await replicas.refresh() and len(replicas.urls) == 5
        # Never read: none from it yet.
        fresh = Replicas([f"dnssrv+https://{RECORD}"], resolver)
        assert not await fresh.refresh() and fresh.urls == []
    finally:
        dns_server.close()


@pytest.mark.timing
async def test_an_agent_follows_the_record_to_a_replica_added_above_its_own(tmp_path: Path) -> None:
    """Two replicas named, then a third that ranks first for the node: the
    agent's heartbeats go to its first choice of the two, then, once the
    record names the third and its wait is over, to the third."""
    from tests.test_agent_failures import make_agent

    taken: dict[str, int] = {}
    servers = []
    for name in ("a", "b", "c"):
        app = web.Application()

        async def register(request: web.Request) -> web.Response:
            return web.json_response({"node": "n1", "stale_after": 60})

        async def heartbeat(request: web.Request, name: str = name) -> web.Response:
            taken[name] = taken.get(name, 0) + 1
            return web.json_response({"seq": 1})

        app.router.add_post("/v1/register", register)
        app.router.add_post("/v1/heartbeat", heartbeat)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    ports = {name: int(s.port or 0) for name, s in zip("abc", servers, strict=True)}
    # Host names (each 127.0.0.1 here) such that the third replica ranks first for n1: all three
    # named anew each try (1 in 3 then; renaming the third alone could not beat a first with a
    # weight of 0.9975, as CI's ports gave once: a try in 400).
    for k in range(100):
        host = {n: f"localhost-{n}{k}.test" for n in "abc"}
        url = {n: f"http://{host[n]}:{ports[n]}" for n in "abc"}
        if ranked("n1", list(url.values()))[0] == url["c"]:
            break
    assert ranked("n1", list(url.values()))[0] == url["c"]
    dns_server = FakeDns()
    resolver = await dns_server.start()
    dns_server.records[RECORD] = [(host[n], ports[n]) for n in "ab"]
    agent = make_agent(tmp_path)
    agent.replicas = Replicas([f"dnssrv+http://{RECORD}"], resolver)
    await agent.replicas.refresh()
    resolving = aiohttp.resolver.ThreadedResolver()

    class TestNames(aiohttp.abc.AbstractResolver):  # localhost-X.test is 127.0.0.1
        async def resolve(self, host: str, port: int = 0,
                          family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:  # fmt: skip
            return await resolving.resolve("127.0.0.1", port, family)

        async def close(self) -> None:
            pass

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=TestNames())) as session:
            from sampler.agent.client import HeartbeatClient

            agent.mailbox.put(window_summary())
            sender = asyncio.create_task(agent._deliver(agent.clients(session),
                                                        lambda u: HeartbeatClient(session, u, agent.token)))
            first_of_two = next(n for n in "abc" if url[n] == ranked("n1", [url["a"], url["b"]])[0])
            while not taken.get(first_of_two):
                await asyncio.sleep(0.05)
            dns_server.records[RECORD].append((host["c"], ports["c"]))
            assert await agent.replicas.refresh()
            for seq in range(2, 400):  # windows go on; the node goes up its order when its wait is over (5 s)
                agent.mailbox.put(window_summary(seq=seq))
                await asyncio.sleep(0.05)
                if taken.get("c"):
                    break
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    finally:
        dns_server.close()
        for server in servers:
            await server.close()
    assert taken.get(first_of_two) and taken.get("c"), taken


def test_the_clis_take_a_record_and_refuse_what_is_neither(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cret-s3cret-s3cret-s3cret\n")
    for command in (["agent", "--control-plane", "dnssrv+cp.svc:8081", "--token-file", str(tmp_path / "secret")],
                    ["controlplane", "--listen", "127.0.0.1:0", "--pages-listen", "127.0.0.1:0", "--secret-file",
                     str(tmp_path / "secret"), "--peer", "dnssrv+https://cp:1"]):
        r = subprocess.run([sys.executable, "-m", "nodesampler", *command], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 2 and "dnssrv+" in r.stderr, r.stderr
    # Peers over plain http: refused but on loopback (what they send would cross the network in clear text).
    for peer in ("http://cp-1.svc:8080", "dnssrv+http://cp.svc", "http://10.0.0.7:8080"):
        r = subprocess.run([sys.executable, "-m", "nodesampler", "controlplane", "--listen", "127.0.0.1:0",
                            "--pages-listen", "127.0.0.1:0", "--secret-file", str(tmp_path / "secret"), "--peer",
                            peer], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "peers speak https" in r.stderr, (peer, r.stderr)


async def test_a_replicas_peers_follow_the_record() -> None:
    """`--peer dnssrv+...`: the peers are what the record names, read again
    at a poll once `REFRESH_S` has passed; a peer still named keeps what it
    said, one gone is asked no more."""
    from controlplane.fleet.peers import Peers
    from controlplane.state.registry import NodeRegistry
    from tests.test_replicas import Clock

    clock = Clock()
    dns_server = FakeDns()
    resolver = await dns_server.start()
    try:
        dns_server.records[RECORD] = [(f"nodesampler-controlplane-{i}.{PODS}", 8081) for i in range(3)]
        peers = Peers([f"dnssrv+https://{RECORD}"], b"s3cret-s3cret-s3cret-s3cret",
                      NodeRegistry(stale_after=60, clock=clock), lambda node: None)  # fmt: skip
        peers.replicas = Replicas(peers.replicas.given, resolver, clock)
        assert peers.peers == []
        await peers.discover()
        assert [p.url for p in peers.peers] == [f"https://nodesampler-controlplane-{i}.{PODS}:8081" for i in range(3)]
        kept = peers.peers[0]
        kept.holds = {"n1": 1.0}
        del dns_server.records[RECORD][2]
        await peers.discover()
        assert len(peers.peers) == 3  # not read again before REFRESH_S
        clock.now += discovery.REFRESH_S
        await peers.discover()
        assert len(peers.peers) == 2 and peers.peers[0] is kept and kept.holds == {"n1": 1.0}
    finally:
        dns_server.close()


def test_a_process_given_urls_alone_needs_no_dnspython() -> None:
    """dnspython is loaded where a record is read: the kernel tests' guests,
    and any agent given URLs, run without it (it is no Debian package there)."""
    script = ("import sys, nodesampler.cli.sample, sampler.agent.run, controlplane.fleet.peers; "
              "assert not any(m == 'dns' or m.startswith('dns.') for m in sys.modules), 'dns imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


async def test_a_records_target_that_is_no_host_name_is_left_out_and_too_many_are_said(caplog: Any) -> None:
    """An SRV target is a URL's host only when it is a host name: a `/` or
    `@` in it (DNS labels may hold any byte) would move the URL elsewhere.
    More records than MAX_RECORDS: the first, sorted, and a warning with the count."""
    dns_server = FakeDns()
    resolver = await dns_server.start()
    try:
        dns_server.records[RECORD] = [(f"ok-0.{PODS}", 8081), ("evil.example/x", 8081), ("user@evil.example", 8081),
                                      ("evil.example:99", 8081)]  # fmt: skip
        replicas = Replicas([f"dnssrv+{RECORD}"], resolver)
        assert await replicas.refresh()
        assert replicas.urls == [f"https://ok-0.{PODS}:8081"]
        assert "3 SRV targets are not host names" in caplog.text
        dns_server.records[RECORD] = [(f"r-{i:03d}.{PODS}", 8081) for i in range(discovery.MAX_RECORDS + 6)]
        assert await replicas.refresh() and len(replicas.urls) == discovery.MAX_RECORDS
        assert f"names {discovery.MAX_RECORDS + 6} replicas" in caplog.text
    finally:
        dns_server.close()
