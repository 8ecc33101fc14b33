"""The cluster and node pages: they parse, show what the registry holds,
escape what nodes send, and draw an hour of history; the history answers a
chart spec; the charts keep spikes."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wire
from controlplane import pages_api
from controlplane.history.backends import ChartSpec, EmbeddedHistory, Series, promql
from controlplane.state.registry import NodeRegistry
from tests.fakeclock_registry import fleet_registry
from tests.fakeproc import FakeClock
from tests.heartbeats import held, registration
from web.charts import WIDTHS, bin_columns, columns, svg_chart
from web.pages import add_pages

VOID = {"meta", "link", "br", "img", "input", "hr", "path", "rect", "line", "polygon"}


class Balanced(HTMLParser):
    """Every element closed, in order: the page is well formed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: Any) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(html: str) -> str:
    p = Balanced()
    p.feed(html)
    p.close()
    assert p.stack == [], p.stack
    return " ".join(" ".join(p.text).split())


async def pages_client(aiohttp_client: Any, registry: NodeRegistry, history: EmbeddedHistory | None = None) -> Any:
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history or EmbeddedHistory())
    return await aiohttp_client(app)


async def test_cluster_page_shows_every_node(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    r = await client.get("/")
    assert r.status == 200
    text = parse(await r.text())
    for node in ("gpu-1", "cpu-2", "stale-3", "new-4"):
        assert node in text
    assert "37.5%" in text  # the fresh nodes' CPU
    assert "97.0%" in text  # gpu-1's mean GPU utilisation (one card reports it)


async def test_node_page_figures_match_the_registry(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    text = parse(await (await client.get("/node/gpu-1")).text())
    assert "37.5%" in text and "100.0 GiB" in text and "512.0 GiB" in text  # CPU, RAM used and total
    assert "0.50" in text  # load 1m
    assert "7.50" in text and "mistral-7b" in text and "70.0 GiB" in text  # an engine's cores, model, GPU memory
    assert "lost" in text  # the lost card says so
    # Card 1's MIG instances, each a row under it: its SMs and memory; the idle one's SMs absent, not 0.
    assert "1/1 MIG instance 1 — 62.5% 12.5% 6.0 GiB / 20.0 GiB" in text
    assert "1/5 MIG instance 5 — — — 0 B / 10.0 GiB" in text


async def test_stale_node_shows_dashes_not_zeros(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    text = parse(await (await client.get("/node/stale-3")).text())
    assert "stale" in text
    assert "CPU — max —" in text and "RAM —" in text
    assert "0.0%" not in text


async def test_unknown_node_is_404(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    assert (await client.get("/node/nope")).status == 404
    assert (await client.get("/node/..%2Fetc")).status == 404


async def test_hostile_names_are_escaped_everywhere(aiohttp_client: Any) -> None:
    registry = NodeRegistry(clock=FakeClock())
    evil = '<script>alert("x")</script>'
    registry.register(wire.decode_registration(json.dumps(
        {"node": "n1", "hostname": evil, "kernel": '"><img src=x onerror=alert(1)>', "backend": "bpf"}).encode()))
    registry.heartbeat(wire.decode_heartbeat(json.dumps({
        "node": "n1", "seq": 1, "backend": "bpf", "window": {"start": 1.0, "end": 2.0, "samples": 1},
        "machine": {"cpus": 2},
        "shards": [{"id": "s<b>", "model": evil, "replica": "r\"1'",
                    "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}}],
    }).encode()).heartbeat)  # fmt: skip
    history = EmbeddedHistory()
    state = registry.get("n1")
    assert state is not None and state.received is not None
    history.record("n1", state.received)
    client = await pages_client(aiohttp_client, registry, history)
    for path in ("/", "/node/n1", "/node/n1?fragment=1"):
        html = await (await client.get(path)).text()
        assert "<script>alert" not in html and "<img src=x" not in html and "<b>" not in html, path
        parse(html)
    html = await (await client.get("/node/n1")).text()
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html  # shown, as text


async def test_fragment_is_the_main_alone(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    fragment = await (await client.get("/node/gpu-1?fragment=1")).text()
    assert "<html" not in fragment and "<script" not in fragment and "<h1>" in fragment
    parse(fragment)


async def test_history_that_cannot_be_read_still_shows_current_figures(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    app = pages_api.create_app(registry)
    add_pages(app, None, prometheus_url="http://127.0.0.1:9")  # nothing listens there
    client = await aiohttp_client(app)
    r = await client.get("/node/gpu-1")
    assert r.status == 200
    text = parse(await r.text())
    assert "History unavailable" in text and "127.0.0.1:9" in text
    assert "37.5%" in text


def test_embedded_history_answers_a_spec() -> None:
    h = EmbeddedHistory(interval=5)
    for i in range(10):
        hb = {"machine": {"cpu_percent": {"mean": float(i), "p95": 0.0, "max": 2.0 * i}},
              "shards": [{"id": "a", "model": "m1", "cpu_cores": {"mean": 1.0, "max": 1.0}},
                         {"id": "b", "model": "m1", "cpu_cores": {"mean": 0.5, "max": 1.0}},
                         {"id": "c", "model": "m2", "cpu_cores": {"mean": 2.0, "max": 2.0}}]}  # fmt: skip
        h.record("n1", held(hb), at=1000.0 + 5 * i)
        h.record("n2", held(hb), at=1001.0 + 5 * i)
    [cpu] = h.query_now(ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "n1"),)), 0, 2000, 7.0)
    assert cpu.t.tolist() == [1000.0 + 5 * i for i in range(10)] and cpu.v.tolist() == [float(i) for i in range(10)]
    by_model = h.query_now(ChartSpec("llmgw_shard_cpu_cores", (("node", "n1"),), ("model",)), 0, 2000, 7.0)
    assert [(s.label, s.v[0]) for s in by_model] == [("m1", 1.5), ("m2", 2.0)]
    # Across nodes (the fleet charts): on the step grid, counted back from the end.
    fleet = {s.label: s for s in h.query_now(ChartSpec("llmgw_shard_cpu_cores", (), ("model",), "max"),
                                             990, 1001.5, 1.0)}  # fmt: skip
    assert fleet["m2"].t.tolist() == [990.5 + i for i in range(12)]
    assert fleet["m2"].v.tolist()[-2:] == [2.0, 2.0] and np.isnan(fleet["m2"].v[:-2]).all()  # none before 1000
    assert fleet["m1"].v.tolist()[-2:] == [1.0, 1.0]  # the larger engine of m1, on each node


def test_fleet_charts_combine_nodes_on_a_step_grid() -> None:
    """Nodes heartbeat at their own phases; at each step of the grid a fleet
    chart takes each node's last heartbeat (carried at most the stale period)
    and combines those. Hand-computed truth at chosen steps, then every step
    against a plain reading of that rule."""
    h = EmbeddedHistory(interval=5, stale_after=12)

    def hb(cards: dict[int, float]) -> dict[str, Any]:
        return {"gpus": [{"index": i, "name": "H100", "utilization_percent": u} for i, u in cards.items()]}

    sent: dict[str, list[tuple[float, dict[int, float]]]] = {"a": [], "b": [], "c": []}
    for i in range(40):
        at = 1000.0 + 5 * i
        sent["a"].append((at, {0: float(i), 1: 10.0}))  # two cards
        sent["b"].append((at + 1.7, {0: 100.0 - i}))  # another phase
        if i < 20:  # c goes silent at 1095.2: carried 12 s, then gone
            sent["c"].append((at + 3.2, {0: 50.0} if i % 4 else {}))  # every fourth heartbeat without its card
    for node, beats in sent.items():
        for at, cards in beats:
            h.record(node, held(hb(cards)), at=at)

    def chart(agg: str) -> Series:
        [s] = h.query_now(ChartSpec("llmgw_gpu_utilization_percent", (), ("gpu_model",), agg), 1000, 1199, 7)
        return s

    total, mean, top = chart("sum"), chart("avg"), chart("max")
    assert total.t[-1] == 1199 and np.diff(total.t).tolist() == [7.0] * (len(total.t) - 1)
    step = {t: i for i, t in enumerate(total.t.tolist())}

    def value_at(s: Series, t: int) -> float:
        return float(s.v[step[t]])

    # 1038: a's heartbeat of 1035 (7, 10), b's of 1036.7 (93), c's of 1038.2 is later: its 1033.2 (50).
    assert (value_at(total, 1038), value_at(mean, 1038), value_at(top, 1038)) == (160.0, 40.0, 93.0)
    # 1101: a's of 1100 (20, 10), b's of 1096.7 (81); c's last (1098.2: 50) is 2.8 s old: still carried.
    assert value_at(total, 1101) == 20 + 10 + 81 + 50
    # 1115: a's of 1115 (23, 10), b's of 1111.7 (78); c's last is 16.8 s old, past the stale period.
    assert value_at(total, 1115) == 23 + 10 + 78
    # 1066: a's of 1065 (13, 10), b's of 1061.7 (88); c's of 1063.2 came without its card: absent
    # then, not carried from its heartbeat before.
    assert value_at(total, 1066) == 13 + 10 + 88
    # Before any heartbeat (1000 - 199 % 7 = 1003 is the first step): a's first only.
    assert total.t[0] == 1003 and total.v[0] == 0 + 10 + 100  # b's 1001.7 is there too

    for t, s, m, x in zip(total.t, total.v, mean.v, top.v, strict=True):
        known = []
        for beats in sent.values():
            before = [cards for at_, cards in beats if at_ <= t]
            last_at = max((at_ for at_, _ in beats if at_ <= t), default=None)
            if before and t - last_at <= 12:
                known += list(before[-1].values())
        if known:
            assert (s, m, x) == pytest.approx((sum(known), sum(known) / len(known), max(known))), t
        else:
            assert np.isnan(s) and np.isnan(m) and np.isnan(x), t


def test_history_is_bounded_per_node() -> None:
    h = EmbeddedHistory(interval=5, span=60)
    for i in range(1000):
        h.record("n1", held({"machine": {"memory_used_bytes": i}}), at=float(i))
    [s] = h.query_now(ChartSpec("llmgw_node_memory_used_bytes", (("node", "n1"),)), 0, 10_000, 1.0)
    assert len(s.v) == h.capacity == 13 and s.v[-1] == 999.0 and s.v[0] == 987.0


def test_history_grows_with_what_comes_and_a_late_series_is_absent_before_it_came() -> None:
    """A node's ring is made as heartbeats and series come (a restarted
    fleet's first heartbeats cost a few slots, not an hour): every figure
    read back is the one recorded, and a series that came late, after the
    ring wrapped, is absent (NaN) at the heartbeats held before it."""
    h = EmbeddedHistory(interval=5, span=60)  # 13 slots
    h.record("n1", held({"machine": {"cpu_percent": {"mean": 0.0}}}), at=0.0)
    assert h._nodes["n1"].values.shape == (3, 8)  # its mean, p95 and max: three series, a few slots
    for i in range(1, 40):
        hb: dict[str, Any] = {"machine": {"cpu_percent": {"mean": float(i)}}}
        if i >= 30:  # an engine starts after the ring has wrapped twice
            hb["shards"] = [{"id": "late", "cpu_cores": {"mean": i / 10, "max": 1.0}}]
        h.record("n1", held(hb), at=5.0 * i)
    [cpu] = h.query_now(ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "n1"),)), 0, 1000, 1.0)
    assert cpu.t.tolist() == [5.0 * i for i in range(27, 40)] and cpu.v.tolist() == [float(i) for i in range(27, 40)]
    [late] = h.query_now(ChartSpec("llmgw_shard_cpu_cores", (("node", "n1"),)), 0, 1000, 1.0)
    assert np.isnan(late.v[:3]).all() and late.v[3:].tolist() == pytest.approx([i / 10 for i in range(30, 40)])


def test_promql_is_built_not_parsed() -> None:
    spec = ChartSpec("llmgw_shard_cpu_cores", (("node", 'n"1\\'),), ("model",), "avg")
    assert promql(spec) == 'avg by (model) (llmgw_shard_cpu_cores{node="n\\"1\\\\"})'
    with pytest.raises(ValueError):
        promql(ChartSpec("up or vector(1)", ()))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\n"), min_size=1, max_size=12),
                min_size=1, max_size=5, unique=True), st.text(min_size=1, max_size=12))  # fmt: skip
