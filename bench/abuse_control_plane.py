"""The control plane under hostile load, as deployed: TLS on both listeners
and users on the pages from one web config file, 1,000 GPU nodes (8 cards,
4 engines) heartbeating at their rate (one each 5 s, over kept-alive TLS
connections), Prometheus' scrape of /metrics every second, and, in turn:

- baseline: nothing else (the reference every other phase is read against);
- handshakes: 5,000 sockets to the agent port that never say hello (20
  addresses, 250 each: under the per-peer cap);
- non-readers: 250 sockets from each of 4 addresses that ask for
  `/api/nodes` as a user and never read (a 1 KiB receive buffer);
- anonymous loops: 200 clients asking for `/` without a user, in a loop;
- user loops: 200 clients asking for `/` as a user, in a loop (a valid
  password used to flood);
- slow viewers: ten live views as one user from ten addresses, reading a
  byte every 14 s; then a real operator (another user) opens a live view;
- hindsight flood: 20 hostile nodes (their own tokens) each asked a span by
  a viewer, sending pieces as heavy as a body allows (10,000 windows and
  30,000 samples) as fast as their heartbeat rate lets them, and pieces of
  spans nobody asked;
- guess flood: 200 clients guessing passwords in a loop (half as a known
  user, half as names no file holds, some 1,000 bytes long); then a user's
  first login from another address (it is not remembered: bcrypt runs);
- incident export: 20 clients reading a full incident (8 nodes, 6 minutes
  at 100 Hz of 8 engines each) as CSV and JSON in a loop.

Printed for each phase: the control plane's peak RSS (VmHWM, reset at the
phase's start), heartbeat p50/p99 and /metrics' time (median and max), each
beside the baseline's. Targets (#32, #45): RSS under the Deployment's 1 GiB
limit, heartbeat p99 under 50 ms, /metrics under 1 s, the operator's live
view and the newcomer's first login served.

The control plane is pinned to CPU 0; this script and its attackers run on
CPU 1 (the attackers that loop in processes of their own, so the heartbeat
sender's clock is not theirs).

    PYTHONPATH=. .venv/bin/python bench/abuse_control_plane.py [--nodes 1000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import multiprocessing
import os
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heartbeat_throughput import SECRET, free_port, gpu_node_heartbeat  # noqa: E402

from controlplane.ingest import tokens  # noqa: E402
from tests.agent_fleet import web_config_file  # noqa: E402
from tests.test_controlplane_api import registration  # noqa: E402

INTERVAL_S = 5.0
USERS = {"ops": "ops-password", "prometheus": "scrape-password", "operator": "operator-password",
         "newcomer": "first-login"}  # fmt: skip
HOSTILE_NODES = 20
INCIDENT_NODES, INCIDENT_S = 8, 360.0


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{USERS[user]}".encode()).decode()


def status_kib(pid: int, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m is not None
    return int(m.group(1))


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Bench:
    def __init__(self, tmp: Path, nodes: int, seconds: float, incident: str) -> None:
        self.tmp, self.nodes, self.seconds = tmp, nodes, seconds
        self.config = web_config_file(tmp, USERS, cost=10)
        self.context = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
        self.agents, self.pages = free_port(), free_port()
        (tmp / "secret").write_bytes(SECRET)
        self.incident = incident  # written before the control plane starts: it loads it
        self.log = open(tmp / "control.log", "wb")  # noqa: SIM115 (the child's, for its life)
        self.cp = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, "-m", "nodesampler", "controlplane",
             "--listen", f"127.0.0.1:{self.agents}", "--pages-listen", f"127.0.0.1:{self.pages}",
             "--secret-file", str(tmp / "secret"), "--web-config-file", str(self.config), "--stale-after", "3600",
             "--incidents-dir", str(tmp / "incidents")],
            stdout=subprocess.PIPE, stderr=self.log)  # fmt: skip
        assert self.cp.stdout is not None and b"control plane" in self.cp.stdout.readline()
        self.seq = 10
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    def url(self, port: int, path: str) -> str:
        return f"https://127.0.0.1:{port}{path}"

    async def register(self, session: aiohttp.ClientSession) -> None:
        async def one(i: int) -> None:
            node = f"node-{i:05d}"
            auth = f"Bearer {tokens.node_token(SECRET, node)}"
            async with session.post(self.url(self.agents, "/v1/register"), json=registration(node),
                                    headers={"Authorization": auth}) as r:  # fmt: skip
                assert r.status == 200, (r.status, await r.text())
            self.bodies.append((auth, gpu_node_heartbeat(node)))

        for start in range(0, self.nodes, 100):
            await asyncio.gather(*(one(i) for i in range(start, min(self.nodes, start + 100))))

    async def measure(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Heartbeats at the fleet's rate and /metrics every second, for the phase."""
        latencies: list[float] = []
        failures: list[str] = []
        self.seq += 1
        seq = self.seq

        async def send(auth: str, body: dict[str, Any]) -> None:
            started = time.perf_counter()
            try:
                async with session.post(self.url(self.agents, "/v1/heartbeat"), json=dict(body, seq=seq),
                                        headers={"Authorization": auth}) as r:  # fmt: skip
                    await r.read()
                    if r.status != 200:
                        failures.append(str(r.status))
                        return
            except aiohttp.ClientError as e:
                failures.append(type(e).__name__)
                return
            latencies.append((time.perf_counter() - started) * 1e3)

        # Prometheus is a process of its own: its clock is not this one's.
        stop, results = multiprocessing.Event(), multiprocessing.Queue()
        scraper = multiprocessing.Process(target=_scrape_worker, args=(self.url(self.pages, "/metrics"),
                                                                       str(self.tmp / "ca.crt"), stop, results))
        scraper.start()
        gap = INTERVAL_S / len(self.bodies)
        sends = []
        start = time.monotonic()
        for i in range(int(self.seconds / gap)):
            await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
            sends.append(asyncio.create_task(send(*self.bodies[i % len(self.bodies)])))
            if (i + 1) % len(self.bodies) == 0:
                seq += 1  # each node's next heartbeat: seq must increase
        await asyncio.gather(*sends)
        stop.set()
        scrapes = await asyncio.get_running_loop().run_in_executor(None, results.get)
        scraper.join()
        self.seq = seq
        return {"p50": pct(latencies, 50), "p99": pct(latencies, 99), "sent": len(latencies) + len(failures),
                "failed": len(failures), "metrics_median": statistics.median(scrapes), "metrics_max": max(scrapes)}

    def closed(self) -> dict[str, int]:
        req = _request(self.url(self.pages, "/metrics"), basic("prometheus"))
        with _opener(self.context).open(req, timeout=30) as r:
            text = r.read().decode()
        pattern = r'^nodesampler_connections_closed_total\{listener="(\w+)",reason="(\w+)"\} (\S+)$'
        return {f"{m[1]}/{m[2]}": int(float(m[3])) for m in re.finditer(pattern, text, re.M) if float(m[3])}

    def surfaces(self) -> dict[str, float]:
        req = _request(self.url(self.pages, "/metrics"), basic("prometheus"))
        with _opener(self.context).open(req, timeout=30) as r:
            text = r.read().decode()
        pattern = r"^(nodesampler_(?:hindsight|incident|password)\S*) (\S+)$"
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M) if float(m[2])}


