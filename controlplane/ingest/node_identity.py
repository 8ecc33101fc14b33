"""Who is speaking: the node a bearer token may speak for.

Two kinds of token, each optional, both accepted side by side:
- HMAC node tokens (`nodesampler token`), derived from the cluster secret:
  systemd and bare-metal nodes;
- Kubernetes projected service-account tokens (JWTs), verified offline
  against the cluster's service-account issuer keys (JWKS): the agent pod's
  own identity, so no per-node secret is made or distributed.

A JWT is accepted only if its signature verifies against a key of the JWKS,
its `iss` and `aud` are ours, it is within `nbf`/`exp` (with a small leeway),
its subject is the agent's own service account (any pod may ask for a token
of any audience for its own account), and it names a node
(`kubernetes.io.node.name`, projected tokens since Kubernetes 1.30). A token
that names no node is refused: the cluster is older than 1.30, and HMAC
tokens are the way there.

Refusals: `Unauthenticated` (401: nobody we know), and a token that names no
node is `Forbidden` (403: the agent's account, but for no node). A token for
another node than the body's is the caller's 403, as for HMAC tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt

import wire
from controlplane.ingest import tokens
from controlplane.listen.bodies import TooLarge, answer_body

log = logging.getLogger(__name__)

MAX_JWKS_BYTES = 2**20  # an issuer's keys: a few KiB; the API server's answer is read whole within this

LEEWAY_S = 30  # clock skew between the kubelet that minted a token and us
REFETCH_EVERY_S = 60.0  # an unknown key id fetches the JWKS again, at most this often
REREAD_EVERY_S = 300.0  # and the keys are read again this often: a key the issuer withdrew stops verifying
CACHE_MAX = 65536  # verified tokens kept; a fleet rotates each about hourly
# Where Kubernetes mounts a pod's own service-account credentials.
POD_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Unauthenticated(Exception):
    """401: the token proves no identity we accept."""


class Forbidden(Exception):
    """403: a known identity that may not speak for any node."""


def looks_like_jwt(token: str) -> bool:
    # A JWT's header is base64url JSON, so it starts '{"' -> "eyJ". An HMAC
    # token is NODE.HEX: one dot-separated part fewer than a JWT only when the
    # node name has no dot, hence the header check too.
    return token.count(".") == 2 and token.startswith("eyJ")


def parse_service_account(text: str) -> tuple[str, str]:
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name or ":" in text:
        raise ValueError(f"{text!r}: expected NAMESPACE/NAME")
    return namespace, name


class JwksSource:
    """The issuer's public keys, from a file or a URL, fetched at start,
    again when a token names a key id we do not have (rate-limited), so a
    rotated issuer key is picked up without a restart, and every
    `REREAD_EVERY_S` as tokens come, so a key the cluster withdrew stops
    verifying (and the tokens it signed are forgotten) within minutes.

    A URL is fetched with this pod's own service-account token and the
    cluster's CA when they are mounted (the API server's
    `/openid/v1/jwks` requires both), else with the system's CAs."""

    def __init__(self, location: str, sa_dir: Path = POD_SA_DIR, clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[], Awaitable[bytes]] | None = None) -> None:  # fmt: skip
        self.location = location
        self._sa_dir = sa_dir
        self._clock = clock
        self._fetch = fetch or (self._fetch_url if location.startswith(("http://", "https://")) else self._read_file)
        self._keys: dict[str, jwt.PyJWK] = {}
        self._last_try: float | None = None
        self._read_at: float | None = None  # the last fetch that gave keys
        self._rereading: asyncio.Task[bool] | None = None
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None  # one for the process's life, made on first use

    async def _read_file(self) -> bytes:
        return Path(self.location).read_bytes()

    async def _fetch_url(self) -> bytes:
        headers = {}
        sa_token = self._sa_dir / "token"
        if sa_token.exists():
            headers["Authorization"] = f"Bearer {sa_token.read_text().strip()}"
        ca = self._sa_dir / "ca.crt"
        context = ssl.create_default_context(cafile=str(ca) if ca.exists() else None)  # re-read: it may rotate
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        async with self._session.get(self.location, headers=headers, ssl=context) as r:
            if r.status != 200:
                raise OSError(f"HTTP {r.status}")
            try:
                return await answer_body(r, MAX_JWKS_BYTES)
            except TooLarge as e:
                raise OSError(str(e)) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def parse(data: bytes) -> dict[str, jwt.PyJWK]:
        """The signing keys of a JWKS document, by key id. Keys that are not
        for signatures, or of a type this library cannot use, are left out."""
        try:
            doc = json.loads(data)
            keys = doc["keys"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a JWKS document: {e}") from None
        if not isinstance(keys, list):
            raise ValueError("not a JWKS document: 'keys' is not a list")
        out: dict[str, jwt.PyJWK] = {}
        for k in keys:
            if not isinstance(k, dict) or k.get("use", "sig") != "sig" or not isinstance(k.get("kid"), str):
                continue
            try:
                out[k["kid"]] = jwt.PyJWK(k)
            except jwt.PyJWTError as e:
                log.warning("JWKS key %r left out: %s", k.get("kid"), e)
        return out

    async def refresh(self) -> bool:
        """Fetch the keys if the last try is long enough ago; True if fetched."""
        async with self._lock:
            now = self._clock()
            if self._last_try is not None and now - self._last_try < REFETCH_EVERY_S:
                return False
            self._last_try = now
            try:
                keys = self.parse(await self._fetch())
            except (OSError, ValueError, aiohttp.ClientError, TimeoutError) as e:
                log.error("service-account issuer keys from %s not read, keeping %d: %s",
                          self.location, len(self._keys), e)  # fmt: skip
                return False
            if not keys:
                log.error("service-account issuer keys from %s: no signing key, keeping %d",
                          self.location, len(self._keys))  # fmt: skip
                return False
            if keys.keys() != self._keys.keys():
                log.info("service-account issuer keys from %s: %s", self.location, ", ".join(sorted(keys)))
            self._keys = keys
            self._read_at = now
            return True

    def reread_if_due(self) -> None:
        """Start a re-read in the background when one is due: no request
        waits for the issuer (a slow API server would hold every heartbeat)."""
        due = self._read_at is not None and self._clock() - self._read_at >= REREAD_EVERY_S
        if due and (self._rereading is None or self._rereading.done()):
            self._rereading = asyncio.get_running_loop().create_task(self.refresh())

    def has(self, kid: str) -> bool:
        return kid in self._keys

    async def key(self, kid: str) -> jwt.PyJWK | None:
        if kid not in self._keys:
            await self.refresh()
        return self._keys.get(kid)


@dataclass(frozen=True)
class ServiceAccountRules:
    issuer: str
    audience: str = "nodesampler"
    namespace: str = "nodesampler"
    name: str = "nodesampler-agent"

    @property
    def subject(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


class ServiceAccountVerifier:
    """Projected service-account tokens -> the node they were minted on."""

    def __init__(self, keys: JwksSource, rules: ServiceAccountRules, clock: Callable[[], float] = time.time) -> None:
        self.keys, self.rules, self._clock = keys, rules, clock
        self._verified: dict[str, tuple[str, float, str]] = {}  # token -> (node, exp, key id)

    def _remember(self, token: str, node: str, exp: float, kid: str) -> None:
        if len(self._verified) >= CACHE_MAX:
            now = self._clock()
            self._verified = {t: v for t, v in self._verified.items() if v[1] + LEEWAY_S > now}
            if len(self._verified) >= CACHE_MAX:
                self._verified.clear()
        self._verified[token] = (node, exp, kid)

    async def node(self, token: str) -> str:
        self.keys.reread_if_due()
        cached = self._verified.get(token)
        if cached is not None:
            if cached[1] + LEEWAY_S > self._clock() and self.keys.has(cached[2]):
                return cached[0]
            del self._verified[token]  # expired, or its key withdrawn: verified again (and refused)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"malformed token: {e}") from None
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise Unauthenticated("token names no key id")
        key = await self.keys.key(kid)
        if key is None:
            raise Unauthenticated(f"token signed by an unknown key {kid[:64]!r}")
        claims = self._decode(token, key)
        node = self._node_claim(claims)
        self._remember(token, node, float(claims["exp"]), kid)
        return node

    def _decode(self, token: str, key: jwt.PyJWK) -> dict[str, Any]:
        r = self.rules
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=[key.algorithm_name], audience=r.audience, issuer=r.issuer,
                leeway=LEEWAY_S, options={"require": ["exp", "iss", "aud", "sub"]},
            )  # fmt: skip
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"token refused: {e}") from None
        ident = claims.get("kubernetes.io")
        if not isinstance(ident, dict):
            ident = {}
        sa = ident.get("serviceaccount")
        if (claims["sub"] != r.subject or not isinstance(sa, dict) or ident.get("namespace") != r.namespace
                or sa.get("name") != r.name):  # fmt: skip
            raise Unauthenticated(f"token is not for service account {r.namespace}/{r.name}")
        return claims

    @staticmethod
    def _node_claim(claims: dict[str, Any]) -> str:
        node = claims["kubernetes.io"].get("node")
        name = node.get("name") if isinstance(node, dict) else None
        if not isinstance(name, str):
            raise Forbidden("token names no node (a projected token from Kubernetes before 1.30?): "
                            "use an HMAC node token there")  # fmt: skip
        if not wire.NODE_ID.fullmatch(name):
            raise Forbidden(f"token's node {name[:64]!r} is not a node name")
        return name


