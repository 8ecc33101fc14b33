"""Replicas at the size they exist for, as processes: three control planes
sharing 30,000 nodes named as clouds name them (40-64 bytes), each node at
its agent's first choice; TLS and users on the pages, peers over https.

Every replica's `/api/nodes` and cluster page name the whole fleet with no
peer down; every node is `llmgw_node_up 1` at exactly one replica; a
webhook of 1 MB is taken whole through each pages listener and the admin
socket. The fleet is registered once for the module (a minute of this
machine's two cores), and its nodes stay fresh without a heartbeat more
(`--stale-after`), so what each test reads is the same fleet."""

from __future__ import annotations

import asyncio
import collections
import html
import http.client
import json
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controlplane.ingest import tokens
from controlplane.samples.incidents import MAX_NODES
from sampler.agent.replicas import ranked
from tests.agent_fleet import PASSWORD, basic, web_config_file
from tests.conftest import free_port
from tests.simulated_fleet import cloud_names

NODES = 30_000
SECRET = b"s3cret-s3cret-s3cret-s3cret"


class Replica:
    def __init__(self, tmp: Path, index: int) -> None:
        self.tmp, self.index = tmp, index
        self.agent_port, self.pages_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.agent_port}"
        self.pages_url = f"https://127.0.0.1:{self.pages_port}"
        self.admin = tmp / f"admin-{index}.sock"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, peers: list[str]) -> None:
        log = open(self.tmp / f"replica-{self.index}.log", "ab")  # noqa: SIM115 (the child's)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{self.agent_port}",
             "--pages-listen", f"127.0.0.1:{self.pages_port}", "--secret-file", str(self.tmp / "secret"),
             "--web-config-file", str(self.tmp / "web-config.yml"), "--peer-ca-file", str(self.tmp / "ca.crt"),
             "--stale-after", "86400", "--state-file", str(self.tmp / f"state-{self.index}.json"),
             "--admin-socket", str(self.admin), *[a for p in peers for a in ("--peer", p)]],
            stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        log.close()
        assert self.process.stdout is not None and b"control plane" in self.process.stdout.readline()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Fleet:
    def __init__(self, tmp: Path, replicas: list[Replica], nodes: list[str]) -> None:
        self.tmp, self.replicas, self.nodes = tmp, replicas, nodes
        self.context = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
        self.auth = basic("operator", PASSWORD)
        urls = [r.url for r in replicas]
        self.holder = {node: ranked(node, urls)[0] for node in nodes}  # each agent's first choice

    def get(self, replica: Replica, path: str, timeout: float = 120) -> tuple[int, bytes]:
        connection = http.client.HTTPSConnection("127.0.0.1", replica.pages_port, context=self.context,
                                                 timeout=timeout)  # fmt: skip
        try:
            connection.request("GET", path, headers=self.auth)
            r = connection.getresponse()
            return r.status, r.read()
        finally:
            connection.close()

    def api_nodes(self, replica: Replica) -> dict[str, Any]:
        status, body = self.get(replica, "/api/nodes")
        assert status == 200, body[:300]
        answer: dict[str, Any] = json.loads(body)
        return answer


async def register(fleet: Fleet) -> collections.Counter[str]:
    """Each node registered at its first choice, and one window of it heartbeat there."""
    failures: collections.Counter[str] = collections.Counter()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for node in fleet.nodes:
        queue.put_nowait(node)
    connector = aiohttp.TCPConnector(limit=48, ssl=fleet.context)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker() -> None:
            while not queue.empty():
                node = queue.get_nowait()
                url = fleet.holder[node]
                headers = {"Authorization": f"Bearer {tokens.node_token(SECRET, node)}"}
                now = time.time()
                for attempt in range(5):
                    try:
                        async with session.post(f"{url}/v1/register", headers=headers,
                                                json={"node": node, "backend": "proc", "cpus": 8}) as r:  # fmt: skip
                            assert r.status == 200, await r.text()
                        async with session.post(f"{url}/v1/heartbeat", headers=headers, json={
                                "node": node, "seq": 1, "backend": "proc",
                                "window": {"start": now - 5, "end": now, "samples": 10},
                                "machine": {"cpus": 8}}) as r:  # fmt: skip
                            assert r.status == 200, await r.text()
                        break
                    except (aiohttp.ClientError, TimeoutError) as e:
                        failures[type(e).__name__] += 1
                        await asyncio.sleep(0.2 * (attempt + 1))
                else:
                    raise AssertionError(f"{node} not registered: {failures}")

        await asyncio.gather(*(worker() for _ in range(48)))
    return failures


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("replicas-at-size")
    (tmp / "secret").write_bytes(SECRET + b"\n")
    web_config_file(tmp, {"operator": PASSWORD})  # TLS for 127.0.0.1 (ca.crt beside it) and a user
    replicas = [Replica(tmp, i) for i in range(3)]
    try:
        for r in replicas:
            r.start([p.pages_url for p in replicas])
        fleet = Fleet(tmp, replicas, cloud_names(NODES))
        assert all(40 <= len(n) <= 64 for n in fleet.nodes) and len(set(fleet.nodes)) == NODES
        asyncio.run(register(fleet))

        def all_held() -> bool:  # every replica's polls have seen the others' nodes
            held = [{n["node"] for n in fleet.api_nodes(r)["nodes"] if "replica" not in n} for r in replicas]
            return sum(len(h) for h in held) == NODES
        wait_until(all_held, 120, "each node held by its first choice")
        yield fleet
    finally:
        for r in replicas:
            r.stop()