def _scrape_worker(url: str, cafile: str, stop: Any, results: Any) -> None:
    """/metrics once a second as Prometheus' user, until stopped: each scrape's seconds (inf: failed)."""
    import urllib.request

    os.sched_setaffinity(0, {1})
    opener = _opener(ssl.create_default_context(cafile=cafile))
    seconds = []
    while not stop.is_set():
        tick = time.monotonic()
        try:
            with opener.open(_request(url, basic("prometheus")), timeout=30) as r:
                r.read()
            seconds.append(time.monotonic() - tick)
        except (OSError, urllib.error.URLError):
            seconds.append(float("inf"))
        stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))
    results.put(seconds)


def _request(url: str, auth: str) -> Any:
    import urllib.request

    return urllib.request.Request(url, headers={"Authorization": auth})


def _opener(context: ssl.SSLContext) -> Any:
    import urllib.request

    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))


# --- the attacks: each returns what it holds, and a way to let go -------------------


def idle_handshakes(bench: Bench, count: int = 5000, per_address: int = 250) -> Callable[[], None]:
    socks = []
    for i in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.bind((f"127.0.2.{1 + i // per_address}", 0))
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", bench.agents))
        socks.append(s)
    return lambda: [s.close() for s in socks] and None


def non_readers(bench: Bench, peers: int = 4, per_peer: int = 250) -> Callable[[], None]:
    ask = f"GET /api/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {basic('ops')}\r\n\r\n".encode()
    socks = []
    for p in range(peers):
        for _ in range(per_peer):
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            raw.bind((f"127.0.3.{p + 1}", 0))
            raw.settimeout(30)
            raw.connect(("127.0.0.1", bench.pages))
            s = bench.context.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(ask)
            socks.append(s)
    return lambda: [s.close() for s in socks] and None


