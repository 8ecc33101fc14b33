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
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.agent_fleet import PASSWORD, basic, web_config_file
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


@contextmanager
def running_up(state: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], int, list[str]]]:
    """`nodesampler up` with `flags`; its two lines said at start."""
    port = free_port()
    while port >= 65534:  # the agents' port is the next one
        port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nodesampler", "up", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", str(state), "--interval", "1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    said = [proc.stdout.readline(), proc.stdout.readline()]
    try:
        yield proc, port, said
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path, list[str]]]:
    with running_up(tmp_path / "state") as (proc, port, said):
        yield proc, port, tmp_path / "state", said


def made_in_tmp() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("nodesampler-up-*")}


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


def test_up_with_tls_and_users_keeps_its_secret_in_its_state_and_nothing_in_tmp(tmp_path: Path) -> None:
    """The flags the control plane's warning names (`--web-config-file`) are
    `up`'s too: the agent speaks TLS to it, trusting `--ca-file`; the pages
    want the web config's user, who may start an incident; the secret and
    the token are the state directory's (0600), used again by the next run."""
    state = tmp_path / "state"
    config = web_config_file(tmp_path, {"ops": PASSWORD})
    trusted = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    before = made_in_tmp()
    flags = ["--web-config-file", str(config), "--ca-file", str(tmp_path / "ca.crt")]
    with running_up(state, *flags) as (proc, port, said):
        assert f"open https://127.0.0.1:{port}/" in said[0], said

        def pages(path: str, method: str = "GET", body: object = None, user: bool = True) -> tuple[int, str]:
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=trusted)
            return request(conn, method, path, body, basic("ops", PASSWORD) if user else {})

        assert pages("/api/nodes", user=False)[0] == 401
        deadline = time.monotonic() + 120
        while True:  # the agent's first heartbeat, over TLS
            status, body = pages("/api/nodes")
            assert status == 200
            nodes = json.loads(body)["nodes"]
            if nodes and nodes[0]["state"] == "fresh":
                break
            assert time.monotonic() < deadline and proc.poll() is None, body
            time.sleep(0.2)
        status, body = pages("/api/incidents", "POST", {"nodes": [nodes[0]["node"]], "reason": "a look"})
        assert status == 202, body
    assert made_in_tmp() <= before
    for kept in ("secret", "token"):
        assert stat.S_IMODE((state / kept).stat().st_mode) == 0o600
    secret = (state / "secret").read_bytes()
    with running_up(state) as (proc, port, said):
        assert "is up" in said[0]
    assert (state / "secret").read_bytes() == secret  # the same secret: the node's token stays valid


def test_up_misuse_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for flags, says in [(["--tls-cert", str(tmp_path / "c")], "--tls-cert and --tls-key go together"),
                        (["--ca-file", str(tmp_path / "ca")], "--ca-file is what the agent trusts for TLS"),
                        (["--web-config-file", str(tmp_path / "none.yml")], "--web-config-file")]:
        r = subprocess.run([sys.executable, "-m", "nodesampler", "up", "--state-dir", str(tmp_path / "s"), *flags],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, (flags, r.stderr)
