"""The agent API over real HTTP and TLS: projected service-account tokens
end to end, a certificate swapped under a running listener, a wrong CA, a
rotated token file, a config that appears after the agent started, and the
host's disks through pid 1's root."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from controlplane.ingest import agent_api, tokens
from controlplane.ingest.node_identity import JwksSource, NodeAuthenticator, ServiceAccountRules, ServiceAccountVerifier
from controlplane.listen.tls_files import ReloadingServerTLS, TlsSettings
from controlplane.state.registry import NodeRegistry
from sampler.agent.client import DeliveryError, HeartbeatClient
from sampler.agent.config import ConfigFile, TokenFile
from sampler.sources.machine import MachineGaugeReader
from tests.certs import TestCA
from tests.heartbeats import registration as wire_registration
from tests.issuer import ISSUER, TestIssuer
from tests.test_controlplane_api import SECRET, heartbeat, registration


@pytest.fixture(scope="module")
def issuer() -> TestIssuer:
    return TestIssuer()


@pytest.fixture
async def sa_agents(aiohttp_client: Any, issuer: TestIssuer, tmp_path: Path) -> Any:
    (tmp_path / "jwks.json").write_text(json.dumps(issuer.jwks()))
    verifier = ServiceAccountVerifier(JwksSource(str(tmp_path / "jwks.json")), ServiceAccountRules(ISSUER))
    registry = NodeRegistry(stale_after=60)
    return await aiohttp_client(agent_api.create_app(registry, NodeAuthenticator(SECRET, verifier))), registry


async def test_projected_tokens_over_http(sa_agents: Any, issuer: TestIssuer, caplog: Any) -> None:
    client, registry = sa_agents

    async def post(path: str, body: dict[str, Any], token: str) -> int:
        r = await client.post(path, data=json.dumps(body), headers={"Authorization": f"Bearer {token}"})
        return int(r.status)

    caplog.set_level(logging.WARNING)
    assert await post("/v1/register", registration("gpu-17"), issuer.token("gpu-18")) == 403  # another node's
    assert await post("/v1/register", registration("gpu-17"), issuer.token(None)) == 403  # before 1.30
    assert "names no node" in caplog.text
    assert await post("/v1/register", registration("gpu-17"), issuer.token("gpu-17", ttl=-300)) == 401
    assert await post("/v1/register", registration("gpu-17"), issuer.token("gpu-17", audience="api")) == 401
    assert len(registry) == 0  # nothing refused changed anything
    assert await post("/v1/register", registration("gpu-17"), issuer.token("gpu-17")) == 200
    assert await post("/v1/heartbeat", heartbeat("gpu-17"), issuer.token("gpu-17")) == 200
    assert await post("/v1/register", registration("bm-1"), tokens.node_token(SECRET, "bm-1")) == 200  # HMAC too
    assert len(registry) == 2


def _serial(writer: asyncio.StreamWriter) -> int:
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return int(x509.load_der_x509_certificate(der).serial_number)


async def test_tls_listener_picks_up_a_new_certificate(tmp_path: Path, caplog: Any) -> None:
    ca = TestCA()
    cafile = ca.write_ca(tmp_path / "ca.crt")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first = ca.issue(cert, key, ["localhost", "127.0.0.1"])
    tls = ReloadingServerTLS(TlsSettings(cert, key))
    runner = web.AppRunner(agent_api.create_app(NodeRegistry(60), SECRET))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context)
    await site.start()
    port = runner.addresses[0][1]
    client_ctx = ssl.create_default_context(cafile=str(cafile))

    async def served_serial() -> int:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="localhost")
        serial = _serial(writer)
        writer.close()
        return serial

    try:
        assert await served_serial() == first
        # The kubelet swaps a Secret's files: write aside, then rename over.
        second = ca.issue(tmp_path / "new.crt", tmp_path / "new.key", ["localhost"])
        os.replace(tmp_path / "new.key", key)
        os.replace(tmp_path / "new.crt", cert)
        assert await served_serial() == second
        key.write_text("half written")  # a broken pair keeps the last good one
        caplog.set_level(logging.ERROR)
        assert await served_serial() == second
        assert "not reloaded" in caplog.text
        # The agent's client with another cluster's CA is refused, and says why.
        other_ca = TestCA("another CA").write_ca(tmp_path / "other.crt")
        ctx = ssl.create_default_context(cafile=str(other_ca))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            client = HeartbeatClient(session, f"https://localhost:{port}", tokens.node_token(SECRET, "n1"))
            with pytest.raises(DeliveryError, match="not trusted"):
                await client.register(wire_registration("n1"))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx)) as session:
            client = HeartbeatClient(session, f"https://localhost:{port}", tokens.node_token(SECRET, "n1"))
            await client.register(wire_registration("n1"))
    finally:
        await runner.cleanup()


def test_token_file_rotation_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(path)
    assert token.value() == "first"
    (tmp_path / "next").write_text("second")
    os.replace(tmp_path / "next", path)  # a new inode, as the kubelet's atomic writer makes
    assert token.value() == "second"
    path.unlink()  # mid-rotation: the last good token is still sent
    assert token.value() == "second"
    path.write_text("bad token\x00")
    assert token.value() == "second"


def test_a_config_that_appears_later_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    cfg = ConfigFile(path)
    assert cfg.specs is None and not cfg.changed()  # no file: the busiest groups
    path.write_text('[[shard]]\nid = "s0"\nselect = "pid:1"\n')
    assert cfg.changed() and cfg.specs is not None and [w.id for w in cfg.specs] == ["s0"]
    path.unlink()
    assert cfg.changed() and cfg.specs is None


def test_disks_come_from_pid_1s_mount_table_through_its_root(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    host_root = tmp_path / "host-root"
    (host_root / "data").mkdir(parents=True)
    (proc / "1").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "1" / "root").symlink_to(host_root)
    (proc / "filesystems").write_text("nodev\ttmpfs\n\text4\n")
    (proc / "1" / "mountinfo").write_text("1 0 254:1 / / rw - ext4 /dev/vda1 rw\n"
                                          "2 1 254:2 / /data rw - ext4 /dev/vdb rw\n")  # fmt: skip
    (proc / "self" / "mountinfo").write_text("9 0 0:50 / / rw - overlay overlay rw\n")  # the container's
    disks = MachineGaugeReader(proc).read_disks()
    assert disks is not None and [d["mount"] for d in disks] == ["/", "/data"]
    assert disks[1]["bytes"] == os.statvfs(host_root / "data").f_blocks * os.statvfs(host_root).f_frsize
    (proc / "1" / "root").unlink()  # pid 1's root out of reach: the agent's own table, as it sees it
    own = MachineGaugeReader(proc).read_disks()
    assert own is not None and [d["mount"] for d in own] == ["/"]  # the overlay's one mount, not /data