def _loop_worker(url: str, cafile: str, auth: str | None, clients: int, stop: Any) -> None:
    # On the sender's CPU, below it: what the sender measures is the control plane, not its wait for CPU 1.
    os.sched_setaffinity(0, {1})
    os.nice(19)

    async def main() -> None:
        context = ssl.create_default_context(cafile=cafile)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients, ssl=context)) as session:

            async def loop() -> None:
                while not stop.is_set():
                    try:
                        async with session.get(url, headers={"Authorization": auth} if auth else {}) as r:
                            await r.read()
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.1)

            await asyncio.gather(*(loop() for _ in range(clients)))

    asyncio.run(main())


def page_loops(bench: Bench, auth: str | None, clients: int = 200, path: str = "/",
               other_auth: str | None = None, other_path: str | None = None) -> Callable[[], None]:  # fmt: skip
    """`clients` in two processes, each looping over a page (the second process's
    auth and path may differ)."""
    stop = multiprocessing.Event()
    cafile = str(bench.tmp / "ca.crt")
    workers = [multiprocessing.Process(target=_loop_worker, args=(bench.url(bench.pages, p), cafile, a, clients // 2,
                                                                  stop))
               for a, p in ((auth, path), (other_auth or auth, other_path or path))]  # fmt: skip
    for w in workers:
        w.start()

    def let_go() -> None:
        stop.set()
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()

    return let_go


def slow_viewers(bench: Bench, viewers: int = 10) -> tuple[Callable[[], None], list[str]]:
    """Ten live views as one user from ten addresses, each reading a byte every 14 s; what each was first told."""
    stop = threading.Event()
    socks, told = [], []
    for i in range(viewers):
        raw = socket.socket()
        raw.bind((f"127.0.4.{i + 1}", 0))
        raw.settimeout(30)
        raw.connect(("127.0.0.1", bench.pages))
        s = bench.context.wrap_socket(raw, server_hostname="127.0.0.1")
        s.sendall(f"GET /node/node-{i + 1:05d}/live HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: {basic('ops')}\r\n\r\n".encode())  # fmt: skip
        first = b""
        while b"\n\n" not in first.split(b"\r\n\r\n", 1)[-1]:  # the head, then the first event (chunked)
            first += s.recv(1)
        told.append("refused" if b"event: refused" in first else "served")
        socks.append(s)

    def read_slowly() -> None:
        while not stop.wait(14):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.recv(1)

    thread = threading.Thread(target=read_slowly, daemon=True)
    thread.start()

    def let_go() -> None:
        stop.set()
        thread.join()
        for s in socks:
            s.close()

    return let_go, told


async def write_full_incident(directory: Path) -> str:
    """An incident of `INCIDENT_NODES` nodes' `INCIDENT_S` at 100 Hz of 8
    engines each, captured as the control plane captures one (the nodes'
    rings and pieces as the agent cuts them); its id."""
    from controlplane.samples.hindsight import HindsightFetches
    from controlplane.samples.incidents import Incidents
    from controlplane.state.registry import NodeRegistry
    from tests.test_hindsight_fetch import T0, filled_ring
    from tests.test_incidents import Node, captured, known

    registry = NodeRegistry(stale_after=60)
    names = [f"node-{i:05d}" for i in range(INCIDENT_NODES)]
    nodes = []
    fetches = HindsightFetches(wall=lambda: T0 + INCIDENT_S)
    for name in names:
        known(registry, name)
        node = Node(fetches, name, seconds=1)
        node.ring = filled_ring(seconds=INCIDENT_S, shards=8)
        nodes.append(node)
    incidents = Incidents(directory, fetches, registry, before_s=INCIDENT_S - 5, after_s=0,
                          wall=lambda: T0 + INCIDENT_S)  # fmt: skip
    incidents.load()
    incident = incidents.start("bench: a full incident", "operator", names, at=T0 + INCIDENT_S)
    await captured(incidents, nodes, incident.id)
    await incidents.close()
    return incident.id


