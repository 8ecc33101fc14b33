"""The web configuration file, read as Prometheus' exporter-toolkit reads it:
what it takes, what it refuses (with a line naming the key), and the
password checks it leads to, bounded."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import bcrypt
import pytest

from controlplane.listen.page_access import PasswordChecker, basic_credentials, host_name, peer_of
from controlplane.listen.web_config import ReloadingWebConfig, WebConfigError, load, parse
from tests.agent_fleet import web_config_file

HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()


def test_an_empty_file_is_plain_http_without_users(tmp_path: Path) -> None:
    config = parse(b"", tmp_path)
    assert config.tls is None and config.users == {} and config.headers == {}


def test_a_full_file(tmp_path: Path) -> None:
    path = web_config_file(tmp_path, {"ops": "pw"}, extra="http_server_config:\n  http2: false\n  headers:\n"
                                                          "    Strict-Transport-Security: max-age=31536000\n")
    config = load(path)
    assert config.tls is not None and config.tls.cert_file == tmp_path / "tls.crt"  # relative to the file
    assert list(config.users) == ["ops"] and bcrypt.checkpw(b"pw", config.users["ops"])
    assert config.headers == {"Strict-Transport-Security": "max-age=31536000"}
    assert config.tls.context().verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(("text", "says"), [
    ("basic_auth_user:\n  ops: x\n", "the file.basic_auth_user: unknown key"),
    ("tls_server_config:\n  cert_file: a.crt\n", "cert_file and key_file go together"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
     "cipher_suites: not supported by nodesampler"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Sometimes\n", "is not one of"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAndVerifyClientCert\n",
     "needs client_ca_file"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: SSL3\n", "min_version: 'SSL3'"),
    ("basic_auth_users:\n  ops: plaintext\n", "not a bcrypt hash"),
    (f"basic_auth_users:\n  'a:b': {HASH}\n", "is not a user name"),
    ("http_server_config:\n  headers: {Set-Cookie: x}\n", "headers.Set-Cookie: unknown key"),
    ("rate_limit: {interval: 1s}\n", "rate_limit: not supported"),
    ("http_server_config:\n  http2: true\n", "http2: nodesampler serves HTTP/1.1 alone"),  # the toolkit's default
    ("- a list\n", "expected a mapping"),
    ("basic_auth_users: [ops]\n", "basic_auth_users: expected a mapping"),
    ("{unclosed\n", "not YAML"),
])  # fmt: skip
def test_what_the_file_may_not_say(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(WebConfigError) as e:
        parse(text.encode(), tmp_path)
    assert says in str(e.value), str(e.value)


def test_certificate_files_that_do_not_load_are_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    with pytest.raises(WebConfigError, match="tls_server_config"):
        load(path)


def test_a_changed_file_is_reread_and_a_broken_one_keeps_the_last(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                  ) -> None:  # fmt: skip
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  ops: {HASH}\n")
    config = ReloadingWebConfig(path)
    path.write_text(f"basic_auth_users:\n  ops: {HASH}\n  more: {HASH}\n")
    assert set(config.maybe_reload().users) == {"ops", "more"}
    path.write_text("basic_auth_users: [broken\n")
    assert set(config.maybe_reload().users) == {"ops", "more"}
    assert set(config.maybe_reload().users) == {"ops", "more"}
    assert caplog.text.count("not reloaded") == 1  # once per change, not per request
    path.write_text(f"tls_server_config:\n  cert_file: a\n  key_file: b\nbasic_auth_users:\n  ops: {HASH}\n")
    assert set(config.maybe_reload().users) == {"ops", "more"}  # TLS is not turned on under its clients


@pytest.mark.parametrize(("header", "name"), [("example.org", "example.org"), ("Example.ORG.:8080", "example.org"),
                                              ("[::1]:80", "::1"), ("127.0.0.1:9", "127.0.0.1"), ("::1", "::1")])
def test_host_names(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize("header", ["Bearer abc", "Basic", "Basic !!!", "Basic " + "YQ==", "Basic " + "A" * 5000,
                                    "Basic " + "/w==" + "/w==", "Basic é", "Basic \udcff\udcfe",
                                    "Basic " + "/w=="])  # fmt: skip
def test_malformed_basic_credentials(header: str) -> None:
    assert basic_credentials(header) is None


async def test_password_checks_wait_their_turn_and_a_good_one_is_remembered() -> None:
    users = {"ops": bcrypt.hashpw(b"pw", bcrypt.gensalt(8))}
    checker = PasswordChecker(max_waiting=3, max_waiting_a_peer=3)
    try:
        assert await checker.check(users, "ops", "pw") is True
        assert checker.checks == 1
        # Twenty guesses at once: three wait, seventeen are refused at once.
        results = await asyncio.gather(*(checker.check(users, "ops", f"guess{i}") for i in range(20)),
                                       checker.check(users, "ops", "pw"))  # fmt: skip
        assert results[:20].count(None) == 17 and results[:20].count(False) == 3
        assert results[20] is True  # remembered: not behind the guesses
        assert checker.checks == 4 and (checker.refused, checker.wrong, checker.good) == (17, 3, 1)
        # An unknown user costs a check too (a wrong name and a wrong password take as long).
        assert await checker.check(users, "nobody", "pw") is False and checker.checks == 5
    finally:
        checker.close()


@pytest.mark.timing
async def test_password_checks_take_turns_by_peer() -> None:
    """A flood from one address fills its own queue alone: another address's
    first login is refused by none of it, and is checked second, after the
    check already running (40 guesses in one global queue once locked it out)."""
    users = {"ops": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)), "prometheus": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))}
    checker = PasswordChecker(max_waiting=64, max_waiting_a_peer=4)
    # The order bcrypt ran the checks in, recorded in its thread: the count of checks
    # read when the login returns may already include the next guess's, started
    # before the login's coroutine resumed (CI saw 3 for 2).
    checked: list[bytes] = []
    run_bcrypt = checker._bcrypt

    def recording(check):  # type: ignore[no-untyped-def]
        checked.append(check.password)
        return run_bcrypt(check)

    checker._bcrypt = recording  # type: ignore[method-assign]
    try:
        guesses = [asyncio.ensure_future(checker.check(users, "ops", f"guess{i}", peer="10.0.0.66"))
                   for i in range(40)]  # fmt: skip
        await asyncio.sleep(0)  # four guesses wait (the first is being taken), the rest are refused
        assert await checker.check(users, "prometheus", "pw", peer="10.0.0.2") is True
        results = await asyncio.gather(*guesses)
        assert results.count(None) == 36 and results.count(False) == 4
        assert checked == [b"guess0", b"pw", b"guess1", b"guess2", b"guess3"]
    finally:
        checker.close()


def test_peers_are_addresses_and_ipv6_prefixes() -> None:
    assert peer_of("10.1.2.3") == "10.1.2.3" and peer_of("::ffff:10.1.2.3") == "10.1.2.3"
    assert peer_of("2001:db8::1") == peer_of("2001:db8::ffff:2") == "2001:db8::/64" != peer_of("2001:db8:0:1::1")
    assert peer_of(None) == "unknown"


async def test_a_name_no_file_holds_is_checked_at_the_files_highest_cost() -> None:
    """A known user's check costs the hash's cost; an unknown name's, the
    highest cost of the file's users (a cost-10 dummy against cost-12 users
    answered unknown names 4x faster: users enumerable by timing). A
    password longer than bcrypt's 72 bytes is judged on those 72, for a
    known user or not (bcrypt 5 raises on it: a 500 and a traceback)."""
    users = {"low": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)), "high": bcrypt.hashpw(b"p" * 72, bcrypt.gensalt(6))}
    checker = PasswordChecker()
    try:
        assert await checker.check(users, "nobody", "x" * 100, peer="a") is False
        assert list(checker._dummies) == [6]
        assert await checker.check(users, "high", "p" * 72 + "more", peer="a") is True
        assert await checker.check(users, "low", "x" * 500, peer="a") is False
        assert await checker.check(users, "low", "\0" * 80, peer="a") is False
    finally:
        checker.close()


async def test_client_certificates_are_asked_for_as_the_file_says(tmp_path: Path) -> None:
    """`RequireAndVerifyClientCert` with `client_ca_file`, through the listener's
    guard as the control plane serves: a client without a certificate, or with
    one another CA signed, gets no answer; one the file's CA signed does."""
    from aiohttp import web

    from controlplane.listen.connection_limits import ConnectionGuard, ConnectionLimits
    from tests.certs import TestCA

    clients, strangers = TestCA("clients CA"), TestCA("another CA")
    clients.write_ca(tmp_path / "clients.crt")
    clients.issue(tmp_path / "client.crt", tmp_path / "client.key", ["prometheus"])
    strangers.issue(tmp_path / "stranger.crt", tmp_path / "stranger.key", ["prometheus"])
    path = web_config_file(tmp_path, {}, extra="  client_auth_type: RequireAndVerifyClientCert\n"
                                                "  client_ca_file: clients.crt\n")  # fmt: skip
    config = ReloadingWebConfig(path)
    assert config.tls is not None and config.current.tls is not None
    assert config.current.tls.client_auth_type == "RequireAndVerifyClientCert"
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello\n")

    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    guard = ConnectionGuard(ConnectionLimits(request_s=5), tls=config.tls.handshake_context)
    server = await asyncio.get_running_loop().create_server(guard.protocol_factory(runner.server), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def ask(cert: str | None) -> bytes:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        if cert is not None:
            context.load_cert_chain(tmp_path / f"{cert}.crt", tmp_path / f"{cert}.key")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            return answer
        except (ssl.SSLError, ConnectionError):
            return b""

    try:
        assert (await ask("client")).endswith(b"hello\n")
        assert await ask(None) == b""
        assert await ask("stranger") == b""
    finally:
        server.close()
        await runner.cleanup()
