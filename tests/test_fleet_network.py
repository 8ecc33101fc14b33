"""A small fleet across a real network path: three agents, each in a network
namespace of the test's making, heartbeat to a control plane in another, over
veth pairs (pyroute2). One agent's link is cut for 30 s, then throttled to a
trickle (tbf) while nftables drops a share of its packets: that node goes
stale and comes back alone; the others never notice.

Root only (namespaces); every address lives inside the test's namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REQUIRE_BPF

pytestmark = pytest.mark.live

AGENTS = 3
PORT = 8081
STALE_AFTER = 3.0

POLLER = """
import json, sys, time, urllib.request
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:8080/api/nodes", timeout=2) as r:
            nodes = json.load(r)["nodes"]
        print(json.dumps({n["node"]: n["state"] for n in nodes}), flush=True)
    except Exception as e:
        print(json.dumps({"error": str(e)}), flush=True)
    time.sleep(0.2)
"""


class Network:
    """Namespaces cp and a0..aN; a veth pair from cp to each agent, 10.77.I.0/30."""

    def __init__(self) -> None:
        from pyroute2 import IPRoute, NetNS, netns

        tag = uuid.uuid4().hex[:6]
        self.cp = f"ns-cp-{tag}"
        self.agents = [f"ns-a{i}-{tag}" for i in range(AGENTS)]
        self.names = [self.cp, *self.agents]
        for name in self.names:
            netns.create(name)
        with IPRoute() as ipr:
            for i, agent in enumerate(self.agents):
                ipr.link("add", ifname=f"vc{i}-{tag}", kind="veth", peer={"ifname": f"va{i}", "net_ns_fd": agent})
                ipr.link("set", index=ipr.link_lookup(ifname=f"vc{i}-{tag}")[0], net_ns_fd=self.cp)
        for i, agent in enumerate(self.agents):
            for ns_name, ifname, address in ((self.cp, f"vc{i}-{tag}", f"10.77.{i}.1"), (agent, "va", f"10.77.{i}.2")):
                with NetNS(ns_name) as ns:
                    ifname = ifname if ifname != "va" else f"va{i}"
                    idx = ns.link_lookup(ifname=ifname)[0]
                    ns.addr("add", index=idx, address=address, prefixlen=30)
                    ns.link("set", index=idx, state="up")
                    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    def run(self, ns: str, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["ip", "netns", "exec", ns, *args], **kw)

    def set_link(self, i: int, up: bool) -> None:
        from pyroute2 import NetNS

        with NetNS(self.agents[i]) as ns:
            ns.link("set", index=ns.link_lookup(ifname=f"va{i}")[0], state="up" if up else "down")

    def throttle(self, i: int, on: bool) -> None:
        """A trickle (tbf at 1 kbit/s) and 30% of packets dropped (nftables numgen)."""
        from pyroute2 import NetNS

        agent = self.agents[i]
        with NetNS(agent) as ns:
            idx = ns.link_lookup(ifname=f"va{i}")[0]
            # pyroute2 builds a tbf's options for "del" too: it wants them both times.
            ns.tc("add" if on else "del", kind="tbf", index=idx, handle=0x10000, rate="1kbit", burst=1600,
                  latency="2s")  # fmt: skip
        rules = (f"add table inet trickle; add chain inet trickle out {{ type filter hook output priority 0; }}; "
                 f"add rule inet trickle out ip daddr 10.77.{i}.1 numgen random mod 100 < 30 drop")  # fmt: skip
        cmd = ["nft", rules] if on else ["nft", "delete table inet trickle"]
        subprocess.run(["ip", "netns", "exec", agent, *cmd], check=True)

    def close(self) -> None:
        from pyroute2 import netns

        for name in self.names:
            with contextlib.suppress(OSError):  # already gone
                netns.remove(name)


class View:
    """The control plane's view of the fleet, polled from inside its namespace."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.history: list[dict[str, str]] = []

    def next(self) -> dict[str, str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "poller died"
        view: dict[str, str] = json.loads(line)
        self.history.append(view)
        return view

    def until(self, check: Callable[[dict[str, str]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check(self.next()):
                return
        raise AssertionError(f"timed out; last views {self.history[-3:]}")

    def hold(self, seconds: float, check: Callable[[dict[str, str]], bool]) -> None:
        """Every view for `seconds` satisfies check."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            view = self.next()
            assert check(view), view


@pytest.fixture
def network() -> Iterator[Network]:
    if os.geteuid() != 0:
        if REQUIRE_BPF:
            pytest.fail("the fleet test needs root for network namespaces")
        pytest.skip("needs root for network namespaces")
    net = Network()
    yield net
    net.close()


def test_one_node_cut_and_throttled_goes_stale_and_recovers_alone(network: Network, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("fleet-secret-fleet-secret\n")
    py = [sys.executable, "-m", "nodesampler"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cp = network.run(network.cp, [*py, "controlplane", "--listen", f"0.0.0.0:{PORT}", "--pages-listen",
                                      "127.0.0.1:8080", "--secret-file", str(secret), "--stale-after",
                                      str(STALE_AFTER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        procs.append(cp)
        assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
        for i, agent in enumerate(network.agents):
            token = tmp_path / f"n{i}.token"
            token.write_bytes(subprocess.run([*py, "token", f"n{i}", "--secret-file", str(secret)],
                                             capture_output=True, check=True).stdout)  # fmt: skip
            procs.append(network.run(agent, [*py, "agent", "--control-plane", f"http://10.77.{i}.1:{PORT}",
                                             "--token-file", str(token), "--node", f"n{i}", "--interval", "0.5",
                                             "--backend", "proc"],
                                     stderr=open(tmp_path / f"n{i}.log", "ab")))  # noqa: SIM115  # fmt: skip
        poller = network.run(network.cp, [sys.executable, "-c", POLLER], stdout=subprocess.PIPE)
        procs.append(poller)
        view = View(poller)

        def all_fresh(v: dict[str, str]) -> bool:
            return all(v.get(f"n{i}") == "fresh" for i in range(AGENTS))

        def others_fresh(v: dict[str, str]) -> bool:
            return all(v.get(f"n{i}") == "fresh" for i in range(1, AGENTS))

        view.until(all_fresh)

        network.set_link(0, up=False)  # cut
        view.until(lambda v: v.get("n0") == "stale" and others_fresh(v))
        view.hold(float(os.environ.get("FLEET_CUT_S", 30)) - STALE_AFTER, others_fresh)
        network.set_link(0, up=True)
        view.until(all_fresh)  # back alone: nobody restarted anything

        network.throttle(0, on=True)  # a trickle, and packets lost
        view.until(lambda v: v.get("n0") == "stale" and others_fresh(v))
        view.hold(5, others_fresh)
        network.throttle(0, on=False)
        view.until(all_fresh)
        assert all(others_fresh(v) for v in view.history[next(i for i, v in enumerate(view.history) if all_fresh(v)):])
        # The agent logs its recovery once the answer to its first delivered
        # heartbeat is back, which can be just after the control plane shows it fresh.
        deadline = time.monotonic() + 60
        while "reachable again" not in (log := (tmp_path / "n0.log").read_text()):
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        assert "unreachable" in log
    finally:
        for p in procs:
            p.kill()
            p.wait()