def _hostile_worker(agents: str, pages: str, cafile: str, stop: Any) -> None:
    """`HOSTILE_NODES` nodes with their own tokens, each asked a span by a viewer,
    sending the heaviest pieces a body holds as fast as they are let."""
    from wire.hindsight import MAX_WINDOWS

    os.sched_setaffinity(0, {1})
    os.nice(19)

    def piece(span: str, t_from: float) -> dict[str, Any]:
        return {"id": span, "from": t_from, "to": t_from + 1, "done": False, "windows": [[0, 0]] * MAX_WINDOWS,
                "machine": {"cpu_percent": {"start": 0, "us": [1] * 30_000, "v": [1.5] * 30_000}}}  # fmt: skip

    async def node(session: aiohttp.ClientSession, i: int) -> None:
        name = f"hostile-{i:02d}"
        auth = {"Authorization": f"Bearer {tokens.node_token(SECRET, name)}"}
        async with session.post(f"{agents}/v1/register", json=registration(name), headers=auth) as r:
            await r.read()
        seq, asked, viewer_asked = 1, None, 0.0
        while not stop.is_set():
            now = time.time()
            if now - viewer_asked > 10:  # a viewer's look (the control plane lets one in each 10 s a node)
                viewer_asked = now
                async with session.post(f"{pages}/api/nodes/{name}/hindsight", json={"from": now - 300, "to": now - 1},
                                        headers={"Authorization": basic("ops")}) as r:  # fmt: skip
                    await r.read()
            body = gpu_node_heartbeat(name) | {"seq": seq, "hindsight_held_seconds": 900.0}
            body["hindsight"] = piece(asked["id"], asked["from"]) if asked else piece("nobody-asked", now - 10)
            seq += 1
            try:
                async with session.post(f"{agents}/v1/heartbeat", json=body, headers=auth) as r:
                    answer = await r.json(content_type=None)
                    if r.status == 429:
                        await asyncio.sleep(0.25)
                    elif r.status == 200:
                        asked = answer.get("hindsight")
            except (aiohttp.ClientError, ValueError):  # refused, or an answer that is not JSON
                await asyncio.sleep(0.25)

    async def main() -> None:
        context = ssl.create_default_context(cafile=cafile)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=HOSTILE_NODES * 2, ssl=context)) as s:
            await asyncio.gather(*(node(s, i) for i in range(HOSTILE_NODES)))

    asyncio.run(main())


def hindsight_flood(bench: Bench) -> Callable[[], None]:
    stop = multiprocessing.Event()
    worker = multiprocessing.Process(target=_hostile_worker, args=(bench.url(bench.agents, ""),
                                                                   bench.url(bench.pages, ""),
                                                                   str(bench.tmp / "ca.crt"), stop))  # fmt: skip
    worker.start()

    def let_go() -> None:
        stop.set()
        worker.join(30)
        if worker.is_alive():
            worker.kill()

    return let_go


def guess_flood(bench: Bench) -> Callable[[], None]:
    wrong = "Basic " + base64.b64encode(b"ops:guess").decode()
    unknown = "Basic " + base64.b64encode(b"nobody:" + b"x" * 1000).decode()
    return page_loops(bench, wrong, other_auth=unknown, path="/api/nodes")


def incident_exports(bench: Bench) -> Callable[[], None]:
    path = f"/api/incidents/{bench.incident}"
    return page_loops(bench, basic("ops"), clients=20, path=path + "?format=csv", other_path=path)


