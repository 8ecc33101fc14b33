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


def cmd_up(args: argparse.Namespace) -> int:
    """The control plane (embedded history, pages, /metrics) and an agent on
    this machine, as two child processes, until Ctrl-C or SIGTERM."""
    import secrets
    import subprocess
    import tempfile

    from controlplane.ingest.tokens import node_token
    from controlplane.server import split_address
    from sampler.agent.run import default_node

    try:
        host, port = split_address(args.listen)
    except ValueError as e:
        fail(EXIT_USAGE, f"--listen {e}")
    if port in (0, 65535):
        fail(EXIT_USAGE, f"--listen {args.listen}: a fixed port below 65535 is needed (the agents' is the next one)")
    node = default_node()
    state = args.state_dir if args.state_dir is not None else default_state_dir()
    try:
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        fail(EXIT_USAGE, f"--state-dir {state}: {e}")
    work = Path(tempfile.mkdtemp(prefix="nodesampler-up-"))
    secret = secrets.token_hex(32).encode()
    (work / "secret").write_bytes(secret)
    (work / "token").write_text(node_token(secret, node))
    for f in ("secret", "token"):
        (work / f).chmod(0o600)
    me = [sys.executable, "-m", "nodesampler"]
    agent_addr = f"{host}:{port + 1}"
    children: list[subprocess.Popen[bytes]] = []
    stop_on_sigterm()
    try:
        hosts = [arg for name in page_hosts(host) for arg in ("--pages-host", name)]
        cp = subprocess.Popen([*me, "controlplane", "--listen", agent_addr, "--pages-listen", args.listen,
                               "--secret-file", str(work / "secret"), "--state-file", str(state / "registry.json"),
                               "--incidents-dir", str(state / "incidents"), "--admin-socket",
                               str(state / "admin.sock"), *hosts], stdout=subprocess.PIPE)  # fmt: skip
        children.append(cp)
        assert cp.stdout is not None
        if not cp.stdout.readline():
            fail(1, "the control plane did not start (is the address taken?)")
        children.append(subprocess.Popen([*me, "agent", "--control-plane", f"http://{agent_addr}", "--token-file",
                                          str(work / "token"), "--node", node, "--hz", f"{args.hz:g}",
                                          "--interval", f"{args.interval:g}"]))  # fmt: skip
        print(f"nodesampler {__version__} is up: open http://{args.listen}/ (node {node}; Ctrl-C stops)\n"
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
