"""Which control-plane replica holds a node (sampler/agent/replicas.py): the
order is the same in every process, spreads a fleet evenly, and moves few
nodes when replicas come and go; a node held by a later replica tries its
way back, less often when its first choice keeps going away; and, as
processes, a real agent given three replicas heartbeats to its first
choice, moves to the next when that one is killed, and comes back."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import html
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sampler.agent.replicas import MAX_RETURN_S, SETTLED_S, ReplicaChoice, ranked, weight
from tests.conftest import free_port

NODES = [f"gpu-{i:05d}" for i in range(10_000)]
REPLICAS = [f"https://nodesampler-{i}.nodesampler.nodesampler.svc:8081" for i in range(4)]


def holders(replicas: list[str]) -> dict[str, str]:
    return {node: ranked(node, replicas)[0] for node in NODES}


def test_the_order_is_the_same_in_every_process() -> None:
    script = "from sampler.agent.replicas import ranked; print(ranked('gpu-7', ['a', 'b', 'c']))"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})  # fmt: skip
    assert other.stdout.strip() == str(ranked("gpu-7", ["a", "b", "c"]))
    assert ranked("gpu-7", ["c", "a", "b", "a"]) == ranked("gpu-7", ["a", "b", "c"])  # the list's order, twice: one
    assert weight("gpu-7", "a") != weight("gpu-7", "b")


def test_a_fleet_is_spread_evenly_and_moves_little() -> None:
    three = holders(REPLICAS[:3])
    shares = collections.Counter(three.values())
    assert all(0.30 < n / len(NODES) < 0.37 for n in shares.values()), shares
    # A fourth replica takes about a quarter, each from whichever held it; no node moves between the three.
    four = holders(REPLICAS)
    moved = [n for n in NODES if four[n] != three[n]]
    assert all(four[n] == REPLICAS[3] for n in moved)
    assert 0.22 < len(moved) / len(NODES) < 0.28, len(moved)
    # Losing one moves its own nodes alone, each to its next in order.
    two = holders([REPLICAS[0], REPLICAS[2]])
    assert [n for n in NODES if two[n] != three[n]] == [n for n in NODES if three[n] == REPLICAS[1]]
    assert all(two[n] == ranked(n, REPLICAS[:3])[1] for n in NODES if three[n] == REPLICAS[1])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_node_moves_down_its_order_and_tries_its_way_back() -> None:
    clock = Clock()
    choice = ReplicaChoice("gpu-7", REPLICAS[:3], return_every_s=30, clock=clock)
    first, second, third = choice.order
    assert choice.url == first and not choice.worth_trying_back()
    assert choice.failed() and choice.url == second  # the next, at once
    assert choice.failed() and choice.url == third
    assert not choice.failed() and choice.url == first  # none answered: the first again, after the backoff
    assert choice.failed() and choice.url == second
    clock.now += 29
    assert not choice.worth_trying_back()
    clock.now += 1
    assert choice.worth_trying_back() and choice.back_to_first() == 1 and choice.url == first
    assert choice.failed() and choice.url == second  # still down: held where it was, tried again in 30 s
    clock.now += 30
    assert choice.worth_trying_back()
    choice.back_to_first()
    choice.taken()  # back
    # It goes again soon after: the node waits twice as long before trying it next time, and so on.
    waits = []
    for _ in range(6):
        clock.now += 10
        assert choice.failed() and choice.url == second
        waited = 0
        while not choice.worth_trying_back():
            clock.now += 5
            waited += 5
        waits.append(waited)
        choice.back_to_first()
        choice.taken()
    assert waits == [60, 120, 240, 480, 600, 600] and MAX_RETURN_S == 600
    # It stays: after a while it is trusted again, and the wait is back to 30 s.
    clock.now += SETTLED_S
    choice.taken()
    clock.now += 1
    assert choice.failed()
    clock.now += 30
    assert choice.worth_trying_back()


def test_one_replica_is_the_control_plane_as_before() -> None:
    choice = ReplicaChoice("gpu-7", ["http://cp:8081"], return_every_s=30, clock=Clock())
    assert not choice.failed() and choice.url == "http://cp:8081" and not choice.worth_trying_back()
    with pytest.raises(ValueError):
        ReplicaChoice("gpu-7", [], return_every_s=30)


# --- as processes ---------------------------------------------------------------------


class Replica:
    def __init__(self, tmp: Path, index: int) -> None:
        self.tmp, self.index = tmp, index
        self.agent_port, self.pages_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.agent_port}"  # its agent listener: the agents' --control-plane
        self.pages_url = f"http://127.0.0.1:{self.pages_port}"  # its pages listener: the replicas' --peer
        self.process: subprocess.Popen[bytes] | None = None
        self.extra: list[str] = []

    def start(self) -> None:
        log = open(self.tmp / f"replica-{self.index}.log", "ab")  # noqa: SIM115 (the child's)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{self.agent_port}",
             "--pages-listen", f"127.0.0.1:{self.pages_port}", "--secret-file", str(self.tmp / "secret"),
             *self.extra],
            stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        log.close()
        assert self.process.stdout is not None and b"control plane" in self.process.stdout.readline()

    def nodes(self) -> dict[str, dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.pages_port}/api/nodes?here=1", timeout=10) as r:
            return {n["node"]: n for n in json.loads(r.read())["nodes"]}  # its own

    def holds_fresh(self, node: str) -> bool:
        try:
            n = self.nodes().get(node)
        except OSError:
            return False
        return n is not None and n["state"] == "fresh"

    def kill(self, how: signal.Signals = signal.SIGKILL) -> None:
        assert self.process is not None
        self.process.send_signal(how)
        self.process.wait()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.pages_port}/metrics", timeout=10) as r:
            return str(r.read().decode())


@pytest.fixture(params=[False, True], ids=["alone", "peers"])
def replicas(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[Replica]]:
    """Three replicas; with peers, each given all three (itself too) and a state file."""
    (tmp_path / "secret").write_text("s3cret-s3cret-s3cret-s3cret\n")
    started = [Replica(tmp_path, i) for i in range(3)]
    for r in started:
        if request.param:
            r.extra = [a for p in started for a in ("--peer", p.pages_url)] + [
                "--state-file", str(tmp_path / f"state-{r.index}.json"),
                "--admin-socket", str(tmp_path / f"admin-{r.index}.sock")]
        r.start()
    yield started
    for r in started:
        if r.process is not None and r.process.poll() is None:
            r.kill()


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def start_agent(replicas: list[Replica], tmp_path: Path, interval: float,
                hindsight: str = "0") -> subprocess.Popen[bytes]:  # fmt: skip
    token = tmp_path / "token"
    token.write_bytes(subprocess.run([sys.executable, "-m", "nodesampler", "token", "n1", "--secret-file",
                                      str(tmp_path / "secret")], capture_output=True, check=True).stdout)  # fmt: skip
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 (the child's)
    agent = subprocess.Popen([sys.executable, "-m", "nodesampler", "agent", "--token-file", str(token), "--node", "n1",
                              "--interval", str(interval), "--backend", "proc", "--hindsight", hindsight,
                              *[a for r in replicas for a in ("--control-plane", r.url)]],
                             stderr=log)  # fmt: skip
    log.close()
    return agent


def fleet_view(replica: Replica, here: bool = False) -> dict[str, Any]:
    url = f"http://127.0.0.1:{replica.pages_port}/api/nodes" + ("?here=1" if here else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def listing(replicas: list[Replica], node: str) -> list[tuple[int, str]]:
    """The replicas whose /api/nodes has the node, and its state there."""
    out = []
    for r in replicas:
        n = r.nodes().get(node)
        if n is not None:
            out.append((r.index, n["state"]))
    return out


@pytest.mark.live
@pytest.mark.timing
def test_an_agent_moves_to_the_next_replica_and_comes_back(replicas: list[Replica], tmp_path: Path) -> None:
    by_url = {r.url: r for r in replicas}
    first, second, _ = (by_url[u] for u in ranked("n1", list(by_url)))
    agent = start_agent(replicas, tmp_path, interval=0.5)
    try:
        wait_until(lambda: first.holds_fresh("n1"), 60, "the node at its first choice")
        assert all("n1" not in r.nodes() for r in replicas if r is not first)  # held by one replica alone
        first.kill()
        # The next in its order, within two windows of its first missed heartbeat (and the sends' timeout).
        wait_until(lambda: second.holds_fresh("n1"), 30, "the node at its second choice")
        first.start()  # back, on the same address, knowing nothing
        wait_until(lambda: first.holds_fresh("n1"), 30, "the node back at its first choice")
        said = (tmp_path / "agent.log").read_text()
        assert f"control plane {first.url} unreachable" in said and f"heartbeats go to {second.url}" in said
        assert f"trying {first.url} again" in said
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_moved_node_is_one_series_at_the_replica_that_holds_it(replicas: list[Replica], tmp_path: Path) -> None:
    """The replica a node left lets it go once a peer holds it: it leaves that
    replica's /api/nodes and /metrics (no `llmgw_node_up 0` to fire
    `NodeDown` for a node that is fine); a replica that comes back from its
    state file knowing the node, stale, lets it go too."""
    by_url = {r.url: r for r in replicas}
    first, second, third = (by_url[u] for u in ranked("n1", list(by_url)))
    agent = start_agent(replicas, tmp_path, interval=2.0)  # back to its first choice after 12 s at the soonest
    try:
        wait_until(lambda: listing(replicas, "n1") == [(first.index, "fresh")], 60, "the node at its first choice")
        first.kill(signal.SIGTERM)  # its state file keeps the node
        wait_until(lambda: listing([second, third], "n1") == [(second.index, "fresh")], 30,
                   "the node at its second choice, and nowhere else")  # fmt: skip
        # Any replica's /api/nodes is the fleet: the node, from the replica that holds it; the one down, named
        # (once the third has asked it since it went: until then it counts what it held at the poll before).
        wait_until(lambda: f'nodesampler_peer_up{{peer="{first.pages_url}"}} 0.0' in third.metrics(), 30,
                   "the third to find the first down")  # fmt: skip
        fleet = fleet_view(third)
        [row] = [n for n in fleet["nodes"] if n["node"] == "n1"]
        assert row["state"] == "fresh" and row["replica"] == second.pages_url
        assert {p["peer"]: p["answered"] for p in fleet["peers"]} == {first.pages_url: False, second.pages_url: True}
        not_shown = [p["nodes_not_shown"] for p in fleet["peers"] if p["peer"] == first.pages_url]
        assert not_shown == [0]  # unknown: not counted
        assert "replica" not in [n for n in fleet_view(second)["nodes"] if n["node"] == "n1"][0]  # its own
        assert fleet_view(third, here=True)["nodes"] == []  # ?here=1: this replica's own alone
        # So is its cluster page: the node's row, and the replica that did not answer named.
        with urllib.request.urlopen(f"http://127.0.0.1:{third.pages_port}/", timeout=10) as r:
            page = r.read().decode()
        assert 'href="/node/n1"' in page and f"The replica {first.pages_url} did not answer" in page
        assert re.search(r'id="nodes">1<', page), "the fleet is one node"
        first.start()
        # Whichever holds it then (the agent comes back to its first choice), it is one node, fresh, at one replica.
        wait_until(lambda: len(listing(replicas, "n1")) == 1 and listing(replicas, "n1")[0][1] == "fresh", 30,
                   f"one replica lists the node: {listing(replicas, 'n1')}")  # fmt: skip
        for r in replicas:
            assert [n["state"] for n in fleet_view(r)["nodes"] if n["node"] == "n1"] == ["fresh"]
        up = [r.index for r in replicas if 'llmgw_node_up{node="n1"}' in r.metrics()]
        assert up == [listing(replicas, "n1")[0][0]]
        let_go = 0.0
        for r in replicas:
            text = r.metrics()
            peers_up = re.findall(r'^nodesampler_peer_up\{peer="([^"]+)"\} [01]\.0$', text, re.M)
            assert sorted(peers_up) == sorted(p.pages_url for p in replicas if p is not r)  # itself not a peer
            let_go += float(re.search(r"^nodesampler_nodes_let_go_total (\S+)$", text, re.M)[1])  # type: ignore[index]
        assert let_go >= 1
        logs = {r.pages_url: (tmp_path / f"replica-{r.index}.log").read_text() for r in replicas}
        assert "node n1 is held by" in "".join(logs.values())
        assert not any(f"held by {url}" in said for url, said in logs.items())  # itself, in its --peer list: no peer
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)


def moved_then_died(replicas: list[Replica], tmp_path: Path) -> tuple[Replica, Replica]:
    """n1 at its first choice, which is then stopped (its state file keeping the node): n1 moves to its
    second, and its agent dies there. The first stays down. Returns the first and the second."""
    for r in replicas:
        r.kill(signal.SIGTERM)
        r.extra += ["--stale-after", "3"]  # down soon after its agent dies
        r.start()
    by_url = {r.url: r for r in replicas}
    first, second, _ = (by_url[u] for u in ranked("n1", list(by_url)))
    agent = start_agent(replicas, tmp_path, interval=0.5)
    try:
        wait_until(lambda: listing(replicas, "n1") == [(first.index, "fresh")], 60, "the node at its first choice")
        first.kill(signal.SIGTERM)  # its state file keeps the node
        wait_until(lambda: second.holds_fresh("n1"), 30, "the node at its second choice")
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
    up = [r for r in replicas if r is not first]
    wait_until(lambda: listing(up, "n1") == [(second.index, "stale")], 30, "the node down at its second choice")
    kept = json.loads((tmp_path / f"state-{first.index}.json").read_text())["nodes"]
    assert "n1" in [entry["registration"]["node"] for entry in kept]
    return first, second


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_node_that_moved_and_died_is_down_at_one_replica(replicas: list[Replica], tmp_path: Path) -> None:
    """As processes: the replica a node left comes back from its state file
    knowing the node as it was before it moved, after the node died at its
    new replica. Exactly one replica exports it, down: the one that heard it
    last (before, held lists named fresh nodes alone, and both did, for a week)."""
    first, second = moved_then_died(replicas, tmp_path)
    first.start()  # knows the node from before it moved, heard from earlier than the second did
    wait_until(lambda: len(listing(replicas, "n1")) == 1, 30, f"one replica lists the node: {listing(replicas, 'n1')}")
    assert listing(replicas, "n1") == [(second.index, "stale")]
    assert [r.index for r in replicas if re.search(r'^llmgw_node_up\{node="n1"\} 0$', r.metrics(), re.M)] == [
        second.index]  # fmt: skip


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_node_forgotten_while_a_replica_was_down_stays_forgotten(replicas: list[Replica], tmp_path: Path) -> None:
    """As processes: the node is forgotten (`nodesampler forget`) at the
    replica that holds it while the one it left is down; that one comes back
    from its state file knowing the node, and lets its copy go on its peers'
    word (the forgetting, told in their held lists): no replica exports it."""
    first, second = moved_then_died(replicas, tmp_path)
    forgot = subprocess.run([sys.executable, "-m", "nodesampler", "forget", "n1", "--admin-socket",
                             str(tmp_path / f"admin-{second.index}.sock")], capture_output=True, text=True)  # fmt: skip
    assert forgot.returncode == 0, forgot.stderr
    first.start()
    wait_until(lambda: listing(replicas, "n1") == [], 30, f"no replica lists the node: {listing(replicas, 'n1')}")
    assert "node n1 was forgotten at" in (tmp_path / f"replica-{first.index}.log").read_text()
    assert not any('llmgw_node_up{node="n1"}' in r.metrics() for r in replicas)


async def test_a_peer_proves_itself_on_every_request_and_its_answer_is_checked(aiohttp_client: Any) -> None:
    """The held list is for peers alone: no signature, a node's token, another
    cluster's secret, a challenge used twice or made elsewhere, a request
    signed for another replica, path, method or user: all refused. The answer
    names every node heard from, fresh or stale, with its age, and carries the
    replica's proof. A peer's answer is checked whole: anything not a held
    list (a bad name, a negative or huge age, no replica id) is refused."""
    import msgspec

    from controlplane import pages_api
    from controlplane.fleet import peers
    from controlplane.ingest import agent_api, tokens
    from controlplane.listen.peer_auth import HEADER, PeerAuth
    from controlplane.state.registry import NodeRegistry
    from tests.fakeproc import FakeClock
    from tests.peer_requests import SignedPeer
    from tests.test_controlplane_api import heartbeat, registration
    from wire.schema import Heartbeat, Registration

    secret, clock = b"s3cret-s3cret-s3cret-s3cret", FakeClock()
    registry = NodeRegistry(stale_after=60, clock=clock)
    registry.register(msgspec.convert(registration("n1"), Registration))
    registry.heartbeat(msgspec.convert(heartbeat("n1"), Heartbeat))
    clock.advance(100)  # n1: stale now, and still in the held list (the older copy elsewhere lets go)
    registry.register(msgspec.convert(registration("n3"), Registration))
    registry.heartbeat(msgspec.convert(heartbeat("n3"), Heartbeat))
    registry.register(msgspec.convert(registration("n2"), Registration))  # known, never heard: not held
    registry.register(msgspec.convert(registration("n4"), Registration))
    registry.forget("n4")
    registry.remember_forgotten("n4", clock() - 30)  # an operator forgot it 30 s ago: told to the peers
    app = agent_api.create_app(registry, secret)
    peers.add_routes(app, peers.Peers([], secret, registry, lambda node: None), lambda: pages_api.nodes_json(registry))
    client = await aiohttp_client(app)
    peer, stranger = SignedPeer(client, secret), SignedPeer(client, b"another-cluster-secret")
    for headers in ({}, {"Authorization": f"Bearer {tokens.node_token(secret, 'peer')}"},
                    {"Authorization": "Bearer peer." + hmac.new(secret, b"nodesampler peer token v1",
                                                                hashlib.sha256).hexdigest()},  # the old fixed bearer
                    {HEADER: "from=x; challenge=y; mac=z"}, {HEADER: "\udcff"},
                    await stranger.headers("GET", "/v1/peer/held"),
                    await peer.headers("GET", "/v1/peer/held", target="http://replica-2.example:8080"),
                    await peer.headers("GET", "/v1/peer/nodes"), await peer.headers("POST", "/v1/peer/held"),
                    # Signed for a user, sent without it: another request.
                    {HEADER: (await peer.headers("GET", "/v1/peer/held", user="alice"))[HEADER]}):  # fmt: skip
        assert (await client.get("/v1/peer/held", headers=headers)).status == 401, headers
    # A challenge made by another replica (another process's key) is no challenge here.
    elsewhere = PeerAuth(secret, "elsewhere").challenge()
    made_elsewhere = await peer.headers("GET", "/v1/peer/held", challenge=elsewhere)
    assert (await client.get("/v1/peer/held", headers=made_elsewhere)).status == 401
    signed = await peer.headers("GET", "/v1/peer/held")
    r = await client.get("/v1/peer/held", headers=signed)
    assert r.status == 200, await r.text()
    assert (await client.get("/v1/peer/held", headers=signed)).status == 401  # replayed: its challenge is spent
    answer = peers.parse_held(await r.read())
    holds = dict(answer.nodes)
    assert sorted(holds) == ["n1", "n3"] and 100 <= holds["n1"] < 101 and holds["n3"] < 1
    assert answer.forgotten == [("n4", 30.0)]
    r = await peer.request("GET", "/v1/peer/held")  # and its proof covers the body it sent
    assert r.status == 200
    ok = json.dumps({"replica": "x", "nodes": [["ok-1", 1.5], ["ok-5", 2]]}).encode()
    assert peers.parse_held(ok) == peers.HeldAnswer("x", [("ok-1", 1.5), ("ok-5", 2.0)], [])
    for not_an_answer in (b"[]", b'{"nodes": []}', b"{not json", b'{"replica": "x", "nodes": [["bad name", 1]]}',
                          b'{"replica": "x", "nodes": [["ok", -1]]}', b'{"replica": "x", "nodes": [["ok", null]]}',
                          b'{"replica": "x", "nodes": [["ok", 1' + b"0" * 400 + b"]]}",
                          b'{"replica": "x", "nodes": [["ok", 1e400]]}', b'{"replica": "x", "nodes": ["n4"]}',
                          json.dumps({"replica": "x" * 65, "nodes": []}).encode()):  # fmt: skip
        with pytest.raises(ValueError):
            peers.parse_held(not_an_answer)


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_prometheus_counts_a_moved_node_once_and_fires_no_node_down(replicas: list[Replica], tmp_path: Path) -> None:
    """A real Prometheus scraping all three replicas and evaluating the shipped
    rules: the node is one series before and after its replica goes away and
    comes back, up at whichever holds it, and `NodeDown` never fires."""
    import shutil

    from tests.test_prometheus_live import Stack

    if shutil.which("prometheus") is None:
        pytest.fail("prometheus missing: make setup installs Debian's prometheus")
    root = Path(__file__).resolve().parent.parent
    stack = Stack(tmp_path)
    by_url = {r.url: r for r in replicas}
    first = by_url[ranked("n1", list(by_url))[0]]
    agent = start_agent(replicas, tmp_path, interval=1.0)
    try:
        targets = ", ".join(f"'127.0.0.1:{r.pages_port}'" for r in replicas)
        config = tmp_path / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          f"rule_files: ['{root / 'deploy' / 'alerts.yml'}']\n"
                          "scrape_configs:\n"
                          f"  - job_name: nodesampler\n    static_configs: [{{targets: [{targets}]}}]\n")  # fmt: skip
        stack.start(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                     f"--web.listen-address=127.0.0.1:{stack.prom_port}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stack.wait_ready()
        once = 'count by (node) (llmgw_node_up{node="n1"})'
        stack.wait_for(once, lambda r: len(r) == 1 and float(r[0]["value"][1]) == 1)
        stack.wait_for('llmgw_node_up{node="n1"}', lambda r: len(r) == 1 and float(r[0]["value"][1]) == 1)
        first.kill(signal.SIGTERM)
        stack.wait_for('llmgw_node_up{node="n1"} == 1', lambda r: len(r) == 1 and r[0]["metric"]["instance"]
                       != f"127.0.0.1:{first.pages_port}", timeout=60)  # fmt: skip
        first.start()  # back with its state file: it knew the node
        stack.wait_for('up{job="nodesampler"} == 1', lambda r: len(r) == 3)
        # Held at one replica: counted once, up, whichever it is.
        stack.wait_for(once, lambda r: len(r) == 1 and float(r[0]["value"][1]) == 1, timeout=60)
        stack.wait_for('llmgw_node_up{node="n1"}', lambda r: len(r) == 1 and float(r[0]["value"][1]) == 1)
        assert stack.query('ALERTS{alertname="NodeDown"}') == []
        # Over the whole run, as Prometheus saw it every second: up at two replicas at once only within a
        # scrape of each move (the one it left scraped once more before it let go), never for a poll.
        twice = stack.query('count_over_time((count by (node) (llmgw_node_up{node="n1"} == 1) > 1)[5m:1s])')
        assert twice == [] or float(twice[0]["value"][1]) <= 4, twice
        # Never known down anywhere: the replica that came back let it go before it served a scrape.
        assert stack.query('max_over_time((llmgw_node_up{node="n1"} == 0)[5m:1s])') == []
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        stack.stop()


async def test_a_node_told_arrived_at_a_peer_is_let_go_if_silent_here(aiohttp_client: Any) -> None:
    import msgspec

    from controlplane import pages_api
    from controlplane.fleet import peers
    from controlplane.ingest import agent_api
    from controlplane.state.registry import NodeRegistry
    from tests.fakeproc import FakeClock
    from tests.peer_requests import SignedPeer
    from tests.test_controlplane_api import heartbeat, registration
    from wire.schema import Heartbeat, Registration

    secret, clock = b"s3cret-s3cret-s3cret-s3cret", FakeClock()
    registry = NodeRegistry(stale_after=60, clock=clock)
    for node in ("n1", "n2"):
        registry.register(msgspec.convert(registration(node), Registration))
        registry.heartbeat(msgspec.convert(heartbeat(node), Heartbeat))
    app = agent_api.create_app(registry, secret)
    gone: list[str] = []

    def let_go(node: str) -> None:
        gone.append(node)
        registry.forget(node)

    replicas = peers.Peers([], secret, registry, let_go)
    peers.add_routes(app, replicas, lambda: pages_api.nodes_json(registry))
    client = await aiohttp_client(app)
    peer = SignedPeer(client, secret)
    clock.advance(peers.ARRIVED_AFTER_S / 2)
    told = {"replica": "another", "nodes": ["n1", "unknown"]}
    r = await peer.request("POST", "/v1/peer/arrived", json=told)
    assert (await r.json()) == {"let_go": 0} and gone == []  # it spoke here just now: the polls settle it
    clock.advance(peers.ARRIVED_AFTER_S)
    r = await peer.request("POST", "/v1/peer/arrived", json=told)
    assert (await r.json()) == {"let_go": 1} and gone == ["n1"] and registry.get("n2") is not None
    assert (await client.post("/v1/peer/arrived", json=told)).status == 401
    bad: Any
    for bad in ([], {"replica": "another", "nodes": ["n2", "bad name"]}, {"replica": "another", "nodes": [7]}):
        assert (await peer.request("POST", "/v1/peer/arrived", json=bad)).status == 400
    assert registry.get("n2") is not None  # a bad telling changes nothing
    # A telling of 60,000 names of 64 bytes (a whole fleet moved at once, ~4 MB): read whole, not cut short.
    many = [f"ip-10-{i >> 16}-{(i >> 8) & 255}-{i & 255}.eu-west-1.compute.internal-xxxxxxxxxxxxxxx"[:64]
            for i in range(peers.MAX_ARRIVALS)]  # fmt: skip
    r = await peer.request("POST", "/v1/peer/arrived", json={"replica": "another", "nodes": many})
    assert r.status == 200 and (await r.json()) == {"let_go": 0}


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_webhook_to_any_replica_captures_each_node_where_it_is_held(replicas: list[Replica],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """Alertmanager's webhook sent to a replica that does not hold the node:
    the incident is started at the replica that does (its samples are in
    that node's answers there), and the answer says where."""
    from tests.test_up import UnixConnection, request

    by_url = {r.url: r for r in replicas}
    holder, other, _ = (by_url[u] for u in ranked("n1", list(by_url)))
    agent = start_agent(replicas, tmp_path, interval=0.5)
    try:
        wait_until(lambda: holder.holds_fresh("n1"), 60, "the node at its first choice")
        # The other replica learns who holds it at its next poll.
        wait_until(lambda: 'nodesampler_peer_nodes{peer="' + holder.pages_url + '"} 1.0' in other.metrics(), 30,
                   "the other replica knows the holder")  # fmt: skip
        alert = {"version": "4", "alerts": [{"status": "firing", "labels": {"alertname": "NodeCPUSaturated",
                                                                           "node": "n1"},
                                             "fingerprint": "f1"}]}  # fmt: skip
        status, body = request(UnixConnection(tmp_path / f"admin-{other.index}.sock"), "POST", "/api/alertmanager",
                               alert)  # fmt: skip
        assert status == 200, body
        answer = json.loads(body)
        assert answer["started"] is None and answer["forwarded"][holder.pages_url]["nodes"] == ["n1"], answer
        started = answer["forwarded"][holder.pages_url]["started"]
        with urllib.request.urlopen(f"http://127.0.0.1:{holder.pages_port}/api/incidents", timeout=10) as r:
            assert started_by(r, "alertmanager") == [started]
        with urllib.request.urlopen(f"http://127.0.0.1:{other.pages_port}/api/incidents", timeout=10) as r:
            assert json.loads(r.read())["incidents"] == []
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)


