"""Who may read the pages and change the fleet, as deployed: the control
plane's own process with the web configuration file operators give
Prometheus (TLS on both listeners, bcrypt users on the pages), a real agent
heartbeating over that TLS, and requests from the loopback addresses a
service mesh's sidecar uses (Istio connects from 127.0.0.6)."""

from __future__ import annotations

import base64
import http.client
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from tests.agent_fleet import PASSWORD, Fleet, basic, fresh_with_seq
from tests.certs import TestCA
from tests.conftest import free_port
from tests.test_connection_limits import connect, wait_closed_by_server

pytestmark = pytest.mark.live

SIDECAR = "127.0.0.6"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def ask(fleet: Fleet, method: str, path: str, headers: dict[str, str] | None = None, source: str = SIDECAR,
        port: int | None = None) -> tuple[int, dict[str, str], str]:  # fmt: skip
    """One request from `source` (another loopback address than the agent's)."""
    port = port or fleet.pages_port
    if fleet.context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, context=fleet.context, timeout=10, source_address=(source, 0))
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


def forget(fleet: Fleet, node: str, admin: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(fleet.cli("forget", node, "--admin-socket", str(admin), *flags), capture_output=True,
                          text=True)  # fmt: skip


def test_a_loopback_peer_is_no_operator_and_this_machine_forgets_through_its_socket(fleet: Fleet) -> None:
    admin = fleet.tmp / "admin.sock"
    fleet.start_control_plane("--admin-socket", str(admin))
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    # A sidecar, a port-forward or a DNS-rebound page: loopback, and refused (it was a 200).
    status, _, body = ask(fleet, "DELETE", "/api/nodes/n1")
    assert status == 403 and "nodesampler forget" in body
    assert ask(fleet, "DELETE", "/api/nodes/n1", source="127.0.0.1")[0] == 403
    assert [n["node"] for n in fleet.nodes()] == ["n1"]
    # The operator on this machine: the socket is the control plane's user's alone.
    assert stat.S_IMODE(os.stat(admin).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(admin).st_mode)
    # Heard from within --stale-after: its agent would register it again at once. Refused, saying when.
    heard = forget(fleet, "n1", admin)
    assert heard.returncode == 1 and heard.stderr.count("\n") == 1, heard.stderr
    assert re.search(r"409 n1 last heartbeat \d+ s ago, within --stale-after", heard.stderr), heard.stderr
    assert "--force" in heard.stderr and [n["node"] for n in fleet.nodes()] == ["n1"]
    assert fleet.agent is not None
    fleet.agent.kill()
    done = forget(fleet, "n1", admin, "--force")
    assert done.returncode == 0 and done.stdout.strip() == "forgot n1", done.stderr
    assert fleet.nodes() == []
    again = forget(fleet, "n1", admin)
    assert again.returncode == 1 and "404" in again.stderr and again.stderr.count("\n") == 1
    missing = forget(fleet, "n1", fleet.tmp / "nothing.sock")
    assert missing.returncode == 1 and "--admin-socket" in missing.stderr


ADMIN_CLIENT = """
import http.client, socket, sys
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(sys.argv[1])
c = Unix("localhost", timeout=10)
c.request("GET", "/api/nodes")
print(c.getresponse().status)
"""


def test_the_admin_socket_is_its_own_and_serves_its_user_alone(fleet: Fleet) -> None:
    """A second control plane does not take a live admin socket over, nor a
    path where something else lies; a peer of another uid is refused even
    where the socket's mode would let it in; on stopping, the control plane
    removes its own socket, never one another put at the path since."""
    # A directory another uid may enter (pytest's own are root's alone): the socket's mode is the question.
    shared = Path(tempfile.mkdtemp(prefix="nodesampler-admin-"))
    shared.chmod(0o755)
    try:
        admin_socket_checks(fleet, shared / "admin.sock")
    finally:
        shutil.rmtree(shared)


def admin_socket_checks(fleet: Fleet, admin: Path) -> None:
    fleet.start_control_plane("--admin-socket", str(admin))
    second = subprocess.run(fleet.cli("controlplane", "--listen", f"127.0.0.1:{free_port()}", "--pages-listen",
                                      f"127.0.0.1:{free_port()}", "--secret-file", str(fleet.secret),
                                      "--admin-socket", str(admin)),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert second.returncode != 0 and "another process serves it" in second.stderr, second.stderr
    assert forget(fleet, "nobody", admin).stderr.count("404") == 1  # the first still answers on it
    not_a_socket = fleet.tmp / "plain"
    not_a_socket.write_text("an operator's file\n")
    third = subprocess.run(fleet.cli("controlplane", "--listen", f"127.0.0.1:{free_port()}", "--pages-listen",
                                     f"127.0.0.1:{free_port()}", "--secret-file", str(fleet.secret),
                                     "--admin-socket", str(not_a_socket)),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert third.returncode != 0 and "not a socket" in third.stderr
    assert not_a_socket.read_text() == "an operator's file\n"
    if os.geteuid() == 0:  # another uid's client: only root can be one here
        os.chmod(admin, 0o666)  # as a mistaken mode would leave it
        other = subprocess.run([sys.executable, "-c", ADMIN_CLIENT, str(admin)], user=65534, capture_output=True,
                               text=True, timeout=30)  # fmt: skip
        assert other.stdout.strip() == "403", other.stderr
    # Another instance's socket put at the path while this one runs: left alone at exit.
    os.unlink(admin)
    theirs = socket.socket(socket.AF_UNIX)
    theirs.bind(str(admin))
    assert fleet.control is not None
    fleet.control.terminate()
    assert fleet.control.wait(timeout=30) == 0
    assert stat.S_ISSOCK(os.lstat(admin).st_mode)
    theirs.close()  # now a leftover nobody listens on: the next control plane replaces it
    fleet.start_control_plane("--admin-socket", str(admin))
    assert forget(fleet, "nobody", admin).stderr.count("404") == 1
    fleet.control.terminate()
    assert fleet.control.wait(timeout=30) == 0 and not admin.exists()


def test_pages_need_a_user_tls_serves_both_listeners_and_only_named_hosts_are_served(fleet: Fleet) -> None:
    config = fleet.secure({"ops": PASSWORD, "prometheus": "scrape-me"},
                          extra="http_server_config:\n  headers: {X-Frame-Options: deny}\n")
    fleet.start_control_plane("--web-config-file", str(config), "--pages-host", "pages.example")
    fleet.start_agent()  # over TLS, with the web config's certificate
    fleet.wait_for(fresh_with_seq)
    ops = basic("ops", PASSWORD)

    # Nothing but /health without a user; a wrong password and a malformed header are the same 401.
    for headers in ({}, basic("ops", "guess"), basic("nobody", PASSWORD), {"Authorization": "Basic %%%"},
                    {"Authorization": "Bearer x"}, {"Authorization": "Basic é"}):  # fmt: skip (é: a byte not ASCII)
        for path in ("/", "/node/n1", "/api/nodes", "/metrics", "/node/n1/live", "/heatmap.png", "/api/heatmap",
                     "/heatmap/cell"):  # fmt: skip
            status, h, _ = ask(fleet, "GET", path, headers)
            assert status == 401 and h["WWW-Authenticate"].startswith("Basic "), (path, headers, status)
    status, _, body = ask(fleet, "GET", "/health")
    assert status == 200 and '"status": "ok"' in body
    status, h, body = ask(fleet, "GET", "/api/nodes", ops)
    assert status == 200 and '"node": "n1"' in body and h["X-Frame-Options"] == "deny"
    assert ask(fleet, "GET", "/metrics", basic("prometheus", "scrape-me"))[0] == 200

    # A name the listener was not told it serves (a DNS-rebound page's own): refused; an address is served.
    assert ask(fleet, "GET", "/api/nodes", {**ops, "Host": "evil.example:8080"})[0] == 421
    assert ask(fleet, "GET", "/api/nodes", {**ops, "Host": "Pages.Example."})[0] == 200
    assert ask(fleet, "GET", "/api/nodes", {**ops, "Host": f"127.0.0.1:{fleet.pages_port}"})[0] == 200

    # A user added to the file is taken without a restart; a file that breaks keeps the last good one.
    text = config.read_text()
    added = f"  late: {bcrypt.hashpw(b'also', bcrypt.gensalt(4)).decode()}\n"
    with_late = text.replace("basic_auth_users:\n", "basic_auth_users:\n" + added)
    config.write_text(with_late)
    assert ask(fleet, "GET", "/api/nodes", basic("late", "also"))[0] == 200
    config.write_text(with_late.replace("basic_auth_users:", "basic_auth_user:"))
    assert ask(fleet, "GET", "/api/nodes", basic("late", "also"))[0] == 200
    assert "not reloaded, keeping the last good one" in (fleet.tmp / "control.log").read_text()

    # Forgetting a node: a user may, from anywhere; without one, nobody.
    assert ask(fleet, "DELETE", "/api/nodes/n1")[0] == 401
    assert fleet.agent is not None
    fleet.agent.kill()
    assert ask(fleet, "DELETE", "/api/nodes/n1", ops)[0] == 409  # heard from within --stale-after
    status, _, body = ask(fleet, "DELETE", "/api/nodes/n1?force=1", ops)
    assert status == 200 and '"forgotten": "n1"' in body


def test_tls_handshakes_are_counted_against_the_peer_cap_and_timed_out(fleet: Fleet) -> None:
    """Sockets that never say hello to a TLS listener: before, asyncio held
    each (and a 256 KiB buffer) for the handshake's timeout with no cap
    counting them, `per_peer` stayed 0. Now the cap sees them, and the rest
    are closed at the deadline, counted as `handshake`."""
    config = fleet.secure()
    fleet.start_control_plane("--web-config-file", str(config), "--max-connections-per-peer", "40",
                              "--request-deadline", "2", "--idle-timeout", "600")  # fmt: skip
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    socks = [connect(port, "127.0.0.9") for port in (fleet.agent_port, fleet.pages_port) for _ in range(50)]
    try:
        left_open = wait_closed_by_server(socks, timeout=60)
        assert not left_open, f"{len(left_open)} of {len(socks)} still open"
        counts = {k: v for k, v in closed_counts_tls(fleet).items() if v}
        assert counts == {("agents", "per_peer"): 10, ("agents", "handshake"): 40,
                          ("pages", "per_peer"): 10, ("pages", "handshake"): 40}, counts  # fmt: skip
        fleet.wait_for(lambda n: fresh_with_seq(n, above=node["heartbeat"]["seq"] + 1))
    finally:
        for s in socks:
            s.close()


def closed_counts_tls(fleet: Fleet) -> dict[tuple[str, str], float]:
    status, text = fleet.pages("/metrics")
    assert status == 200
    pattern = r'^nodesampler_connections_closed_total\{listener="(\w+)",reason="(\w+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


@pytest.mark.timing
def test_a_flood_of_guessed_passwords_waits_its_turn_and_costs_a_user_nothing(fleet: Fleet) -> None:
    """bcrypt is ~50-100 ms a check at cost 10: guesses run one at a time,
    at most 4 of one address waiting (429 beyond); a user's password once
    found good is not checked again, so the user is answered while the
    guesses' queue is full; and another user's first login, from another
    address, is checked in its turn beside the flood, not refused with it
    (40 guesses in one queue of 16 once locked it out)."""
    config = fleet.secure({"ops": PASSWORD, "prometheus": PASSWORD})
    slow = "".join(f"  {user}: {bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(12)).decode()}\n"
                   for user in ("ops", "prometheus"))  # fmt: skip
    config.write_text(config.read_text().split("basic_auth_users:")[0] + "basic_auth_users:\n" + slow)
    fleet.start_control_plane("--web-config-file", str(config))  # cost 12: ~250 ms a check
    assert fleet.pages("/api/nodes")[0] == 200  # checked once, remembered
    guess = b"GET /api/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic " + \
        base64.b64encode(b"ops:guess") + b"\r\n\r\n"  # fmt: skip
    assert fleet.context is not None
    socks = []
    try:
        for _ in range(60):
            s = fleet.context.wrap_socket(socket.create_connection(("127.0.0.1", fleet.pages_port), timeout=60,
                                                                   source_address=(SIDECAR, 0)),
                                          server_hostname="127.0.0.1")  # fmt: skip
            s.sendall(guess)
            socks.append(s)
        assert fleet.pages("/api/nodes")[0] == 200  # remembered
        first_login = ask(fleet, "GET", "/api/nodes", basic("prometheus", PASSWORD), source="127.0.0.9")
        assert first_login[0] == 200, first_login
        statuses = [int(s.recv(64).split()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert set(statuses) == {401, 429} and statuses.count(401) >= 5, statuses
    status, metrics = ask(fleet, "GET", "/metrics", basic("ops", PASSWORD))[::2]
    refused = re.search(r"^nodesampler_password_checks_total\{result=\"refused\"\} (\S+)$", metrics, re.M)
    assert status == 200 and refused is not None and float(refused[1]) == statuses.count(429)


def test_every_password_of_any_length_for_any_name_is_judged_alike(fleet: Fleet) -> None:
    """bcrypt reads 72 bytes of a password; a longer one is judged on those, as
    Go's bcrypt (Prometheus' exporter-toolkit) judges it, for a user the file
    holds or not: 401 or 200, never 500, and a flood of them is a few log
    lines, not a traceback each (one client once wrote 9 MB of log in 3 s)."""
    exact = "p" * 72
    config = fleet.secure({"ops": exact})
    fleet.start_control_plane("--web-config-file", str(config))
    assert ask(fleet, "GET", "/api/nodes", basic("ops", exact + "beyond what bcrypt reads"))[0] == 200
    for user in ("ops", "nobody", "é" * 100):
        for password in ("x" * 73, "ü" * 1500, "q" * 1000, "", "\0" * 80):
            status, _, body = ask(fleet, "GET", "/api/nodes", basic(user, password))
            assert status in (401, 429) and "Traceback" not in body, (user, len(password), status)
    log = (fleet.tmp / "control.log").read_text()
    assert "Traceback" not in log and log.count("wrong user or password") <= 1, log[-2000:]


def test_a_reloaded_web_config_takes_whole_on_both_listeners(fleet: Fleet) -> None:
    """A web config reloaded to `RequireAndVerifyClientCert` and TLS 1.3
    applies to the next handshake on the agents' listener and the pages':
    a TLS 1.2 client, and a client without a certificate, are refused
    (before, only the certificate was swapped, and both still got 200)."""
    config = fleet.secure()
    fleet.start_control_plane("--web-config-file", str(config))
    clients = TestCA("clients CA")
    clients.write_ca(fleet.tmp / "clients.crt")
    clients.issue(fleet.tmp / "client.crt", fleet.tmp / "client.key", ["prometheus"])

    def hello(port: int, highest: ssl.TLSVersion | None = None, certificate: bool = False) -> int | None:
        """The status a request got, or None when the handshake was refused."""
        context = ssl.create_default_context(cafile=str(fleet.tmp / "ca.crt"))
        if highest is not None:
            context.maximum_version = highest
        if certificate:
            context.load_cert_chain(fleet.tmp / "client.crt", fleet.tmp / "client.key")
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except (OSError, http.client.HTTPException):  # ssl.SSLError, a reset, a close before the answer
            return None
        finally:
            conn.close()

    listeners = (fleet.agent_port, fleet.pages_port)
    assert all(hello(port, ssl.TLSVersion.TLSv1_2) is not None for port in listeners)
    tightened = config.read_text().replace("  key_file: tls.key\n", "  key_file: tls.key\n"
                                           "  client_auth_type: RequireAndVerifyClientCert\n"
                                           "  client_ca_file: clients.crt\n  min_version: TLS13\n")  # fmt: skip
    staged = config.with_suffix(".new")
    staged.write_text(tightened)
    os.replace(staged, config)  # as a Secret's files are swapped
    for port in listeners:
        assert hello(port, ssl.TLSVersion.TLSv1_2, certificate=True) is None, port  # below min_version
        assert hello(port) is None, port  # no certificate
        assert hello(port, certificate=True) is not None, port
    assert "reloaded" in (fleet.tmp / "control.log").read_text()


def test_a_users_live_views_are_capped_from_any_number_of_addresses(fleet: Fleet) -> None:
    """Four live views a user, wherever they connect from (ten viewers from ten
    addresses took every live slot); another user is still served."""
    config = fleet.secure({"ops": PASSWORD, "other": PASSWORD})
    fleet.start_control_plane("--web-config-file", str(config))
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    assert fleet.context is not None
    held = []
    try:
        for i, user in enumerate(["ops"] * 5 + ["other"]):
            conn = http.client.HTTPSConnection("127.0.0.1", fleet.pages_port, context=fleet.context, timeout=10,
                                               source_address=(f"127.0.0.{20 + i}", 0))  # fmt: skip
            conn.request("GET", "/node/n1/live", headers=basic(user, PASSWORD))
            r = conn.getresponse()
            assert r.status == 200
            held.append((conn, r.read1(200).decode()))
        firsts = [first for _, first in held]
        assert all(f.startswith("retry:") for f in firsts[:4]), firsts
        assert firsts[4].startswith("event: refused") and "for this user" in firsts[4], firsts[4]
        assert firsts[5].startswith("retry:"), firsts[5]
    finally:
        for conn, _ in held:
            conn.close()
