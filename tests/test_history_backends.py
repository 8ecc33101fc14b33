"""One chart spec, two backends: the embedded history and a real Prometheus
(started by the test, scraping the control plane's /metrics) give the same
series for the same heartbeats."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

import wire
from controlplane import pages_api
from controlplane.history.backends import ChartSpec, EmbeddedHistory, PrometheusHistory, Series
from controlplane.state.registry import NodeRegistry
from tests.conftest import free_port
from web.pages import add_pages

pytestmark = pytest.mark.live

SPECS = [
    ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "n1"),)),
    ChartSpec("llmgw_shard_cpu_cores", (("node", "n1"),), ("model",)),
    ChartSpec("llmgw_gpu_utilization_percent", (("node", "n1"),), ("gpu",), "max"),
]


def start_prometheus(tmp_path: Path, name: str, target_port: int,
                     scrape_s: int = 1) -> tuple[subprocess.Popen[bytes], int]:  # fmt: skip
    """A real Prometheus scraping 127.0.0.1:target_port every scrape_s; and its port."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus missing: make setup installs Debian's prometheus")
    port = free_port()
    config = tmp_path / f"prometheus-{name}.yml"
    config.write_text(f"global: {{scrape_interval: {scrape_s}s}}\nscrape_configs:\n  - job_name: {name}\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n")  # fmt: skip
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / name}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return prom, port


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
    registry = NodeRegistry(stale_after=3600)
    history = EmbeddedHistory(interval=1)
    runner = web.AppRunner(pages_api.create_app(registry, history=history))
    await runner.setup()
    pages_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", pages_port).start()
    prom, prom_port = start_prometheus(tmp_path, "cp", pages_port)
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

            registry.register(wire.decode_registration(json.dumps({"node": "n1"}).encode()))
            start = time.time()
            for seq, level in enumerate([10.0, 40.0, 25.0, 80.0], 1):
                state = registry.heartbeat(wire.decode_heartbeat(json.dumps(heartbeat(seq, level)).encode()).heartbeat)
                assert state.received is not None
                history.record("n1", state.received)
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


def _gpu_heartbeat(seq: int) -> dict[str, Any]:
    body = heartbeat(seq, 20.0 + (seq % 7) * 10)
    for g in body["gpus"]:
        g.update(uuid=f"GPU-{g['index']}", memory_used_bytes=2**30 * (1 + seq % 5), memory_total_bytes=2**34)
    return body


def _chart_paths(page: str) -> list[str]:
    return re.findall(r'<path d="([^"]*)"', page)


async def test_pages_from_prometheus_draw_lines_at_5_and_15_s_scrapes(tmp_path: Path) -> None:
    """A real Prometheus scraping the control plane every 5 s, and another every
    15 s; the pages drawn from each: every chart with data draws line segments,
    and in a real browser the lines have length (screenshots kept)."""
    registry = NodeRegistry(stale_after=3600)
    source = web.AppRunner(pages_api.create_app(registry))
    await source.setup()
    metrics_port = free_port()
    await web.TCPSite(source, "127.0.0.1", metrics_port).start()
    proms: dict[int, tuple[subprocess.Popen[bytes], int]] = {}
    runners = [source]
    try:
        for scrape in (5, 15):
            proms[scrape] = start_prometheus(tmp_path, f"cp{scrape}", metrics_port, scrape)
        registry.register(wire.decode_registration(json.dumps(
            {"node": "n1", "gpus": [{"index": 0, "uuid": "GPU-0", "name": "H200"}]}).encode()))  # fmt: skip
        pages: dict[int, int] = {}
        for scrape, (_, prom_port) in proms.items():
            app = pages_api.create_app(registry)
            add_pages(app, None, f"http://127.0.0.1:{prom_port}")
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            pages[scrape] = free_port()
            await web.TCPSite(runner, "127.0.0.1", pages[scrape]).start()
        async with aiohttp.ClientSession() as session:

            async def samples(prom_port: int) -> int:
                query = 'count_over_time(llmgw_node_cpu_utilization_percent{node="n1"}[10m])'
                try:
                    async with session.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": query}) as r:
                        result = (await r.json())["data"]["result"]
                except (aiohttp.ClientError, KeyError):
                    return 0
                return int(float(result[0]["value"][1])) if result else 0

            seq, deadline = 0, time.monotonic() + 120
            # Heartbeats every second until each Prometheus has four scrapes of them.
            while min([await samples(p) for _, p in proms.values()]) < 4:
                assert time.monotonic() < deadline, "Prometheus did not scrape four times"
                seq += 1
                registry.heartbeat(wire.decode_heartbeat(json.dumps(_gpu_heartbeat(seq)).encode()).heartbeat)
                await asyncio.sleep(1.0)
            for scrape, port in pages.items():
                for path in ("/node/n1", "/"):
                    async with session.get(f"http://127.0.0.1:{port}{path}") as r:
                        assert r.status == 200
                        page = await r.text()
                    paths = _chart_paths(page)
                    assert paths, (scrape, path)
                    assert all(" L" in d for d in paths), (scrape, path, [d[:80] for d in paths if " L" not in d])
        await asyncio.to_thread(_lines_have_length, pages)
    finally:
        for prom, _ in proms.values():
            prom.kill()
            prom.wait()
        for runner in runners:
            await runner.cleanup()


