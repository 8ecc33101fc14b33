"""Heartbeats a second one control plane process sustains on one core,
beside a do-nothing handler's rate on the same core in the same run.

The control plane runs pinned to CPU 0; `wrk` (a C load generator, Debian's
`wrk`) runs pinned to CPU 1 with 64 connections, sending the heartbeats of
NODES registered nodes in turn, each with its own token, so that the client
is not what is measured. Each body is an 8-GPU, 4-engine node's. Every node
has been heard from once before the runs, unless `--fresh`: then the runs
begin with every node's first heartbeat (a fleet after a control-plane
restart), and the share of first heartbeats is printed.

The reference is an aiohttp handler that reads the body and answers
`{"ok": true}`, driven by the same wrk script on the same core: our
machines' speed varies several-fold from day to day, so the figure that
means something is the ratio. Target: at least 0.5, flat from 200 to 10,000
nodes, fresh or not.

With `--tokens k8s` every node speaks with a projected service-account
token (RS256 JWT) that the control plane verifies against a JWKS file; a
verified token is cached until it expires, so the rate should match HMAC's.

With `--scale N` (a machine with 2N cores) the fleet is spread over 1, 2 ...
N replicas as agents spread it (sampler/agent/replicas.py), each replica on
a core of its own and driven by a wrk of its own on another: the fleet's
rate at k replicas against k times one replica's, in the same run (#46's
target: at least 0.9).

With `--peers N` the measured control plane is one of N+1 replicas
(controlplane/fleet/peers.py): N more, on CPU 1, poll it every 5 s for the nodes
it holds (all of them) and are polled by it. The cost of peering is this
run's ratio against one without (#46's target: at most 5% less).

    PYTHONPATH=. .venv/bin/python bench/heartbeat_throughput.py [--nodes 200] [--seconds 10] [--runs 3]
                                                                [--tokens hmac|k8s] [--fresh] [--peers N]
                                                                [--scale N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.ingest import tokens  # noqa: E402
from sampler.gpu.gpm import CLOCK_EVENTS, METRICS, clock_event_field, fields  # noqa: E402
from tests.issuer import ISSUER, TestIssuer  # noqa: E402
from tests.test_controlplane_api import heartbeat, registration  # noqa: E402

SECRET = b"bench secret, long enough to use"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_node_heartbeat(node: str) -> dict[str, Any]:
    """A heartbeat of an 8-GPU node running 4 engines: what a fleet's bodies look like."""
    body = heartbeat(node)
    gpu = body["gpus"][0]
    # A Hopper card's: GPM, its clock events and its faults' counts too (sampler/gpu/gpm.py, nvml.py).
    gpm = {f: 40.0 + k for k, f in enumerate(f for stem in METRICS for f in fields(stem))}
    gpm.update({clock_event_field(r): 0.0 for r in CLOCK_EVENTS}, gpm_interval_seconds=0.1, xid_errors=0,
               xid_errors_total=0, pcie_replays=0, pcie_replays_total=3, remapped_rows_correctable=0,
               remapped_rows_uncorrectable=0, row_remap_pending=False, row_remap_failed=False)  # fmt: skip
    body["gpus"] = [dict(gpu, index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", utilization_p95_percent=99.0,
                         utilization_max_percent=100.0, memory_bandwidth_percent=41.0, sm_clock_hz=1980000000, **gpm)
                    for i in range(8)]  # fmt: skip
    shard = body["shards"][0]
    body["shards"] = [dict(shard, id=f"s{i}", pgid=1000 + i, pgids=[1000 + i], gpu_indices=[2 * i, 2 * i + 1],
                           gpu_sm_activity_percent=40.0, gpu_tensor_activity_percent=41.0) for i in range(4)]
    return body


def lua_string(text: str) -> str:
    return "[==[" + text + "]==]"


def lua_heartbeats(port: int, requests: list[tuple[str, str]], first_seq: int = 1) -> str:
    """wrk's script sending the bodies round the fleet, each node's `seq` one
    more at each of its heartbeats (the control plane refuses a replay); the
    script's own `response` may follow."""
    lines = ["local heads, pre, post, seqs = {}, {}, {}, {}\n"]
    for i, (auth, body) in enumerate(requests, 1):
        before, sep, after = body.partition('"seq": 1,')
        assert sep, "a heartbeat body with seq 1"
        lines.append(f'heads[{i}] = {{["Host"] = "127.0.0.1:{port}", ["Authorization"] = "{auth}", '
                     f'["Content-Type"] = "application/json"}}\n'
                     f'pre[{i}], post[{i}], seqs[{i}] = {lua_string(before + chr(34) + "seq" + chr(34) + ": ")}, '
                     f'{lua_string("," + after)}, {first_seq - 1}\n')  # fmt: skip
    lines.append("local n = 0\nrequest = function()\n  n = n % #heads + 1\n  seqs[n] = seqs[n] + 1\n"
                 '  return wrk.format("POST", "/v1/heartbeat", heads[n], pre[n] .. seqs[n] .. post[n])\nend\n')
    return "".join(lines)


