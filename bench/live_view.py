"""The live view's cost (#19), measured three ways. Not a test: no thresholds.

1. Heartbeat size: a GPU node's heartbeat (8 cards, 4 engines) without raw
   samples and with them at 10, 100 and 1000 Hz (5 s windows; NVML's ~6
   utilisation samples a second per card), and the agent's time to encode
   them.
2. The control plane's ingest: `nodesampler controlplane` pinned to CPU 0
   holding 1,000 nodes at the fleet's rate (one heartbeat per node every
   5 s), first with nobody watching, then with 10 nodes live (a viewer
   each, their heartbeats carrying 100 Hz raw samples): its CPU, the
   heartbeats' latency (p50, p99), and the events the viewers got.
3. The agent's CPU with the live view off and on: `nodesampler controlplane`
   and `nodesampler agent --hz 100` (the kernel backend as root, else /proc
   at 10 Hz, said), the agent's CPU over --seconds with nobody watching,
   then over as long with a viewer.

    PYTHONPATH=. .venv/bin/python bench/live_view.py [--nodes 1000] [--live 10] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_control_plane import register_fleet  # noqa: E402
from heartbeat_throughput import SECRET, free_port, gpu_node_heartbeat  # noqa: E402

import wire  # noqa: E402
from controlplane.ingest import tokens  # noqa: E402
from sampler.window.series import RateSeries  # noqa: E402
from wire import raw as raw_samples  # noqa: E402

INTERVAL_S = 5.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def with_raw(hb: dict[str, Any], hz: float, rng: np.random.Generator) -> tuple[dict[str, Any], float]:
    """The heartbeat with a window of raw samples at `hz`, as the agent builds
    them; and the seconds the encoding took."""
    n = int(hz * INTERVAL_S)

    def series(scale: float) -> RateSeries:
        s = RateSeries(n, 0.0)
        for v in rng.uniform(0, scale, n):
            s.add(float(v), 1 / hz * rng.uniform(0.98, 1.02))
        return s

    machine, shards = series(100), [series(8) for _ in hb["shards"]]
    gpus = {g["index"]: (np.sort(rng.uniform(0, INTERVAL_S * 1e6, 30)), rng.integers(0, 101, 30).astype(float))
            for g in hb["gpus"]}  # fmt: skip
    started = time.perf_counter()
    cpu = raw_samples.rate_series(-0.01, *machine.samples(), digits=4)
    gpm_t = np.arange(0.1, INTERVAL_S + 1e-9, 0.1)  # GPM's intervals: 10 a second, four percent series a card
    points = [(i, {"utilization_percent": raw_samples.gpu_points(t / 1e6, v),
                   **{field: raw_samples.gpu_points(gpm_t, rng.uniform(0, 100, len(gpm_t)))
                      for field in list(raw_samples.GPU_POINTS)[1:]}}) for i, (t, v) in gpus.items()]  # fmt: skip
    per_shard = [(s["id"], raw_samples.rate_series(-0.01, *r.samples(), digits=5))
                 for s, r in zip(hb["shards"], shards, strict=True)]  # fmt: skip
    out = {**hb, "raw": raw_samples.fit_raw(len(wire.dumps(hb)), cpu, points, per_shard)}
    body = wire.dumps(out)
    return json.loads(body), time.perf_counter() - started


def sizes() -> dict[float, dict[str, Any]]:
    rng = np.random.default_rng(1)
    hb = gpu_node_heartbeat("node-00000")
    print(f"1. heartbeat of a GPU node ({len(hb['gpus'])} cards, {len(hb['shards'])} engines), 5 s windows:")
    print(f"   without raw samples: {len(wire.dumps(hb)):7d} bytes")
    bodies = {}
    for hz in (10, 100, 1000):
        runs = [with_raw(hb, hz, rng) for _ in range(5)]
        body, _ = runs[0]
        size = len(wire.dumps(body))
        kept = len(body["raw"]["shards"])
        print(f"   with raw at {hz:4d} Hz: {size:7d} bytes ({size / 1024:.0f} KiB), engines kept {kept} of "
              f"{len(hb['shards'])}; encoding {statistics.median(s for _, s in runs) * 1e3:.1f} ms median of 5",
              flush=True)  # fmt: skip
        bodies[hz] = body
    return bodies


async def ingest(nodes: int, live: int, seconds: float, raw_body: dict[str, Any], tmp: Path) -> None:
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    port, pages = free_port(), free_port()
    cp = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "nodesampler", "controlplane",
                           "--listen", f"127.0.0.1:{port}", "--pages-listen", f"127.0.0.1:{pages}",
                           "--secret-file", str(secret), "--stale-after", "3600",
                           "--max-live-nodes", str(max(live, 1))],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
        plain, rich = [], []
        for node, auth in register_fleet(port, nodes):
            plain.append((auth, json.dumps(gpu_node_heartbeat(node))))
            rich.append((auth, json.dumps({**raw_body, "node": node})))
        print(f"2. control plane (CPU 0) with {nodes} nodes, heartbeats at {nodes / INTERVAL_S:.0f}/s "
              f"for {seconds:.0f} s each:", flush=True)  # fmt: skip
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:
            for watched in (0, live):
                await phase(session, cp.pid, port, pages, [rich[i] if i < watched else plain[i] for i in range(nodes)],
                            watched, seconds)  # fmt: skip
    finally:
        cp.terminate()
        cp.wait()


async def phase(session: aiohttp.ClientSession, pid: int, port: int, pages: int, bodies: list[tuple[str, str]],
                watched: int, seconds: float) -> None:  # fmt: skip
    """The fleet's heartbeats for `seconds`, the first `watched` nodes live."""
    nodes = len(bodies)
    events = [0] * watched

    async def view(k: int) -> None:
        async with session.get(f"http://127.0.0.1:{pages}/node/node-{k:05d}/live") as r:
            async for line in r.content:
                events[k] += line.startswith(b"event: window")

    viewers = [asyncio.create_task(view(k)) for k in range(watched)]
    await asyncio.sleep(1.0)
    lat: dict[bool, list[float]] = {True: [], False: []}

    async def send(i: int) -> None:
        auth, body = bodies[i % nodes]
        started = time.perf_counter()
        async with session.post(f"http://127.0.0.1:{port}/v1/heartbeat", data=body,
                                headers={"Authorization": auth, "Content-Type": "application/json"}) as r:
            await r.read()
            assert r.status == 200, r.status
        lat[i % nodes < watched].append((time.perf_counter() - started) * 1e3)

    gap = INTERVAL_S / nodes
    cpu0, start = cpu_seconds(pid), time.monotonic()
    sends = []
    for i in range(int(seconds / gap)):
        await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
        sends.append(asyncio.create_task(send(i)))
    await asyncio.gather(*sends)
    cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - start)
    for v in viewers:
        v.cancel()
    await asyncio.gather(*viewers, return_exceptions=True)
    sent = sum(len(v) for v in lat.values())
    line = (f"   {watched:2d} live: control plane {100 * cpu:.1f}% of a core for {sent / seconds:.0f} "
            f"heartbeats/s ({1e3 * cpu * seconds / sent:.2f} ms of CPU each); latency p50 "
            f"{statistics.median(lat[False]):.1f} ms, p99 {np.percentile(lat[False], 99):.1f} ms")
    if watched:
        line += (f"; live ones p50 {statistics.median(lat[True]):.1f} ms, p99 {np.percentile(lat[True], 99):.1f} ms;"
                 f" viewers got {sum(events)} windows ({min(events)}-{max(events)} each)")
    print(line, flush=True)


