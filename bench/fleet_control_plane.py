"""One control plane process holding a fleet: GPU nodes of 8 cards and 4
engines, an hour of embedded history each (720 heartbeats at 5 s).

The control plane runs as `nodesampler controlplane`, pinned to CPU 0; this
script and wrk run on CPU 1. For each fleet size:

1. every node registers, then wrk sends heartbeats round the fleet until
   each node has sent `--heartbeats` (the hour, arriving in minutes: the
   rings hold as much as an hour at 5 s does);
2. the control plane's RSS with that hour held;
3. the cluster page, a node page and /metrics, each fetched in turn, and the
   growth of peak RSS over those views (VmHWM, reset through clear_refs);
4. heartbeats at the fleet's own rate (one per node every 5 s) for
   `--seconds`, once alone and once while a cluster page, a node page and
   /metrics are fetched every second: their p50, p99 and max.

Targets (#15): RSS under 1.5 GiB at 1,000 nodes; cluster page under 200 ms,
node page under 50 ms, /metrics under 250 ms; page views raise peak RSS by
less than 64 MiB; heartbeat p99 under 50 ms while pages are fetched.

    PYTHONPATH=. .venv/bin/python bench/fleet_control_plane.py [--nodes 100 1000] [--heartbeats 720]
                                                               [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heartbeat_throughput import SECRET, free_port, gpu_node_heartbeat, lua_heartbeats, lua_string  # noqa: E402

from controlplane.ingest import tokens  # noqa: E402
from tests.test_controlplane_api import registration  # noqa: E402

INTERVAL_S = 5.0
MiB = 2**20


SEQ = itertools.count(10**9)  # every node's seq, above any the fill phase sent


def status_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))  # type: ignore[union-attr]


def register_fleet(port: int, nodes: int) -> list[tuple[str, str]]:
    """Nodes node-00000... registered with the control plane on `port`: each one's name and bearer header."""
    out = []
    for i in range(nodes):
        node = f"node-{i:05d}"
        auth = f"Bearer {tokens.node_token(SECRET, node)}"
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/register", method="POST",
                                     data=json.dumps(registration(node)).encode(),
                                     headers={"Authorization": auth, "Content-Type": "application/json"})
        urllib.request.urlopen(req).read()
        out.append((node, auth))
    return out