def _lines_have_length(pages: dict[int, int]) -> None:
    from playwright.sync_api import sync_playwright

    from tests.test_browser import ARTIFACTS, CHROMIUM_ARGS, open_page

    chromium = shutil.which("chromium")
    assert chromium is not None, "chromium missing: make setup installs Debian's chromium"
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            for scrape, port in pages.items():
                open_page(page, f"http://127.0.0.1:{port}/node/n1")
                lengths = page.evaluate("[...document.querySelectorAll('svg.chart path')].map(p => p.getTotalLength())")
                assert lengths and all(n > 0 for n in lengths), (scrape, lengths)
                page.screenshot(path=str(ARTIFACTS / f"node-page-prometheus-{scrape}s.png"), full_page=True)
        finally:
            browser.close()


ROUTER = """\
# HELP llmgw_endpoint_waiting Requests the router holds for an endpoint.
# TYPE llmgw_endpoint_waiting gauge
llmgw_endpoint_waiting{replica="r.1"} 3
llmgw_endpoint_waiting{replica="r+2"} 5
llmgw_endpoint_waiting{replica="rx1"} 9
llmgw_endpoint_waiting{replica="elsewhere"} 1
"""


def legend(page: str, caption: str) -> list[str]:
    figure = re.search(rf"<figcaption>{re.escape(caption)}[^<]*</figcaption>.*?<div class=\"legend\">(.*?)</div>",
                       page, re.S)  # fmt: skip
    assert figure is not None, caption
    return re.findall(r"</i>([^<]*)</span>", figure.group(1))


async def test_the_router_queue_chart_holds_the_replicas_on_this_node(tmp_path: Path) -> None:
    """The seed's queue chart: the router's llmgw_endpoint_waiting for the
    replicas on this node now, their ids quoted for the regex (`r.1` must
    not bring `rx1`, `r+2` must match itself)."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=ROUTER, content_type="text/plain")

    router = web.Application()
    router.router.add_get("/metrics", metrics)
    router_runner = web.AppRunner(router)
    await router_runner.setup()
    router_port, pages_port = free_port(), free_port()
    await web.TCPSite(router_runner, "127.0.0.1", router_port).start()
    prom, prom_port = start_prometheus(tmp_path, "router", router_port)
    registry = NodeRegistry(stale_after=3600)
    for node, replicas in (("n1", ["r.1", "r+2"]), ("n2", ["rx1"])):
        registry.register(wire.decode_registration(json.dumps({"node": node}).encode()))
        shards = [{"id": f"s{i}", "replica": r, "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}}
                  for i, r in enumerate(replicas)]  # fmt: skip
        body = {"node": node, "seq": 1, "backend": "bpf", "window": {"start": 1.0, "end": 2.0, "samples": 10},
                "machine": {}, "shards": shards}  # fmt: skip
        registry.heartbeat(wire.decode_heartbeat(json.dumps(body).encode()).heartbeat)
    base = f"http://127.0.0.1:{prom_port}"
    pages = pages_api.create_app(registry)
    add_pages(pages, None, base)
    pages_runner = web.AppRunner(pages)
    await pages_runner.setup()
    await web.TCPSite(pages_runner, "127.0.0.1", pages_port).start()
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:  # Prometheus has scraped the router: go on
                try:
                    async with session.get(f"{base}/api/v1/query", params={"query": "llmgw_endpoint_waiting"}) as r:
                        if len((await r.json())["data"]["result"]) == 4:
                            break
                except (aiohttp.ClientError, KeyError, ValueError):
                    pass
                assert time.monotonic() < deadline, "Prometheus never scraped the router"
                await asyncio.sleep(0.2)
            async with session.get(f"http://127.0.0.1:{pages_port}/node/n1") as r:
                page = await r.text()
            assert legend(page, "Requests waiting") == ["router r+2", "router r.1"]
            async with session.get(f"http://127.0.0.1:{pages_port}/node/n2") as r:
                assert legend(await r.text(), "Requests waiting") == ["router rx1"]
            # The page's hour at its step (a span the step does not divide) ends
            # at `now`: the scrape just taken is on the chart, not a step later.
            now = time.time()
            spec = ChartSpec("llmgw_endpoint_waiting", (), ("replica",))
            series = await PrometheusHistory(base, session).query(spec, now - 3600, now, 3600 / 496)
            assert [s.label for s in series] == ["elsewhere", "r+2", "r.1", "rx1"]
            assert [s.t[-1] for s in series] == pytest.approx([math.floor(now * 1000) / 1000] * 4, abs=1e-4)
    finally:
        prom.kill()
        prom.wait()
        await pages_runner.cleanup()
        await router_runner.cleanup()