def watch(url: str, stop: threading.Event, got: list[int]) -> None:
    with urllib.request.urlopen(url, timeout=60) as r:
        for line in r:
            got[0] += line.startswith(b"event: window")
            if stop.is_set():
                return


def agent_cpu(seconds: float, tmp: Path) -> None:
    root = os.geteuid() == 0
    backend, hz = ("bpf", 100) if root else ("proc", 10)
    secret = tmp / "secret2"
    secret.write_bytes(SECRET)
    token = tmp / "token"
    token.write_text(tokens.node_token(SECRET, "bench") + "\n")
    port, pages = free_port(), free_port()
    cp = subprocess.Popen([sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{port}",
                           "--pages-listen", f"127.0.0.1:{pages}", "--secret-file", str(secret), "--live-linger", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    agent = None
    try:
        assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
        agent = subprocess.Popen([sys.executable, "-m", "nodesampler", "agent", "--control-plane",
                                  f"http://127.0.0.1:{port}", "--token-file", str(token), "--node", "bench",
                                  "--backend", backend, "--hz", str(hz), "--interval", str(INTERVAL_S)],
                                 stderr=subprocess.DEVNULL)  # fmt: skip
        print(f"3. the agent ({backend} backend, {hz} Hz, {INTERVAL_S:.0f} s windows), {seconds:.0f} s each:",
              flush=True)
        time.sleep(20)  # loaded, registered, steady
        figures = {}
        for live in (False, True, False):
            stop, got = threading.Event(), [0]
            if live:
                url = f"http://127.0.0.1:{pages}/node/bench/live"
                threading.Thread(target=watch, args=(url, stop, got), daemon=True).start()
                time.sleep(2 * INTERVAL_S)  # the next windows carry raw samples
            c0, t0 = cpu_seconds(agent.pid), time.monotonic()
            time.sleep(seconds)
            figures[live] = (cpu_seconds(agent.pid) - c0) / (time.monotonic() - t0)
            stop.set()
            print(f"   live {'on ' if live else 'off'}: agent {100 * figures[live]:.2f}% of a core"
                  + (f" ({got[0]} windows streamed)" if live else ""), flush=True)
            if live:
                time.sleep(2 * INTERVAL_S + 16)  # the viewer is found gone, the linger passes
    finally:
        for p in (agent, cp):
            if p is not None:
                p.terminate()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--live", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    bodies = sizes()
    everywhere = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as tmp:
        os.sched_setaffinity(0, {1})  # the control plane has CPU 0 to itself
        asyncio.run(ingest(args.nodes, args.live, min(args.seconds, 30.0), bodies[100], Path(tmp)))
        os.sched_setaffinity(0, everywhere)
        agent_cpu(args.seconds, Path(tmp))


if __name__ == "__main__":
    main()