def test_a_regex_of_values_matches_them_and_nothing_else(values: list[str], other: str) -> None:
    """Punctuation escaped (Python's re reads it as RE2 does), the rest left
    as it is: a regex of node names or replica ids matches them alone."""
    from controlplane.history.backends import regex_alternatives

    pattern = re.compile(regex_alternatives(tuple(values)))
    assert all(pattern.fullmatch(v) for v in values)
    assert (pattern.fullmatch(other) is not None) == (other in values)
    assert regex_alternatives(("r.1", "r+2")) == "r\\.1|r\\+2"


def test_downsampling_keeps_a_spike() -> None:
    t = np.arange(10_000, dtype=float)
    v = np.ones(10_000)
    v[4321] = 50.0  # one sample in ten thousand, far narrower than a pixel
    lo, hi, mean, _ = bin_columns(t, v, 0, 10_000, 100)
    assert np.nanmax(hi) == 50.0 and np.nanmin(lo) == 1.0
    assert np.nanmax(mean) < 2.0  # the mean alone would hide it
    # Nothing to draw: one line saying so, no empty frame whose axes read as zero.
    for series in ([], [Series("s", np.array([]), np.array([]))]):
        note = svg_chart("cpu", series, 0, 3600, "percent")
        assert note == '<p class="chart-none"><span class="title">cpu</span>: no data in this span</p>'