def test_each_replicas_api_nodes_names_the_whole_fleet(fleet: Fleet) -> None:
    for r in fleet.replicas:
        answer = fleet.api_nodes(r)
        names = [n["node"] for n in answer["nodes"]]
        assert len(names) == NODES and set(names) == set(fleet.nodes), f"replica {r.index}: {len(names)} nodes"
        assert all(p["answered"] for p in answer["peers"]), answer["peers"]
        assert all(n["state"] == "fresh" for n in answer["nodes"])
        # Each from the replica that holds it: its own without `replica`, a peer's with that peer's URL.
        pages = {p.url: p.pages_url for p in fleet.replicas}
        wrong = [n["node"] for n in answer["nodes"] if n.get("replica", r.pages_url) != pages[fleet.holder[n["node"]]]]
        assert wrong == [], f"replica {r.index}: {len(wrong)} nodes from another replica than their holder"


def test_every_node_is_up_at_exactly_one_replica(fleet: Fleet) -> None:
    up: collections.Counter[str] = collections.Counter()
    for r in fleet.replicas:
        status, body = fleet.get(r, "/metrics")
        assert status == 200
        text = body.decode()
        mine = re.findall(r'^llmgw_node_up\{node="([^"]+)"\} 1$', text, re.M)
        assert set(mine) == {n for n, u in fleet.holder.items() if u == r.url}
        up.update(mine)
        assert not re.search(r"^llmgw_node_up\{[^}]*\} 0", text, re.M)
    assert up == collections.Counter(fleet.nodes)


def test_each_cluster_page_names_the_whole_fleet(fleet: Fleet) -> None:
    for r in fleet.replicas:
        status, body = fleet.get(r, "/")
        page = body.decode()
        assert status == 200 and re.search(rf'id="nodes">{NODES}<', page), f"replica {r.index}"
        assert "did not answer" not in page
        # The fleet's picture is the whole fleet's: each replica's part, asked of it.
        legend = re.search(r'data-legend="([^"]+)"', page)
        assert legend is not None
        status, body = fleet.get(r, html.unescape(legend.group(1)))
        rows = json.loads(body)["rows"]
        assert status == 200 and sorted(n for row in rows for n in row["nodes"]) == sorted(fleet.nodes)


def alerts_body(nodes: list[str], size: int) -> bytes:
    """Alertmanager's webhook (version 4) of ~`size` bytes: one firing alert a node, annotations as long as it takes."""
    alerts = [{"status": "firing", "labels": {"alertname": "NodeCPUStarved", "node": node, "severity": "page"},
               "annotations": {"description": ""}, "startsAt": "2026-12-07T02:00:00Z",
               "fingerprint": node} for node in nodes]  # fmt: skip
    bare = len(json.dumps({"version": "4", "status": "firing", "alerts": alerts}))
    pad = (size - bare) // len(alerts)
    for alert in alerts:
        alert["annotations"]["description"] = "x" * pad  # type: ignore[index]
    return json.dumps({"version": "4", "status": "firing", "receiver": "nodesampler", "alerts": alerts}).encode()


def captured(fleet: Fleet, nodes: list[str]) -> set[str]:
    """What a webhook naming `nodes` captures: at each replica, an incident of the first MAX_NODES it holds."""
    shares: dict[str, list[str]] = {}
    for node in nodes:
        shares.setdefault(fleet.holder[node], []).append(node)
    assert len(shares) == 3
    return {n for share in shares.values() for n in share[:MAX_NODES]}


def test_a_webhook_of_a_megabyte_is_taken_whole_through_each_listener_and_the_admin_socket(fleet: Fleet) -> None:
    """1,000,000 bytes (over aiohttp's 128 KiB buffer eight times): read to its end, its alerts split by the
    replica that holds each node, each share captured there (an incident holds MAX_NODES nodes at most)."""
    for step, r in enumerate(fleet.replicas):
        nodes = fleet.nodes[step * 900:(step + 1) * 900]
        body = alerts_body(nodes, 1_000_000)
        assert 999_000 <= len(body) <= 1_000_000
        connection = http.client.HTTPSConnection("127.0.0.1", r.pages_port, context=fleet.context, timeout=120)
        try:
            connection.request("POST", "/api/alertmanager", body=body,
                               headers={**fleet.auth, "Content-Type": "application/json"})  # fmt: skip
            answer = connection.getresponse()
            status, text = answer.status, answer.read()
        finally:
            connection.close()
        assert status == 200, text[:300]
        done = json.loads(text)
        started = set(done.get("nodes") or [])
        for peer, theirs in done.get("forwarded", {}).items():
            assert "error" not in theirs, (peer, theirs)
            started |= set(theirs["nodes"])
        assert started == captured(fleet, nodes), f"through replica {r.index}: {len(started)} nodes"
    # And the admin socket (an operator's `kubectl exec`), whose user is the forwarder's own.
    r = fleet.replicas[0]
    nodes = fleet.nodes[2700:3600]
    body = alerts_body(nodes, 1_000_000)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(120)
        s.connect(str(r.admin))
        s.sendall(b"POST /api/alertmanager HTTP/1.1\r\nHost: admin\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, text = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    done = json.loads(text)
    forwarded = done.get("forwarded", {}).values()
    started = set(done.get("nodes") or []).union(*(set(t.get("nodes") or []) for t in forwarded))
    assert started == captured(fleet, nodes), done.get("forwarded")
