"""One series per node after any fault: random sequences of agents moving
and dying, replicas killed (with their state file as last saved, or saved
at a SIGTERM) and restarted from it, partitions between replicas, and
operators forgetting nodes, against three replicas; after each quiet
period (every replica up, no partition, a few polls), each node is exported
by exactly one replica, and a node forgotten while its agent is stopped by
none (hypothesis, property-based).

The replicas are the control plane's own parts (NodeRegistry, its state
file, Peers' held answers and their settling) on one fake clock; what is
not run is the HTTP between them, which the process tests
(tests/test_replicas.py, tests/test_replicas_at_size.py) and the hostile
peer's (tests/test_hostile_peer.py) exercise."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.fleet import peers
from controlplane.state import registry_state
from controlplane.state.registry import NodeRegistry, UnknownNode
from sampler.agent.replicas import ranked
from tests.fakeproc import FakeClock
from tests.test_controlplane_api import heartbeat, registration
from wire.schema import Heartbeat, Registration

REPLICAS = 3
NODES = [f"ip-10-0-0-{i}.eu-west-1.compute.internal" for i in range(6)]
URLS = [f"https://nodesampler-controlplane-{i}.nodesampler-controlplane:8080" for i in range(REPLICAS)]
TICK_S = 5.0  # a heartbeat interval and a poll
SAVE_EVERY_TICKS = 6  # the state file every SAVE_EVERY_S (30 s)
SECRET = b"s3cret-s3cret-s3cret-s3cret"


@dataclass
class Replica:
    index: int
    state_file: Path
    clock: FakeClock
    registry: NodeRegistry | None = None  # None: down
    peers: peers.Peers | None = None

    def start(self) -> None:
        registry = self.registry = NodeRegistry(stale_after=60, clock=self.clock)
        registry_state.load(registry, self.state_file)
        self.peers = peers.Peers(URLS, SECRET, registry, lambda node: None if registry.forget(node) else None)

    def save(self) -> None:
        assert self.registry is not None
        registry_state.write(self.state_file, registry_state.encoded(self.registry))


@dataclass
class Fleet:
    tmp: Path
    clock: FakeClock = field(default_factory=lambda: FakeClock(1000.0))
    replicas: list[Replica] = field(default_factory=list)
    agents: dict[str, bool] = field(default_factory=dict)  # node -> its agent runs
    at: dict[str, int] = field(default_factory=dict)  # node -> the replica its agent heartbeats to
    cut: set[frozenset[int]] = field(default_factory=set)  # replicas that cannot reach each other
    forgotten: set[str] = field(default_factory=set)  # forgotten by an operator since its agent last ran
    ticks: int = 0

    def __post_init__(self) -> None:
        self.replicas = [Replica(i, self.tmp / f"state-{i}.json", self.clock) for i in range(REPLICAS)]
        for r in self.replicas:
            r.start()
        self.agents = dict.fromkeys(NODES, True)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.registry is not None]

    def reach(self, a: int, b: int) -> bool:
        return self.replicas[b].registry is not None and frozenset((a, b)) not in self.cut

    # --- what happens ---------------------------------------------------------------------

    def tick(self) -> None:
        self.clock.advance(TICK_S)
        self.ticks += 1
        for node, runs in self.agents.items():
            if runs:
                self.send(node)
        for r in self.up():
            self.poll(r)
        if self.ticks % SAVE_EVERY_TICKS == 0:
            for r in self.up():
                r.save()

    def send(self, node: str) -> None:
        """The agent's window, to its first choice that is up (it moves at once, and back at once)."""
        up = [URLS.index(u) for u in ranked(node, URLS) if self.replicas[URLS.index(u)].registry is not None]
        if not up:
            return
        target = self.replicas[up[0]]
        assert target.registry is not None and target.peers is not None
        try:
            target.registry.heartbeat(msgspec.convert(heartbeat(node), Heartbeat))
        except UnknownNode:  # it registers, and the peers it reaches are told
            target.registry.register(msgspec.convert(registration(node), Registration))
            target.registry.heartbeat(msgspec.convert(heartbeat(node), Heartbeat))
            for other in self.up():
                if other is not target and self.reach(target.index, other.index):
                    assert other.peers is not None
                    other.peers.told_arrived([node])
        self.at[node] = target.index

    def poll(self, r: Replica) -> None:
        assert r.peers is not None
        for peer in r.peers.peers:
            j = URLS.index(peer.url)
            other = self.replicas[j]
            if j == r.index or self.reach(r.index, j):
                assert other.registry is not None and other.peers is not None
                r.peers.heard(peer, peers.held_answer(other.registry, other.peers.instance))
            else:
                r.peers.heard(peer, None, "ConnectionRefusedError")
        r.peers.settle()

    def kill_replica(self, i: int, saved: bool) -> None:
        r = self.replicas[i]
        if r.registry is not None and len(self.up()) > 1:
            if saved:  # SIGTERM: the state file written last
                r.save()
            r.registry = r.peers = None

    def start_replica(self, i: int) -> None:
        if self.replicas[i].registry is None:
            self.replicas[i].start()

    def stop_agent(self, n: int) -> None:
        self.agents[NODES[n]] = False

    def start_agent(self, n: int) -> None:
        self.agents[NODES[n]] = True
        self.forgotten.discard(NODES[n])

    def forget(self, n: int, via: int) -> None:
        """An operator's `nodesampler forget --force`, its agent stopped first: at every
        replica the one asked reaches (forward.py's `_forget_everywhere`), each saving its state."""
        node = NODES[n]
        if self.agents[node] or self.replicas[via].registry is None:
            return
        forgot = False
        for r in self.up():
            if (r.index == via or self.reach(via, r.index)) and r.registry is not None and r.registry.forget(node):
                r.registry.remember_forgotten(node, self.clock())
                r.save()
                forgot = True
        if forgot:
            self.forgotten.add(node)

    def known(self) -> set[str]:
        """The nodes some replica knows, up or in the state file it will start from."""
        known = {s.node for r in self.up() if r.registry is not None for s in r.registry.nodes()}
        for r in self.replicas:
            if r.registry is None:
                down = NodeRegistry(stale_after=60, clock=self.clock)
                registry_state.load(down, r.state_file)
                known |= {s.node for s in down.nodes()}
        return known

    def quiet(self) -> None:
        """Every replica up, no partition, a few polls: then each node at one replica, or at none if
        forgotten. (A node whose agent is stopped and that no replica knows, or whose replica died
        before saving it, is at none: nothing can know it.)"""
        known = self.known()
        self.cut.clear()
        for i in range(REPLICAS):
            self.start_replica(i)
        for _ in range(3):
            self.tick()
        self.check(known)

    def check(self, known: set[str]) -> None:
        for node in NODES:
            exported = [r.index for r in self.up() if r.registry is not None and r.registry.get(node) is not None]
            if node in self.forgotten:
                assert exported == [], f"{node}, forgotten, exported by {exported}"
            elif self.agents[node]:
                assert exported == [self.at[node]], f"{node} heartbeats to {self.at[node]}, exported by {exported}"
            elif node in known:
                assert len(exported) == 1, f"{node} exported by {exported}"
            else:
                assert exported == [], f"{node}, known nowhere, exported by {exported}"


