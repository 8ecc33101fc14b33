"""A peer replica's signed requests to a test server (controlplane/listen/peer_auth.py):
a challenge asked of the server, then the request signed for it alone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from controlplane import pages_api
from controlplane.fleet import forward, peers
from controlplane.listen.page_access import FORWARDED_FOR, FORWARDED_USER, PageAccess
from controlplane.listen.peer_auth import CHALLENGE_PATH, HEADER, PROOF, PeerAuth
from controlplane.samples.live import LiveSamples
from controlplane.state.registry import NodeRegistry
from web.pages import add_pages


def replica_pages(registry: NodeRegistry, replicas: peers.Peers, hosts: Iterable[str] = (),
                  live: LiveSamples | None = None) -> web.Application:  # fmt: skip
    """A replica's pages listener as the server composes it with peers: its
    access taking their signed requests, their routes, and forwarding to
    the holder."""
    access = PageAccess(hosts=hosts)
    access.peer_auth = replicas.auth
    app = pages_api.create_app(registry, access=access, live=live)
    add_pages(app, None)
    peers.add_routes(app, replicas, lambda: pages_api.nodes_json(registry))
    app[forward.FORWARDER] = forward.Forwarder(replicas)
    app.middlewares.append(forward.to_holder)
    return app


class SignedPeer:
    def __init__(self, client: Any, secret: bytes, instance: str = "a-peer") -> None:
        self.client = client
        self.auth = PeerAuth(secret, instance)
        self.target = f"http://{client.host}:{client.port}"  # its URL as a --peer list names it

    async def challenge(self) -> str:
        r = await self.client.get(CHALLENGE_PATH)
        assert r.status == 200
        challenge: str = (await r.json())["challenge"]
        return challenge

    async def headers(self, method: str, path: str, user: str = "", viewer: str = "",
                      target: str | None = None, challenge: str | None = None) -> dict[str, str]:  # fmt: skip
        challenge = challenge or await self.challenge()
        headers = {HEADER: self.auth.sign(method, target or self.target, path, challenge, user, viewer)}
        if user:
            headers[FORWARDED_USER] = user
        if viewer:
            headers[FORWARDED_FOR] = viewer
        return headers

    async def request(self, method: str, path: str, user: str = "", viewer: str = "", **kwargs: Any) -> Any:
        """The answer, after checking that it carries the server's proof (over its body when it is a peer route's)."""
        headers = {**kwargs.pop("headers", {}), **await self.headers(method, path, user, viewer)}
        challenge = headers[HEADER].split("challenge=")[1].split(";")[0]
        r = await self.client.request(method, path, headers=headers, **kwargs)
        body = await r.read()
        assert self.auth.proven(r.headers.get(PROOF), challenge, r.status, body) or self.auth.proven(
            r.headers.get(PROOF), challenge, r.status, None), f"no proof on {method} {path}: {r.status}"
        return r