def started_by(answer: Any, source: str) -> list[str]:
    """The incidents of an /api/incidents answer that `source` started. The
    agent here watches this machine's busiest groups, and on a loaded machine
    one may be judged starved and start an incident of its own (CI saw one)."""
    incidents = json.loads(answer.read())["incidents"]
    assert all(i["source"] in (source, "starvation") for i in incidents), incidents
    return [i["id"] for i in incidents if i["source"] == source]


def live_windows(replica: Replica, node: str, count: int) -> list[dict[str, Any]]:
    """The first `count` window events of the node's live view on `replica`'s pages."""
    events = []
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.pages_port}/node/{node}/live", timeout=30) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        kind = None
        for line in r:
            text = line.decode().rstrip("\n")
            if text.startswith("event: "):
                kind = text[7:]
                assert kind == "window", text
            elif text.startswith("data: ") and kind == "window":
                events.append(json.loads(text[6:]))
                if len(events) == count:
                    return events
    raise AssertionError(f"the stream ended after {len(events)} windows")


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_node_held_elsewhere_is_read_through_any_replica(replicas: list[Replica], tmp_path: Path) -> None:
    """A node held by one replica, read through another's pages: its page,
    its live view (every window, every sample of it), a span of its
    hindsight and its incidents are the holder's, sent on as they come."""
    import urllib.error

    from tests.test_up import UnixConnection, request

    by_url = {r.url: r for r in replicas}
    holder, other, _ = (by_url[u] for u in ranked("n1", list(by_url)))
    agent = start_agent(replicas, tmp_path, interval=0.5, hindsight="1")
    try:
        wait_until(lambda: holder.holds_fresh("n1"), 60, "the node at its first choice")
        wait_until(lambda: 'nodesampler_peer_nodes{peer="' + holder.pages_url + '"} 1.0' in other.metrics(), 30,
                   "the other replica knows the holder")  # fmt: skip
        assert "n1" not in other.nodes()  # the other replica knows nothing of it itself
        pages = f"http://127.0.0.1:{other.pages_port}"
        with urllib.request.urlopen(f"{pages}/node/n1", timeout=10) as r:
            page = r.read().decode()
        assert r.status == 200 and "n1" in page and "/node/n1/live" in page
        # Live: consecutive windows, each with every sample its window counted.
        windows = live_windows(other, "n1", 6)
        seqs = [w["seq"] for w in windows]
        assert seqs == list(range(seqs[0], seqs[0] + 6)), seqs
        for w in windows:
            [machine] = [s for s in w["series"] if s["key"] == "machine"]
            assert w["samples"] > 0 and len(machine["v"]) == len(machine["us"]) == w["samples"]
        # A span of its hindsight, asked for and read through the other replica; fetched at the holder.
        status, body = request(UnixConnection(tmp_path / f"admin-{other.index}.sock"), "POST",
                               "/api/nodes/n1/hindsight", {"at": time.time() - 2})  # fmt: skip
        assert status == 202, body
        span = json.loads(body)
        with urllib.request.urlopen(f"{pages}{span['url']}", timeout=10) as r:
            assert json.loads(r.read())["id"] == span["id"]
        with urllib.request.urlopen(f"http://127.0.0.1:{holder.pages_port}{span['url']}", timeout=10) as r:
            assert r.status == 200  # it is the holder's
        # An operator's incident started through the other replica is the holder's, and read through any.
        status, body = request(UnixConnection(tmp_path / f"admin-{other.index}.sock"), "POST", "/api/incidents",
                               {"nodes": ["n1"], "reason": "a test"})  # fmt: skip
        assert status == 202, body
        incident = json.loads(body)["id"]
        with urllib.request.urlopen(f"http://127.0.0.1:{holder.pages_port}/api/incidents", timeout=10) as r:
            assert started_by(r, "operator") == [incident]
        with urllib.request.urlopen(f"{pages}/api/incidents?node=n1", timeout=10) as r:
            assert started_by(r, "operator") == [incident]
        with urllib.request.urlopen(f"{pages}/api/incidents/{incident}", timeout=10) as r:
            assert json.loads(r.read())["id"] == incident
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{pages}/api/incidents/no-such-one", timeout=10)
        assert missing.value.code == 404
        counted = r'^nodesampler_forwarded_requests_total\{result="answered"\} (\S+)$'
        answered = re.search(counted, other.metrics(), re.M)
        # The page, the stream, the span asked and read, the incident started, listed and read.
        assert answered is not None and float(answered[1]) == 7
        # An operator forgets a node at every replica that knows it.
        status, body = request(UnixConnection(tmp_path / f"admin-{other.index}.sock"), "DELETE",
                               "/api/nodes/n1?force=1")  # its agent still sends: forced
        assert status == 200 and json.loads(body)["replicas"] == [holder.pages_url], body
        status, body = request(UnixConnection(tmp_path / f"admin-{other.index}.sock"), "DELETE", "/api/nodes/n9")
        assert status == 404, body
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)


