"""`nodesampler agent`: sample this node window after window and deliver each
window's summary to the control plane as a heartbeat.

Sampling runs on a thread of its own and never waits for the network; the
sender keeps only the newest summary, so an unreachable control plane costs
old summaries, never memory or samples. Delivery retries with capped
exponential backoff and jitter, and the log says one line per event (the
control plane went away, came back, restarted), not one per retry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import random
import signal
import socket
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from nodesampler import __version__, wire
from sampler.selectors import GroupSelector, GroupWatch
from sampler.window_sampler import WindowSampler

log = logging.getLogger(__name__)

BACKOFF_START_S = 1.0
BACKOFF_CAP_S = 30.0


class ConfigError(ValueError):
    pass


def parse_config(data: bytes, source: str = "config") -> list[GroupWatch]:
    """The agent's TOML: one [[shard]] table per engine (id, model, replica, select)."""
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    shards = doc.get("shard", [])
    if not isinstance(shards, list) or len(shards) > wire.MAX_SHARDS:
        raise ConfigError(f"{source}: 'shard' must be a list of at most {wire.MAX_SHARDS} tables")
    watches = []
    for i, s in enumerate(shards):
        where = f"{source}: shard {i + 1}"
        if not isinstance(s, dict):
            raise ConfigError(f"{where}: must be a table")
        try:
            sid = wire.name(s.get("id"), "id")
            model = wire.name(s["model"], "model") if s.get("model") is not None else None
            replica = wire.name(s["replica"], "replica") if s.get("replica") is not None else None
        except wire.WireError as e:
            raise ConfigError(f"{where}: {e}") from None
        if not isinstance(s.get("select"), str):
            raise ConfigError(f"{where}: 'select' must be a selector string")
        try:
            selector = GroupSelector.parse(s["select"])
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        watches.append(GroupWatch(sid, selector, model, replica))
    ids = [w.id for w in watches]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: shard ids must be unique")
    return watches


class ConfigFile:
    """The config file, re-read when it changes. A change that does not parse
    is logged once and the previous shards stay in force."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self.watches = self._load()

    def _stamp(self) -> tuple[int, int]:
        st = self.path.stat()
        return st.st_mtime_ns, st.st_size

    def _load(self) -> list[GroupWatch]:
        self._seen = self._stamp()
        return parse_config(self.path.read_bytes(), str(self.path))

    def changed(self) -> list[GroupWatch] | None:
        """The new shards if the file changed and parses; None otherwise."""
        try:
            if self._stamp() == self._seen:
                return None
            self.watches = self._load()
        except (OSError, ConfigError) as e:
            log.error("config not reloaded, keeping %d shards: %s", len(self.watches), e)
            return None
        log.info("config reloaded: %d shards", len(self.watches))
        return self.watches


class NewestSummary:
    """A one-slot mailbox: a new summary replaces one not yet sent."""

    def __init__(self) -> None:
        self._summary: dict[str, Any] | None = None
        self._ready = asyncio.Event()
        self.replaced = 0

    def put(self, summary: dict[str, Any]) -> None:
        if self._summary is not None:
            self.replaced += 1
        self._summary = summary
        self._ready.set()

    async def get(self) -> dict[str, Any]:
        await self._ready.wait()
        summary, self._summary = self._summary, None
        self._ready.clear()
        assert summary is not None
        return summary

    def newer(self) -> dict[str, Any] | None:
        """A summary that arrived while the last was being sent, if any."""
        if self._summary is None:
            return None
        summary, self._summary = self._summary, None
        self._ready.clear()
        return summary


class DeliveryError(Exception):
    pass


class UnknownToControlPlane(DeliveryError):
    """404: the control plane does not know this node (it restarted)."""


class HeartbeatClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            async with self.session.post(self.base_url + path, data=wire.dumps(body), headers=self.headers) as r:
                if r.status == 200:
                    return
                text = (await r.text())[:300]
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise DeliveryError(f"{type(e).__name__}: {e}") from None
        if r.status == 404 and path == "/v1/heartbeat":
            raise UnknownToControlPlane(text)
        raise DeliveryError(f"HTTP {r.status}: {text}")

    async def register(self, registration: dict[str, Any]) -> None:
        await self._post("/v1/register", registration)

    async def heartbeat(self, summary: dict[str, Any]) -> None:
        await self._post("/v1/heartbeat", summary)


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter over its upper half."""

    start: float = BACKOFF_START_S
    cap: float = BACKOFF_CAP_S
    failures: int = 0
    rand: Callable[[float, float], float] = random.uniform

    def next_delay(self) -> float:
        self.failures += 1
        top = min(self.cap, self.start * 2 ** (self.failures - 1))
        return self.rand(top / 2, top)

    def reset(self) -> int:
        failures, self.failures = self.failures, 0
        return failures