REFERENCE_SERVER = """
import sys
from aiohttp import web

async def handle(request):
    await request.read()
    return web.json_response({"ok": True})

app = web.Application(client_max_size=512 * 1024)
app.router.add_post("/v1/heartbeat", handle)
print("reference", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


class Agents:
    """The fleet's side of the set-up: registrations and warm-up heartbeats
    over one kept-alive connection (10,000 new connections would take longer
    than the runs)."""

    def __init__(self, port: int, issuer: TestIssuer | None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.issuer = issuer

    def token(self, node: str) -> str:
        return tokens.node_token(SECRET, node) if self.issuer is None else self.issuer.token(node)

    def post(self, path: str, auth: str, body: str) -> None:
        self.conn.request("POST", path, body=body.encode(),
                          headers={"Authorization": auth, "Content-Type": "application/json"})  # fmt: skip
        answer = self.conn.getresponse()
        text = answer.read()
        assert answer.status == 200, (path, answer.status, text[:200])

    def fleet(self, names: list[str], heard: bool) -> list[tuple[str, str]]:
        """Registers each node (and sends its first heartbeat when `heard`);
        the (authorization, heartbeat body with seq 1) of each."""
        requests = []
        for node in names:
            auth = f"Bearer {self.token(node)}"
            self.post("/v1/register", auth, json.dumps(registration(node)))
            body = json.dumps(gpu_node_heartbeat(node))
            if heard:
                self.post("/v1/heartbeat", auth, body)
            requests.append((auth, body))
        return requests


def wrk(port: int, script: Path, seconds: int, cpu: int = 1) -> tuple[float, float, str, str]:
    """(requests a second, p99 in ms, p50 as wrk printed it, non-2xx count)."""
    out = subprocess.run(["taskset", "-c", str(cpu), "wrk", "-t1", "-c64", f"-d{seconds}s", "--latency",
                          "-s", str(script), f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rate, _ms(lat["99"]), lat["50"], errors.group(1) if errors else "0"


def scaling(replicas: int, nodes: int, seconds: int) -> None:
    """The fleet over 1..`replicas` replicas, each on its core with its wrk on another."""
    import os
    import threading

    from sampler.agent.replicas import ranked

    cores = len(os.sched_getaffinity(0))
    if cores < 2 * replicas:
        raise SystemExit(f"--scale {replicas}: needs {2 * replicas} cores (a replica and its wrk each), "
                         f"this machine has {cores}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "secret").write_bytes(SECRET)
        one = 0.0
        for k in range(1, replicas + 1):
            ports = [(free_port(), free_port()) for _ in range(k)]
            urls = [f"http://127.0.0.1:{a}" for a, _ in ports]
            procs = [subprocess.Popen(["taskset", "-c", str(i), sys.executable, "-m", "nodesampler", "controlplane",
                                       "--listen", f"127.0.0.1:{a}", "--pages-listen", f"127.0.0.1:{b}",
                                       "--secret-file", str(Path(tmp) / "secret"), "--max-heartbeats-per-second",
                                       "0", *([x for _, b in ports for x in ("--peer", f"http://127.0.0.1:{b}")]
                                              if k > 1 else [])],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                     for i, (a, b) in enumerate(ports)]  # fmt: skip
            try:
                for proc in procs:
                    assert proc.stdout is not None and b"control plane" in proc.stdout.readline()
                names = [f"node-{i:05d}" for i in range(nodes)]
                rates: list[float] = [0.0] * k
                scripts = []
                for i, (port, _) in enumerate(ports):
                    mine = [n for n in names if ranked(n, urls)[0] == urls[i]]
                    script = Path(tmp) / f"heartbeats-{k}-{i}.lua"
                    script.write_text(lua_heartbeats(port, Agents(port, None).fleet(mine, heard=True), first_seq=2))
                    scripts.append(script)

                def drive(i: int, port: int, script: Path, cpu: int, rates: list[float] = rates) -> None:
                    rates[i] = wrk(port, script, seconds, cpu=cpu)[0]

                threads = [threading.Thread(target=drive, args=(i, ports[i][0], scripts[i], k + i)) for i in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                one = one or rates[0]
                print(f"{k} replicas: {sum(rates):7.0f} heartbeats/s ({', '.join(f'{r:.0f}' for r in rates)}), "
                      f"{sum(rates) / (k * one):.2f} of {k} x one replica's", flush=True)
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", choices=("hmac", "k8s"), default="hmac")
    ap.add_argument("--fresh", action="store_true", help="runs begin with every node's first heartbeat")
    ap.add_argument("--peers", type=int, default=0, help="other replicas peering with the measured one")
    ap.add_argument("--scale", type=int, default=0, help="the fleet over 1..N replicas (2N cores)")
    args = ap.parse_args()
    if args.scale:
        scaling(args.scale, args.nodes, args.seconds)
        return
    issuer = TestIssuer() if args.tokens == "k8s" else None
    if shutil.which("wrk") is None:
        raise SystemExit("heartbeat_throughput: needs wrk (apt-get install wrk)")
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_bytes(SECRET)
        port, pages, ref_port = free_port(), free_port(), free_port()
        identity = ["--secret-file", str(secret)]
        if issuer is not None:
            (Path(tmp) / "jwks.json").write_text(json.dumps(issuer.jwks()))
            identity = ["--k8s-jwks", str(Path(tmp) / "jwks.json"), "--k8s-issuer", ISSUER]
        others = [(free_port(), free_port()) for _ in range(args.peers)]
        everyone = [a for p in [pages, *(o[1] for o in others)] for a in ("--peer", f"http://127.0.0.1:{p}")]
        if args.peers and issuer is not None:
            raise SystemExit("--peers needs the cluster secret: with --tokens hmac")
        cp = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "nodesampler", "controlplane",
                               "--listen", f"127.0.0.1:{port}", "--pages-listen", f"127.0.0.1:{pages}", *identity,
                               "--max-heartbeats-per-second", "0",  # the flood is the measurement
                               *(everyone if args.peers else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        peers = [subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "nodesampler", "controlplane",
                                   "--listen", f"127.0.0.1:{a}", "--pages-listen", f"127.0.0.1:{b}", *identity,
                                   *everyone], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                 for a, b in others]  # fmt: skip
        ref = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", REFERENCE_SERVER, str(ref_port)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
            assert ref.stdout is not None and b"reference" in ref.stdout.readline()
            agents = Agents(port, issuer)
            print(f"{args.nodes} nodes{', fresh' if args.fresh else ''}, {args.tokens} tokens, wrk -t1 -c64 on CPU 1, "
                  "the control plane and the do-nothing reference on CPU 0"
                  f"{f', {args.peers} peers polling it on CPU 1' if args.peers else ''}", flush=True)
            rates, refs, p99s = [], [], []
            for run in range(args.runs):
                names = [f"node-{run if args.fresh else 0}-{i:05d}" for i in range(args.nodes)]
                if run == 0 or args.fresh:
                    requests = agents.fleet(names, heard=not args.fresh)
                    if run == 0:
                        print(f"{len(requests[0][1])}-byte heartbeats", flush=True)
                # Each run's seqs begin after the last run's: a node's seq must grow (a replay is refused).
                script = Path(tmp) / "heartbeats.lua"
                script.write_text(lua_heartbeats(port, requests, first_seq=1 if args.fresh else 2 + run * 10**8))
                rate, p99, p50, errors = wrk(port, script, args.seconds)
                ref_rate, _, _, _ = wrk(ref_port, script, args.seconds)
                rates.append(rate)
                refs.append(ref_rate)
                p99s.append(p99)
                first = f"  first heartbeats {min(1.0, args.nodes / (rate * args.seconds)):4.0%}" if args.fresh else ""
                print(f"run {run + 1}: {rate:7.0f} heartbeats/s  reference {ref_rate:7.0f}/s  "
                      f"ratio {rate / ref_rate:.2f}  p50 {p50:>8}  p99 {p99:6.1f}ms  non-2xx {errors}{first}",
                      flush=True)  # fmt: skip
            print(f"median: {statistics.median(rates):.0f} heartbeats/s against {statistics.median(refs):.0f}/s, "
                  f"ratio {statistics.median(r / f for r, f in zip(rates, refs, strict=True)):.2f}, "
                  f"p99 {statistics.median(p99s):.1f} ms")
        finally:
            for process in (cp, ref, *peers):
                process.terminate()
                process.wait()


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


if __name__ == "__main__":
    main()