async def test_a_forwarded_request_is_checked_and_never_sent_on(aiohttp_client: Any, unused_tcp_port: int) -> None:
    """The pages take a peer's signed request (only given peers): one signed
    with another secret is 401; a signed one is served for the host it
    was signed for, with no more rights than this replica gives the user it
    names (a user its web config lacks has none); a request about a node a
    peer holds is sent to that peer's --peer URL, and a peer that does not
    answer is a 502 that names it; a request a peer forwarded is served
    here, never sent on."""
    import msgspec

    from controlplane.fleet import forward, peers
    from controlplane.listen.page_access import ADMIN_SOCKET_USER
    from controlplane.state.registry import NodeRegistry
    from tests.peer_requests import SignedPeer, replica_pages
    from tests.test_controlplane_api import heartbeat, registration
    from wire.schema import Heartbeat, Registration

    secret = b"s3cret-s3cret-s3cret-s3cret"
    registry = NodeRegistry(stale_after=60)
    for node in ("n1", "n2", "n3"):
        registry.register(msgspec.convert(registration(node), Registration))
        registry.heartbeat(msgspec.convert(heartbeat(node), Heartbeat))
    replicas = peers.Peers([f"http://127.0.0.1:{unused_tcp_port}"], secret, registry, lambda node: None)
    [peer] = replicas.peers  # nobody listens there
    peer.instance, peer.holds, peer.answered_at = "another", {"n1": 0.0}, registry.clock() + 5  # fresher than ours
    app = replica_pages(registry, replicas, hosts=["pages.example"])
    client = await aiohttp_client(app)
    signer = SignedPeer(client, secret)
    target = "http://replica-2.example"  # this replica's name, as a peer's --peer list has it

    async def signed(method: str, path: str, user: str = "") -> dict[str, str]:
        return {**await signer.headers(method, path, user, target=target), "Host": "replica-2.example"}

    assert (await client.get("/api/nodes", headers={"Host": "evil.example"})).status == 421
    stranger = SignedPeer(client, b"another-cluster-secret")
    wrong = {**await stranger.headers("GET", "/api/nodes", target=target), "Host": "replica-2.example"}
    assert (await client.get("/api/nodes", headers=wrong)).status == 401
    assert (await client.get("/api/nodes", headers=await signed("GET", "/api/nodes"))).status == 200
    # Signed for another host than the one it reached: refused.
    elsewhere = {**await signed("GET", "/api/nodes"), "Host": "replica-3.example"}
    assert (await client.get("/api/nodes", headers=elsewhere)).status == 401
    # A peer's request is served here: n2 is forgotten here only with rights this replica gives.
    assert (await client.delete("/api/nodes/n2", headers=await signed("DELETE", "/api/nodes/n2"))).status == 403
    alice = await signed("DELETE", "/api/nodes/n2?force=1", "alice")  # no such user here: no rights
    assert (await client.delete("/api/nodes/n2?force=1", headers=alice)).status == 403
    # The user is in the MAC: a request signed for nobody does not become alice's.
    renamed = {**await signed("DELETE", "/api/nodes/n2?force=1"), "X-Nodesampler-User": ADMIN_SOCKET_USER}
    assert (await client.delete("/api/nodes/n2?force=1", headers=renamed)).status == 401
    admin = await signed("DELETE", "/api/nodes/n2?force=1", ADMIN_SOCKET_USER)  # the forwarder's admin socket
    assert (await client.delete("/api/nodes/n2?force=1", headers=admin)).status == 200
    # A client's request about n1 goes to its holder's --peer URL, which does not answer.
    async with peers_sessions(replicas):
        r = await client.get("/api/nodes", headers={"Host": "pages.example"})
        assert r.status == 200
        r = await client.get("/node/n1", headers={"Host": "pages.example"})
        assert r.status == 502 and peer.url in await r.text()
        assert app[forward.FORWARDER].failed == 1
        r = await client.get("/node/n1", headers=await signed("GET", "/node/n1"))  # from a peer: served here
        assert r.status == 200 and "n1" in await r.text()


