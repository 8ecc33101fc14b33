"""The agent and the control plane as the separate processes they are in
production, for the tests that run them so: each started from the CLI, the
control plane's view read through its pages listener."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import free_port

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


def fresh_with_seq(nodes: list[dict[str, Any]], above: int = 0) -> bool:
    return bool(nodes) and nodes[0]["state"] == "fresh" and nodes[0]["heartbeat"]["seq"] > above
