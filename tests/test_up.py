"""`nodesampler up`, the README's first command, as a newcomer runs it: it
keeps incidents in its state directory and says where, answers to its own
host names only, and its admin socket is how this machine's user starts an
incident (nobody does anonymously)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.live


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(self.path))


def request(conn: http.client.HTTPConnection, method: str, path: str, body: object = None,
            headers: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    data = None if body is None else json.dumps(body)
    sent = dict(headers or {}) | ({"Content-Type": "application/json"} if body is not None else {})
    try:
        conn.request(method, path, body=data, headers=sent)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path, list[str]]]:
    port = free_port()
    while port >= 65534:  # the agents' port is the next one
        port = free_port()
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "nodesampler", "up", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", str(state), "--interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    said = [proc.stdout.readline(), proc.stdout.readline()]
    try:
        yield proc, port, state, said
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_up_keeps_incidents_and_answers_its_own_names(up: tuple[subprocess.Popen[str], int, Path, list[str]]) -> None:
    proc, port, state, said = up
    assert "is up" in said[0] and f"kept in {state}" in said[1], said
    assert stat.S_IMODE(state.stat().st_mode) == 0o700

    def pages(path: str, host: str = f"127.0.0.1:{port}", method: str = "GET", body: object = None) -> tuple[int, str]:
        return request(http.client.HTTPConnection("127.0.0.1", port, timeout=10), method, path, body, {"Host": host})

    # A page that rebinds its own name to this machine is refused; the machine's own names are served.
    assert pages("/api/nodes", host=f"attacker.example:{port}")[0] == 421
    deadline = time.monotonic() + 120
    while True:  # the agent's first heartbeat: its own schedule
        status, body = pages("/api/nodes", host=f"localhost:{port}")
        assert status == 200
        nodes = json.loads(body)["nodes"]
        if nodes and nodes[0]["state"] == "fresh":
            break
        assert time.monotonic() < deadline and proc.poll() is None, body
        time.sleep(0.2)
    node = nodes[0]["node"]
    # Nobody starts an incident anonymously; Alertmanager's webhook wants a user too.
    assert pages("/api/incidents", method="POST", body={"nodes": [node]})[0] == 403
    assert pages("/api/alertmanager", method="POST", body={"alerts": []})[0] == 403
    admin = UnixConnection(state / "admin.sock")
    status, body = request(admin, "POST", "/api/incidents", {"nodes": [node], "reason": "a look"})
    assert status == 202, body
    incident = json.loads(body)["id"]
    listed = json.loads(pages("/api/incidents")[1])
    assert [i["id"] for i in listed["incidents"]] == [incident]
    files = list((state / "incidents").iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert (state / "registry.json").is_file() and not (state / "admin.sock").exists()
