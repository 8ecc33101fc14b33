"""A fleet over three control-plane replicas (#46): the cluster page from any
replica, each replica's /metrics, and the time to all-fresh after one is
killed, each beside the same figure of one replica holding the fleet alone,
measured in the same run (our machines' speed varies several-fold: the
ratio is the figure that means something).

1. Pages and scrapes. Three replicas, peered, and one replica alone; each
   filled with 8-GPU, 4-engine nodes (registered, one heartbeat each), the
   three each with the nodes whose first choice it is (as agents choose,
   sampler/agent/replicas.py). At `--page-nodes` (10,000): the cluster page
   from each replica (the whole fleet: its own rows and its peers') against
   the one replica's; then, at `--scrape-nodes` (30,000) over the three, each
   replica's /metrics against the one replica's at a third of that (what
   each of the three holds), and the one replica's at the whole fleet.
   Targets: the cluster page under 500 ms from any replica; each replica's
   scrape as one replica's of a third of the fleet. Each answer timed is
   checked: every cluster page names the whole fleet (its count) and no
   replica that did not answer; every scrape has each node it holds up, and
   the three together each node once.
2. Failover. `--fleet` simulated nodes (tests/simulated_fleet.py: the
   agent's own replica choice) heartbeat every `--interval` to three
   replicas; one is killed (SIGKILL): the time until every node is fresh at
   a survivor, in seconds and in windows; then it comes back: the time until
   its nodes are back at it. Target: all fresh within two windows.

    PYTHONPATH=. .venv/bin/python bench/replicas_fleet.py [--page-nodes 10000] [--scrape-nodes 30000]
                                                          [--fleet 1000] [--interval 2] [--skip-pages]
                                                          [--whole-alone]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.heartbeat_throughput import SECRET, Agents, free_port  # noqa: E402
from sampler.agent.replicas import ranked  # noqa: E402
from tests.simulated_fleet import SimulatedFleet, cloud_names  # noqa: E402


class Replica:
    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.agent_port, self.pages_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.agent_port}"  # the agents'
        self.pages_url = f"http://127.0.0.1:{self.pages_port}"  # the peers'
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, peers: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{self.agent_port}",
             "--pages-listen", f"127.0.0.1:{self.pages_port}", "--secret-file", str(self.tmp / "secret"),
             "--stale-after", "3600", "--max-heartbeats-per-second", "1000",
             "--request-deadline", "300",  # what is timed is the answer, not the deadline a scrape is held to
             *[a for p in peers for a in ("--peer", p)]],
            stdout=subprocess.PIPE, stderr=open(self.tmp / f"{self.name}.log", "ab"))  # noqa: SIM115 (the child's)
        assert self.process.stdout is not None and b"control plane" in self.process.stdout.readline()

    def get_ms(self, path: str) -> tuple[float, bytes]:
        started = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.pages_port}{path}", timeout=120) as r:
            body = r.read()
        return (time.perf_counter() - started) * 1e3, body

    def median_ms(self, path: str, check: Callable[[bytes], None], times: int = 5) -> tuple[float, int]:
        """The median time of `path`, each answer checked (a fast wrong answer is no figure)."""
        got = []
        for _ in range(times):
            time.sleep(1.1)  # a rendered view serves the second after it (SHARE_FOR_S): each measured anew
            ms, body = self.get_ms(path)
            check(body)
            got.append((ms, len(body)))
        return statistics.median(ms for ms, _ in got), got[-1][1]

    def held_fresh(self) -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.pages_port}/api/nodes?here=1", timeout=30) as r:
            return {n["node"] for n in json.loads(r.read())["nodes"] if n["state"] == "fresh"}

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(how)
            self.process.wait()


def fill(replicas: dict[str, Replica], names: list[str]) -> None:
    """Each node registered and heard from once at its replica, the replicas filled at once."""
    share: dict[str, list[str]] = {url: [] for url in replicas}
    for node in names:
        share[ranked(node, list(replicas))[0]].append(node)
    # A connection of its own each time: one kept from before was closed idle (--idle-timeout).
    threads = [threading.Thread(target=Agents(replicas[url].agent_port, None).fleet, args=(nodes, True))
               for url, nodes in share.items()]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()


NAMES = cloud_names(100_000)  # as EC2, GKE and AKS name nodes, 40-64 bytes


def nodes(first: int, last: int) -> list[str]:
    return NAMES[first:last]


def whole_fleet(count: int) -> Callable[[bytes], None]:
    """A cluster page's check: it counts the whole fleet, and names no replica that did not answer."""

    def check(body: bytes) -> None:
        page = body.decode()
        assert f'id="nodes">{count}<' in page, "the cluster page does not count the whole fleet"
        assert "did not answer" not in page, "a replica did not answer"

    return check


def up_exactly(held: set[str]) -> Callable[[bytes], None]:
    """A scrape's check: each node this replica holds is up there, and no other."""

    def check(body: bytes) -> None:
        up = set(re.findall(r'^llmgw_node_up\{node="([^"]+)"\} 1$', body.decode(), re.M))
        assert up == held, f"{len(up)} nodes up, {len(held)} held"

    return check