@contextlib.asynccontextmanager
async def peers_sessions(replicas: Any) -> Any:
    """The sessions `polled` gives a replica's peers, for a test that polls by hand."""
    import aiohttp

    async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as forwarding:
        replicas.session, replicas.forwarding = session, forwarding
        try:
            yield
        finally:
            replicas.session = replicas.forwarding = None


def held_here(replicas: list[Replica]) -> dict[int, set[str]]:
    """The nodes each live replica holds fresh (its own, `?here=1`)."""
    out = {}
    for r in replicas:
        if r.process is not None and r.process.poll() is None:
            out[r.index] = {n for n, row in r.nodes().items() if row["state"] == "fresh"}
    return out


def up_series(replica: Replica) -> list[str]:
    return re.findall(r'^llmgw_node_up\{node="([^"]+)"\} 1$', replica.metrics(), re.M)


@pytest.mark.live
@pytest.mark.timing
@pytest.mark.parametrize("replicas", [True], indirect=True, ids=["peers"])
def test_a_fleet_over_three_replicas_survives_one_killed_and_its_return(replicas: list[Replica]) -> None:
    """300 nodes over three replicas: each held by exactly one, its first
    choice; one replica `kill -9`: its nodes' next windows go to their next
    choices (no window lost), each node once in every survivor's fleet view;
    it comes back: its third of the fleet returns to it, and no node is
    counted twice, in any replica's /metrics."""
    from tests.simulated_fleet import SimulatedFleet

    urls = [r.url for r in replicas]
    fleet = SimulatedFleet(urls, b"s3cret-s3cret-s3cret-s3cret", nodes=300, interval=1.0)
    first = {node: ranked(node, urls)[0] for node in fleet.nodes}

    def at_first_choices() -> bool:
        held = held_here(replicas)
        return all(held.get(r.index, set()) == {n for n, u in first.items() if u == r.url} for r in replicas)

    fleet.start()
    try:
        wait_until(at_first_choices, 60, "every node at its first choice")
        assert all(0.25 < sum(u == r.url for u in first.values()) / 300 < 0.42 for r in replicas)
        # The fleet's picture on any replica is the whole fleet's: each replica's part, asked of it.
        for r in replicas:
            with urllib.request.urlopen(f"{r.pages_url}/", timeout=30) as page:
                legend = re.search(r'data-legend="([^"]+)"', page.read().decode())
            assert legend is not None
            with urllib.request.urlopen(r.pages_url + html.unescape(legend.group(1)), timeout=30) as answer:
                rows = json.loads(answer.read())["rows"]
            assert sorted(n for row in rows for n in row["nodes"]) == sorted(fleet.nodes)
        victim = replicas[1]
        victims = {n for n, u in first.items() if u == victim.url}
        victim.kill()  # SIGKILL: no goodbye, its state file as it was last written
        survivors = [r for r in replicas if r is not victim]
        wait_until(lambda: set().union(*held_here(survivors).values()) == set(fleet.nodes), 30,
                   "every node fresh at a survivor")  # fmt: skip
        moved = {n for n, u in fleet.held_by.items() if u != first[n]}
        assert moved == victims and all(fleet.held_by[n] == ranked(n, urls)[1] for n in moved)
        assert sum(fleet.lost.values()) == 0 and not fleet.refused, (fleet.lost, fleet.refused)
        for r in survivors:  # the whole fleet on each, once; the one down named
            view = fleet_view(r)
            assert sorted(n["node"] for n in view["nodes"]) == sorted(fleet.nodes)
            assert [p["peer"] for p in view["peers"] if not p["answered"]] == [victim.pages_url]
        victim.start()  # back on the same address, from its state file
        wait_until(at_first_choices, 60, "its third of the fleet back at the replica that came back")
        # Let go where they were within a poll: one `llmgw_node_up 1` a node, all replicas together.
        def counted() -> collections.Counter[str]:
            return collections.Counter(n for r in replicas for n in up_series(r))

        try:
            wait_until(lambda: counted() == collections.Counter(fleet.nodes), 15, "each node up at one replica")
        except AssertionError:
            now = counted()
            raise AssertionError(f"twice: {sorted(n for n, k in now.items() if k > 1)[:10]}, "
                                 f"nowhere: {sorted(set(fleet.nodes) - set(now))[:10]}") from None
        assert not any(re.search(r"^llmgw_node_up\{[^}]*\} 0", r.metrics(), re.M) for r in replicas)
        assert sum(fleet.lost.values()) == 0 and not fleet.refused, (fleet.lost, fleet.refused)
    finally:
        fleet.stop()


