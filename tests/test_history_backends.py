"""One chart spec, two backends: the embedded history and a real Prometheus
(started by the test, scraping the control plane's /metrics) give the same
series for the same heartbeats."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from controlplane import pages_api
from controlplane.history import ChartSpec, EmbeddedHistory, PrometheusHistory, Series
from controlplane.registry import NodeRegistry
from nodesampler import wire
from tests.test_agent_processes import free_port

pytestmark = pytest.mark.live

SPECS = [
    ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "n1"),)),
    ChartSpec("llmgw_shard_cpu_cores", (("node", "n1"),), ("model",)),
    ChartSpec("llmgw_gpu_utilization_percent", (("node", "n1"),), ("gpu",), "max"),
]


def heartbeat(seq: int, level: float) -> dict[str, Any]:
    return {"node": "n1", "seq": seq, "backend": "bpf", "window": {"start": 1.0, "end": 2.0, "samples": 10},
            "machine": {"cpus": 8, "cpu_percent": {"mean": level, "p95": level, "max": level}},
            "shards": [{"id": "a", "model": "m1", "cpu_cores": {"mean": level / 10, "p95": 1.0, "max": 1.0}},
                       {"id": "b", "model": "m1", "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}},
                       {"id": "c", "model": "m2", "cpu_cores": {"mean": level / 20, "p95": 1.0, "max": 1.0}}],
            "gpus": [{"index": 0, "name": "H200", "utilization_percent": level},
                     {"index": 1, "name": "H200", "utilization_percent": 100 - level}]}  # fmt: skip


def runs(series: Series) -> list[float]:
    """The successive distinct values: what both backends must agree on (Prometheus
    repeats a value at every step until the next scrape changes it)."""
    v = series.v[~np.isnan(series.v)].round(6).tolist()
    return [x for i, x in enumerate(v) if i == 0 or x != v[i - 1]]


async def test_embedded_and_prometheus_give_the_same_series(tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus missing: make setup installs Debian's prometheus")
    registry = NodeRegistry(stale_after=3600)
    history = EmbeddedHistory(interval=1)
    runner = web.AppRunner(pages_api.create_app(registry, history=history))
    await runner.setup()
    pages_port, prom_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", pages_port).start()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: cp\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{pages_port}']}}]\n")  # fmt: skip
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{prom_port}"

            async def scraped(level: float) -> bool:
                params = {"query": 'llmgw_node_cpu_utilization_percent{node="n1"}'}
                try:
                    async with session.get(f"{base}/api/v1/query", params=params) as r:
                        result = (await r.json())["data"]["result"]
                except (aiohttp.ClientError, KeyError):
                    return False
                return bool(result) and float(result[0]["value"][1]) == level

            registry.register(wire.parse_registration(json.dumps({"node": "n1"}).encode()))
            start = time.time()
            for seq, level in enumerate([10.0, 40.0, 25.0, 80.0], 1):
                hb = wire.parse_heartbeat(json.dumps(heartbeat(seq, level)).encode())
                registry.heartbeat(hb)
                history.record("n1", hb)
                deadline = time.monotonic() + 60
                while not await scraped(level):  # Prometheus has this heartbeat: go on
                    assert time.monotonic() < deadline, "Prometheus never scraped the control plane"
                    await asyncio.sleep(0.2)
            end = time.time() + 1
            prometheus = PrometheusHistory(base, session)
            for spec in SPECS:
                embedded = await history.query(spec, start - 1, end, 1.0)
                remote = await prometheus.query(spec, start - 1, end, 0.5)
                assert [s.label for s in embedded] == [s.label for s in remote], spec
                for e, p in zip(embedded, remote, strict=True):
                    assert runs(e) == runs(p), (spec, e.label)
                assert embedded, spec
    finally:
        prom.kill()
        prom.wait()
        await runner.cleanup()
