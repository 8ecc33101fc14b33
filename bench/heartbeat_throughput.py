"""Heartbeats a second one control plane process sustains on one core.

The control plane runs pinned to CPU 0; `wrk` (a C load generator, Debian's
`wrk`) runs pinned to CPU 1 with 64 connections, sending the heartbeats of
NODES registered nodes in turn, each with its own token, so that the client
is not what is measured. Prints requests a second, p50/p99 latency and any
non-2xx answers, for several runs. Each body is an 8-GPU, 4-engine node's. Target: 5,000 heartbeats a second with
p99 under 50 ms.

With `--tokens k8s` every node speaks with a projected service-account
token (RS256 JWT) that the control plane verifies against a JWKS file; a
verified token is cached until it expires, so the rate should match HMAC's.

    PYTHONPATH=. .venv/bin/python bench/heartbeat_throughput.py [--nodes 200] [--seconds 10] [--runs 3]
                                                                [--tokens hmac|k8s]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodesampler import tokens  # noqa: E402
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
    body["gpus"] = [dict(gpu, index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", utilization_p95_percent=99.0,
                         utilization_max_percent=100.0, memory_bandwidth_percent=41.0, sm_clock_hz=1980000000)
                    for i in range(8)]  # fmt: skip
    shard = body["shards"][0]
    body["shards"] = [dict(shard, id=f"s{i}", pgid=1000 + i, pgids=[1000 + i]) for i in range(4)]
    return body


def lua_string(text: str) -> str:
    return "[==[" + text + "]==]"


def lua_heartbeats(port: int, requests: list[tuple[str, str]]) -> str:
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
                     f'{lua_string("," + after)}, 0\n')  # fmt: skip
    lines.append("local n = 0\nrequest = function()\n  n = n % #heads + 1\n  seqs[n] = seqs[n] + 1\n"
                 '  return wrk.format("POST", "/v1/heartbeat", heads[n], pre[n] .. seqs[n] .. post[n])\nend\n')
    return "".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", choices=("hmac", "k8s"), default="hmac")
    args = ap.parse_args()
    issuer = TestIssuer() if args.tokens == "k8s" else None
    if shutil.which("wrk") is None:
        raise SystemExit("heartbeat_throughput: needs wrk (apt-get install wrk)")
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_bytes(SECRET)
        port, pages = free_port(), free_port()
        identity = ["--secret-file", str(secret)]
        if issuer is not None:
            (Path(tmp) / "jwks.json").write_text(json.dumps(issuer.jwks()))
            identity = ["--k8s-jwks", str(Path(tmp) / "jwks.json"), "--k8s-issuer", ISSUER]
        cp = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "nodesampler", "controlplane",
                               "--listen", f"127.0.0.1:{port}", "--pages-listen", f"127.0.0.1:{pages}", *identity,
                               "--max-heartbeats-per-second", "0"],  # the flood is the measurement
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            assert cp.stdout is not None and b"control plane" in cp.stdout.readline()
            requests = []
            for i in range(args.nodes):
                node = f"node-{i:05d}"
                token = tokens.node_token(SECRET, node) if issuer is None else issuer.token(node)
                headers = {"Authorization": f"Bearer {token}",
                           "Content-Type": "application/json"}  # fmt: skip
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/register", method="POST",
                                             data=json.dumps(registration(node)).encode(), headers=headers)
                urllib.request.urlopen(req).read()
                requests.append((headers["Authorization"], json.dumps(gpu_node_heartbeat(node))))
            size = len(requests[0][1])
            script = Path(tmp) / "heartbeats.lua"
            script.write_text(lua_heartbeats(port, requests))
            print(f"{args.nodes} nodes, {args.tokens} tokens, {size}-byte heartbeats, wrk -t1 -c64 on CPU 1, "
                  "control plane on CPU 0")
            rates, p99s = [], []
            for run in range(args.runs):
                out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", "-c64", f"-d{args.seconds}s", "--latency",
                                      "-s", str(script), f"http://127.0.0.1:{port}"],
                                     capture_output=True, text=True, check=True).stdout  # fmt: skip
                rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
                lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M))
                errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
                rates.append(rate)
                p99s.append(_ms(lat["99"]))
                print(f"run {run + 1}: {rate:8.0f} heartbeats/s  p50 {lat['50']:>8}  p99 {lat['99']:>8}  "
                      f"non-2xx {errors.group(1) if errors else 0}", flush=True)  # fmt: skip
                time.sleep(1)
            print(f"median: {statistics.median(rates):.0f} heartbeats/s, p99 {statistics.median(p99s):.1f} ms")
        finally:
            cp.terminate()
            cp.wait()


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


if __name__ == "__main__":
    main()
