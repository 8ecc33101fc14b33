"""The agent on a node shared with tenants who write what it reads: each
hostile input driven at its worst by processes of its own, against the agent
and control plane as the separate processes they are in production. The
node must stay fresh, every heartbeat accepted, SIGTERM answered; each test
prints the agent's peak RSS and the longest gap between heartbeats it saw,
for the closing notes (figures, not thresholds)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_fleet import Fleet, fresh_with_seq

pytestmark = pytest.mark.live

NEAR_MISSES = 2000  # process groups whose leaders nearly match the selector


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def watch_heartbeats(fleet: Fleet, count: int) -> tuple[dict[str, Any], float]:
    """Poll until `count` more heartbeats have come, asserting the node is
    fresh at every look; the node, and the longest gap between new seqs seen."""
    [node] = fleet.wait_for(fresh_with_seq)
    first, last_seq, last_at, gap = node["heartbeat"]["seq"], node["heartbeat"]["seq"], time.monotonic(), 0.0

    def more(nodes: list[dict[str, Any]]) -> bool:
        nonlocal last_seq, last_at, gap
        assert nodes and nodes[0]["state"] == "fresh", nodes
        seq = nodes[0]["heartbeat"]["seq"]
        if seq != last_seq:
            now = time.monotonic()
            gap, last_seq, last_at = max(gap, now - last_at), seq, now
        return bool(seq >= first + count)

    [node] = fleet.wait_for(more)
    return node, gap


def test_command_lines_written_to_freeze_the_agent_leave_the_node_fresh(fleet: Fleet, tmp_path: Path) -> None:
    """The README's own `cmdline:vllm serve .*llama-70b`, against a 1 MB line
    of repeated `vllm serve` (Python's `re` took minutes on it: quadratic)
    and thousands of process groups whose leaders' lines nearly match: the
    selector still finds the one engine, and the node stays fresh."""
    hostile = []
    try:
        # The issue's own reproduction: ~1 MB of `vllm serve` in one command line.
        hostile.append(subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"] + ["vllm serve"] * 90000,
            process_group=0, stdin=subprocess.DEVNULL))  # fmt: skip
        # Leaders whose lines are `vllm serve` to past the 32 KiB prefix, never the model.
        for _ in range(NEAR_MISSES):
            hostile.append(subprocess.Popen(
                ["/bin/sh", "-c", "read x", "vllm"] + ["serve vllm"] * 3300 + ["serve"],
                process_group=0, stdin=subprocess.PIPE))  # fmt: skip
        engine = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: sum(range(10000)); time.sleep(0.01)",
             "vllm", "serve", "--model", "meta/llama-70b"], process_group=0)  # fmt: skip
        hostile.append(engine)
        config = tmp_path / "agent.toml"
        config.write_text('[[shard]]\nid = "s0"\nmodel = "llama-70b"\nselect = "cmdline:vllm serve .*llama-70b"\n')
        fleet.start_control_plane()
        fleet.start_agent("--config", str(config))
        node, gap = watch_heartbeats(fleet, 5)
        assert node["heartbeats"] == node["heartbeat"]["seq"]  # not one refused
        [shard] = node["heartbeat"]["shards"]
        assert shard["id"] == "s0" and shard["pgid"] == engine.pid
        assert shard["cpu_cores"]["mean"] > 0
        assert fleet.agent is not None
        print(f"\ncmdline: agent peak RSS {peak_rss_kib(fleet.agent.pid)} KiB; longest gap between heartbeats "
              f"{gap:.2f} s at --interval 1; {NEAR_MISSES} near misses and one 1 MB line")
        fleet.agent.send_signal(signal.SIGTERM)
        assert fleet.agent.wait(timeout=30) == 0  # answered, not held behind a match
        assert "Traceback" not in fleet.agent_log()
    finally:
        for p in hostile:
            p.kill()
        for p in hostile:
            p.wait()


# An engine's metrics endpoint as a tenant could write it, in a process of its own.
HOSTILE_ENGINE = r'''
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODIES = {
    "/one-sample": b"a 1\n" * (2 << 20),                                           # 8 MiB, 2M samples
    "/families": b"".join(b"# TYPE f%d gauge\nf%d 1\n" % (i, i) for i in range(100_000)),
    "/one-line": b'vllm:num_requests_waiting{pad="' + b"p" * (8 << 20) + b'"} 1\n',
}

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/drip":  # the status line, a byte every 1.5 s
            for byte in b"HTTP/1.1 200 OK\r\n\r\n" * 1000:
                self.wfile.write(bytes([byte])); self.wfile.flush(); time.sleep(1.5)
        elif self.path == "/redirect":
            self.send_response(302); self.send_header("Location", "http://127.0.0.1:%d/target" % PORT)
            self.send_header("Content-Length", "0"); self.end_headers()
        elif self.path == "/target":
            print("target asked", flush=True)
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        else:
            body = BODIES[self.path]
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
PORT = server.server_address[1]
print(PORT, flush=True)
server.serve_forever()
'''

ENDPOINTS = {"one-sample": "more than 100000 lines", "families": "more than 100000 lines",
             "one-line": "a line longer than 64 KiB", "drip": "not whole within 2 s|no answer within the window",
             "redirect": "HTTP 302: redirects are not followed"}  # fmt: skip


def test_engines_written_to_exhaust_the_agent_cost_their_own_figures(fleet: Fleet, tmp_path: Path) -> None:
    """Each hostile metrics endpoint of the issue behind a shard of its own:
    heartbeats keep going, each such shard says why it has no queue
    figures, the redirect's target is never asked, and the agent's peak RSS
    stays within its DaemonSet request (96 MiB)."""


    server = subprocess.Popen([sys.executable, "-c", HOSTILE_ENGINE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    sleepers = [subprocess.Popen(["sleep", "600"], process_group=0) for _ in ENDPOINTS]
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        config = tmp_path / "agent.toml"
        config.write_text("".join(
            f'[[shard]]\nid = "{name}"\nselect = "pgid:{p.pid}"\nmetrics_url = "http://127.0.0.1:{port}/{name}"\n'
            for name, p in zip(ENDPOINTS, sleepers, strict=True)))  # fmt: skip
        fleet.start_control_plane()
        fleet.start_agent("--config", str(config))

        def all_say_why(nodes: list[dict[str, Any]]) -> bool:
            if not fresh_with_seq(nodes, above=3):
                return False
            shards = {s["id"]: s for s in nodes[0]["heartbeat"]["shards"]}
            return all(re.fullmatch(why, shards.get(n, {}).get("metrics_error", "")) for n, why in ENDPOINTS.items())

        fleet.wait_for(all_say_why)
        node, gap = watch_heartbeats(fleet, 5)
        assert node["heartbeats"] == node["heartbeat"]["seq"]  # not one refused
        for s in node["heartbeat"]["shards"]:
            assert "requests_waiting" not in s and "metrics_error" in s, s
        assert fleet.agent is not None
        peak = peak_rss_kib(fleet.agent.pid)
        print(f"\nengine metrics: agent peak RSS {peak} KiB; longest gap between heartbeats {gap:.2f} s "
              f"at --interval 1; endpoints {', '.join(ENDPOINTS)}")
        assert peak < 96 * 1024, peak  # the DaemonSet's memory request
        fleet.agent.send_signal(signal.SIGTERM)
        assert fleet.agent.wait(timeout=30) == 0
        assert "Traceback" not in fleet.agent_log()
    finally:
        server.kill()
        out, _ = server.communicate()
        for p in sleepers:
            p.kill()
            p.wait()
    assert "target asked" not in out
