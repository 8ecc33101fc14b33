"""`nodesampler up`: the control plane and an agent of this machine, in one process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from nodesampler import __version__
from nodesampler.cli.parser import EXIT_USAGE, fail
from nodesampler.cli.sampling import stop_on_sigterm


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
        cp = subprocess.Popen([*me, "controlplane", "--listen", agent_addr, "--pages-listen", args.listen,
                               "--secret-file", str(work / "secret")], stdout=subprocess.PIPE)  # fmt: skip
        children.append(cp)
        assert cp.stdout is not None
        if not cp.stdout.readline():
            fail(1, "the control plane did not start (is the address taken?)")
        children.append(subprocess.Popen([*me, "agent", "--control-plane", f"http://{agent_addr}", "--token-file",
                                          str(work / "token"), "--node", node, "--hz", f"{args.hz:g}",
                                          "--interval", f"{args.interval:g}"]))  # fmt: skip
        print(f"nodesampler {__version__} is up: open http://{args.listen}/ (node {node}; Ctrl-C stops)", flush=True)
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
