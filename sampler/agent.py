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
import contextlib
import importlib.metadata
import logging
import os
import platform
import random
import signal
import socket
import ssl
import threading
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

import wire
from sampler.shards.pods import LABEL_KEY
from sampler.shards.pods import METRICS_URL as POD_METRICS_URL
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler


def file_stamp(path: Path) -> tuple[int, int, int]:
    """A file's identity: stat follows the symlink, so a ConfigMap's or a
    Secret's update, which swaps `..data`, is a new inode."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


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

BACKOFF_START_S = 1.0
BACKOFF_CAP_S = 30.0


class ConfigError(ValueError):
    pass




def parse_config(data: bytes, source: str = "config") -> list[ShardSpec]:
    """The agent's TOML: one [[shard]] table per engine (id, model, replica, select, metrics_url;
    a `k8s:` shard, one per matching pod: model_label, replica_label, and no id)."""
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    shards = doc.get("shard", [])
    if not isinstance(shards, list) or len(shards) > wire.MAX_SHARDS:
        raise ConfigError(f"{source}: 'shard' must be a list of at most {wire.MAX_SHARDS} tables")
    specs = []
    for i, s in enumerate(shards):
        where = f"{source}: shard {i + 1}"
        if not isinstance(s, dict):
            raise ConfigError(f"{where}: must be a table")
        if not isinstance(s.get("select"), str):
            raise ConfigError(f"{where}: 'select' must be a selector string")
        try:
            selector = Selector.parse(s["select"])
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        pods = selector.kind == "k8s"
        if pods and "id" in s:
            raise ConfigError(f"{where}: a k8s: shard's id is each pod's NAMESPACE/POD[/CONTAINER]: drop 'id'")
        try:
            sid = f"k8s:{i}" if pods else wire.name(s.get("id"), "id")
            model = wire.name(s["model"], "model") if s.get("model") is not None else None
            replica = wire.name(s["replica"], "replica") if s.get("replica") is not None else None
        except wire.WireError as e:
            raise ConfigError(f"{where}: {e}") from None
        labels = {}
        for key in ("model_label", "replica_label"):
            value = s.get(key)
            if value is not None and (not pods or not isinstance(value, str) or not LABEL_KEY.fullmatch(value)):
                raise ConfigError(f"{where}: '{key}' must be a pod label's name, on a k8s: shard")
            labels[key] = value
        metrics_url = s.get("metrics_url")
        if metrics_url is not None and not (
            isinstance(metrics_url, str) and metrics_url.startswith(("http://", "https://"))
            and len(metrics_url) <= 2048 and metrics_url.isprintable() and " " not in metrics_url
        ):  # fmt: skip
            raise ConfigError(f"{where}: 'metrics_url' must be an http:// or https:// URL")
        if pods and metrics_url is not None and not POD_METRICS_URL.fullmatch(metrics_url):
            raise ConfigError(f"{where}: a k8s: shard's 'metrics_url' is http(s)://{{pod_ip}}:PORT/PATH, "
                              "PORT a number, {port:NAME} or {annotation:KEY}")  # fmt: skip
        if not pods and metrics_url is not None and "{pod_ip}" in metrics_url:
            raise ConfigError(f"{where}: '{{pod_ip}}' is a k8s: shard's alone")
        specs.append(ShardSpec(sid, selector, model, replica, metrics_url, **labels))
    ids = [w.id for w in specs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: shard ids must be unique")
    return specs


class ConfigFile:
    """The config file, re-read when it changes. A file that does not exist
    is "no engines configured yet" (the busiest groups are reported) and is
    watched until it appears: a ConfigMap mounted as optional. A change that
    does not parse is logged once and the previous shards stay in force."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.specs: list[ShardSpec] | None = None
        try:
            self.specs = self._load()
        except FileNotFoundError:
            log.info("config %s does not exist (yet): reporting the busiest groups", path)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            return file_stamp(self.path)
        except FileNotFoundError:
            return None

    def _load(self) -> list[ShardSpec]:
        self._seen = self._stamp()
        if self._seen is None:
            raise FileNotFoundError(self.path)
        return parse_config(self.path.read_bytes(), str(self.path))

    def changed(self) -> bool:
        """Whether `specs` changed: the file changed and parses, appeared, or went away."""
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return False
            if stamp is None:
                self._seen, self.specs = None, None
                log.warning("config %s went away: reporting the busiest groups", self.path)
                return True
            self.specs = self._load()
        except FileNotFoundError:
            return False  # gone between stat and read: the next look decides
        except (OSError, ConfigError) as e:
            kept = "the busiest groups" if self.specs is None else f"{len(self.specs)} shards"
            log.error("config not reloaded, keeping %s: %s", kept, e)
            return False
        log.info("config loaded: %d shards", len(self.specs))
        return True


