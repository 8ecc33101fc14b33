"""`nodesampler controlplane`: the two listeners in one process, sharing one
registry (and the embedded history), until SIGTERM or SIGINT. The
composition is here: the agents' app (controlplane/ingest/agent_api.py), the pages'
app with /metrics (controlplane/pages_api.py), their keys
(controlplane/keys.py) and lifecycles; the pages (web/) add their routes to
the pages' app through `add_routes`."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import signal
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from controlplane import pages_api
from controlplane.export.own_metrics import ControlPlaneMetrics
from controlplane.fleet.forward import FORWARDER, Forwarder, to_holder
from controlplane.fleet.peer_metrics import PeersCollector
from controlplane.fleet.peers import Peers, fleet_chart_parts, heatmap_parts, merged_rows, polled
from controlplane.fleet.peers import add_routes as add_peer_routes
from controlplane.history.backends import EmbeddedHistory
from controlplane.ingest import agent_api
from controlplane.ingest.node_identity import NodeAuthenticator
from controlplane.listen.connection_limits import (
    GUARD,
    ConnectionGuard,
    ConnectionLimits,
    end_turn_when_answering,
    within_deadline,
)
from controlplane.listen.page_access import AdminSocketInUse, PageAccess, listen_admin_socket, remove_admin_socket
from controlplane.listen.tls_files import ReloadingServerTLS
from controlplane.listen.web_config import ReloadingWebConfig
from controlplane.samples.hindsight import HindsightFetches
from controlplane.samples.incidents import AFTER_S, BEFORE_S, HOLDERS, Incidents
from controlplane.samples.incidents import MAX_BYTES as MAX_INCIDENT_BYTES
from controlplane.samples.live import LiveSamples
from controlplane.samples.surface_metrics import SurfacesCollector
from controlplane.state.registry import MAX_SHARDS_PER_NODE, NodeRegistry
from controlplane.state.starvation import StarvationRules

log = logging.getLogger(__name__)

# A rendered view serves the requests of the second after it (controlplane/listen/page_worker.py):
# heartbeats are seconds apart, and a 1,000-node /api/nodes is 4.7 MB and ~100 ms to render.
SHARE_FOR_S = 1.0
# Page requests under way at once, the rest waiting unread: 200 clients asking
# for pages in a loop filled the one event loop's queue, and a heartbeat waited
# behind them (p99 188 ms against 12 ms alone, at 1,000 nodes).
PAGES_AT_ONCE = 8
# ... but Prometheus' scrape and the kubelet's probes go at once, whatever waits.
# So do the peers' polls (a token's HMAC, checked at once): a flood of page views
# must not make a replica look down to its peers, which would then not let go.
FIRST_IN_LINE = (b"GET /metrics ", b"GET /metrics?", b"GET /health ", b"GET /health?", b"GET /v1/peer/",
                 b"POST /v1/peer/")  # fmt: skip


class StartError(Exception):
    """What keeps the control plane from starting, in one line that names it."""


def split_address(text: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) -> (host, port); ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: expected HOST:PORT")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """A listen address on this machine alone (any other name may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return (mapped or address).is_loopback


def _count_close(own: ControlPlaneMetrics, listener: str, reason: str) -> None:
    own.connections_closed.labels(listener, reason).inc()


async def serve(agent_listen: str, pages_listen: str, auth: NodeAuthenticator, stale_after: float,
                prometheus_url: str | None = None, tls: ReloadingServerTLS | None = None,
                starvation: StarvationRules | None = None, limits: ConnectionLimits | None = None,
                max_shards: int = MAX_SHARDS_PER_NODE, state_file: Path | None = None,
                forget_after: float | None = None,
                add_routes: Callable[[web.Application, EmbeddedHistory | None, str | None], None] | None = None,
                live: LiveSamples | None = None, heartbeat_rate: float = agent_api.HEARTBEAT_RATE,
                web_config: ReloadingWebConfig | None = None, pages_hosts: Iterable[str] = (),
                admin_socket: Path | None = None, incidents_dir: Path | None = None,
                incidents_bytes: int = MAX_INCIDENT_BYTES,
                incident_span: tuple[float, float] = (BEFORE_S, AFTER_S), peers: Iterable[str] = (),
                peer_ssl: ssl.SSLContext | None = None, peer_secret: bytes | None = None) -> None:  # fmt: skip
    """`tls` is the agent listener's (--tls-cert, or the web config's); the
    pages listener takes the web config's TLS and users (controlplane/listen/page_access.py)."""
    if tls is None and not is_loopback(split_address(agent_listen)[0]):
        log.warning("agent listener %s has no TLS: bearer tokens cross the network in clear text "
                    "(--tls-cert and --tls-key, or --web-config-file)", agent_listen)  # fmt: skip
    pages_tls = web_config.tls if web_config is not None else None
    if not (web_config and web_config.current.users) and not is_loopback(split_address(pages_listen)[0]):
        log.warning("pages listener %s has no users: every node's name, kernel, GPUs and pods are readable by "
                    "any client that reaches it (--web-config-file's basic_auth_users)", pages_listen)  # fmt: skip
    registry = NodeRegistry(stale_after, starvation=starvation, max_shards=max_shards, gone_after=forget_after)
    own = ControlPlaneMetrics(registry)
    # The embedded history is fed only when the pages read it (no --prometheus).
    history = None if prometheus_url else EmbeddedHistory(stale_after=stale_after)
    access = PageAccess(web_config, pages_hosts)
    fetches = HindsightFetches()  # spans of the nodes' hindsight: asked for on the pages, fetched by the agents' API
    incidents = None
    if incidents_dir is not None:
        incidents = Incidents(incidents_dir, fetches, registry, incidents_bytes, before_s=incident_span[0],
                              after_s=incident_span[1])  # fmt: skip
        try:
            log.info("incidents kept in %s: %d there", incidents_dir, incidents.load())
        except OSError as e:
            raise StartError(f"--incidents-dir {incidents_dir}: {e}") from e
    else:
        log.info("no incidents kept: --incidents-dir, or --state-file, names where")
    own.prometheus.register(SurfacesCollector(fetches, incidents, access.checker if web_config is not None else None))
    pages = pages_api.create_app(registry, own, history, state_file, live, access, SHARE_FOR_S, fetches, incidents)
    if add_routes is not None:  # the pages (web/pages.py): charts from the history or from Prometheus
        add_routes(pages, history, prometheus_url)
    limits = limits or ConnectionLimits()
    loop = asyncio.get_running_loop()
    runners: list[web.AppRunner] = []
    servers: list[asyncio.AbstractServer] = []
    admin_made: tuple[int, int] | None = None  # the admin socket's identity, once made
    agents = agent_api.create_app(registry, auth, own, history, live, heartbeat_rate, fetches, incidents)
    peer_urls = list(peers)
    if peer_urls:  # replicas sharing the fleet (controlplane/fleet/peers.py): only then is the route there
        secret = peer_secret or auth.secret
        if secret is None:
            raise ValueError("--peer: peers sign their requests with a key made from --peer-secret-file's secret")

        def let_go(node: str) -> None:
            if registry.forget(node):
                if history is not None:
                    history.forget(node)
                # Its spans' pieces go to the replica it moved to, which knows of none.
                fetches.forget(node, "the node moved to another replica: the rest was not fetched")

        replicas = Peers(peer_urls, secret, registry, let_go, peer_ssl)
        # On the pages listener alone, which --peer names (DESIGN): the agents' port, open to every
        # node, serves no peer route.
        add_peer_routes(pages, replicas, functools.partial(pages_api.nodes_json, registry), history)
        agents[agent_api.ON_REGISTERED] = replicas.arrived

        async def fleet_rows(own: list[dict[str, Any]], view: str = "nodes") -> dict[str, Any]:
            return merged_rows(own, await replicas.fleet_rows(view))

        pages[pages_api.FLEET_ROWS] = fleet_rows
        if history is not None:  # the fleet charts: each replica's totals for its own nodes (with Prometheus: its)
            pages[pages_api.FLEET_CHART_PARTS] = functools.partial(fleet_chart_parts, replicas)
            pages[pages_api.HEATMAP_PARTS] = functools.partial(heatmap_parts, replicas)
        pages[HOLDERS] = replicas
        # A node's pages, live view, spans and incidents from the replica that holds it (controlplane/fleet/forward.py).
        access.peer_auth = replicas.auth
        forwarder = pages[FORWARDER] = Forwarder(replicas)
        pages.middlewares.append(to_holder)
        pages.cleanup_ctx.append(lambda app: polled(replicas))  # after the pages' own: the state file is in
        own.prometheus.register(PeersCollector(replicas, forwarder))
    try:
        for name, app, address, context in (
            ("agents", agents, agent_listen, tls.handshake_context if tls else None),
            ("pages", pages, pages_listen, pages_tls.handshake_context if pages_tls else None),
        ):
            # Every connection through a guard (controlplane/listen/connection_limits.py):
            # aiohttp's own sites would time out neither half a request nor none,
            # and asyncio's TLS server counts no handshake; the guard does the TLS.
            is_pages = name == "pages"
            guard = ConnectionGuard(limits, functools.partial(_count_close, own, name), context,
                                    PAGES_AT_ONCE if is_pages else 0, FIRST_IN_LINE if is_pages else ())  # fmt: skip
            app[GUARD] = guard
            app.middlewares.insert(0, within_deadline)
            app.on_response_prepare.append(end_turn_when_answering)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            host, port = split_address(address)
            assert runner.server is not None  # set up
            try:
                servers.append(await loop.create_server(guard.protocol_factory(runner.server), host, port))
            except OSError as e:  # said with what failed: the CLI's one line names it
                raise StartError(f"cannot listen on {address} ({name}): {e.strerror or e}") from e
        if peer_urls:
            replicas.serving = True
            replicas.listening.set()
        if admin_socket is not None:  # the pages' routes to the operator (listen/page_access.py)
            try:
                admin_server, admin_made = await listen_admin_socket(runners[1], admin_socket)
            except AdminSocketInUse as e:
                raise StartError(str(e)) from e  # it names the flag and path
            except OSError as e:
                raise StartError(f"--admin-socket {admin_socket}: {e}") from e
            servers.append(admin_server)
        if auth.service_accounts is not None:
            await auth.service_accounts.keys.refresh()  # a failure is logged; tokens are refused until keys load
        scheme, pages_scheme = ("https" if tls else "http"), ("https" if pages_tls else "http")
        log.info("control plane: agents on %s://%s, pages on %s://%s", scheme, agent_listen, pages_scheme, pages_listen)
        print(f"nodesampler control plane: agents on {scheme}://{agent_listen}, "
              f"pages on {pages_scheme}://{pages_listen}/", flush=True)  # fmt: skip
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for server in servers:
            server.close()  # no new connections; the runners close the open ones
        for runner in runners:
            await runner.cleanup()
        access.checker.close()
        if admin_socket is not None and admin_made is not None:
            remove_admin_socket(admin_socket, admin_made)
        if auth.service_accounts is not None:
            await auth.service_accounts.keys.close()
