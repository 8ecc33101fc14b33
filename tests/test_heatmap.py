"""The fleet's picture (controlplane/history/heatmap.py, web/heatmap_view.py): a
burst on one node in a thousand colours its band's cell and a click there
opens that node at that moment; nothing measured is grey, never idle; rows
grouped by GPU model, the busiest first; bad asks refused, changing nothing."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
import time
import zlib
from typing import Any

import numpy as np
import pytest

from controlplane import pages_api
from controlplane.history.backends import EmbeddedHistory
from controlplane.history.heatmap import ABSENT, LEVELS, MAX_ROWS, MEASURES, PALETTE, column_end, heatmap
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


def test_a_node_s_busiest_card_in_each_window_and_its_ring_wrapped() -> None:
    """Two cards, each missing in some windows: a cell is the busier card
    measured there, grey only where neither was; and a node whose ring has
    wrapped (more heartbeats than an hour holds, read in the ring's order)
    has each window's own figure, the hour's first included."""
    history = EmbeddedHistory(interval=INTERVAL)
    now = 1_000_000.0 - INTERVAL / 2
    for k in range(800, -1, -1):  # 801 heartbeats: the ring holds 721
        cards = [{"index": i, "uuid": f"GPU-{i}", "name": "H100", "utilization_percent": float(u)}
                 for i, u in ((0, k % 50), (1, (k * 3) % 70)) if not (i == 0 and k % 4 == 0 or i == 1 and k % 3 == 0)]
        history.record("n1", held({"machine": {"cpu_percent": {"mean": 1.0, "p95": 1.0, "max": float(k % 90)}},
                                   "gpus": cards}), at=now - k * INTERVAL)  # fmt: skip
    end = covering(now)

    def busiest_card(k: int) -> int | None:
        return max([u for u, off in ((k % 50, k % 4 == 0), ((k * 3) % 70, k % 3 == 0)) if not off], default=None)

    def cpu(k: int) -> int | None:
        return k % 90

    for key, expected in (("cpu", cpu), ("gpu", busiest_card)):
        [row] = heatmap(history, MEASURES[key], end, INTERVAL).rows
        for column in range(len(row.levels)):
            k = len(row.levels) - 1 - column  # the heartbeat in that window
            want = expected(k)
            assert row.levels[column] == (ABSENT if want is None else round(want * (LEVELS - 1) / 100)), (key, k)


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


async def test_a_prometheus_that_does_not_answer_leaves_a_reason_not_a_picture(aiohttp_client: Any) -> None:
    """With --prometheus the picture is Prometheus' (tests/test_heatmap_prometheus.py);
    one that cannot be reached is said where the picture would be, and its image is a 502."""
    registry, history, _ = fleet_with_history(2, 2)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, None, prometheus_url="http://127.0.0.1:9")
    client = await aiohttp_client(app)
    page = await (await client.get("/")).text()
    assert '<img class="heatmap"' not in page
    assert re.search(r'id="heatmap-error">No picture: Prometheus at http://127.0.0.1:9: ClientConnectorError', page)
    end = column_end(time.time(), 15.0)
    r = await client.get(f"/heatmap.png?measure=cpu&end={end}")
    assert r.status == 502 and "Prometheus at http://127.0.0.1:9" in await r.text()


def test_three_replicas_parts_draw_what_one_history_of_every_node_draws() -> None:
    """Each replica's part, sent as a peer sends it and combined, is the
    picture one history of every node draws: the same rows, levels and
    worst nodes; a node that moved in the hour is one row with the windows
    of both replicas."""
    from controlplane.history.heatmap import build, column_grid, own_part, parse_part, part_json

    now = 1_000_000.0
    whole = EmbeddedHistory(interval=INTERVAL)
    replicas = [EmbeddedHistory(interval=INTERVAL) for _ in range(3)]
    for i in range(240):
        for k in range(30, -1, -1):
            hb = held({"machine": {"cpu_percent": {"mean": 1.0, "p95": 1.0, "max": float((i * 7 + k) % 101)}},
                       "gpus": [{"index": 0, "uuid": "GPU-0", "name": model_of(i), "utilization_percent": 1.0}]
                       if model_of(i) else []})  # fmt: skip
            # Node 5 moved from replica 2 to replica 0 half way through.
            at = replicas[(0 if k < 15 else 2) if i == 5 else i % 3]
            whole.record(node_name(i), hb, at=now - k * INTERVAL)
            at.record(node_name(i), hb, at=now - k * INTERVAL)
    end = covering(now)
    columns = column_grid(end, INTERVAL)[2]
    sent = [parse_part(json.loads(part_json(own_part(r, MEASURES["cpu"], end, columns))), columns) for r in replicas]
    got = build(MEASURES["cpu"], sent, end, columns)
    expected = heatmap(whole, MEASURES["cpu"], end, INTERVAL)
    assert got.nodes == expected.nodes == 240 and len(got.rows) == len(expected.rows)
    assert [r.nodes for r in got.rows] == [r.nodes for r in expected.rows]
    for g, e in zip(got.rows, expected.rows, strict=True):
        assert (g.levels == e.levels).all() and (g.worst == e.worst).all()
    # The moved node's own windows: both halves, from the two replicas (31 heartbeats, 31 columns).
    whole_part = own_part(whole, MEASURES["cpu"], end, columns)
    moved = [part.levels[part.names.index(node_name(5))] for part in sent if node_name(5) in part.names]
    assert len(moved) == 2 and all(0 < (m != ABSENT).sum() < 31 for m in moved)
    both = np.where(moved[0] != ABSENT, moved[0], moved[1])
    assert (both == whole_part.levels[whole_part.names.index(node_name(5))]).all()


def packed(levels: bytes) -> str:
    return base64.b64encode(zlib.compress(levels)).decode()


@pytest.mark.parametrize(("part", "why"), [
    ([], "not a part"),
    ({"nodes": ["a"], "groups": [], "levels": packed(b"\0" * 4)}, "as many groups as nodes"),
    ({"nodes": ["a b"], "groups": [""], "levels": packed(b"\0" * 4)}, "not a node id"),
    ({"nodes": ["a", "a"], "groups": ["", ""], "levels": packed(b"\0" * 8)}, "a node twice"),
    ({"nodes": ["a"], "groups": ["\x1b[2J"], "levels": packed(b"\0" * 4)}, "printable"),
    ({"nodes": ["a"], "groups": [""], "levels": packed(b"\0" * 3)}, "not 1 rows of 4"),
    ({"nodes": ["a"], "groups": [""], "levels": packed(b"\0" * 50_000_000)}, "not 1 rows of 4"),  # a zip bomb
    ({"nodes": ["a"], "groups": [""], "levels": packed(b"\0\0\0\xfb")}, "out of range"),
    ({"nodes": ["a"], "groups": [""], "levels": "%%%"}, ""),
])  # fmt: skip
def test_a_peers_part_is_checked_before_anything_is_drawn(part: Any, why: str) -> None:
    from controlplane.history.heatmap import parse_part

    with pytest.raises((ValueError, binascii.Error, zlib.error), match=why or None):
        parse_part(part, 4)


async def test_a_peers_ask_for_its_part_is_checked(aiohttp_client: Any) -> None:
    """A replica's part is a peer's alone (its token); an ask that is no
    picture's (a measure not offered, an end not finite, columns out of
    range) is 400; an answer is the replica's nodes."""
    from controlplane.fleet import peers
    from controlplane.history.heatmap import parse_part
    from controlplane.ingest import agent_api
    from tests.peer_requests import SignedPeer

    secret = b"s3cret-s3cret-s3cret-s3cret"
    registry, history, now = fleet_with_history(4, 3)
    app = agent_api.create_app(registry, secret)
    peers.add_routes(app, peers.Peers([], secret, registry, lambda node: None), lambda: pages_api.nodes_json(registry),
                     history)  # fmt: skip
    client = await aiohttp_client(app)
    peer = SignedPeer(client, secret)
    ask = f"/v1/peer/heatmap?measure=cpu&end={covering(now)}&columns=720"
    assert (await client.get(ask)).status == 401
    r = await peer.request("GET", ask)
    part = parse_part(await r.json(), 720)
    assert r.status == 200 and sorted(part.names) == [node_name(i) for i in range(4)]
    assert ((part.levels != ABSENT).sum(axis=1) == 3).all()
    for bad in ("measure=disk&end=1e9&columns=720", "measure=cpu&end=nan&columns=720", "measure=cpu&end=1e9&columns=0",
                "measure=cpu&end=1e9&columns=721", "measure=cpu&end=1e9"):  # fmt: skip
        assert (await peer.request("GET", f"/v1/peer/heatmap?{bad}")).status == 400, bad