class NodeAuthenticator:
    """Either kind of token -> the node it speaks for."""

    def __init__(self, secret: bytes | None = None, service_accounts: ServiceAccountVerifier | None = None) -> None:
        if secret is None and service_accounts is None:
            raise ValueError("a cluster secret, service-account verification, or both are needed")
        self.secret, self.service_accounts = secret, service_accounts
        # HMAC tokens that verified, by token: a node's token is the same at every
        # heartbeat, and recomputing its MAC took 3% of the control plane's time
        # under a heartbeat flood. Only a verified token is kept (one a node, so
        # the fleet's size bounds it); an invalid one is computed every time.
        self._hmac_verified: dict[str, str] = {}

    MAX_REMEMBERED = 100_000

    async def node(self, token: str) -> str:
        # HMAC first: a microsecond, and a node name may itself start like a JWT.
        if self.secret is not None:
            if (node := self._hmac_verified.get(token)) is not None:
                return node
            if (node := tokens.verify(self.secret, token)) is not None:
                if len(self._hmac_verified) >= self.MAX_REMEMBERED:
                    self._hmac_verified.clear()
                self._hmac_verified[token] = node
                return node
        if self.service_accounts is not None and looks_like_jwt(token):
            return await self.service_accounts.node(token)
        raise Unauthenticated("invalid token")