def get_ms(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        size = len(r.read())
    return (time.perf_counter() - started) * 1e3, size


def fill(port: int, bodies: list[tuple[str, str]], count: int, tmp: Path) -> float:
    """wrk sends the bodies round the fleet until `count` were answered; heartbeats a second."""
    script, marker = tmp / "fill.lua", tmp / f"filled-{count}"
    script.write_text(
        lua_heartbeats(port, bodies)
        + f"local done, target = 0, {count}\n"
        + "response = function(status)\n  done = done + 1\n"
        + f"  if done == target then io.open({lua_string(str(marker))}, 'w'):close() end\nend\n"
    )  # fmt: skip
    # wrk's own end is its duration: the script leaves a file when the count is answered.
    started = time.monotonic()
    wrk = subprocess.Popen(["wrk", "-t1", "-c32", "-d3600s", "-s", str(script), f"http://127.0.0.1:{port}"],
                           stdout=subprocess.DEVNULL)  # fmt: skip
    while not marker.exists():
        assert wrk.poll() is None, "wrk ended before the fleet's hour was sent"
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    wrk.kill()
    wrk.wait()
    return count / elapsed


async def heartbeats_at_fleet_rate(port: int, pages: int, bodies: list[tuple[str, str]], seconds: float,
                                   with_pages: bool) -> tuple[list[float], dict[str, list[float]]]:  # fmt: skip
    """Each node once every INTERVAL_S, spread evenly; the latency of each (ms). With
    pages, a cluster page, a node page and /metrics fetched in turn every second."""
    latencies: list[float] = []
    page_ms: dict[str, list[float]] = {"cluster page": [], "node page": [], "/metrics": []}
    gap = INTERVAL_S / len(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def send(auth: str, body: str) -> None:
            started = time.perf_counter()
            body = body.replace('"seq": 1,', f'"seq": {next(SEQ)},', 1)  # after the fill's: a replay is refused
            async with session.post(f"http://127.0.0.1:{port}/v1/heartbeat", data=body,
                                    headers={"Authorization": auth, "Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            latencies.append((time.perf_counter() - started) * 1e3)

        async def browse() -> None:
            while True:
                tick = time.monotonic()
                for name, path in (("cluster page", "/"), ("node page", "/node/node-00000"),
                                   ("/metrics", "/metrics")):  # fmt: skip
                    started = time.perf_counter()
                    async with session.get(f"http://127.0.0.1:{pages}{path}") as r:
                        await r.read()
                    page_ms[name].append((time.perf_counter() - started) * 1e3)
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))

        browsing = asyncio.create_task(browse()) if with_pages else None
        sends = []
        start = time.monotonic()
        for i in range(int(seconds / gap)):
            await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
            sends.append(asyncio.create_task(send(*bodies[i % len(bodies)])))
        await asyncio.gather(*sends)
        if browsing is not None:
            browsing.cancel()
            await asyncio.gather(browsing, return_exceptions=True)
    return latencies, page_ms


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def one_fleet(nodes: int, heartbeats: int, seconds: float, tmp: Path) -> dict[str, float]:
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    port, pages = free_port(), free_port()
    cp = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "nodesampler", "controlplane",
                           "--listen", f"127.0.0.1:{port}", "--pages-listen", f"127.0.0.1:{pages}",
                           "--secret-file", str(secret), "--stale-after", "3600", "--max-heartbeats-per-second", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    figures: dict[str, float] = {}
    try:
        assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
        bodies = [(auth, json.dumps(gpu_node_heartbeat(node))) for node, auth in register_fleet(port, nodes)]
        rss_empty = status_kib(cp.pid, "VmRSS")
        rate = fill(port, bodies, nodes * heartbeats, tmp)
        figures["rss_mib"] = status_kib(cp.pid, "VmRSS") / 1024
        print(f"{nodes} nodes: filled {nodes * heartbeats} heartbeats at {rate:.0f}/s; RSS {rss_empty / 1024:.0f} MiB "
              f"registered, {figures['rss_mib']:.0f} MiB with the hour held", flush=True)  # fmt: skip
        growth = {}
        for name, path in (("cluster page", "/"), ("node page", "/node/node-00000"), ("/metrics", "/metrics")):
            Path(f"/proc/{cp.pid}/clear_refs").write_text("5")  # VmHWM from here
            before = status_kib(cp.pid, "VmRSS")
            runs = [get_ms(f"http://127.0.0.1:{pages}{path}") for _ in range(5)]
            figures[name] = statistics.median(ms for ms, _ in runs)
            growth[name] = (status_kib(cp.pid, "VmHWM") - before) / 1024
            print(f"  {name:13s} {figures[name]:7.1f} ms median of 5 (min {min(ms for ms, _ in runs):.1f}), "
                  f"{runs[0][1] // 1024} KiB, peak RSS +{growth[name]:.1f} MiB", flush=True)  # fmt: skip
        figures["peak_growth_mib"] = max(growth.values())
        print(f"  page views raised peak RSS by {figures['peak_growth_mib']:.1f} MiB at most", flush=True)
        for with_pages in (False, True):
            lat, page_ms = asyncio.run(heartbeats_at_fleet_rate(port, pages, bodies, seconds, with_pages))
            what = "while pages and /metrics are fetched every second" if with_pages else "alone"
            print(f"  heartbeats at {nodes / INTERVAL_S:.0f}/s {what}: p50 {p(lat, 50):.1f} ms, "
                  f"p99 {p(lat, 99):.1f} ms, max {max(lat):.1f} ms ({len(lat)} sent)", flush=True)  # fmt: skip
            if with_pages:
                figures["heartbeat_p99_with_pages"] = p(lat, 99)
                print("  " + ", ".join(f"{k} {statistics.median(v):.0f} ms (max {max(v):.0f})"
                                       for k, v in page_ms.items() if v) + " meanwhile", flush=True)  # fmt: skip
    finally:
        cp.terminate()
        cp.wait()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--heartbeats", type=int, default=720, help="per node: 720 is an hour at 5 s")
    ap.add_argument("--seconds", type=float, default=20.0, help="of heartbeats at the fleet's rate, each phase")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("fleet_control_plane: needs wrk (apt-get install wrk)")
    os.sched_setaffinity(0, {1})  # the control plane has CPU 0 to itself
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in args.nodes:
            results[nodes] = one_fleet(nodes, args.heartbeats, args.seconds, Path(tmp))
    if len(results) > 1:
        small, large = min(results), max(results)
        print(f"growth from {small} to {large} nodes: " + ", ".join(
            f"{k} x{results[large][k] / results[small][k]:.1f}" for k in results[small]
            if results[small][k] > 0))  # fmt: skip


if __name__ == "__main__":
    main()
