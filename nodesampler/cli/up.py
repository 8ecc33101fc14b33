"""`nodesampler up`: the control plane and an agent of this machine, in one process."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

from nodesampler import __version__
from nodesampler.cli.parser import EXIT_USAGE, fail
from nodesampler.cli.sampling import stop_on_sigterm


def default_state_dir() -> Path:
    """Where `up` keeps its state and incidents: XDG's state directory."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "nodesampler"


def page_hosts(host: str) -> list[str]:
    """The names the pages answer to (--pages-host): localhost and the listen
    address's name; on every address, this machine's names too. An address
    written as an IP is always served (controlplane/listen/page_access.py)."""
    hosts = ["localhost"]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        hosts.append(host)
    else:
        if address.is_unspecified:
            hosts += [socket.gethostname(), socket.getfqdn()]
    return list(dict.fromkeys(h for h in hosts if h))


def agent_host(host: str) -> str:
    """Where the agent reaches the control plane: the listen address, or
    `localhost` where it is every address (a certificate names one host)."""
    try:
        return "localhost" if ipaddress.ip_address(host).is_unspecified else host
    except ValueError:
        return host


def kept_secret(state: Path) -> bytes:
    """The cluster secret, kept in the state directory (0600) and used again
    by the next run, so that its node's token and registry stay valid; none
    is left in /tmp."""
    import secrets

    path = state / "secret"
    try:
        secret = path.read_bytes().strip()
        if len(secret) >= 32:
            return secret
    except FileNotFoundError:
        pass
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def _tls_given(args: argparse.Namespace) -> bool:
    """Whether the agent listener speaks TLS: --tls-cert, or the web config's tls_server_config."""
    if args.tls_cert is not None or args.tls_key is not None:
        if args.tls_cert is None or args.tls_key is None:
            fail(EXIT_USAGE, "--tls-cert and --tls-key go together")
        if args.web_config_file is not None:
            fail(EXIT_USAGE, "--tls-cert/--tls-key and --web-config-file: give one (its tls_server_config)")
        return True
    if args.web_config_file is None:
        return False
    from controlplane.listen.web_config import WebConfigError, load

    try:
        return load(args.web_config_file).tls is not None
    except (OSError, WebConfigError) as e:
        fail(EXIT_USAGE, f"--web-config-file {args.web_config_file}: {e}")


def cmd_up(args: argparse.Namespace) -> int:
    """The control plane (embedded history, pages, /metrics) and an agent on
    this machine, as two child processes, until Ctrl-C or SIGTERM."""
    import subprocess

    from controlplane.ingest.tokens import node_token
    from controlplane.server import split_address
    from sampler.agent.run import default_node

    try:
        host, port = split_address(args.listen)
    except ValueError as e:
        fail(EXIT_USAGE, f"--listen {e}")
    if port in (0, 65535):
        fail(EXIT_USAGE, f"--listen {args.listen}: a fixed port below 65535 is needed (the agents' is the next one)")
    tls = _tls_given(args)
    if args.ca_file is not None and not tls:
        fail(EXIT_USAGE, "--ca-file is what the agent trusts for TLS: give --tls-cert or a web config with TLS")
    node = default_node()
    state = args.state_dir if args.state_dir is not None else default_state_dir()
    try:
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        secret = kept_secret(state)
        token = state / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(node_token(secret, node))
    except OSError as e:
        fail(EXIT_USAGE, f"--state-dir {state}: {e}")
    state_file = args.state_file if args.state_file is not None else state / "registry.json"
    incidents = args.incidents_dir if args.incidents_dir is not None else state / "incidents"
    tls_flags = [] if args.tls_cert is None else ["--tls-cert", str(args.tls_cert), "--tls-key", str(args.tls_key)]
    if args.web_config_file is not None:
        tls_flags = ["--web-config-file", str(args.web_config_file)]
    me = [sys.executable, "-m", "nodesampler"]
    agent_addr = f"{host}:{port + 1}"
    agent_url = f"{'https' if tls else 'http'}://{agent_host(host)}:{port + 1}"
    children: list[subprocess.Popen[bytes]] = []
    stop_on_sigterm()
    try:
        hosts = [arg for name in page_hosts(host) for arg in ("--pages-host", name)]
        cp = subprocess.Popen([*me, "controlplane", "--listen", agent_addr, "--pages-listen", args.listen,
                               "--secret-file", str(state / "secret"), "--state-file", str(state_file),
                               "--incidents-dir", str(incidents), "--admin-socket",
                               str(state / "admin.sock"), *hosts, *tls_flags], stdout=subprocess.PIPE)  # fmt: skip
        children.append(cp)
        assert cp.stdout is not None
        if not cp.stdout.readline():
            fail(1, "the control plane did not start (is the address taken?)")
        ca = [] if args.ca_file is None else ["--ca-file", str(args.ca_file)]
        children.append(subprocess.Popen([*me, "agent", "--control-plane", agent_url, "--token-file",
                                          str(token), "--node", node, "--hz", f"{args.hz:g}",
                                          "--interval", f"{args.interval:g}", *ca]))  # fmt: skip
        scheme = "https" if args.web_config_file is not None and tls else "http"
        print(f"nodesampler {__version__} is up: open {scheme}://{args.listen}/ (node {node}; Ctrl-C stops)\n"
              f"state and incidents kept in {state} (--state-dir); this machine's user starts an incident or "
              f"forgets a node through {state / 'admin.sock'}", flush=True)  # fmt: skip
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        fail(1, "a child process stopped; stopping the other")
    except KeyboardInterrupt:
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(timeout=15)
            except subprocess.TimeoutExpired:
                c.kill()