def _path_starts(svg: str) -> list[int]:
    """How many separate runs (move-tos) each series' line has."""
    return [d.count("M") for d in re.findall(r'<path d="([^"]*)"', svg)]


@pytest.mark.parametrize("every", [1, 5, 15, 60])
@pytest.mark.parametrize("span", [300, 3600, 86400])
def test_lines_are_joined_at_whatever_step_the_data_has(every: int, span: int) -> None:
    end = 1_764_445_200.0
    t = np.arange(end - span, end + 0.001, every, dtype=np.float64)
    t = t + np.random.default_rng(every).uniform(-0.2, 0.2, len(t)) * every  # heartbeats are not on a grid
    svg = svg_chart("c", [Series("s", t, np.sin(t / 600) + 2)], end - span, end, "cores")
    [runs] = _path_starts(svg)
    assert runs == 1, (every, span)
    assert svg.count(" L") > 0 or len(t) < 2


def test_a_real_hole_is_a_gap() -> None:
    end = 1_764_445_200.0
    t = np.arange(end - 3600, end, 5.0)
    hole = (t > end - 1800) & (t < end - 1680)  # two minutes without a heartbeat
    svg = svg_chart("c", [Series("s", t[~hole], np.ones((~hole).sum()))], end - 3600, end, "cores")
    assert _path_starts(svg) == [2]
    one_missed = (t > end - 1800) & (t < end - 1794)  # one heartbeat lost in 5 s data: joined
    svg = svg_chart("c", [Series("s", t[~one_missed], np.ones((~one_missed).sum()))], end - 3600, end, "cores")
    assert _path_starts(svg) == [1]


