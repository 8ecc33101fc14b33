"""Hundreds of nodes heartbeating to control-plane replicas as agents do:
each node's replica chosen by the agent's own ReplicaChoice
(sampler/agent/replicas.py), a window sent to the next replica at once when
its replica does not answer, and back up its order when its wait is over.
A node's figures are the least the wire takes: the tests read where a node
is held and whether any of its windows was lost, not what it measured."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import aiohttp

from controlplane.ingest import tokens
from sampler.agent.replicas import ReplicaChoice
from sampler.agent.run import return_every_s

REGIONS = ("eu-west-1", "us-east-2", "ap-southeast-2", "sa-east-1")


def cloud_names(count: int) -> list[str]:
    """Names as EC2, GKE and AKS give them, 40 to 64 bytes."""
    names = []
    for i in range(count):
        a, b, c = (i >> 16) & 255, (i >> 8) & 255, i & 255
        kind = i % 3
        if kind == 0:
            name = f"ip-10-{100 + a}-{b}-{c}.{REGIONS[i % 4]}.compute.internal"
        elif kind == 1:
            name = f"gke-prod-inference-h100-pool-{i:08x}-{(i * 2654435761) % 10**6:06d}"
        else:
            name = f"aks-gpunodepool-{i:08d}-vmss{i:06x}.inference-westeurope-prod.internal"[:64]
        names.append(name)
    return names


class SimulatedFleet:
    def __init__(self, replicas: list[str], secret: bytes, nodes: int, interval: float) -> None:
        self.replicas, self.secret, self.interval = replicas, secret, interval
        self.nodes = [f"sim-{i:04d}" for i in range(nodes)]
        self.delivered: Counter[str] = Counter()  # windows each node's replicas took
        self.lost: Counter[str] = Counter()  # windows no replica took
        self.refused: Counter[str] = Counter()  # 4xx but 404, by answer: the same at any replica, not a reason to move
        self.held_by: dict[str, str] = {}  # the replica that took each node's last window
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(self._node(session, node, i)) for i, node in enumerate(self.nodes)]
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _node(self, session: aiohttp.ClientSession, node: str, index: int) -> None:
        headers = {"Authorization": f"Bearer {tokens.node_token(self.secret, node)}"}
        choice = ReplicaChoice(node, self.replicas, return_every_s(self.interval))
        registered: str | None = None
        # The fleet's windows spread over the interval, as agents' clocks are.
        start = time.time() + self.interval * index / len(self.nodes)
        for seq in range(1, 1 << 30):
            await asyncio.sleep(max(0.0, start + seq * self.interval - time.time()))
            if choice.worth_trying_back():
                choice.back_to_first()
            end = time.time()
            body = {"node": node, "seq": seq, "backend": "proc",
                    "window": {"start": end - self.interval, "end": end, "samples": 10},
                    "machine": {"cpus": 8}}  # fmt: skip
            for _ in range(2 * len(self.replicas)):  # each replica at most twice: then the window is lost
                url = choice.url
                try:
                    if registered != url:
                        async with session.post(f"{url}/v1/register", headers=headers,
                                                json={"node": node, "backend": "proc", "cpus": 8}) as r:  # fmt: skip
                            if r.status >= 500:
                                raise aiohttp.ClientError(f"HTTP {r.status}")
                            if r.status != 200:
                                self.refused[f"register: {r.status} {await r.text()}"] += 1
                                break
                        registered = url
                    async with session.post(f"{url}/v1/heartbeat", headers=headers, json=body) as r:
                        if r.status == 404:  # it does not know the node (it restarted): register there again
                            registered = None
                            continue
                        if r.status >= 500:
                            raise aiohttp.ClientError(f"HTTP {r.status}")
                        if r.status != 200:
                            self.refused[f"heartbeat: {r.status} {await r.text()}"] += 1
                            break
                    choice.taken()
                    self.delivered[node] += 1
                    self.held_by[node] = url
                    break
                except (aiohttp.ClientError, TimeoutError, OSError):
                    registered = None
                    choice.failed()  # the next in its order, at once (or the first again, none left)
            else:
                self.lost[node] += 1
