"""Server time to render a node page: 8 GPUs, 4 engines, an hour of embedded
history at a 5 s heartbeat (720 heartbeats). Target: under 50 ms.

    PYTHONPATH=. .venv/bin/python bench/page_render.py [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiohttp.test_utils import make_mocked_request  # noqa: E402
from heartbeat_throughput import gpu_node_heartbeat  # noqa: E402

import wire  # noqa: E402
from controlplane import pages_api  # noqa: E402
from controlplane.history.backends import EmbeddedHistory  # noqa: E402
from controlplane.state.registry import NodeRegistry  # noqa: E402
from tests.test_controlplane_api import registration  # noqa: E402
from web.pages import add_pages, cluster_page, node_page  # noqa: E402


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    registry = NodeRegistry()
    history = EmbeddedHistory(interval=5)
    now = time.time()
    registry.register(wire.decode_registration(json.dumps(registration("gpu-0")).encode()))
    for i in range(720):
        hb = gpu_node_heartbeat("gpu-0")
        hb["machine"]["cpu_percent"] = {"mean": 30 + (i % 50), "p95": 60.0, "max": 90 + (i % 10)}
        for g in hb["gpus"]:
            g["utilization_percent"] = float((i * 7 + g["index"]) % 100)
        parsed = wire.parse_heartbeat(json.dumps(hb).encode())
        history.record("gpu-0", parsed, at=now - 3600 + 5 * i)
    registry.heartbeat(parsed)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history)
    for label, handler, path, info in (("node page", node_page, "/node/gpu-0", {"node": "gpu-0"}),
                                       ("cluster page (1 node)", cluster_page, "/", {})):  # fmt: skip
        times = []
        for _ in range(args.runs):
            request = make_mocked_request("GET", path, match_info=info, app=app)
            t = time.perf_counter()
            response = await handler(request)
            times.append((time.perf_counter() - t) * 1e3)
            assert response.status == 200
        print(f"{label}: {statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f}) "
              f"over {args.runs} renders, {len(response.text or '') // 1024} KiB of HTML")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
