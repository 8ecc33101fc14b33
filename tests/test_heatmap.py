"""The fleet's picture (controlplane/heatmap.py, web/heatmap_view.py): a
burst on one node in a thousand colours its band's cell and a click there
opens that node at that moment; nothing measured is grey, never idle; rows
grouped by GPU model, the busiest first; bad asks refused, changing nothing."""

from __future__ import annotations

import base64
import math
import re
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from controlplane import pages_api
from controlplane.heatmap import ABSENT, LEVELS, MAX_ROWS, MEASURES, PALETTE, column_end, heatmap
from controlplane.history import EmbeddedHistory
from tests.heartbeats import held
from tests.heatmap_fleet import fleet_with_history, idle_cpu, model_of, node_name
from web.pages import add_pages

INTERVAL = 5.0


def covering(now: float) -> float:
    """A picture's end whose last column holds `now`."""
    return math.ceil(now / INTERVAL) * INTERVAL


def decode_png(png: bytes) -> tuple[int, int, bytes, np.ndarray]:
    """A palette PNG's width, height, palette and pixels (filter 0 rows, as the picture writes them)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    idat = b""
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind, data = png[at + 4 : at + 8], png[at + 8 : at + 8 + length]
        assert struct.unpack(">I", png[at + 8 + length : at + 12 + length])[0] == zlib.crc32(kind + data)
        if kind == b"IDAT":
            idat += data
        chunks[kind] = data
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 3)
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, width + 1)
    assert (raw[:, 0] == 0).all()
    return width, height, chunks[b"PLTE"], raw[:, 1:]


def test_a_burst_on_one_node_in_a_thousand_colours_its_band_and_names_the_node() -> None:
    """1,000 nodes, each idle at its own CPU: node 421 at 100% for one
    window. Its band's cell in that window is the top colour and names it;
    the band's other windows are its nodes' worst idle figure."""
    burst = node_name(421)
    _, history, now = fleet_with_history(1000, 60, {burst: 3})
    picture = heatmap(history, MEASURES["cpu"], covering(now), INTERVAL)
    assert picture.nodes == 1000 and len(picture.rows) <= MAX_ROWS + 3  # a band may end each of the three groups
    [(i, row)] = [(i, r) for i, r in enumerate(picture.rows) if burst in r.nodes]
    assert len(row.nodes) == 5 and all(model_of(int(n[5:])) == model_of(421) for n in row.nodes)
    column = int(np.ceil((now - 3 * INTERVAL - picture.start) / picture.step)) - 1
    assert row.levels[column] == LEVELS - 1
    node, at = picture.cell(i, column)  # type: ignore[misc]
    assert node == burst and picture.start + column * picture.step < at < picture.start + (column + 1) * picture.step
    worst_idle = max(idle_cpu(int(n[5:])) for n in row.nodes)
    others = [c for c in range(picture.columns) if c != column and row.levels[c] != ABSENT]
    assert len(others) == 59
    assert {int(row.levels[c]) for c in others} == {round(worst_idle / 100 * (LEVELS - 1))}
    # The PNG says the same: that pixel in the palette's top colour.
    width, height, palette, pixels = decode_png(picture.png())
    assert (width, height) == (picture.columns, len(picture.rows)) and palette == PALETTE
    assert pixels[i, column] == LEVELS - 1 and (pixels[i, others] == row.levels[others]).all()
    # And the script's legend: the row's levels and which node was worst, cell by cell.
    legend: Any = picture.legend()
    levels = np.frombuffer(base64.b64decode(legend["rows"][i]["levels"]), dtype=np.uint8)
    worst = np.frombuffer(base64.b64decode(legend["rows"][i]["worst"]), dtype="<i2")
    assert levels[column] == LEVELS - 1 and legend["rows"][i]["nodes"][worst[column]] == burst


def test_windows_without_a_heartbeat_are_grey_not_idle() -> None:
    """A node silent for a while: its cells there are ABSENT (grey), not 0;
    a cell that nobody measured names no node."""
    history = EmbeddedHistory(interval=INTERVAL)
    now = 1_000_000.0
    for k in range(40, -1, -1):
        if not 10 <= k < 20:
            history.record("n1", held({"machine": {"cpu_percent": {"mean": 0.0, "p95": 0.0, "max": 0.0}}}),
                           at=now - k * INTERVAL)  # fmt: skip
    picture = heatmap(history, MEASURES["cpu"], covering(now), INTERVAL)
    [row] = picture.rows
    measured = row.levels != ABSENT
    assert measured.sum() == 31 and (row.levels[measured] == 0).all()  # idle: the palette's palest, measured
    silent = np.flatnonzero(~measured)
    assert picture.cell(0, int(silent[-1])) is None and picture.cell(0, picture.columns) is None
    assert PALETTE[3 * ABSENT : 3 * ABSENT + 3] != PALETTE[0:3]


def test_rows_are_grouped_by_gpu_model_the_busiest_first_cpu_nodes_last() -> None:
    _, history, now = fleet_with_history(30, 4)
    picture = heatmap(history, MEASURES["cpu"], covering(now), INTERVAL)
    assert len(picture.rows) == 30  # under MAX_ROWS: a row a node
    groups = [r.group for r in picture.rows]
    assert groups[-10:] == ["CPU nodes"] * 10
    for model in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        rows = [r for r in picture.rows if r.group == model]
        cpus = [idle_cpu(int(r.nodes[0][5:])) for r in rows]
        assert len(rows) == 10 and cpus == sorted(cpus, reverse=True)
    # The group whose busiest node is busiest comes first: node 29 (A100... 29 % 3 == 2: CPU), so 28 (A100) leads.
    assert groups[0] == model_of(28)


def test_a_fleet_of_ten_thousand_is_at_most_max_rows_plus_a_band_a_group() -> None:
    _, history, now = fleet_with_history(10_000, 2)
    picture = heatmap(history, MEASURES["cpu"], covering(now), INTERVAL)
    assert len(picture.rows) <= MAX_ROWS + 3 and sum(len(r.nodes) for r in picture.rows) == 10_000
    assert max(len(r.nodes) for r in picture.rows) == 50


def test_the_gpu_measure_takes_the_busiest_card_and_cpu_nodes_have_none() -> None:
    _, history, now = fleet_with_history(6, 3)
    picture = heatmap(history, MEASURES["gpu"], covering(now), INTERVAL)
    for row in picture.rows:
        [node] = row.nodes
        measured = row.levels[row.levels != ABSENT]
        if model_of(int(node[5:])) is None:
            assert len(measured) == 0
        else:
            assert len(measured) == 3 and set(measured) == {round(idle_cpu(int(node[5:])) / 2 / 100 * (LEVELS - 1))}


async def pages(aiohttp_client: Any, nodes: int, heartbeats: int, bursts: dict[str, int] | None = None) -> Any:
    registry, history, _ = fleet_with_history(nodes, heartbeats, bursts)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history)
    return await aiohttp_client(app), history


async def test_the_cluster_page_draws_the_picture_and_a_cell_opens_its_node(aiohttp_client: Any) -> None:
    burst = node_name(7)
    client, history = await pages(aiohttp_client, 12, 20, {burst: 2})
    page = await (await client.get("/")).text()
    png_url = re.search(r'<img class="heatmap" src="([^"]+)"', page)
    cell_url = re.search(r'data-cell="([^"]+)"', page)
    assert png_url is not None and cell_url is not None
    assert "SMs busy" in page and "GPU utilisation" in page  # a fleet with GPUs offers their measures
    r = await client.get(png_url.group(1).replace("&amp;", "&"))
    assert r.status == 200 and r.content_type == "image/png"
    width, height, _, pixels = decode_png(await r.read())
    assert height == 12 and width == 720
    [row] = [i for i in range(height) if (pixels[i] == LEVELS - 1).any()]
    column = int(np.flatnonzero(pixels[row] == LEVELS - 1)[0])
    r = await client.get(f"{cell_url.group(1).replace('&amp;', '&')}&row={row}&column={column}", allow_redirects=False)
    assert r.status == 303
    location = r.headers["Location"]
    assert location.startswith(f"/node/{burst}?at=") and location.endswith("#hindsight")
    node_page = await (await client.get(location.split("#")[0])).text()
    assert 'id="moment"' in node_page and "from the fleet's picture" in node_page


async def test_a_fleet_without_gpus_offers_no_gpu_measure(aiohttp_client: Any) -> None:
    registry, history, _ = fleet_with_history(3, 3, gpus=False)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history)
    client = await aiohttp_client(app)
    page = await (await client.get("/?measure=gpu")).text()
    assert "SMs busy" not in page and "GPU utilisation" not in page and 'class="heatmap"' in page
    # An unoffered measure falls back to CPU's.
    assert '<strong aria-current="true">CPU busy, the window&#39;s highest sample</strong>' in page


@pytest.mark.parametrize(("query", "status"), [
    ("measure=nope&end={end}", 400), ("measure=cpu", 400), ("measure=cpu&end=abc", 400),
    ("measure=cpu&end=nan", 400), ("measure=cpu&end={end_plus}", 400), ("measure=cpu&end={old}", 400),
    ("measure=cpu&end={future}", 400)])  # fmt: skip
async def test_bad_asks_are_refused(aiohttp_client: Any, query: str, status: int) -> None:
    client, history = await pages(aiohttp_client, 3, 3)
    end = column_end(history.clock(), INTERVAL)
    asked = query.format(end=end, end_plus=end + 2.5, old=end - 7200, future=end + 3600)
    for path in ("/heatmap.png", "/api/heatmap", "/heatmap/cell"):
        r = await client.get(f"{path}?{asked}&row=0&column=0", allow_redirects=False)
        assert r.status == status, (path, asked, await r.text())


async def test_a_cell_outside_or_unmeasured_is_404_and_bad_coordinates_400(aiohttp_client: Any) -> None:
    client, history = await pages(aiohttp_client, 3, 3)
    end = column_end(history.clock(), INTERVAL)
    base = f"/heatmap/cell?measure=cpu&end={end}"
    assert (await client.get(f"{base}&row=99&column=0", allow_redirects=False)).status == 404
    assert (await client.get(f"{base}&row=0&column=0", allow_redirects=False)).status == 404  # an hour ago: none
    assert (await client.get(f"{base}&row=x&column=0", allow_redirects=False)).status == 400
    assert (await client.get("/node/node-00000?at=12", allow_redirects=False)).status == 400


async def test_with_prometheus_the_page_has_no_picture(aiohttp_client: Any) -> None:
    registry, history, _ = fleet_with_history(2, 2)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, None, prometheus_url="http://127.0.0.1:9")
    client = await aiohttp_client(app)
    page = await (await client.get("/")).text()
    assert 'class="heatmap"' not in page
    r = await client.get(f"/heatmap.png?measure=cpu&end={column_end(history.clock(), INTERVAL)}")
    assert r.status == 404