def registration_body(sampler: WindowSampler, node: str) -> dict[str, Any]:
    gauges = sampler.gauges.read()
    body: dict[str, Any] = {
        "node": node,
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "agent_version": __version__,
        "backend": sampler.backend.name,
    }
    if sampler.backend.reason:
        body["backend_reason"] = sampler.backend.reason[: wire.MAX_TEXT]
    for key in ("cpus", "memory_bytes", "disks"):
        if key in gauges:
            body[key] = gauges[key]
    if sampler.gpus is not None and (inventory := sampler.gpus.inventory()) is not None:
        body["gpus"] = inventory
    return body


class Agent:
    def __init__(self, sampler: WindowSampler, client_url: str, token: str, node: str, interval: float,
                 stopping: threading.Event, config: ConfigFile | None = None) -> None:  # fmt: skip
        """`stopping` must also end the sampler's sleeps, so that SIGTERM
        does not wait for the window in progress."""
        self.sampler, self.url, self.token, self.node = sampler, client_url, token, node
        self.interval, self.config = interval, config
        self.stopping = stopping
        self.mailbox = NewestSummary()
        self.sent = 0

    # --- the sampling thread -----------------------------------------------------

    def _sample_forever(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sampler.prime(0)
        while not self.stopping.is_set():
            if self.config is not None and (watches := self.config.changed()) is not None:
                self.sampler.watches = watches
            try:
                summary = self.sampler.run_window(self.interval)
            except Exception:  # a bug must not end sampling silently; the next window tries again
                log.exception("window failed")
                self.stopping.wait(self.interval)
                continue
            if not self.stopping.is_set():
                loop.call_soon_threadsafe(self.mailbox.put, summary)

    # --- delivery -------------------------------------------------------------

    async def _deliver(self, client: HeartbeatClient) -> None:
        backoff = Backoff()
        registered = False
        down_since_reason: str | None = None
        summary = await self.mailbox.get()
        while True:
            try:
                if not registered:
                    await client.register(registration_body(self.sampler, self.node))
                    registered = True
                    log.info("registered with %s as %s", self.url, self.node)
                await client.heartbeat(summary)
                self.sent += 1
            except UnknownToControlPlane:
                log.warning("control plane does not know this node (it restarted): registering again")
                registered = False
                continue  # at once, with the same summary
            except DeliveryError as e:
                if down_since_reason is None:
                    log.warning("control plane unreachable (%s); retrying with backoff", e)
                    down_since_reason = str(e)
                await asyncio.sleep(backoff.next_delay())
                summary = self.mailbox.newer() or summary  # only the newest is worth sending
                continue
            if down_since_reason is not None:
                log.warning("control plane reachable again after %d failed attempts", backoff.reset())
                down_since_reason = None
            backoff.reset()
            summary = await self.mailbox.get()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        thread = threading.Thread(target=self._sample_forever, args=(loop,), name="sampler", daemon=True)
        timeout = aiohttp.ClientTimeout(total=max(5.0, min(30.0, 2 * self.interval)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if self.sampler.gpus is not None:
                await loop.run_in_executor(None, self.sampler.gpus.wait_ready, 60.0)
            thread.start()
            sender = asyncio.create_task(self._deliver(HeartbeatClient(session, self.url, self.token)))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({sender, stopped}, return_when=asyncio.FIRST_COMPLETED)
            log.info("stopping")
            self.stopping.set()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            await loop.run_in_executor(None, thread.join)


def read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path}: empty token file")
    return token


def default_node() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
