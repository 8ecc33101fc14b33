"""The agent and the control plane as the separate processes they are in
production, for the tests that run them so: each started from the CLI, the
control plane's view read through its pages listener."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.certs import TestCA
from tests.conftest import free_port

INTERVAL = 1.0
PASSWORD = "correct horse battery"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def web_config_file(tmp: Path, users: dict[str, str], tls: bool = True, cost: int = 4, extra: str = "") -> Path:
    """A web configuration file as an operator writes one (bcrypt hashes; the
    certificate, for localhost and 127.0.0.1, from a CA whose file is `ca.crt` beside it)."""
    import bcrypt

    lines = []
    if tls:
        ca = TestCA("web config CA")
        ca.write_ca(tmp / "ca.crt")
        ca.issue(tmp / "tls.crt", tmp / "tls.key", ["localhost", "127.0.0.1"])
        lines += ["tls_server_config:", "  cert_file: tls.crt", "  key_file: tls.key"]  # relative to the file
    if users:
        lines.append("basic_auth_users:")
        lines += [f"  {u}: {bcrypt.hashpw(p.encode(), bcrypt.gensalt(cost)).decode()}" for u, p in users.items()]
    path = tmp / "web-config.yml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.secret = tmp / "secret"
        self.secret.write_text("s3cret-s3cret-s3cret-s3cret\n")
        self.agent_port, self.pages_port = free_port(), free_port()
        self.control: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.fds: list[int] = []
        self.scheme = "http"
        self.pages_headers: dict[str, str] = {}  # a user's, once the pages have users (secure)
        self.context: ssl.SSLContext | None = None

    def secure(self, users: dict[str, str] | None = None, extra: str = "") -> Path:
        """TLS on both listeners and users on the pages, from one web config file (its path): the
        helpers below speak https as the user `ops` from here on."""
        users = {"ops": PASSWORD} if users is None else users
        path = web_config_file(self.tmp, users, extra=extra)
        self.scheme, self.context = "https", ssl.create_default_context(cafile=str(self.tmp / "ca.crt"))
        if users:
            self.pages_headers = basic(*next(iter(users.items())))
        return path

    def pages(self, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
        """The pages listener's answer (status, body), as this fleet's user unless headers say otherwise."""
        url = f"{self.scheme}://127.0.0.1:{self.pages_port}{path}"
        request = urllib.request.Request(url, method=method, headers=self.pages_headers if headers is None else headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

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
            self.cli("agent", "--control-plane", f"{self.scheme}://127.0.0.1:{self.agent_port}", "--token-file",
                     str(token), "--node", "n1", "--interval", str(INTERVAL), "--backend", "proc",
                     *(["--ca-file", str(self.tmp / "ca.crt")] if self.scheme == "https" else []), *extra),
            stderr=self.log("agent.log"))  # fmt: skip

    def nodes(self) -> list[dict[str, Any]]:
        try:
            status, body = self.pages("/api/nodes")
        except (urllib.error.URLError, ConnectionError):
            return []
        nodes: list[dict[str, Any]] = json.loads(body)["nodes"] if status == 200 else []
        return nodes

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