def pages_and_scrapes(args: argparse.Namespace, tmp: Path) -> None:
    three = [Replica(tmp, f"replica-{i}") for i in range(3)]
    alone = Replica(tmp, "alone")
    for r in three:
        r.start([p.pages_url for p in three])
    alone.start([])
    by_url = {r.url: r for r in three}
    print(f"filling {args.page_nodes} GPU nodes over three replicas, and into one alone", flush=True)
    fill(by_url, nodes(0, args.page_nodes))
    fill({alone.url: alone}, nodes(0, args.page_nodes))
    one_ms, one_size = alone.median_ms("/", whole_fleet(args.page_nodes))
    print(f"\ncluster page, {args.page_nodes} GPU nodes (median of 5):")
    print(f"  one replica alone: {one_ms:7.0f} ms ({one_size / 1e3:.0f} kB)")
    for r in three:
        ms, size = r.median_ms("/", whole_fleet(args.page_nodes))
        print(f"  from {r.name} of three: {ms:7.0f} ms ({size / 1e3:.0f} kB), {ms / one_ms:.2f} of one alone"
              f"{'' if ms < 500 else '  (target: under 500 ms)'}")
    print(f"\nfilling up to {args.scrape_nodes} nodes over the three", flush=True)
    fill(by_url, nodes(args.page_nodes, args.scrape_nodes))
    fill({alone.url: alone}, nodes(args.page_nodes, args.scrape_nodes // 3))
    third_ms, third_size = alone.median_ms("/metrics", up_exactly(set(nodes(0, args.scrape_nodes // 3))), 3)
    print(f"\n/metrics, {args.scrape_nodes} nodes over three (median of 3):")
    print(f"  one replica alone, {args.scrape_nodes // 3} nodes: {third_ms:7.0f} ms ({third_size / 1e6:.1f} MB)")
    everyone = nodes(0, args.scrape_nodes)
    counted = 0
    for r in three:
        held = {n for n in everyone if ranked(n, list(by_url))[0] == r.url}
        ms, size = r.median_ms("/metrics", up_exactly(held), 3)
        counted += len(held)
        print(f"  {r.name}: {len(held)} nodes, {ms:7.0f} ms ({size / 1e6:.1f} MB), "
              f"{ms / third_ms:.2f} of one replica's third")
    assert counted == len(everyone)  # each node up at exactly one of the three
    if args.whole_alone:  # the fleet no one replica should hold: about a gigabyte of text at 30,000
        fill({alone.url: alone}, nodes(args.scrape_nodes // 3, args.scrape_nodes))
        whole_ms, whole_size = alone.median_ms("/metrics", up_exactly(set(nodes(0, args.scrape_nodes))), 3)
        print(f"  one replica alone, all {args.scrape_nodes}: {whole_ms:7.0f} ms ({whole_size / 1e6:.1f} MB)")
    rss = {r.name: int(Path(f"/proc/{r.process.pid}/status").read_text().split("VmRSS:")[1].split()[0]) >> 10
           for r in (*three, alone) if r.process is not None}  # fmt: skip
    print(f"  resident: {', '.join(f'{k} {v} MiB' for k, v in rss.items())}")
    for r in (*three, alone):
        r.stop()


def failover(args: argparse.Namespace, tmp: Path) -> None:
    three = [Replica(tmp, f"failover-{i}") for i in range(3)]
    for r in three:
        r.start([p.pages_url for p in three])
    urls = [r.url for r in three]
    fleet = SimulatedFleet(urls, SECRET, nodes=args.fleet, interval=args.interval)
    everyone = set(fleet.nodes)
    fleet.start()
    try:
        deadline = time.monotonic() + 120
        while set().union(*(r.held_fresh() for r in three)) != everyone:
            assert time.monotonic() < deadline, "the fleet never came up"
            time.sleep(0.5)
        victim = three[1]
        survivors = [r for r in three if r is not victim]
        theirs = {n for n in fleet.nodes if ranked(n, urls)[0] == victim.url}
        time.sleep(2 * args.interval)
        killed = time.monotonic()
        victim.stop(signal.SIGKILL)
        while set().union(*(r.held_fresh() for r in survivors)) != everyone:
            time.sleep(0.2)
        moved_s = time.monotonic() - killed
        print(f"\nfailover, {args.fleet} nodes every {args.interval:g} s over three replicas, one killed "
              f"({len(theirs)} nodes its own):")
        print(f"  every node fresh at a survivor after {moved_s:.1f} s: {moved_s / args.interval:.2f} windows "
              f"(target: at most 2); windows lost: {sum(fleet.lost.values())}")
        back = time.monotonic()
        victim.start([p.pages_url for p in three])
        while not theirs <= victim.held_fresh():
            time.sleep(0.5)
        print(f"  it came back: its {len(theirs)} nodes back at it after {time.monotonic() - back:.1f} s "
              f"(they try it again every {max(5.0, min(60.0, 6 * args.interval)):g} s)")
    finally:
        fleet.stop()
        for r in three:
            r.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-nodes", type=int, default=10_000)
    ap.add_argument("--scrape-nodes", type=int, default=30_000)
    ap.add_argument("--fleet", type=int, default=1000, help="simulated nodes for the failover")
    ap.add_argument("--interval", type=float, default=2.0, help="their heartbeat interval, seconds")
    ap.add_argument("--skip-pages", action="store_true")
    ap.add_argument("--whole-alone", action="store_true", help="also one replica's /metrics of the whole fleet")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "secret").write_bytes(SECRET)
        if not args.skip_pages:
            pages_and_scrapes(args, tmp)
        failover(args, tmp)


if __name__ == "__main__":
    main()