@pytest.mark.parametrize("interval", [1.0, 5.0, 15.0, 60.0])
async def test_embedded_history_draws_lines_at_any_heartbeat_interval(aiohttp_client: Any, interval: float) -> None:
    """Heartbeats every 1 to 60 s over the last hour: every chart of both pages draws joined lines."""
    registry, _ = fleet_registry()
    history = EmbeddedHistory(interval=interval)
    state = registry.get("gpu-1")
    assert state is not None and state.received is not None
    now = time.time()  # the pages chart the last hour of the wall clock
    for k in range(int(3600 / interval), 0, -1):
        hb = wire.heartbeat_json(state.received.heartbeat)
        hb["machine"]["cpu_percent"]["mean"] = 30.0 + k % 13
        history.record("gpu-1", held(hb), at=now - k * interval)
    client = await pages_client(aiohttp_client, registry, history)
    for path in ("/node/gpu-1", "/"):
        page = await (await client.get(path)).text()
        paths = re.findall(r'<path d="([^"]*)"', page)
        assert paths and all(" L" in d for d in paths), (path, interval)


async def test_an_engines_quota_throttling_and_threads_show_at_a_glance(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    text = parse(await (await client.get("/node/gpu-1")).text())
    assert "6.00 88% 172" in text  # mistral's row: a 6-core quota, throttled 88% of periods, 172 threads


async def test_a_starved_engine_is_marked_and_says_why(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    client = await pages_client(aiohttp_client, registry)
    page = await (await client.get("/node/gpu-1")).text()
    text = parse(page)
    # mistral: throttled 88% of periods in a 6-core quota with 172 threads, its GPUs busy 9.5%, 12 requests queued.
    assert ("172 9.5% 12 / 4 25.0% host-bound throttled in 88% of CFS periods (quota 6 cores, 172 threads); "
            "its GPUs busy 10% of the time with 12 requests waiting") in text
    assert "92.5% — — ok" in text  # llama: judged (a run-queue wait), fed, its GPUs busy; no queue figures
    assert len(re.findall(r'<tr class="starved">', page)) == 1
    cpu = parse(await (await client.get("/node/cpu-2")).text())
    assert "host-bound" not in cpu and " ok" not in cpu  # nothing measured to judge by: a dash, not "ok"


def a_minute_of(registry: NodeRegistry, node: str, vary: Callable[[dict[str, Any], int], None]) -> EmbeddedHistory:
    """The node's heartbeat recorded 12 times, 5 s apart up to now, `vary` making the k-th its own."""
    state = registry.get(node)
    assert state is not None and state.received is not None
    history = EmbeddedHistory(interval=5)
    now = time.time()
    for k in range(12, 0, -1):
        hb = wire.heartbeat_json(state.received.heartbeat)
        vary(hb, k)
        history.record(node, held(hb), at=now - 5 * k)
    return history


async def test_the_embedded_history_charts_the_engines_own_queue(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()

    def queue(hb: dict[str, Any], k: int) -> None:
        hb["shards"][1]["requests_waiting"] = float(k)

    history = a_minute_of(registry, "gpu-1", queue)
    client = await pages_client(aiohttp_client, registry, history)
    page = await (await client.get("/node/gpu-1")).text()
    figure = re.search(r"<figcaption>Requests waiting[^<]*</figcaption>(.*?)</figure>", page, re.S)
    assert figure is not None
    # mistral's engine reports its queue; llama has no endpoint (no series); the router's is Prometheus's alone.
    assert re.findall(r"</i>([^<]*)</span>", figure.group(1)) == ["engine s1"]
    assert len(re.findall(r'<path d="M', figure.group(1))) == 1


def big_fleet(n: int) -> NodeRegistry:
    """n fresh nodes with CPU 0..n-1 % (node-0000 the idlest), and two stale ones."""
    clock = FakeClock(1000.0)
    registry = NodeRegistry(stale_after=60, clock=clock)
    for name in ("old-a", "old-b"):
        registry.register(wire.decode_registration(json.dumps({"node": name}).encode()))
    clock.advance(100)
    for i in range(n):
        node = f"node-{i:04d}"
        registry.register(registration(node, hostname=f"h{i}.rack{i % 3}"))
        body = {"node": node, "seq": 1, "backend": "bpf", "window": {"start": 1.0, "end": 6.0, "samples": 50},
                "machine": {"cpus": 8, "cpu_percent": {"mean": i % 100, "p95": 50.0, "max": 100.0}},
                "shards": [{"id": "s0", "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0},
                            "cpu_quota_cores": 1.0, "cpu_throttled_ratio": 0.9 if i % 10 == 0 else 0.0}]}  # fmt: skip
        registry.heartbeat(wire.decode_heartbeat(json.dumps(body).encode()).heartbeat)
    return registry


def row_nodes(page: str) -> list[str]:
    return re.findall(r'<tr class="(?:fresh|stale)">\s*<td><a href="/node/([^"]+)"', page)


async def test_the_cluster_page_of_a_fleet_sums_up_orders_filters_and_pages(aiohttp_client: Any) -> None:
    client = await pages_client(aiohttp_client, big_fleet(250))
    page = await (await client.get("/")).text()
    text = parse(page)
    # The whole fleet at the top, whatever is shown below.
    assert "Nodes 252 250 fresh · 2 stale" in text and "GPUs 0" in text
    assert "Engines 250 25 CPU-starved · 0 host-bound" in text
    assert "Busiest node-0099 CPU 99.0%" in text
    # Stale first, then the busiest; a hundred rows a page.
    rows = row_nodes(page)
    assert len(rows) == 100 and rows[:2] == ["old-a", "old-b"]
    assert rows[2:5] == ["node-0099", "node-0199", "node-0098"]
    assert "page 1 of 3" in text and 'rel="next" href="?page=2"' in page and 'rel="prev"' not in page
    last = await (await client.get("/?page=3")).text()
    assert len(row_nodes(last)) == 52 and 'rel="prev" href="?page=2"' in last
    # Filters in the URL: by name or host name (any case), by state; the pager keeps them.
    rack = await (await client.get("/?q=RACK1&state=fresh")).text()
    assert len(row_nodes(rack)) == 83 and "83 of 252 nodes match" in parse(rack)
    assert all(int(n[5:]) % 3 == 1 for n in row_nodes(rack))
    stale = await (await client.get("/?state=stale")).text()
    assert row_nodes(stale) == ["old-a", "old-b"]
    many = await (await client.get("/?q=node&state=fresh&page=2")).text()
    assert 'href="?q=node&amp;state=fresh&amp;page=3"' in many and 'href="?q=node&amp;state=fresh&amp;page=1"' in many
    assert row_nodes(await (await client.get("/?q=nothing-like-it")).text()) == []
    # A page past the last shows the last.
    assert row_nodes(await (await client.get("/?page=99")).text()) == row_nodes(last)


async def test_the_cluster_page_refuses_bad_filters_and_escapes_the_good(aiohttp_client: Any) -> None:
    client = await pages_client(aiohttp_client, big_fleet(3))
    for bad in ("/?state=gone", "/?page=0", "/?page=two", "/?q=" + "x" * 201, "/?q=%00"):
        r = await client.get(bad)
        assert r.status == 400, bad
        assert "<" not in await r.text()
    page = await (await client.get('/?q=<script>"x"</script>')).text()
    assert "<script>\"x\"" not in page and "&lt;script&gt;" in page
    assert "No node matches." in parse(page)


async def test_a_pods_row_names_it_and_links_to_its_hour(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()

    def cores(hb: dict[str, Any], k: int) -> None:
        hb["shards"][1]["cpu_cores"] = {"mean": 0.5, "p95": 1.0, "max": float(k)}

    history = a_minute_of(registry, "cpu-2", cores)
    client = await pages_client(aiohttp_client, registry, history)
    page = await (await client.get("/node/cpu-2")).text()
    assert "namespace llm · pod engine-0 · container vllm" in parse(page)
    link = re.search(r'<a href="(\?shard=[^"]+)"[^>]*>llm/engine-0/vllm</a>', page)
    assert link is not None and link.group(1) == "?shard=llm/engine-0/vllm#history"
    page = await (await client.get("/node/cpu-2?shard=llm/engine-0/vllm")).text()
    assert "The last hour of llm/engine-0/vllm, and of the node" in parse(page)
    figure = re.search(r"<figcaption>CPU cores of llm/engine-0/vllm[^<]*</figcaption>(.*?)</figure>", page, re.S)
    assert figure is not None and re.findall(r"</i>([^<]*)</span>", figure.group(1)) == ["mean", "max"]
    assert len(re.findall(r'<path d="M', figure.group(1))) == 2  # both lines drawn from the hour's heartbeats
    for bad in ("", "x" * 200, "a\x1b[2J"):
        assert (await client.get("/node/cpu-2", params={"shard": bad})).status == 400


def test_history_read_on_one_thread_while_heartbeats_arrive_on_another() -> None:
    """The pages read the embedded history on their own thread while the event
    loop records: nodes appearing and rings wrapping under a reader never
    break it, and what it reads is what was recorded."""
    h = EmbeddedHistory(interval=5, span=50, stale_after=60)
    spec = ChartSpec("llmgw_gpu_utilization_percent", (), ("gpu_model",), "sum")
    done, errors = threading.Event(), []

    def write() -> None:
        try:
            for i in range(4000):
                node = f"n{i % 400}" if i >= 400 else f"n{i}"  # 400 nodes appear, then each wraps its ring
                h.record(node, held({"gpus": [{"index": g, "name": "H100", "utilization_percent": 1.0}
                                              for g in range(4)]}), at=1000.0 + i / 100)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as the interpreter allows
    try:
        writer.start()
        reads = 0
        while not done.is_set() or reads == 0:
            for s in h.query_now(spec, 900, 1100, 1.0):
                assert set(s.v[~np.isnan(s.v)].tolist()) <= {float(4 * n) for n in range(1, 401)}
            reads += 1
        writer.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors
    [s] = h.query_now(spec, 900, 1050, 1.0)  # the last heartbeats came 1036-1040
    assert s.v[-1] == 4 * 400  # every node's four cards, each 1.0


def test_series_gone_for_the_hour_give_their_room_to_new_ones() -> None:
    """A node's engines restarting under new names, far more series over a day
    than a node may hold at once: those with no value in the hour are
    evicted, so the newest engines are charted, never refused."""
    h = EmbeddedHistory(interval=5, span=60)  # 13 heartbeats held
    for i in range(2000):  # 400 engines, each for five heartbeats: 800 series of cores
        shard = {"id": f"e{i // 5}", "model": "m", "cpu_cores": {"mean": float(i), "max": float(i)}}
        h.record("n1", held({"machine": {"cpu_percent": {"mean": 1.0}}, "shards": [shard]}), at=5.0 * i)
    spec = ChartSpec("llmgw_shard_cpu_cores", (("node", "n1"),), ("shard",))
    got = {s.label: s.v[~np.isnan(s.v)].tolist() for s in h.query_now(spec, 0, 10_000, 5.0)}
    # The engines of the last 13 heartbeats (1987-1999), each with its own values.
    assert got == {"e397": [1987.0, 1988.0, 1989.0], "e398": [float(x) for x in range(1990, 1995)],
                   "e399": [float(x) for x in range(1995, 2000)]}  # fmt: skip
    [cpu] = h.query_now(ChartSpec("llmgw_node_cpu_utilization_percent", (("node", "n1"),)), 0, 10_000, 5.0)
    assert cpu.v.tolist() == [1.0] * 13  # the series that never stopped kept its row


async def test_a_card_with_gpm_shows_what_its_sms_did_and_one_without_shows_dashes(aiohttp_client: Any) -> None:
    """gpu-1's card 0 has GPM (SMs busy 38.5%, tensor 27.5%, clocks held back
    by its power cap a fifth of the window); card 1 says neither: dashes,
    never 0; and the SMs' chart is drawn beside the utilisation's."""
    registry, _ = fleet_registry()
    state = registry.get("gpu-1")
    assert state is not None and state.received is not None
    history = EmbeddedHistory()
    history.record("gpu-1", state.received)
    client = await pages_client(aiohttp_client, registry, history)
    page = await (await client.get("/node/gpu-1")).text()
    text = parse(page)
    assert "0 NVIDIA H200 97.0% 38.5% 27.5%" in text and "power cap 20%" in text
    assert "1 NVIDIA H200 — — —" in text  # card 1: no utilisation samples, no GPM: not measured
    assert 'aria-label="GPU SMs busy by card' in page and 'aria-label="GPU utilisation by card' in page
    cpu = await (await client.get("/node/cpu-2")).text()
    assert "SMs busy by card" not in cpu  # no card, no GPM chart


async def test_nothing_is_drawn_empty(aiohttp_client: Any) -> None:
    """A fleet without GPUs has no GPU charts, one line instead; a node whose
    engines export no queue has no queue chart, one line saying why; an
    engine's own page likewise. Where an engine does export one, its chart
    is there."""
    from tests.fakeclock_registry import _heartbeat

    registry = NodeRegistry(stale_after=60, clock=FakeClock(1000.0))
    registry.register(registration("cpu-1"))
    body = _heartbeat("cpu-1", [], [{"id": "s0", "pgid": 77, "cpu_cores": {"mean": 2.0, "p95": 3.0, "max": 4.0}}])
    registry.heartbeat(wire.decode_heartbeat(json.dumps(body).encode()).heartbeat)
    client = await pages_client(aiohttp_client, registry)
    cluster = await (await client.get("/")).text()
    charts = re.search(r'<section class="charts">(.*?)</section>', cluster, re.S)
    assert charts is not None and "<svg" not in charts.group(1)
    assert "no GPUs on this fleet&#x27;s fresh nodes" in charts.group(1)
    node = await (await client.get("/node/cpu-1")).text()
    assert "GPU utilisation by card" not in node and "<figcaption>Requests waiting" not in node
    assert '<span class="title">Requests waiting</span>: no engine here exports a queue' in node
    engine = await (await client.get("/node/cpu-1?shard=s0")).text()
    assert '<span class="title">Requests waiting in s0</span>: this engine exports no queue' in engine
    fleet, _ = fleet_registry()  # gpu-1's mistral exports its queue: the charts are there
    history = a_minute_of(fleet, "gpu-1", lambda hb, k: None)
    with_queue = await (await (await pages_client(aiohttp_client, fleet, history)).get("/node/gpu-1?shard=s1")).text()
    assert "<figcaption>Requests waiting in s1" in with_queue and "<figcaption>Requests waiting (" in with_queue


def test_the_palette_stays_apart_for_ten_series_and_colour_blindness() -> None:
    """Any two of the ten colours at least 15 CIELAB (1976) units apart, for
    normal vision and with deuteranopia, protanopia and tritanopia simulated
    (Machado, Oliveira and Fernandes 2009, severity 1)."""
    from itertools import combinations

    from web.charts import PALETTE

    def linear(colour: str) -> np.ndarray:
        c = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0
        return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)

    def lab(rgb: np.ndarray) -> np.ndarray:
        xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ rgb
        t = xyz / np.array([0.95047, 1.0, 1.08883])
        f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
        return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])

    visions = {
        "normal": np.eye(3),
        "deutan": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                            [-0.011820, 0.042940, 0.968881]]),
        "protan": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
        "tritan": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
    }  # fmt: skip
    assert len(set(PALETTE)) == len(PALETTE) >= 10
    for vision, seen in visions.items():
        colours = [lab(np.clip(seen @ linear(c), 0, 1)) for c in PALETTE]
        nearest = min(float(np.linalg.norm(a - b)) for a, b in combinations(colours, 2))
        assert nearest >= 15, (vision, nearest)


