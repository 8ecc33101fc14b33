"""A kubelet's `/pods` for tests: aiohttp over TLS on a thread of its own,
checking the bearer token as a kubelet does, serving PodList documents
shaped like the real API's (what `kubectl get --raw /api/v1/nodes/N/proxy/pods`
prints), or failing as told."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509

from tests.certs import TestCA
from tests.conftest import free_port

TOKEN = "kubelet-test-token"


def pod_doc(namespace: str, name: str, containers: dict[str, str], labels: dict[str, str] | None = None,
            phase: str = "Running", runtime: str = "containerd", ip: str | None = "10.244.1.7",
            uid: str | None = None, **meta: Any) -> dict[str, Any]:  # fmt: skip
    """One pod as the kubelet reports it; `containers` maps names to running ids ("" for not started)."""
    statuses = []
    for cname, cid in containers.items():
        status: dict[str, Any] = {"name": cname, "image": "vllm/vllm-openai:v0.6", "ready": bool(cid),
                                  "restartCount": 0, "state": {"running": {}} if cid else {"waiting": {}}}  # fmt: skip
        if cid:
            status["containerID"] = f"{runtime}://{cid}"
        statuses.append(status)
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{namespace}-{name}",
                     "labels": labels or {}, **meta},  # fmt: skip
        "spec": {"nodeName": "n1", "containers": [{"name": c} for c in containers]},
        "status": {"phase": phase, "podIP": ip, "containerStatuses": statuses},
    }


class FakeKubelet:
    def __init__(self, tmp: Path, subject: x509.Name | None = None, ca: TestCA | None = None,
                 port: int | None = None, token: str = TOKEN) -> None:  # fmt: skip
        """`subject`: its certificate's (the cluster's kubelet-serving kind:
        `certs.kubelet_serving_name`); default, named after its address.
        `ca`: who signs it (the cluster's); default, a CA of its own."""
        self.port = port or free_port()
        self.ca = ca or TestCA("kubelet test CA")
        self.ca_file = self.ca.write_ca(tmp / "kubelet-ca.crt")
        self.ca.issue(tmp / "kubelet.crt", tmp / "kubelet.key", ["127.0.0.1"], subject)
        self.token = token
        self.token_file = tmp / "token"
        self.token_file.write_text(token + "\n")
        self.pods: list[dict[str, Any]] = []
        self.mode = "ok"  # "ok", "error" (500), "slow" (never answers in time), "garbage"
        self.requests = 0
        self.refused = 0  # requests without the right token
        self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls.load_cert_chain(tmp / "kubelet.crt", tmp / "kubelet.key")
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.refused += 1
            return web.Response(status=401, text="Unauthorized")
        if self.mode == "error":
            return web.Response(status=500, text="internal error")
        if self.mode == "slow":
            await self.release.wait()
        if self.mode == "garbage":
            return web.Response(body=b'{"kind": "Status", "items": 3}', content_type="application/json")
        doc = {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": self.pods}
        return web.Response(body=json.dumps(doc).encode(), content_type="application/json")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/pods", self._pods)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=self._tls).start())
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