async def test_a_peer_whose_part_did_not_come_is_named_and_the_rest_drawn(aiohttp_client: Any) -> None:
    from controlplane.history.heatmap import Part
    from controlplane.pages_api import HEATMAP_PARTS

    registry, history, _ = fleet_with_history(3, 3)
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history)
    other = Part([node_name(99)], [""], np.full((1, 720), 200, dtype=np.uint8))

    async def peers_parts(measure: str, end: float, columns: int) -> tuple[list[Part], list[str]]:
        return [other], ["http://cp-2:8080: TimeoutError: "]

    app[HEATMAP_PARTS] = peers_parts
    client = await aiohttp_client(app)
    page = await (await client.get("/")).text()
    assert "The picture leaves out the nodes of replica http://cp-2:8080: TimeoutError" in page
    assert "4 nodes" in page  # this replica's three and the answering peer's one


def _vector(*results: tuple[dict[str, str], object]) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": m, "value": [1.0, v]} for m, v in results]}}).encode()  # fmt: skip


def test_a_bad_series_in_prometheus_answer_costs_that_series_alone() -> None:
    """Prometheus may hold series our exporter never wrote (another job's
    `node` label, a card's model of control characters, NaN): each is left
    out or absent, the rest drawn; an answer that is not a success is an error."""
    from controlplane.history.backends import HistoryError
    from controlplane.history.heatmap_prometheus import _results, picture, scores_and_groups

    scores = _vector(({"node": "a"}, "50"), ({"node": "b c"}, "60"), ({"node": "d"}, "NaN"), ({}, "1"),
                     ({"node": "e"}, "Inf"))  # fmt: skip
    groups = _vector(({"node": "a", "gpu_model": "H100"}, "1"), ({"node": "a", "gpu_model": "A100"}, "1"),
                     ({"node": "f", "gpu_model": "bad\x07"}, "1"), ({"node": "../g"}, "1"))  # fmt: skip
    names, models, score = scores_and_groups(scores, groups)
    assert names == ["a", "d", "e", "f"] and models == ["A100", "", "", ""] and score == [50.0, -1.0, -1.0, -1.0]
    matrix = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"node": "a"}, "values": [[1000.0 + 15 * 240, "50"], ["x", "1"], [1000.0 + 15, "oops"], 7]},
        {"metric": {"node": "zz"}, "values": [[1000.0 + 15, "99"]]},
        {"metric": {"node": "f"}, "values": "not points"}]}}).encode()  # fmt: skip
    drawn = picture(MEASURES["cpu"], 1000.0 + 3600, 240, names, models, score, [matrix])
    [a] = [r for r in drawn.rows if r.nodes == ["a"]]
    assert a.levels[-1] == round(50 * (LEVELS - 1) / 100) and (a.levels[:-1] == ABSENT).all()
    assert all((r.levels == ABSENT).all() for r in drawn.rows if r.nodes != ["a"])
    for body in (b"<html>", b'{"status": "error", "error": "parse error at char 3"}', b"[]",
                 b'{"status": "success", "data": {"resultType": "scalar", "result": [1, "2"]}}'):
        with pytest.raises(HistoryError):
            _results(body, "matrix")


async def test_an_answer_over_its_bound_is_refused_unread(aiohttp_server: Any) -> None:
    """A Prometheus (or what answers at its URL) that sends more than the
    bound is cut off there: an error, not memory."""
    import aiohttp
    from aiohttp import web

    from controlplane.history.backends import HistoryError, PrometheusHistory

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(64):
            await response.write(b" " * 65536)
        return response

    app = web.Application()
    app.router.add_post("/api/v1/query", endless)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        prometheus = PrometheusHistory(f"http://127.0.0.1:{server.port}", session)
        with pytest.raises(HistoryError, match="an answer over 1000000 bytes"):
            await prometheus.ask("query", {"query": "up"}, 1_000_000)
        assert (await prometheus.ask("query", {"query": "up"}, 8 << 20)).strip() == b""
