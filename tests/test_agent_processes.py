"""The agent and the control plane as the separate processes they are in
production: the control plane killed and restarted, and down for 30 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.live

INTERVAL = 1.0


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.secret = tmp / "secret"
        self.secret.write_text("s3cret-s3cret-s3cret-s3cret\n")
        self.agent_port, self.pages_port = free_port(), free_port()
        self.control: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.fds: list[int] = []

    def log(self, name: str) -> int:
        """An fd appending to a log file, for a child's stderr (the child keeps it open)."""
        fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.fds.append(fd)
        return fd

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "nodesampler", *args]

    def start_control_plane(self, *extra: str) -> None:
        self.control = subprocess.Popen(
            self.cli("controlplane", "--listen", f"127.0.0.1:{self.agent_port}", "--pages-listen",
                     f"127.0.0.1:{self.pages_port}", "--secret-file", str(self.secret), *extra),
            stdout=subprocess.PIPE, stderr=self.log("control.log"))  # fmt: skip
        assert self.control.stdout is not None
        assert b"control plane" in self.control.stdout.readline()  # it listens

    def kill_control_plane(self) -> None:
        assert self.control is not None
        self.control.kill()
        self.control.wait()

    def start_agent(self, *extra: str) -> None:
        token = self.tmp / "token"
        token.write_bytes(subprocess.run(self.cli("token", "n1", "--secret-file", str(self.secret)),
                                         capture_output=True, check=True).stdout)  # fmt: skip
        self.agent = subprocess.Popen(
            self.cli("agent", "--control-plane", f"http://127.0.0.1:{self.agent_port}", "--token-file", str(token),
                     "--node", "n1", "--interval", str(INTERVAL), "--backend", "proc", *extra),
            stderr=self.log("agent.log"))  # fmt: skip

    def nodes(self) -> list[dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.pages_port}/api/nodes", timeout=5) as r:
                nodes: list[dict[str, Any]] = json.load(r)["nodes"]
                return nodes
        except (urllib.error.URLError, ConnectionError):
            return []

    def wait_for(self, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> list[dict[str, Any]]:
        """Poll the control plane's view until `check` holds (the agent works on its own schedule)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.nodes()
            if check(nodes):
                return nodes
            time.sleep(0.1)
        raise AssertionError(f"timed out; last view {self.nodes()}; agent log:\n{self.agent_log()}")

    def agent_log(self) -> str:
        return (self.tmp / "agent.log").read_text()

    def wait_for_log(self, text: str, timeout: float = 60) -> str:
        """The agent logs a recovery when the answer to its first delivered heartbeat
        is back, which can be just after the control plane shows the node fresh."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.agent_log()):
            assert time.monotonic() < deadline, log
            time.sleep(0.1)
        return log

    def agent_rss_kib(self) -> int:
        assert self.agent is not None
        for line in Path(f"/proc/{self.agent.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        for p in (self.agent, self.control):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def fresh_with_seq(nodes: list[dict[str, Any]], above: int = 0) -> bool:
    return bool(nodes) and nodes[0]["state"] == "fresh" and nodes[0]["heartbeat"]["seq"] > above


def test_agent_registers_again_at_once_after_a_restart(fleet: Fleet) -> None:
    fleet.start_control_plane()
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    assert node["node"] == "n1" and node["registration"]["backend"] == "proc"
    seq = node["heartbeat"]["seq"]
    fleet.kill_control_plane()
    fleet.start_control_plane()  # same ports, empty registry
    [node] = fleet.wait_for(lambda n: fresh_with_seq(n, above=seq))
    # Re-registered at the first heartbeat the new control plane answered 404
    # (or refused while it started): the windows lost are the one or two in flight.
    first_accepted = node["heartbeat"]["seq"] - (node["heartbeats"] - 1)
    assert first_accepted <= seq + 2, (seq, node["heartbeat"]["seq"], node["heartbeats"])


def test_agent_rides_out_a_30_s_outage_alone_without_growing(fleet: Fleet) -> None:
    fleet.start_control_plane()
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    rss_before = fleet.agent_rss_kib()
    fleet.kill_control_plane()
    time.sleep(30)  # the outage itself: the agent keeps sampling, retries, keeps one summary
    rss_during = fleet.agent_rss_kib()
    fleet.start_control_plane()
    [node] = fleet.wait_for(fresh_with_seq)
    assert node["heartbeat"]["seq"] >= 25  # sampling never stopped: ~30 windows passed
    log = fleet.wait_for_log("reachable again")
    assert log.count("unreachable") == 1  # one line for the outage, not one per retry
    assert log.count("reachable again") == 1
    assert rss_during - rss_before < 4096, (rss_before, rss_during)
    assert fleet.agent is not None
    fleet.agent.send_signal(signal.SIGTERM)
    assert fleet.agent.wait(timeout=30) == 0  # SIGTERM stops it cleanly
    assert "Traceback" not in fleet.agent_log()


def test_a_process_with_a_hostile_name_leaves_the_node_fresh(fleet: Fleet) -> None:
    """Any local user can write a tab or a non-breaking space into its own comm:
    the agent escapes it; every heartbeat is accepted; the page and /metrics show it."""
    code = ("open('/proc/self/comm', 'wb').write('bz\\t\\xa0x'.encode())\nprint('ready', flush=True)\n"
            "while True:\n    pass\n")  # fmt: skip
    busy = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, process_group=0)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"ready\n"
        fleet.start_control_plane()
        fleet.start_agent()

        def shows_it(nodes: list[dict[str, Any]]) -> bool:
            return fresh_with_seq(nodes, above=2) and any(
                s.get("command") == "bz\\t\\xa0x" for s in nodes[0]["heartbeat"]["shards"])

        [node] = fleet.wait_for(shows_it)
        assert node["heartbeats"] == node["heartbeat"]["seq"]  # not one refused
        [shard] = [s for s in node["heartbeat"]["shards"] if s.get("command") == "bz\\t\\xa0x"]
        base = f"http://127.0.0.1:{fleet.pages_port}"
        with urllib.request.urlopen(f"{base}/node/n1", timeout=5) as r:
            assert "bz\\t\\xa0x" in r.read().decode()
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert f'shard="{shard["id"]}"' in r.read().decode()
        assert "left out" not in fleet.agent_log()
    finally:
        busy.kill()
        busy.wait()
