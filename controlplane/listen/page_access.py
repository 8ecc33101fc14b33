"""Who may read the pages listener, and who may change the fleet through it.

- **Users**: with `basic_auth_users` in the web config file
  (controlplane/listen/web_config.py), every request but `/health` needs one of
  them (HTTP basic auth, bcrypt hashes, as Prometheus and node_exporter
  check them). `/health` stays open: the kubelet's probes carry no
  password, and it says no more than that the control plane answers and how
  many nodes it knows.
- **Hosts**: with `--pages-host NAME` given, a request whose `Host` names
  another host is refused (421): a web page that DNS-rebinds its own name to
  an operator's `kubectl port-forward` sends its own name. A `Host` written
  as an IP address is always served: it rebinds nothing, and Prometheus'
  targets and the kubelet's probes name the pod's address.
- **The admin socket** (`--admin-socket PATH`): a Unix socket, mode 0600,
  that serves the same routes to the control plane's own user (and root)
  without a password: `nodesampler forget NODE` on the control plane's
  machine (`kubectl exec`, which RBAC grants apart from port-forward).
- **Forgetting a node** (`DELETE /api/nodes/NODE`) needs an authenticated
  user or the admin socket; without either it is refused (403). A loopback
  peer is no operator: every service-mesh sidecar and anyone allowed
  `pods/portforward` arrives from loopback.

bcrypt costs about 50-100 ms of CPU a check (cost 10, the htpasswd default),
so an anonymous flood of guessed passwords must not buy that without bound:
checks run one at a time on a thread of their own (bcrypt lets go of the
GIL, so the event loop goes on), at most `MAX_WAITING` wait (429 beyond),
and a password once found good is remembered (a digest of user, hash and
password, for as long as the hash stays in the file), so Prometheus' scrape
every 15 s costs one check a restart, not one a scrape.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from controlplane.listen.connection_limits import end_turn
from controlplane.listen.web_config import ReloadingWebConfig

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health"})
MAX_WAITING = 16  # password checks queued behind the one running; ~1 s of bcrypt at cost 10
REMEMBERED = 256  # good passwords remembered (digests): far more than a fleet's scrapers and operators
REALM = 'Basic realm="nodesampler", charset="UTF-8"'
USER = web.RequestKey("user", str)  # the request's authenticated user (absent: none)


def from_admin_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def host_name(header: str) -> str:
    """A Host header's name, without its port: `[::1]:8080` -> `::1`, `Example.org.:80` -> `example.org`."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def basic_credentials(header: str) -> tuple[str, str] | None:
    """`Basic base64(user:password)` -> (user, password); None when it is not that."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value or len(value) > 4096:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64 (binascii.Error), not ASCII (UnicodeEncodeError) or not UTF-8 within
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


class PasswordChecker:
    """bcrypt, bounded (see the module's docstring)."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self._remembered: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._waiting = 0
        # A name no file holds still costs a check, so a wrong name and a wrong password take as long.
        self._dummy: bytes | None = None
        self.checks = 0

    @staticmethod
    def _digest(user: str, hashed: bytes, password: str) -> bytes:
        return hashlib.sha256(b"\0".join((user.encode(), hashed, password.encode()))).digest()

    def remembered(self, users: dict[str, bytes], user: str, password: str) -> bool:
        """Whether the password was found good already (no bcrypt to wait for)."""
        hashed = users.get(user)
        if hashed is None:
            return False
        digest = self._digest(user, hashed, password)
        if digest in self._remembered:
            self._remembered.move_to_end(digest)
            return True
        return False

    async def check(self, users: dict[str, bytes], user: str, password: str) -> bool | None:
        """Whether the password is the user's; None when too many checks wait already."""
        if self.remembered(users, user, password):
            return True
        hashed = users.get(user)
        if self._waiting >= self.max_waiting + 1:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcrypt")
        self._waiting += 1
        try:
            ok = await asyncio.get_running_loop().run_in_executor(self._executor, self._bcrypt, hashed, password)
        finally:
            self._waiting -= 1
        if ok and hashed is not None:
            self._remembered[self._digest(user, hashed, password)] = None
            while len(self._remembered) > REMEMBERED:
                self._remembered.popitem(last=False)
        return ok and hashed is not None

    def _bcrypt(self, hashed: bytes | None, password: str) -> bool:
        import bcrypt  # here: the kernel tier's guests import the control plane without it

        self.checks += 1
        if hashed is None:
            if self._dummy is None:
                self._dummy = bcrypt.hashpw(b"not a password", bcrypt.gensalt(10))
            bcrypt.checkpw(password.encode(), self._dummy)
            return False
        try:
            return bool(bcrypt.checkpw(password.encode(), hashed))
        except ValueError:  # a hash bcrypt cannot read (the file's check is by shape only)
            log.error("basic_auth_users: a user's hash is not one bcrypt reads")
            return False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class PageAccess:
    """The pages listener's rules: the web config (or none), the hosts it serves, its checker."""

    def __init__(self, web_config: ReloadingWebConfig | None = None, hosts: Iterable[str] = ()) -> None:
        self.web_config = web_config
        self.hosts = frozenset(host_name(h) for h in hosts)
        self.checker = PasswordChecker()

    def users(self) -> dict[str, bytes]:
        return self.web_config.maybe_reload().users if self.web_config is not None else {}

    def headers(self) -> dict[str, str]:
        return self.web_config.current.headers if self.web_config is not None else {}


PAGE_ACCESS = web.AppKey("page_access", PageAccess)


# Refusals are answered, not raised: a raised HTTPException's traceback holds the
# frame that caught it, which holds it back, and each such cycle waits for the
# cyclic GC. 200 clients looping anonymously made ~66,000 such objects between
# full collections of 130-150 ms each, on the loop that takes the heartbeats.
def _unauthorized(text: str) -> web.Response:
    return web.Response(status=401, text=text, headers={"WWW-Authenticate": REALM})


@web.middleware
async def page_access(request: web.Request, handler: Handler) -> web.StreamResponse:
    access = request.app.get(PAGE_ACCESS)
    if access is None or from_admin_socket(request):
        return await handler(request)
    if access.hosts:
        name = host_name(request.headers.get("Host", ""))
        if name not in access.hosts and not is_address(name):
            return web.Response(status=421, text="this listener does not serve that host (--pages-host)\n")
    users = access.users()
    if users and request.path not in OPEN_PATHS:
        credentials = basic_credentials(request.headers.get("Authorization", ""))
        if credentials is None:
            return _unauthorized("a user and password are needed (basic auth)\n")
        ok: bool | None = True
        if not access.checker.remembered(users, *credentials):
            # bcrypt is waited for off the loop: the turn goes to the next request
            # (a flood of guesses held every turn, and a user queued behind them).
            end_turn(request)
            ok = await access.checker.check(users, *credentials)
        if ok is None:
            return web.Response(status=429, text="too many password checks under way; try again\n",
                                headers={"Retry-After": "1"})  # fmt: skip
        if not ok:
            return _unauthorized("wrong user or password\n")
        request[USER] = credentials[0]
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The web config's `http_server_config.headers`, on every answer (pages, streams, errors)."""
    access = request.app.get(PAGE_ACCESS)
    if access is not None:
        for name, value in access.headers().items():
            response.headers[name] = value


def may_change_fleet(request: web.Request) -> bool:
    return from_admin_socket(request) or USER in request


async def listen_admin_socket(runner: web.AppRunner, path: os.PathLike[str] | str) -> asyncio.AbstractServer:
    """The admin socket: made 0600 from the start (umask around bind: a chmod after
    it leaves a moment when others may connect); a stale one from a crash is replaced."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    assert runner.server is not None
    return await asyncio.get_running_loop().create_unix_server(runner.server, sock=sock)