async def first_login(bench: Bench) -> str:
    """A user's first request (bcrypt runs), from an address of its own."""
    connector = aiohttp.TCPConnector(ssl=bench.context, local_addr=("127.0.5.1", 0))
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        async with session.get(bench.url(bench.pages, "/api/nodes"), headers={"Authorization": basic("newcomer")}) as r:
            await r.read()
            return f"the newcomer's first login: HTTP {r.status} in {(time.perf_counter() - started) * 1e3:.0f} ms"


async def operator_live_view(bench: Bench, session: aiohttp.ClientSession) -> str:
    async with session.get(bench.url(bench.pages, "/node/node-00000/live"),
                           headers={"Authorization": basic("operator")}) as r:  # fmt: skip
        if r.status != 200:
            return f"HTTP {r.status}"
        first = await r.content.readuntil(b"\n\n")
        return "refused" if b"event: refused" in first else "served"


async def run(args: argparse.Namespace, tmp: Path) -> None:
    bench = Bench(tmp, args.nodes, args.seconds, await write_full_incident(tmp / "incidents"))
    try:
        connector = aiohttp.TCPConnector(limit=256, ssl=bench.context)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            await bench.register(session)
            print(f"{args.nodes} nodes registered over TLS; heartbeats at {args.nodes / INTERVAL_S:.0f}/s, "
                  f"/metrics scraped every second, {args.seconds:g} s a phase; the control plane on CPU 0", flush=True)
            await bench.measure(session)  # warm: every connection made, the first scrape's caches filled
            rows: list[tuple[str, dict[str, Any], int, str]] = []
            phases: list[tuple[str, Callable[[], Any]]] = [
                ("baseline", lambda: (lambda: None)),
                ("5,000 idle TLS handshakes", lambda: idle_handshakes(bench)),
                ("4 x 250 non-readers of /api/nodes", lambda: non_readers(bench)),
                ("200 anonymous page loops", lambda: page_loops(bench, None)),
                ("200 page loops as a user", lambda: page_loops(bench, basic("ops"))),
                ("10 slow live viewers", lambda: slow_viewers(bench)),
                (f"hindsight flood: {HOSTILE_NODES} nodes", lambda: hindsight_flood(bench)),
                ("200 password guess loops", lambda: guess_flood(bench)),
                ("20 exports of a full incident", lambda: incident_exports(bench)),
            ]
            phases = [p for i, p in enumerate(phases) if i == 0 or not args.phases or i in args.phases]
            for name, attack in phases:
                Path(f"/proc/{bench.cp.pid}/clear_refs").write_text("5")  # VmHWM from here
                held = await asyncio.get_running_loop().run_in_executor(None, attack)
                note = ""
                if isinstance(held, tuple):
                    held, told = held
                    note = (f"viewers: {told.count('served')} served, {told.count('refused')} refused; "
                            f"the operator's live view: {await operator_live_view(bench, session)}")
                figures = await bench.measure(session)
                if name == "200 password guess loops":
                    note = await first_login(bench)
                peak = status_kib(bench.cp.pid, "VmHWM")
                await asyncio.get_running_loop().run_in_executor(None, held)
                rows.append((name, figures, peak, note))
                print(f"  {name}: done", flush=True)
            base = rows[0][1]
            print(f"\n{'phase':36s} {'peak RSS':>9s} {'hb p50':>8s} {'hb p99':>8s} {'x base':>7s} "
                  f"{'/metrics':>9s} {'max':>7s} {'failed':>7s}")  # fmt: skip
            for name, f, peak, note in rows:
                print(f"{name:36s} {peak / 1024:6.0f} MiB {f['p50']:6.1f}ms {f['p99']:6.1f}ms "
                      f"{f['p99'] / base['p99']:6.2f}x {f['metrics_median'] * 1e3:7.0f}ms "
                      f"{f['metrics_max'] * 1e3:5.0f}ms {f['failed']:4d}/{f['sent']}")  # fmt: skip
                if note:
                    print(f"    {note}")
            print(f"closed connections, by listener and reason: {bench.closed()}")
            print(f"the new surfaces, as counted: {bench.surfaces()}")
    finally:
        bench.cp.terminate()
        bench.cp.wait()
        bench.log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--phases", type=int, nargs="*", default=[], help="only these (1-8; the baseline always runs)")
    args = ap.parse_args()
    os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory() as tmp:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
