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
- **Peers** (`--peer`, controlplane/fleet/forward.py): a replica that forwards a
  node's request to the replica holding it signs it for that replica alone
  (controlplane/listen/peer_auth.py) in place of a password. It checked its
  user already and names them (`X-Nodesampler-User`), and the client's
  address (`X-Nodesampler-Viewer`), both in the signature: the holder counts
  their live views as its own, and gives them the rights its own web config
  gives that name (none for a name it does not hold). Such a request is not
  held to `--pages-host` (the host it was signed for is checked instead), and
  is served here, never forwarded again. Only a replica given peers takes
  such a request at all; its answer carries the replica's proof.
- **Forgetting a node** (`DELETE /api/nodes/NODE`) needs an authenticated
  user or the admin socket; without either it is refused (403). A loopback
  peer is no operator: every service-mesh sidecar and anyone allowed
  `pods/portforward` arrives from loopback.

bcrypt costs about 50-100 ms of CPU a check (cost 10, the htpasswd default),
so an anonymous flood of guessed passwords must not buy that without bound:
- checks run one at a time on a thread of their own (bcrypt lets go of the
  GIL, so the event loop goes on), taken from the peers' queues in turn, so
  a real login waits for one check of each other peer, not for a flood's
  queue: 40 guesses from one address once locked the first login and
  Prometheus' first scrape out. A peer is its IPv4 address or its IPv6 /64.
  At most `MAX_WAITING_A_PEER` of one peer's and `MAX_WAITING` in all wait
  (429 beyond);
- a password once found good is remembered (a digest of user, hash and
  password, for as long as the hash stays in the file), so Prometheus'
  scrape every 15 s costs one check a restart, not one a scrape;
