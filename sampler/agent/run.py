"""The agent: a thread samples window after window and never waits for the
network; the sender delivers the newest summary to the control-plane
replica that holds the node (sampler/agent/replicas.py), to the next one
at once when that one does not answer, retrying with capped exponential
backoff and jitter once none does; the log says one line per event (the
control plane went away, came back, restarted, the node moved), not one
per retry.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import platform
import signal
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

import wire
from sampler.agent.client import AlreadyDelivered, DeliveryError, HeartbeatClient, Refused, UnknownToControlPlane
from sampler.agent.config import ConfigFile, TokenFile
from sampler.agent.delivery import Backoff, NewestSummary
from sampler.agent.replicas import ReplicaChoice
from sampler.off_thread import Said
from sampler.window.sampler import WindowSampler
from wire.discovery import REFRESH_S, Replicas
from wire.schema import Registration, WindowSummary


def _installed_version() -> str | None:
    """The distribution's version, as installed: the agent sits below the
    CLI's package and does not import it. None (not sent) when run from a
    tree that is not installed."""
    try:
        return importlib.metadata.version("nodesampler")
    except importlib.metadata.PackageNotFoundError:
        return None


AGENT_VERSION = _installed_version()

log = logging.getLogger(__name__)


class AgentFailed(Exception):
    """A part of the agent died (the sampling thread, the sender): the process
    exits non-zero, with the traceback in the log, and its supervisor (the
    DaemonSet, systemd) starts it again."""


WINDOW_FAILURES_BEFORE_EXIT = 3  # one failed window is retried; three in a row is a broken agent
# A node held by a later replica tries its first choice again this often (six windows: a
# minute at the 10 s default, at least 5 s): back within a minute of its return.
RETURN_EVERY_WINDOWS = 6


def return_every_s(interval: float) -> float:
    return min(60.0, max(5.0, RETURN_EVERY_WINDOWS * interval))


def registration_body(sampler: WindowSampler, node: str, hostname: str | None = None) -> Registration:
    # The gauges of the last window: no /proc or statvfs here, on the event loop (a hung mount would stall it).
    gauges = sampler.last_gauges
    inventory = sampler.gpus.inventory() if sampler.gpus is not None else None
    return wire.made(Registration, {
        "node": node,
        "hostname": hostname or socket.gethostname(),
        "kernel": platform.release(),
        "agent_version": AGENT_VERSION,
        "backend": sampler.backend.name,
        "backend_reason": sampler.backend.reason,
        "cpus": gauges.cpus,
        "memory_bytes": gauges.memory_bytes,
        "disks": gauges.disks,
        "gpus": None if inventory is None else wire.fit_gpus(inventory),
    })  # fmt: skip


Clients = dict[str, HeartbeatClient]  # a replica's URL -> its client


class Agent:
    def __init__(self, sampler: WindowSampler, client_url: str | Sequence[str], token: str | TokenFile, node: str,
                 interval: float,
                 stopping: threading.Event, config: ConfigFile | None = None,
                 ssl_context: ssl.SSLContext | None = None, hostname: str | None = None,
                 alive_file: Path | None = None) -> None:  # fmt: skip
        """`stopping` must also end the sampler's sleeps, so that SIGTERM
        does not wait for the window in progress. `ssl_context` verifies an
        https control plane (default: the system's CAs). `alive_file` is
        touched on the event loop as each window reaches the sender: a
        liveness probe that finds it old knows that sampling or the loop
        that sends has stopped (the sends themselves are bounded by the
        session's timeout, so a control plane that is down never stops it).
        `client_url`: the control plane, or its replicas (the node's is chosen
        by sampler/agent/replicas.py)."""
        self.sampler, self.node = sampler, node
        self.replicas = Replicas([client_url] if isinstance(client_url, str) else client_url)
        self.token = token.value if isinstance(token, TokenFile) else token
        self.interval, self.config, self.ssl_context = interval, config, ssl_context
        self.hostname = hostname  # the host's, read through pid 1 when in a container
        self.stopping = stopping
        self.mailbox = NewestSummary()
        self.sent = 0
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the sender's waits: a test may count them
        self.alive_file = alive_file
        self._said = Said()

    # --- the sampling thread -----------------------------------------------------

    def _sample_forever(self, loop: asyncio.AbstractEventLoop, died: asyncio.Future[None]) -> None:
        try:
            self._sample_windows(loop)
        except BaseException as e:
            log.exception("the sampling thread died")
            failure = AgentFailed(f"the sampling thread died: {e!r}")

            def report() -> None:
                if not died.done():
                    died.set_exception(failure)

            loop.call_soon_threadsafe(report)

    def _sample_windows(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sampler.prime(0)
        failures = 0
        while not self.stopping.is_set():
            if self.config is not None and self.config.changed():
                self.sampler.specs = self.config.specs
            try:
                summary = self.sampler.run_window(self.interval)
                failures = 0
            except Exception:
                failures += 1
                if failures >= WINDOW_FAILURES_BEFORE_EXIT:
                    raise
                log.exception("window failed (%d in a row); the next window tries again", failures)
                self.stopping.wait(self.interval)
                continue
            if not self.stopping.is_set():
                loop.call_soon_threadsafe(self._window_done, summary)

    def _window_done(self, summary: WindowSummary) -> None:
        """On the event loop: the window goes to the sender, and the alive file says so."""
        self.mailbox.put(summary)
        if self.alive_file is None:
            return
        try:
            self.alive_file.touch()
            error = None
        except OSError as e:
            error = f"alive file {self.alive_file}: {e}"
        if self._said.changed("alive file", error) and error is not None:
            log.warning("%s: a liveness probe reading it will fail", error)

    # --- delivery -------------------------------------------------------------

    def clients(self, session: aiohttp.ClientSession) -> dict[str, HeartbeatClient]:
        """A client a replica, on the one session."""
        return {url: HeartbeatClient(session, url, self.token) for url in self.replicas.urls}

    async def _replicas_found(self, clients: Clients, make_client: Callable[[str], HeartbeatClient] | None) -> Clients:
        """The clients of the replicas a DNS record names now; waits while it names none."""
        if make_client is None or not self.replicas.discovered:
            return clients
        while not (urls := self.replicas.urls):
            await self.sleep(self.interval)
        return {url: clients.get(url) or make_client(url) for url in urls}

    async def _refresh_replicas(self) -> None:
        """The records read again every REFRESH_S (a replica added is found, one gone forgotten)."""
        while True:
            await self.replicas.refresh()
            await asyncio.sleep(REFRESH_S if self.replicas.urls else min(REFRESH_S, 5.0))

    async def _deliver(self, clients: dict[str, HeartbeatClient],
                       make_client: Callable[[str], HeartbeatClient] | None = None) -> None:  # fmt: skip
        """`make_client`: a client for a replica a DNS record names later (none: the replicas are given)."""
        clients = await self._replicas_found(clients, make_client)
        choice = ReplicaChoice(self.node, list(clients), return_every_s(self.interval))
        backoff = Backoff()
        registered = False
        down_since_reason: str | None = None
        unknown_again = False  # a 404 right after registering: not a restart, something else is wrong
        registered_gpus: list[dict[str, Any]] | None = None
        summary = await self.mailbox.get()
        while True:
            if make_client is not None and self.replicas.urls and set(self.replicas.urls) != set(clients):
                clients = await self._replicas_found(clients, make_client)
                before = choice.url
                choice.replace(list(clients))
                log.info("the control plane's replicas now: %s", ", ".join(choice.order))
                registered = registered and choice.url == before
            gpus = self.sampler.gpus.inventory() if self.sampler.gpus is not None else None
            if registered and gpus != registered_gpus:
                log.info("the GPUs changed (NVML loaded late, or a card came or went): registering again")
                registered = False
            if choice.worth_trying_back():
                left = choice.order[choice.back_to_first()]
                log.info("trying %s again, this node's first choice (held by %s meanwhile)", choice.url, left)
                registered = False
            client = clients[choice.url]
            try:
                if not registered:
                    body = registration_body(self.sampler, self.node, self.hostname)
                    rate = await client.register(body)
                    registered, registered_gpus = True, gpus
                    log.info("registered with %s as %s", choice.url, self.node)
                    self._fit_rate(rate)
                answer = await client.heartbeat(summary)
                choice.taken()
                self.sent += 1
                if answer.raw != self.sampler.raw_wanted:
                    log.info("raw samples %s: %s", "on" if answer.raw else "off",
                             "someone watches this node live" if answer.raw else "nobody watches any more")  # fmt: skip
                    self.sampler.raw_wanted = answer.raw  # read by the sampling thread at its window's end
                if self.sampler.hindsight is not None:
                    self.sampler.spans.asked = answer.span  # likewise
                unknown_again = False
            except AlreadyDelivered:
                log.debug("the control plane has this window already")
            except UnknownToControlPlane:
                if not unknown_again:
                    log.warning("control plane does not know this node (it restarted): registering again")
                    unknown_again = True
                    registered = False
                    continue  # at once, with the same summary
                registered = False
                await self.sleep(backoff.next_delay())  # 404 again at once: back off like any retry
                continue
            except DeliveryError as e:
                came_back = choice.trying_back
                # Unreachable, timed out or 5xx: the next replica in the node's order, at once. A
                # refusal (4xx) would be the same at any replica: it is not a reason to move.
                failed = choice.url
                if not isinstance(e, Refused) and choice.failed():
                    if not came_back:
                        log.warning("control plane %s unreachable (%s): heartbeats go to %s", failed, e, choice.url)
                    registered = False
                    continue
                registered = registered and choice.url == failed  # none answered: the first choice, after backoff
                if down_since_reason is None:
                    what = "refused the request" if isinstance(e, Refused) else "unreachable"
                    log.warning("control plane %s (%s); retrying with backoff", what, e)
                    down_since_reason = str(e)
                await self.sleep(backoff.next_delay())
                summary = self.mailbox.newer() or summary  # only the newest is worth sending
                continue
            if down_since_reason is not None:
                log.warning("control plane reachable again after %d failed attempts", backoff.reset())
                down_since_reason = None
            backoff.reset()
            summary = await self.mailbox.get()

    def _fit_rate(self, rate: float | None) -> None:
        """Windows no shorter than the control plane's rate allows: an
        `--interval 0.2` against its 2 a second met 429 after 429, and the
        log said unreachable and reachable again without end. The sampling
        thread reads the interval at each window's start."""
        if rate is None or self.interval >= 1.0 / rate - 1e-9:
            return
        wanted, self.interval = self.interval, 1.0 / rate
        if self._said.first(f"rate {rate:g}"):
            log.warning("the control plane takes at most %g heartbeats a second from a node: windows of %g s, "
                        "not --interval %g (its --max-heartbeats-per-second)", rate, self.interval, wanted)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sampler_died: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(target=self._sample_forever, args=(loop, sampler_died), name="sampler",
                                  daemon=True)  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=max(5.0, min(30.0, 2 * self.interval)))
        connector = aiohttp.TCPConnector(ssl=self.ssl_context) if self.ssl_context else None
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if self.sampler.gpus is not None:
                await loop.run_in_executor(None, self.sampler.gpus.wait_ready, 60.0)
            thread.start()
            refresher = asyncio.create_task(self._refresh_replicas()) if self.replicas.discovered else None
            sender = asyncio.create_task(self._deliver(self.clients(session),
                                                       lambda url: HeartbeatClient(session, url, self.token)))
            stopped = asyncio.create_task(stop.wait())
            watched: set[asyncio.Future[Any]] = {sender, stopped, sampler_died}
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            failure: BaseException | None = None
            if sampler_died.done():
                failure = sampler_died.exception()
            elif sender.done() and not sender.cancelled() and (e := sender.exception()) is not None:
                log.error("the heartbeat sender died", exc_info=e)
                failure = AgentFailed(f"the heartbeat sender died: {e!r}")
            log.info("stopping")
            self.stopping.set()
            sender.cancel()
            stopped.cancel()
            if refresher is not None:
                refresher.cancel()
            await asyncio.gather(sender, stopped, *([refresher] if refresher else []), return_exceptions=True)
            await loop.run_in_executor(None, thread.join)
            if failure is not None:
                raise failure


def default_node() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