@pytest.mark.parametrize(("top", "unit", "fixed", "labels"), [
    (1.0, "bytes", False, ["0", "1 B", "2 B"]),  # an idle chart's axis: never "1 B, 1 B, 0 B"
    (121.5 * 2**30, "bytes", False, ["0", "64 GiB", "128 GiB"]),
    (100.0, "percent", True, ["0", "50%", "100%"]),
    (1.0, "ratio", True, ["0", "50%", "100%"]),
    (0.0042, "seconds", False, ["0", "2.5 ms", "5.0 ms"]),
    (8.8, "cores", False, ["0", "5", "10"]),
])  # fmt: skip
def test_value_axes_read_in_their_unit(top: float, unit: str, fixed: bool, labels: list[str]) -> None:
    from web.charts import value_axis

    assert [label for _, label in value_axis(top, unit, fixed)[1]] == labels


@settings(max_examples=300, deadline=None)
@given(st.floats(1e-6, 1e15), st.sampled_from(["bytes", "percent", "ratio", "seconds", "cores", "watts", "celsius"]))
def test_an_axis_holds_its_data_with_no_tick_repeated(top: float, unit: str) -> None:
    from web.charts import value_axis

    got, ticks = value_axis(top, unit)
    assert top <= got <= 2.5 * top or (unit == "bytes" and got == 2.0)  # above the data, not far
    assert len({label for _, label in ticks}) == 3 and ticks[-1][0] == got