- every password is judged alike, whatever its length or user: bcrypt reads
  its first 72 bytes (as Go's bcrypt, which Prometheus' exporter-toolkit
  uses, and htpasswd do; Python's bcrypt 5 raises instead), and a name no
  file holds is checked against a hash of the file's highest cost, so a
  wrong name and a wrong password take as long;
- a wrong password or a full queue is a warning at most once a minute
  (controlplane/listen/rate_limited_log.py), never a traceback.
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
import stat
import struct
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from controlplane.listen.connection_limits import end_turn
from controlplane.listen.peer_auth import CHALLENGE_PATH, HEADER, PROOF, PeerAuth, Verified
from controlplane.listen.rate_limited_log import RateLimitedLog
from controlplane.listen.web_config import ReloadingWebConfig

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health"})
MAX_WAITING = 64  # password checks queued in all; taken in turn by peer, so one peer's do not hold another's
MAX_WAITING_A_PEER = 4  # of one peer: its fifth guess at once is 429
BCRYPT_READS = 72  # bytes of a password bcrypt reads
REMEMBERED = 256  # good passwords remembered (digests): far more than a fleet's scrapers and operators
REALM = 'Basic realm="nodesampler", charset="UTF-8"'
USER = web.RequestKey("user", str)  # the request's authenticated user (absent: none)
FROM_PEER = web.RequestKey("from_peer", bool)  # forwarded by a peer replica (controlplane/fleet/forward.py)
VIEWER = web.RequestKey("viewer", str)  # the address a peer forwarded the request for
FORWARDED_USER = "X-Nodesampler-User"  # the user the forwarding replica checked (absent: none was asked for)
FORWARDED_FOR = "X-Nodesampler-Viewer"  # the client's address, for the holder's live views a client
ADMIN_SOCKET_USER = "(admin socket)"  # who forwarded requests from the admin socket are, at the holder
PEER_REQUEST = web.RequestKey("peer_request", Verified)  # a peer's request, verified: its challenge proves the answer


def verify_peer(request: web.Request, auth: PeerAuth) -> str | None:
    """A peer's signed request (listen/peer_auth.py) checked, and marked as a
    peer's: None; else why it is refused. The user and viewer it names are
    in its MAC."""
    if PEER_REQUEST in request:
        return None
    user, viewer = request.headers.get(FORWARDED_USER, ""), request.headers.get(FORWARDED_FOR, "")
    verified = auth.verify(request.headers.get(HEADER), request.method, request.raw_path, request.host,
                           user, viewer)  # fmt: skip
    if isinstance(verified, str):
        return f"{verified}\n"
    request[PEER_REQUEST] = verified
    request[FROM_PEER] = True
    request[VIEWER] = (viewer or request.remote or "unknown")[:64]
    return None


def admin_peer(request: web.Request) -> bool | None:
    """None: the request did not come through the admin socket; else whether
    its peer (SO_PEERCRED) is this process's user or root, the only ones it serves."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return False
    return uid in (0, os.geteuid())


def from_admin_socket(request: web.Request) -> bool:
    return admin_peer(request) is True


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


def peer_of(address: str | None) -> str:
    """The key a client's checks queue under: its IPv4 address, or its IPv6
    /64 (one host is given a whole /64; an address is not a client there)."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address or "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def bcrypt_cost(hashed: bytes) -> int | None:
    """`$2b$12$...` -> 12 (None: not that shape)."""
    parts = hashed.split(b"$")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None


@dataclass
class _Check:
    hashed: bytes | None  # None: a name no file holds
    dummy_cost: int
    password: bytes
    answer: asyncio.Future[bool] = field(repr=False)


class PasswordChecker:
    """bcrypt, bounded and fair by peer (see the module's docstring)."""

    def __init__(self, max_waiting: int = MAX_WAITING, max_waiting_a_peer: int = MAX_WAITING_A_PEER) -> None:
        self.max_waiting = max_waiting
        self.max_waiting_a_peer = max_waiting_a_peer
        self._remembered: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._queues: collections.OrderedDict[str, collections.deque[_Check]] = collections.OrderedDict()
        self._worker: asyncio.Task[None] | None = None
        # A name no file holds still costs a check at the file's highest cost: a hash of
        # that cost to check against (bcrypt reads only its salt), made once a cost.
        self._dummies: dict[int, bytes] = {}
        self.checks = 0  # bcrypt runs
        self.refused = 0  # checks refused: too many waiting (429)
        self.wrong = 0  # passwords found wrong, or names no file holds (401)
        self.good = 0  # passwords bcrypt found good (a remembered one is not checked)
        self._log = RateLimitedLog("password", log)

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

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

    async def check(self, users: dict[str, bytes], user: str, password: str, peer: str = "") -> bool | None:
        """Whether the password is the user's; None when too many checks wait
        already (in all, or of `peer`, see `peer_of`)."""
        if self.remembered(users, user, password):
            return True
        queue = self._queues.get(peer)
        if self.waiting() >= self.max_waiting or (queue is not None and len(queue) >= self.max_waiting_a_peer):
            self.refused += 1
            self._log.log("too many checks waiting: refused (429)", "from", peer)
            return None
        hashed = users.get(user)
        costs = [c for c in map(bcrypt_cost, users.values()) if c is not None]
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(peer, collections.deque()).append(
            _Check(hashed, max(costs, default=10), password.encode()[:BCRYPT_READS], answer))
        if self._worker is None:
            self._worker = asyncio.create_task(self._take_turns())
        ok = await answer  # cancelled with the request: the check is skipped, not run
        if ok and hashed is not None:
            self.good += 1
            self._remembered[self._digest(user, hashed, password)] = None
            while len(self._remembered) > REMEMBERED:
                self._remembered.popitem(last=False)
        else:
            self.wrong += 1
            self._log.log("wrong user or password (401)", "from", peer)
        return ok and hashed is not None

    async def _take_turns(self) -> None:
        """Each peer's oldest check in turn, one at a time, until none wait."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcrypt")
        loop = asyncio.get_running_loop()
        try:
            while self._queues:
                peer, queue = next(iter(self._queues.items()))
                check = queue.popleft()
                if queue:
                    self._queues.move_to_end(peer)
                else:
                    del self._queues[peer]
                if check.answer.done():  # its client went away
                    continue
                ok = await loop.run_in_executor(self._executor, self._bcrypt, check)
                if not check.answer.done():
                    check.answer.set_result(ok)
        finally:
            self._worker = None

    def _bcrypt(self, check: _Check) -> bool:
        import bcrypt  # here: the kernel tier's guests import the control plane without it

        self.checks += 1
        if check.hashed is None:
            dummy = self._dummies.get(check.dummy_cost)
            if dummy is None:
                dummy = self._dummies[check.dummy_cost] = bcrypt.gensalt(check.dummy_cost) + b"." * 31
            bcrypt.checkpw(check.password, dummy)
            return False
        try:
            return bool(bcrypt.checkpw(check.password, check.hashed))
        except ValueError:  # a hash bcrypt cannot read (the file's check is by shape only)
            self._log.log("basic_auth_users: a user's hash is not one bcrypt reads")
            return False

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        for queue in self._queues.values():
            for check in queue:
                check.answer.cancel()
        self._queues.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class PageAccess:
    """The pages listener's rules: the web config (or none), the hosts it serves, its checker."""

    def __init__(self, web_config: ReloadingWebConfig | None = None, hosts: Iterable[str] = ()) -> None:
        self.web_config = web_config
        self.hosts = frozenset(host_name(h) for h in hosts)
        self.checker = PasswordChecker()
        self.peer_auth: PeerAuth | None = None  # with peers: their signed requests are taken

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
    admin = admin_peer(request)
    if admin is False:
        return web.Response(status=403, text="the admin socket serves the control plane's own user and root\n")
    if access is None or admin:
        return await handler(request)
    if access.peer_auth is not None:
        if request.path == CHALLENGE_PATH and request.method == "GET":
            return await handler(request)  # open: a challenge is all a stranger gets (listen/peer_auth.py)
        if HEADER in request.headers:
            refused = verify_peer(request, access.peer_auth)
            if refused is not None:
                return _unauthorized(refused)
            # The user the forwarder checked, with no more rights here than this replica gives them:
            # a name its own web config holds, or the forwarder's admin socket.
            user = request.headers.get(FORWARDED_USER)
            if user is not None and (user == ADMIN_SOCKET_USER or user in access.users()):
                request[USER] = user
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
            ok = await access.checker.check(users, *credentials, peer=peer_of(request.remote))
        if ok is None:
            return web.Response(status=429, text="too many password checks under way; try again\n",
                                headers={"Retry-After": "1"})  # fmt: skip
        if not ok:
            return _unauthorized("wrong user or password\n")
        request[USER] = credentials[0]
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The web config's `http_server_config.headers`, on every answer (pages, streams, errors);
    and a peer's proof that it answered (listen/peer_auth.py), unless its route proved its body already."""
    access = request.app.get(PAGE_ACCESS)
    if (peer := request.get(PEER_REQUEST)) is not None and PROOF not in response.headers and access is not None \
            and access.peer_auth is not None:  # fmt: skip
        response.headers[PROOF] = access.peer_auth.prove(peer.challenge, response.status, None)
    if access is not None:
        for name, value in access.headers().items():
            response.headers[name] = value


def may_change_fleet(request: web.Request) -> bool:
    return from_admin_socket(request) or USER in request


class AdminSocketInUse(OSError):
    """Another process serves the admin socket's path, or something not a socket is there."""


AdminSocket = tuple[asyncio.AbstractServer, tuple[int, int]]  # its server, and its file's (st_dev, st_ino)


async def listen_admin_socket(runner: web.AppRunner, path: os.PathLike[str] | str) -> AdminSocket:
    """The admin socket: made 0600 from the start (umask around bind: a chmod after
    it leaves a moment when others may connect). A socket left at the path by a
    crash (nobody answers on it) is replaced; a live one, or anything not a
    socket, is refused. Returns the server and the socket file's identity, for
    `remove_admin_socket`."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise AdminSocketInUse(f"--admin-socket {path}: something not a socket is there; not replaced")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listens: a crash's leftover
        except OSError as e:
            raise AdminSocketInUse(f"--admin-socket {path}: cannot tell whether it is in use: {e}") from None
        else:
            raise AdminSocketInUse(f"--admin-socket {path}: another process serves it (another control plane?)")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    made = os.lstat(path)
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_unix_server(runner.server, sock=sock)
    return server, (made.st_dev, made.st_ino)


def remove_admin_socket(path: os.PathLike[str] | str, made: tuple[int, int]) -> None:
    """Unlink the socket this process made, and nothing another put there since."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == made:
            os.unlink(path)
    except OSError:
        pass