def test_the_fleet_charts_of_three_replicas_added_are_the_whole_fleets() -> None:
    """Each replica's totals of a fleet chart for its own nodes, sent as a
    peer sends them and added, draw what one history of every node draws:
    the mean of the cards (`avg`) and their sum, at every instant."""
    from controlplane.fleet.cluster_view import FLEET_CHARTS, chart_parts, chart_parts_json, parse_chart_parts
    from controlplane.history.backends import EmbeddedHistory, combine, step_grid
    from tests.heartbeats import held

    now, span, step = 100_000.0, 600.0, 10.0
    whole = EmbeddedHistory(interval=5, stale_after=60)
    replicas = [EmbeddedHistory(interval=5, stale_after=60) for _ in range(3)]
    for i in range(30):
        for t in range(0, int(span), 5 + i % 3):  # nodes heartbeat at their own instants
            gpus = [{"index": g, "name": "H200" if i % 2 else "A100",
                     "utilization_percent": float((i * 7 + t + g) % 100), "memory_used_bytes": 1000 * i + g}
                    for g in range(2)]  # fmt: skip
            hb = held({"node": f"n{i}", "gpus": gpus})
            whole.record(f"n{i}", hb, at=now - span + t)
            replicas[i % 3].record(f"n{i}", hb, at=now - span + t)
    grid = step_grid(now - span, now, step)
    sent = [parse_chart_parts(json.loads(chart_parts_json(chart_parts(r, now, span, step))), len(grid))
            for r in replicas]  # fmt: skip
    for k, spec in enumerate(FLEET_CHARTS):
        expected = whole.query_now(spec, now - span, now, step)
        got = combine(spec, grid, [part[k] for part in sent])
        assert [s.label for s in got] == [s.label for s in expected] == ["A100", "H200"]
        for g, e in zip(got, expected, strict=True):
            assert (g.t == e.t).all() and np.allclose(g.v, e.v, equal_nan=True, rtol=1e-6), spec
    with pytest.raises(ValueError):
        parse_chart_parts({"charts": [{"H200": [[1.0], [1], [1.0]]}, {}]}, len(grid))  # not the grid's length