async def test_charts_are_drawn_at_the_width_asked_for_and_only_those(aiohttp_client: Any) -> None:
    """`?width=` (the pages' script asks for its column's): every chart of the
    page drawn that wide, its columns binned for it; a width not offered is a
    400, and the script offers the server's widths."""
    registry, _ = fleet_registry()
    history = a_minute_of(registry, "gpu-1", lambda hb, k: None)
    client = await pages_client(aiohttp_client, registry, history)
    for width in WIDTHS:
        page = await (await client.get(f"/node/gpu-1?width={width}&fragment=1")).text()
        widths = set(re.findall(r'<svg class="chart" viewBox="0 0 (\d+) ', page))
        assert widths == {str(width)}, (width, widths)
        frames = set(re.findall(r'<rect x="56" y="8" width="(\d+)"', page))
        assert frames == {str(columns(width))}
    for bad in ("801", "-1", "1e3", "", "560.0"):
        r = await client.get(f"/node/gpu-1?width={bad}")
        assert r.status == 400 and "width: one of" in await r.text(), bad
        assert (await client.get(f"/?width={bad}")).status == 400
    script = (Path(__file__).resolve().parent.parent / "web" / "static" / "charts.js").read_text()
    found = re.search(r"const WIDTHS = \[([\d, ]+)\]", script)
    assert found is not None and tuple(int(w) for w in found.group(1).split(",")) == WIDTHS