STEP = st.one_of(
    st.just(("tick",)),
    st.tuples(st.just("kill_replica"), st.integers(0, REPLICAS - 1), st.booleans()),
    st.tuples(st.just("start_replica"), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("stop_agent"), st.integers(0, len(NODES) - 1)),
    st.tuples(st.just("start_agent"), st.integers(0, len(NODES) - 1)),
    st.tuples(st.just("partition"), st.integers(0, REPLICAS - 1), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("forget"), st.integers(0, len(NODES) - 1), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("wait"), st.integers(1, 40)),  # ticks: long enough for nodes to go stale
    st.just(("quiet",)),
)


def run(fleet: Fleet, steps: list[tuple[Any, ...]]) -> None:
    fleet.tick()
    for step in steps:
        match step:
            case ("tick",):
                fleet.tick()
            case ("kill_replica", i, saved):
                fleet.kill_replica(i, saved)
            case ("start_replica", i):
                fleet.start_replica(i)
            case ("stop_agent", n):
                fleet.stop_agent(n)
            case ("start_agent", n):
                fleet.start_agent(n)
            case ("partition", a, b):
                if a != b:
                    fleet.cut.add(frozenset((a, b)))
            case ("forget", n, via):
                fleet.forget(n, via)
            case ("wait", ticks):
                for _ in range(ticks):
                    fleet.tick()
            case ("quiet",):
                fleet.quiet()
    fleet.quiet()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, max_size=40))
def test_after_any_faults_each_node_is_exported_by_exactly_one_replica(
        steps: list[tuple[Any, ...]], tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    fleet = Fleet(tmp_path_factory.mktemp("faults"))
    # The state file's wall times on the fleet's clock: a replica down for a while comes back that much later.
    monkeypatch.setattr(registry_state, "time", types.SimpleNamespace(time=lambda: fleet.clock() + 1.7e9))
    run(fleet, steps)


def test_a_node_forgotten_while_a_replica_was_down_does_not_come_back_from_its_state_file(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The case the review found, spelled out: before, the replica that was
    down brought the node back from its state file, and exported it, down,
    for a week."""
    fleet = Fleet(tmp_path)
    monkeypatch.setattr(registry_state, "time", types.SimpleNamespace(time=lambda: fleet.clock() + 1.7e9))
    node = NODES[0]
    fleet.tick()
    holder = fleet.at[node]
    fleet.replicas[holder].save()
    fleet.kill_replica(holder, saved=True)
    fleet.tick()  # the node moved to its second choice
    moved_to = fleet.at[node]
    fleet.stop_agent(0)
    fleet.forget(0, via=moved_to)  # forgotten where it is, while its first replica is down
    assert (registry := fleet.replicas[moved_to].registry) is not None and registry.get(node) is None
    fleet.start_replica(holder)  # back, from its state file: it knows the node, heard from before the forgetting
    assert (registry := fleet.replicas[holder].registry) is not None and registry.get(node) is not None
    fleet.quiet()  # its polls: the peers' tombstones, and it lets the node go
    assert all(r.registry is not None and r.registry.get(node) is None for r in fleet.replicas)


def test_a_node_that_moved_and_died_is_down_at_one_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, held lists carried fresh nodes alone: a node that moved and
    then died was `llmgw_node_up 0` at two replicas until --forget-after."""
    fleet = Fleet(tmp_path)
    monkeypatch.setattr(registry_state, "time", types.SimpleNamespace(time=lambda: fleet.clock() + 1.7e9))
    node = NODES[1]
    fleet.tick()
    first = fleet.at[node]
    fleet.kill_replica(first, saved=True)
    fleet.tick()
    second = fleet.at[node]
    fleet.stop_agent(1)
    for _ in range(20):  # stale everywhere (100 s)
        fleet.tick()
    fleet.start_replica(first)  # it comes back knowing the node, from before it moved
    fleet.quiet()
    exported = [r.index for r in fleet.replicas if r.registry is not None and r.registry.get(node) is not None]
    assert exported == [second]