async def test_a_peers_ask_for_fleet_chart_totals_is_checked(aiohttp_client: Any) -> None:
    """The totals are a peer's alone (its token), and an ask that is no chart's
    (not finite, a span over two hours, more steps than a chart has) is 400."""
    from controlplane import pages_api
    from controlplane.fleet import peers
    from controlplane.fleet.cluster_view import parse_chart_parts
    from controlplane.history.backends import EmbeddedHistory
    from controlplane.ingest import agent_api
    from controlplane.state.registry import NodeRegistry
    from tests.heartbeats import held
    from tests.peer_requests import SignedPeer

    secret = b"s3cret-s3cret-s3cret-s3cret"
    registry, history = NodeRegistry(stale_after=60), EmbeddedHistory(interval=5)
    history.record("n1", held({"node": "n1", "gpus": [{"index": 0, "name": "H200", "utilization_percent": 40.0}]}),
                   at=time.time() - 5)  # fmt: skip
    app = agent_api.create_app(registry, secret)
    peers.add_routes(app, peers.Peers([], secret, registry, lambda node: None), lambda: pages_api.nodes_json(registry),
                     history)  # fmt: skip
    client = await aiohttp_client(app)
    peer = SignedPeer(client, secret)
    ask = f"/v1/peer/fleet-charts?end={time.time()}&span=3600&step=7.25"
    assert (await client.get(ask)).status == 401
    r = await peer.request("GET", ask)
    [utilisation, memory] = parse_chart_parts(await r.json(), 497)
    assert r.status == 200 and list(utilisation) == ["H200"] and memory == {}
    assert utilisation["H200"][1].max() == 1 and utilisation["H200"][0].max() == 40.0
    for bad in ("end=nan&span=60&step=1", "end=1e9&span=86400&step=60", "end=1e9&span=3600&step=0.1", "end=1e9"):
        assert (await peer.request("GET", f"/v1/peer/fleet-charts?{bad}")).status == 400, bad


