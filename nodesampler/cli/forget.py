"""`nodesampler forget NODE`: a node the fleet no longer has, forgotten through the admin socket."""

from __future__ import annotations

import argparse
import urllib.parse

from nodesampler.cli.parser import fail


def cmd_forget(args: argparse.Namespace) -> int:
    """DELETE /api/nodes/NODE through the admin socket: 0 forgotten, 1 not (the control plane's answer says why)."""
    import http.client
    import socket

    class _UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(str(args.admin_socket))
            self.sock = sock

    conn = _UnixConnection("localhost", timeout=30)
    try:
        force = "?force=1" if args.force else ""
        conn.request("DELETE", f"/api/nodes/{urllib.parse.quote(args.node, safe='')}{force}")
        r = conn.getresponse()
        body = r.read(4096).decode(errors="replace").strip()
    except OSError as e:
        fail(1, f"--admin-socket {args.admin_socket}: {e} (is the control plane running with --admin-socket?)")
    finally:
        conn.close()
    if r.status != 200:
        fail(1, f"node {args.node!r} not forgotten: {r.status} {body}")
    print(f"forgot {args.node}")
    return 0