class TokenFile:
    """The node's bearer token, re-read when the file changes: the kubelet
    rotates a projected service-account token well before it expires."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self._problem: str | None = None  # said once, not once a heartbeat
        self.reload()

    def reload(self) -> None:
        stamp = file_stamp(self.path)
        if stamp == self._seen:
            return
        token = self.path.read_text().strip()
        if not token:
            raise ValueError(f"{self.path}: empty token file")
        if not token.isascii() or not token.isprintable():
            raise ValueError(f"{self.path}: the token must be printable ASCII")
        if self._seen is not None:
            log.info("token file %s changed: using the new token", self.path)
        self._seen, self._token = stamp, token

    def value(self) -> str:
        try:
            self.reload()
            self._problem = None
        except (OSError, ValueError) as e:  # mid-rotation or removed: the last good token is still worth trying
            if str(e) != self._problem:
                log.warning("token file not re-read, keeping the last token: %s", e)
                self._problem = str(e)
        return self._token


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


class AgentFailed(Exception):
    """A part of the agent died (the sampling thread, the sender): the process
    exits non-zero, with the traceback in the log, and its supervisor (the
    DaemonSet, systemd) starts it again."""


WINDOW_FAILURES_BEFORE_EXIT = 3  # one failed window is retried; three in a row is a broken agent


class Refused(DeliveryError):
    """The control plane answered, and refused (400, 401, 403, 413, 429): not "unreachable"."""


class UnknownToControlPlane(DeliveryError):
    """404: the control plane does not know this node (it restarted)."""


class AlreadyDelivered(DeliveryError):
    """409: the control plane has this window's heartbeat already (the answer
    to the first send was lost), or a later one."""


class HeartbeatClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | Callable[[], str]) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.token = token if callable(token) else (lambda: token)
        self._dropped_said: set[str] = set()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The answer to an accepted body ({} when it cannot be read: it says no more)."""
        headers = {"Authorization": f"Bearer {self.token()}", "Content-Type": "application/json"}
        try:
            async with self.session.post(self.base_url + path, data=wire.dumps(body), headers=headers) as r:
                if r.status == 200:
                    answer: Any = {}
                    with contextlib.suppress(ValueError):
                        answer = await r.json(content_type=None)
                    self._say_dropped(answer)
                    return answer if isinstance(answer, dict) else {}
                text = (await r.text())[:300]
        except aiohttp.ClientConnectorCertificateError as e:
            raise DeliveryError(f"TLS: the control plane's certificate is not trusted (--ca-file?): "
                                f"{e.certificate_error}") from None  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise DeliveryError(f"{type(e).__name__}: {e}") from None
        if r.status == 404 and path == "/v1/heartbeat":
            raise UnknownToControlPlane(text)
        if r.status == 409 and path == "/v1/heartbeat":
            raise AlreadyDelivered(text)
        if 400 <= r.status < 500:
            raise Refused(f"{path} refused, HTTP {r.status}: {text}")
        raise DeliveryError(f"HTTP {r.status}: {text}")

    def _say_dropped(self, answer: Any) -> None:
        """What the control plane left out of an accepted body: once per reason."""
        dropped = answer.get("dropped") if isinstance(answer, dict) else None
        for d in dropped if isinstance(dropped, list) else []:
            reason = str(d.get("reason"))[:200] if isinstance(d, dict) else "?"
            if reason not in self._dropped_said and len(self._dropped_said) < 100:
                self._dropped_said.add(reason)
                log.warning("the control plane left out %s: %s", str(d.get("field"))[:100], reason)

    async def register(self, registration: dict[str, Any]) -> None:
        await self._post("/v1/register", registration)

    async def heartbeat(self, summary: dict[str, Any]) -> bool:
        """Sends a window's summary; True when the control plane asks for the
        next windows' raw samples (someone watches this node live)."""
        return (await self._post("/v1/heartbeat", summary)).get("raw") is True


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