def test_a_span_of_a_node_that_moves_mid_capture_is_named_missing_never_filled() -> None:
    """A replica lets go of a node that moved while its span is fetched: the
    rest of the span is missing, saying why; the replica it moved to knows
    no such span, so nothing fills it."""
    from controlplane.samples.hindsight import HindsightFetches

    fetches = HindsightFetches()
    now = fetches.wall()
    fetch = fetches.ask("n1", now - 60, now - 10, "an incident", held_seconds=900.0)
    fetches.forget("n1", "the node moved to another replica: the rest was not fetched")
    assert fetch.finished_at is not None and fetches.get(fetch.id) is fetch
    assert fetch.missing == [{"from": round(now - 60, 6), "to": round(now - 10, 6),
                              "why": "the node moved to another replica: the rest was not fetched"}]  # fmt: skip
    assert fetch.series == {}


async def test_a_view_draws_the_step_before_while_the_fleets_parts_are_summed() -> None:
    """The fleet charts' parts are summed once a step in the background: the
    first view waits for them; a view while the next step's are summed draws
    the step before's at once; then the new step's."""
    from aiohttp import web

    from controlplane.history.backends import EmbeddedHistory
    from controlplane.listen.page_worker import PAGE_WORKER, PageWorker
    from controlplane.pages_api import FLEET_CHART_PARTS
    from web.pages import FleetChartsKept

    asked: list[float] = []
    release, second = asyncio.Event(), asyncio.Event()

    async def peers_parts(end: float, span: float, step: float) -> tuple[list[Any], list[str]]:
        asked.append(end)
        if len(asked) > 1:
            second.set()
            await release.wait()  # the peers are slow to sum the second step
        return [], ["http://peer:8081: down"]

    app = web.Application()
    app[PAGE_WORKER] = PageWorker()
    app[FLEET_CHART_PARTS] = peers_parts
    kept, history, step = FleetChartsKept(), EmbeddedHistory(), 7.0
    end, (parts, missing) = await kept.newest(app, history, 700.0, step)
    assert end == 700.0 and len(parts) == 1 and missing == ["http://peer:8081: down"]
    end, _ = await kept.newest(app, history, 707.0, step)
    assert end == 700.0  # drawn at once from the step before
    await second.wait()  # ... while the new one is summed
    end, _ = await kept.newest(app, history, 707.0, step)
    assert end == 700.0 and asked == [700.0, 707.0]  # not asked twice
    release.set()
    assert kept.summing is not None
    await kept.summing
    end, _ = await kept.newest(app, history, 707.0, step)
    assert end == 707.0 and asked == [700.0, 707.0]
    app[PAGE_WORKER].close()
