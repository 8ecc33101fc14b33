"""Node tokens, derived from one cluster secret.

A node's token is `NODE.MAC`, where MAC is HMAC-SHA256 of the node's name
under the cluster secret. The control plane recomputes it from the name in
the token, so it keeps no list of tokens, and a token names the one node it
may speak for: a valid token for node A on a heartbeat from node B is
refused (403), a token that does not verify is unauthenticated (401).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from wire.limits import NODE_ID

CONTEXT = b"nodesampler node token v1:"
MIN_SECRET_BYTES = 16


class TokenError(Exception):
    pass


def read_secret(path: Path) -> bytes:
    try:
        secret = path.read_bytes().strip()
    except OSError as e:
        raise TokenError(f"secret file {path}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise TokenError(f"secret file {path}: at least {MIN_SECRET_BYTES} bytes needed")
    return secret


def node_token(secret: bytes, node: str) -> str:
    if not NODE_ID.fullmatch(node):
        raise TokenError(f"node name {node!r}: letters, digits, '.', '-' or '_' only")
    return f"{node}.{hmac.new(secret, CONTEXT + node.encode(), hashlib.sha256).hexdigest()}"


def verify(secret: bytes, token: str) -> str | None:
    """The node a token speaks for, or None if it does not verify."""
    node, sep, mac = token.rpartition(".")
    if not sep or not NODE_ID.fullmatch(node):
        return None
    expected = node_token(secret, node)
    # compare_digest: the time taken says nothing about how much matched.
    return node if hmac.compare_digest(expected.encode(), token.encode()) else None
