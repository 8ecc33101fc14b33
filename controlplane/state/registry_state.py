"""The registry on disk, so a control-plane restart forgets no node.

What is kept is what makes a node known: its registration, when its last
heartbeat arrived (wall time: a restart's monotonic clock starts again) and
how many it sent. Its measurements are not kept: after a restart a node is
stale until it speaks again, so a node that was down stays
`llmgw_node_up 0` and its NodeDown alert goes on firing.

The file is JSON, written whole to a temporary file beside it, flushed to
disk and renamed over the old one, so a crash leaves the old state or the
new one, never half of either. The temporary file's name is new each time
and it is opened `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600: a link another
user left at a name the control plane would write through is never followed
(a fixed `PATH.tmp` was), and nobody else reads what the fleet said. A file that cannot be read is set aside
(`PATH.bad`) and said in the log, and the control plane starts empty: a
bad volume never keeps it from serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

import wire
from controlplane.keys import REGISTRY
from controlplane.state.registry import NodeRegistry, NodeState
from wire.limits import NODE_ID

log = logging.getLogger(__name__)

VERSION = 1
SAVE_EVERY_S = 30.0
MAX_STATE_BYTES = 256 * 2**20  # far beyond any fleet's registrations: a larger file is not ours


def snapshot(registry: NodeRegistry, wall: float, now: float) -> dict[str, Any]:
    def seen(state: NodeState) -> float | None:
        return None if state.received_at is None else wall - (now - state.received_at)

    return {"version": VERSION, "nodes": [
        {"registration": msgspec.to_builtins(s.registration), "last_heartbeat": seen(s), "heartbeats": s.heartbeats}
        for s in registry.nodes()],
        # Nodes forgotten, and when (wall time): a peer that kept a copy lets it go (controlplane/fleet/peers.py).
        "forgotten": [[node, wall - (now - at)] for node, at in registry.forgotten.items()]}  # fmt: skip


def encoded(registry: NodeRegistry) -> bytes:
    """The state as it is now (on the event loop, where the registry changes)."""
    return json.dumps(snapshot(registry, time.time(), registry.clock())).encode()


def write(path: Path, body: bytes) -> None:
    """`body` as the whole of `path` (mode 0600), or the old file left as it was."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:  # a name taken (by chance, or by whoever guessed it): another
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a rename replaces a link at `path` itself, never what it points to
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def load(registry: NodeRegistry, path: Path) -> int:
    """The nodes of the file into the registry; how many. A node whose entry
    is not valid is left out alone; a file that is not valid is set aside."""
    try:
        # Not through a link: whoever may write the directory would choose what is read.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("version") != VERSION or not isinstance(body.get("nodes"), list):
            raise ValueError(f"not a version {VERSION} registry state")
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as e:
        log.error("registry state %s cannot be read (%s): set aside as %s.bad; starting with no nodes", path, e, path)
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError as moved:
            log.error("registry state %s cannot be set aside either: %s", path, moved)
        return 0
    wall, now, loaded = time.time(), registry.clock(), 0
    for entry in body["nodes"]:
        try:
            registration = wire.decode_registration(json.dumps(entry["registration"]).encode())
            seen, count = entry.get("last_heartbeat"), entry.get("heartbeats", 0)
            if seen is not None and not (isinstance(seen, (int, float)) and 0 < seen <= wall + 86400):
                raise ValueError(f"last_heartbeat {seen!r}")
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"heartbeats {count!r}")
        except (KeyError, TypeError, ValueError, wire.WireError) as e:
            log.warning("registry state %s: an entry left out (%s)", path, e)
            continue
        state = registry.register(registration)
        # Its age goes on from when it last spoke: on the monotonic clock of this process.
        state.received_at = None if seen is None else now - (wall - min(seen, wall))
        state.heartbeats = count
        loaded += 1
    forgotten = body.get("forgotten", [])
    for entry in forgotten if isinstance(forgotten, list) else []:
        if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and NODE_ID.fullmatch(entry[0])
                and isinstance(entry[1], (int, float)) and 0 < entry[1] <= wall + 86400):  # fmt: skip
            registry.remember_forgotten(entry[0], now - (wall - min(entry[1], wall)))
    return loaded


STATE_FILE = web.AppKey("state_file", Path)
STATE_WRITER = web.AppKey("state_writer", asyncio.Lock)  # one save at a time: see `save`


def keep_state(app: web.Application, path: Path) -> None:
    """The registry kept in `path`: loaded at start, saved on a period and at the end."""
    app[STATE_FILE] = path
    app[STATE_WRITER] = asyncio.Lock()
    app.cleanup_ctx.append(kept_on_disk)


async def save(app: web.Application) -> None:
    """The registry as it is when this save's turn comes, written off the
    event loop; a failure is logged. Saves (the period's, a DELETE's, the
    last at exit) take turns: two threads writing `PATH.tmp` at once could
    rename a file that holds parts of both, and an older snapshot written
    last would bring a forgotten node back."""
    path = app[STATE_FILE]
    async with app[STATE_WRITER]:
        body = encoded(app[REGISTRY])
        try:
            await asyncio.to_thread(write, path, body)
        except OSError as e:  # a full or read-only volume: said, and tried again at the next save
            log.error("registry state %s cannot be written: %s", path, e)


async def kept_on_disk(app: web.Application) -> AsyncIterator[None]:
    """Load at start, save every SAVE_EVERY_S and at the end (cleanup_ctx)."""
    n = load(app[REGISTRY], app[STATE_FILE])
    log.info("registry state %s: %d nodes known from before", app[STATE_FILE], n)

    async def every() -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            await save(app)

    task = asyncio.create_task(every())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await save(app)
