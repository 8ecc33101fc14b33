"""`nodesampler controlplane`: the fleet's server."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from nodesampler.cli.parser import EXIT_USAGE, fail

if TYPE_CHECKING:  # the control plane's modules load with its command, not with the CLI
    from controlplane.ingest.node_identity import NodeAuthenticator


def _authenticator(args: argparse.Namespace) -> NodeAuthenticator:
    from controlplane.ingest import node_identity as ni
    from controlplane.ingest.tokens import TokenError, read_secret

    if args.secret_file is None and args.k8s_jwks is None:
        fail(EXIT_USAGE, "--secret-file or --k8s-jwks (or both) is needed: nodes must prove who they are")
    if args.k8s_issuer and args.k8s_jwks is None:
        fail(EXIT_USAGE, "--k8s-issuer without --k8s-jwks: the issuer's keys are needed")
    secret = None
    if args.secret_file is not None:
        try:
            secret = read_secret(args.secret_file)
        except TokenError as e:
            fail(EXIT_USAGE, str(e))
    verifier = None
    if args.k8s_jwks is not None:
        if not args.k8s_issuer:
            fail(EXIT_USAGE, "--k8s-jwks needs --k8s-issuer (the tokens' iss)")
        if not args.k8s_jwks.startswith(("http://", "https://")) and not Path(args.k8s_jwks).is_file():
            fail(EXIT_USAGE, f"--k8s-jwks {args.k8s_jwks}: no such file (or give an https:// URL)")
        try:
            namespace, name = ni.parse_service_account(args.k8s_service_account)
        except ValueError as e:
            fail(EXIT_USAGE, f"--k8s-service-account {e}")
        rules = ni.ServiceAccountRules(args.k8s_issuer, args.k8s_audience, namespace, name)
        verifier = ni.ServiceAccountVerifier(ni.JwksSource(args.k8s_jwks), rules)
    return ni.NodeAuthenticator(secret, verifier)


def cmd_controlplane(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import ssl
    import urllib.parse

    from controlplane.listen.connection_limits import ConnectionLimits
    from controlplane.listen.tls_files import ReloadingServerTLS, TlsSettings
    from controlplane.listen.web_config import ReloadingWebConfig, WebConfigError
    from controlplane.samples.live import LiveSamples
    from controlplane.server import StartError, is_loopback, serve, split_address
    from controlplane.state.starvation import StarvationRules
    from web.pages import add_pages
    from wire import discovery

    if args.state_file is not None and not args.state_file.parent.is_dir():
        fail(EXIT_USAGE, f"--state-file {args.state_file}: {args.state_file.parent} is not a directory")
    incidents_dir = args.incidents_dir
    if incidents_dir is None and args.state_file is not None:
        incidents_dir = args.state_file.with_name(args.state_file.name + ".incidents")
    if incidents_dir is not None and not incidents_dir.parent.is_dir():
        fail(EXIT_USAGE, f"--incidents-dir {incidents_dir}: {incidents_dir.parent} is not a directory")
    if args.incidents_mib < 1:
        fail(EXIT_USAGE, "--incidents-mib: at least 1")
    if args.forget_after < args.stale_after:
        fail(EXIT_USAGE, "--forget-after: at least --stale-after (a node is stale before it is forgotten)")
    if args.max_shards_per_node < 1:
        fail(EXIT_USAGE, "--max-shards-per-node: at least 1")
    if args.prometheus is not None and not args.prometheus.startswith(("http://", "https://")):
        fail(EXIT_USAGE, f"--prometheus {args.prometheus!r}: expected an http:// or https:// URL")
    for flag, value in (("--listen", args.listen), ("--pages-listen", args.pages_listen)):
        try:
            split_address(value)
        except ValueError as e:
            fail(EXIT_USAGE, f"{flag} {e}")
    auth = _authenticator(args)
    tls = None
    if (args.tls_cert is None) != (args.tls_key is None):
        fail(EXIT_USAGE, "--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.web_config_file is not None:
        fail(EXIT_USAGE, "--tls-cert/--tls-key and --web-config-file: give one (the file's TLS is both listeners')")
    if args.tls_cert is not None:
        try:
            tls = ReloadingServerTLS(TlsSettings(args.tls_cert, args.tls_key))
        except (OSError, ssl.SSLError) as e:
            fail(EXIT_USAGE, f"--tls-cert/--tls-key: {e}")
    web_config = None
    if args.web_config_file is not None:
        try:
            web_config = ReloadingWebConfig(args.web_config_file)
        except (OSError, WebConfigError) as e:
            fail(EXIT_USAGE, f"--web-config-file {args.web_config_file}: {e}")
        tls = web_config.tls
    for name in args.pages_host:
        if not name or any(c in name for c in "/ @?#"):
            fail(EXIT_USAGE, f"--pages-host {name!r}: a host name (no scheme, port or path)")
    for url in args.peer:
        if (why := discovery.check(url)) is not None:
            fail(EXIT_USAGE, f"--peer {url!r}: {why} (a replica's pages listener)")
        host = urllib.parse.urlsplit(url).hostname or ""
        if discovery.scheme(url) != "https" and (url.startswith(discovery.SRV) or not is_loopback(host)):
            fail(EXIT_USAGE, f"--peer {url!r}: peers speak https (with --peer-ca-file) except on this machine's "
                             "loopback: what they send each other would cross the network in clear text")  # fmt: skip
    if args.peer and args.secret_file is None and args.peer_secret_file is None:
        fail(EXIT_USAGE, "--peer needs --peer-secret-file (or --secret-file): replicas sign their requests with a "
                         "key made from a secret they share")  # fmt: skip
    peer_secret = None
    if args.peer_secret_file is not None:
        from controlplane.ingest.tokens import TokenError, read_secret

        try:
            peer_secret = read_secret(args.peer_secret_file)
        except TokenError as e:
            fail(EXIT_USAGE, f"--peer-secret-file: {e}")
    peer_ssl = None
    if args.peer_ca_file is not None:
        try:
            peer_ssl = ssl.create_default_context(cafile=str(args.peer_ca_file))
        except (OSError, ssl.SSLError) as e:
            fail(EXIT_USAGE, f"--peer-ca-file {args.peer_ca_file}: {e}")
    if args.admin_socket is not None and not args.admin_socket.parent.is_dir():
        fail(EXIT_USAGE, f"--admin-socket {args.admin_socket}: {args.admin_socket.parent} is not a directory")
    logging.getLogger().setLevel(logging.INFO)
    # The cyclic GC less often: a full collection scans every heartbeat the
    # registry holds (65 ms at 1,000 nodes) and, at Python's thresholds, page
    # views' short-lived objects set one off every second or two, each a pause
    # of the loop that takes heartbeats (p99 63 ms against 39 ms like this,
    # bench/abuse_control_plane.py). The objects that die young are not cyclic.
    gc.set_threshold(10_000, 20, 20)
    try:
        rules = StarvationRules(args.starved_throttled_ratio, args.starved_wait_ratio, args.starved_min_wait,
                                args.host_bound_gpu_utilization, args.card_held_back_ratio)  # fmt: skip
        limits = ConnectionLimits(args.request_deadline, args.idle_timeout, args.max_connections_per_peer)
        asyncio.run(serve(args.listen, args.pages_listen, auth, args.stale_after, args.prometheus, tls, rules, limits,
                          args.max_shards_per_node, args.state_file, args.forget_after, add_routes=add_pages,
                          live=LiveSamples(args.max_live_nodes, args.live_linger) if args.max_live_nodes else None,
                          heartbeat_rate=args.max_heartbeats_per_second, web_config=web_config,
                          pages_hosts=args.pages_host, admin_socket=args.admin_socket,
                          incidents_dir=incidents_dir, incidents_bytes=args.incidents_mib << 20,
                          incident_span=(args.incident_before, args.incident_after), peers=args.peer,
                          peer_ssl=peer_ssl, peer_secret=peer_secret))
    except StartError as e:  # an address taken or not ours, a directory not the control plane's own, ...
        fail(EXIT_USAGE, str(e))
    return 0
