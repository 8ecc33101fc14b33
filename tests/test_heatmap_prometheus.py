"""The fleet's picture with `--prometheus` (controlplane/history/heatmap_prometheus.py):
a real Prometheus holding an hour of a fleet's figures (backfilled with
promtool, as if it had scraped the control plane every heartbeat) draws the
picture the embedded history draws from the same heartbeats: the same rows,
groups, colours and worst nodes, banded or not; and the page serves it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from controlplane import pages_api
from controlplane.history.backends import EmbeddedHistory, PrometheusHistory
from controlplane.history.heatmap import ABSENT, LEVELS, MAX_ROWS, MEASURES, Heatmap, column_end, heatmap, own_part
from controlplane.history.heatmap_prometheus import prometheus_heatmap
from controlplane.listen.page_worker import PageWorker
from tests.conftest import free_port
from tests.heatmap_fleet import fleet_with_history, node_name, openmetrics
from tests.test_heatmap import decode_png
from web.pages import add_pages

pytestmark = pytest.mark.live

INTERVAL = 15.0  # a heartbeat a column: the picture from Prometheus has a column a 15 s scrape


@contextlib.asynccontextmanager
async def prometheus_with(tmp_path: Path, metrics: str) -> AsyncIterator[str]:
    """A real Prometheus whose storage holds `metrics` (OpenMetrics, backfilled); its base URL."""
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing: make setup installs Debian's prometheus")
    (tmp_path / "fleet.om").write_text(metrics)
    data = tmp_path / "tsdb"
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "fleet.om"), str(data)],
                   check=True, capture_output=True)  # fmt: skip
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {}\n")
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:  # /-/ready answers 200 once the storage (the backfilled blocks) is open
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{base}/-/ready") as r:
                        if r.status == 200:
                            break
                assert prom.poll() is None and time.monotonic() < deadline, "prometheus did not become ready"
                await asyncio.sleep(0.2)
        yield base
    finally:
        prom.kill()
        prom.wait()


def fleet(nodes: int, bursts: dict[str, int]) -> tuple[EmbeddedHistory, float, str]:
    """The embedded history of `nodes` nodes' hour, the picture's end, and
    the same figures as Prometheus would hold them. Each heartbeat is in
    the middle of its column (Prometheus 2's ranges hold both their ends)."""
    end = column_end(time.time(), INTERVAL)
    now = end - INTERVAL / 2
    _, history, _ = fleet_with_history(nodes, 240, bursts, interval=INTERVAL, now=now, varied=True)
    return history, end, openmetrics(nodes, 240, bursts, INTERVAL, now, varied=True)


def assert_same_picture(embedded: Heatmap, drawn: Heatmap, history: EmbeddedHistory) -> None:
    """The same rows, groups and colours; each cell's worst node the one the
    embedded picture names, or one as bad (a tie within a band)."""
    assert (drawn.start, drawn.step, drawn.columns, drawn.nodes) == (
        embedded.start, embedded.step, embedded.columns, embedded.nodes)  # fmt: skip
    assert [(r.group, r.nodes) for r in drawn.rows] == [(r.group, r.nodes) for r in embedded.rows]
    part = own_part(history, drawn.measure, embedded.start + 3600, embedded.columns)
    level_of = {n: part.levels[i] for i, n in enumerate(part.names)}
    for mine, theirs in zip(drawn.rows, embedded.rows, strict=True):
        differ = np.flatnonzero(mine.levels != theirs.levels)
        assert not differ.size, (mine.nodes, differ, mine.levels[differ], theirs.levels[differ])
        assert ((mine.worst < 0) == (theirs.worst < 0)).all()
        for column in np.flatnonzero(mine.worst >= 0):
            assert level_of[mine.nodes[mine.worst[column]]][column] == mine.levels[column]


@pytest.mark.parametrize("nodes", [30, 3 * MAX_ROWS // 2], ids=["a-row-a-node", "banded"])
async def test_prometheus_draws_the_embedded_history_s_picture(tmp_path: Path, nodes: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """30 nodes (a row each) and 300 (bands of two, a query a band), a third
    on H100s, a third on A100s: from Prometheus, every measure's picture is
    the embedded one, the burst on one node the top colour in its cell and
    named there; the CPU nodes a grey group of their own in the GPU's
    picture, asked nothing."""
    burst = node_name(nodes // 3)  # on an A100
    history, end, metrics = fleet(nodes, {burst: 17})
    async with prometheus_with(tmp_path, metrics) as base, aiohttp.ClientSession() as session:
        prometheus, worker = PrometheusHistory(base, session), PageWorker()
        asked: list[str] = []
        ask = prometheus.ask

        async def counted(path: str, form: dict[str, str], most: int) -> bytes:
            asked.append(path)
            return await ask(path, form, most)

        monkeypatch.setattr(prometheus, "ask", counted)
        try:
            for key in ("cpu", "gpu"):
                measure = MEASURES[key]
                embedded = heatmap(history, measure, end, INTERVAL)
                asked.clear()
                drawn = await prometheus_heatmap(prometheus, worker, measure, end, embedded.columns)
                asked_bands = len({tuple(r.nodes) for r in embedded.rows if (r.levels != ABSENT).any()})
                assert asked.count("query") == 3
                assert asked.count("query_range") == (1 if nodes <= MAX_ROWS else asked_bands)
                assert_same_picture(embedded, drawn, history)
                [row] = [r for r in drawn.rows if burst in r.nodes]
                column = drawn.columns - 1 - 17
                assert row.levels[column] == (LEVELS - 1 if key == "cpu" else round((LEVELS - 1) / 2))
                assert row.nodes[row.worst[column]] == burst
            cpu_nodes = [r for r in drawn.rows if r.group == "CPU nodes"]
            assert cpu_nodes and all((r.levels == ABSENT).all() and (r.worst == -1).all() for r in cpu_nodes)
        finally:
            worker.close()


async def test_the_page_serves_prometheus_picture_and_a_cell_opens_its_node(tmp_path: Path,
                                                                            aiohttp_client: Any) -> None:  # fmt: skip
    """With --prometheus the cluster page draws the picture, its image is the
    one Prometheus' answers make, and a click on the burst's cell opens that
    node at that moment."""
    burst = node_name(7)
    history, end, metrics = fleet(40, {burst: 5})
    async with prometheus_with(tmp_path, metrics) as base:
        registry, _, _ = fleet_with_history(40, 1, interval=INTERVAL)
        app = pages_api.create_app(registry, history=history)
        add_pages(app, None, prometheus_url=base)
        client = await aiohttp_client(app)
        page = await (await client.get("/")).text()
        assert '<img class="heatmap"' in page and "40 nodes" in page and "a column per 15 s of Prometheus" in page
        r = await client.get(f"/heatmap.png?measure=cpu&end={end:.3f}")
        assert r.status == 200
        width, height, _, pixels = decode_png(await r.read())
        embedded = heatmap(history, MEASURES["cpu"], end, INTERVAL)
        assert (width, height) == (embedded.columns, len(embedded.rows))
        [row] = [i for i, rw in enumerate(embedded.rows) if burst in rw.nodes]
        column = embedded.columns - 1 - 5
        assert pixels[row, column] == LEVELS - 1
        cell = await client.get(f"/heatmap/cell?measure=cpu&end={end:.3f}&row={row}&column={column}",
                                allow_redirects=False)  # fmt: skip
        assert cell.status == 303
        at = float(cell.headers["Location"].split("at=")[1].split("#")[0])
        assert cell.headers["Location"].startswith(f"/node/{burst}?") and math.isclose(
            at, end - 5.5 * INTERVAL, abs_tol=1)  # fmt: skip


async def test_a_scrape_rarer_than_a_column_widens_a_burst_and_leaves_no_gaps(tmp_path: Path) -> None:
    """Prometheus scraping every 30 s, columns of 15 s: every column after the
    first scrape is coloured (a column's range is the scrape's), and the
    burst scrape colours the two columns whose ranges hold it, no more."""
    end = column_end(time.time(), INTERVAL)
    now = end - INTERVAL / 2
    metrics = openmetrics(40, 120, {node_name(4): 5}, 30.0, now, gpus=False)
    async with prometheus_with(tmp_path, metrics) as base, aiohttp.ClientSession() as session:
        worker = PageWorker()
        try:
            drawn = await prometheus_heatmap(PrometheusHistory(base, session), worker, MEASURES["cpu"], end, 240)
        finally:
            worker.close()
    assert len(drawn.rows) == 40 and all((r.levels[1:] != ABSENT).all() for r in drawn.rows)
    [row] = [r for r in drawn.rows if r.nodes == [node_name(4)]]
    burst = np.flatnonzero(row.levels == LEVELS - 1)  # the scrape at end - 157.5 s: the columns to end - 150 and - 135
    assert burst.tolist() == [drawn.columns - 1 - 10, drawn.columns - 1 - 9]