def registration_body(sampler: WindowSampler, node: str, hostname: str | None = None) -> dict[str, Any]:
    # The gauges of the last window: no /proc or statvfs here, on the event loop (a hung mount would stall it).
    gauges = sampler.last_gauges
    body: dict[str, Any] = {
        "node": node,
        "hostname": hostname or socket.gethostname(),
        "kernel": platform.release(),
        "agent_version": AGENT_VERSION,
        "backend": sampler.backend.name,
    }
    if sampler.backend.reason:
        body["backend_reason"] = sampler.backend.reason[: wire.MAX_TEXT]
    for key in ("cpus", "memory_bytes", "disks"):
        if key in gauges:
            body[key] = gauges[key]
    if sampler.gpus is not None and (inventory := sampler.gpus.inventory()) is not None:
        body["gpus"] = inventory
    return wire.fit_registration(body)


class Agent:
    def __init__(self, sampler: WindowSampler, client_url: str, token: str | TokenFile, node: str, interval: float,
                 stopping: threading.Event, config: ConfigFile | None = None,
                 ssl_context: ssl.SSLContext | None = None, hostname: str | None = None,
                 alive_file: Path | None = None) -> None:  # fmt: skip
        """`stopping` must also end the sampler's sleeps, so that SIGTERM
        does not wait for the window in progress. `ssl_context` verifies an
        https control plane (default: the system's CAs). `alive_file` is
        touched on the event loop as each window reaches the sender: a
        liveness probe that finds it old knows that sampling or the loop
        that sends has stopped (the sends themselves are bounded by the
        session's timeout, so a control plane that is down never stops it)."""
        self.sampler, self.url, self.node = sampler, client_url, node
        self.token = token.value if isinstance(token, TokenFile) else token
        self.interval, self.config, self.ssl_context = interval, config, ssl_context
        self.hostname = hostname  # the host's, read through pid 1 when in a container
        self.stopping = stopping
        self.mailbox = NewestSummary()
        self.sent = 0
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the sender's waits: a test may count them
        self.alive_file = alive_file
        self._alive_error: str | None = None

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

    def _window_done(self, summary: dict[str, Any]) -> None:
        """On the event loop: the window goes to the sender, and the alive file says so."""
        self.mailbox.put(summary)
        if self.alive_file is None:
            return
        try:
            self.alive_file.touch()
            error = None
        except OSError as e:
            error = f"alive file {self.alive_file}: {e}"
        if error != self._alive_error:
            if error is not None:
                log.warning("%s: a liveness probe reading it will fail", error)
            self._alive_error = error

    # --- delivery -------------------------------------------------------------

    async def _deliver(self, client: HeartbeatClient) -> None:
        backoff = Backoff()
        registered = False
        down_since_reason: str | None = None
        unknown_again = False  # a 404 right after registering: not a restart, something else is wrong
        registered_gpus: list[dict[str, Any]] | None = None
        summary = await self.mailbox.get()
        while True:
            gpus = self.sampler.gpus.inventory() if self.sampler.gpus is not None else None
            if registered and gpus != registered_gpus:
                log.info("the GPUs changed (NVML loaded late, or a card came or went): registering again")
                registered = False
            try:
                if not registered:
                    body = registration_body(self.sampler, self.node, self.hostname)
                    await client.register(body)
                    registered, registered_gpus = True, gpus
                    log.info("registered with %s as %s", self.url, self.node)
                raw_wanted = await client.heartbeat(summary)
                self.sent += 1
                if raw_wanted != self.sampler.raw_wanted:
                    log.info("raw samples %s: %s", "on" if raw_wanted else "off",
                             "someone watches this node live" if raw_wanted else "nobody watches any more")  # fmt: skip
                    self.sampler.raw_wanted = raw_wanted  # read by the sampling thread at its window's end
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
            sender = asyncio.create_task(self._deliver(HeartbeatClient(session, self.url, self.token)))
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
            await asyncio.gather(sender, stopped, return_exceptions=True)
            await loop.run_in_executor(None, thread.join)
            if failure is not None:
                raise failure


def default_node() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
