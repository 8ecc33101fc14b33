"""A real browser: headless Chromium (Debian's, driven by playwright) loads a
node page, waits for an in-place refresh, and keeps a screenshot; and shows
a starved engine beside a healthy one, each measured by a real agent."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.agent_fleet import Fleet, fresh_with_seq
from tests.conftest import CpuCgroup, unavailable
from tests.workloads import busy_threads, start_group

pytestmark = [pytest.mark.live, pytest.mark.timing]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]  # fmt: skip


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def chromium_path() -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium missing: make setup installs Debian's chromium")
    return chromium


@contextlib.contextmanager
def browser_page(width: int, height: int) -> Iterator[tuple[Any, list[str]]]:
    """A page of a headless Chromium, and the URLs its frame has navigated to."""
    chromium = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            navigations: list[str] = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url))
            yield page, navigations
        finally:
            browser.close()


# Waits for the charts drawn for their column: charts.js asks for <main> once
# more on load when the server drew them for another width, and a pointer
# placed on the first drawing can land on that swap (CI saw both a click lost
# and a readout of an empty column).
CHARTS_FITTED = """() => {
    const svg = document.querySelector('main .charts > figure.chart svg.chart');
    return !svg || svg.viewBox.baseVal.width === window.nodesamplerChartWidth;
}"""


def open_page(page: Any, url: str) -> None:
    """Goes to `url` and returns once its charts are the ones drawn for their column."""
    page.goto(url)
    page.wait_for_function(CHARTS_FITTED)


def test_node_page_refreshes_in_place(fleet: Fleet) -> None:
    fleet.start_control_plane()
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(1000, 500) as (page, navigations):
        open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/n1")
        assert page.locator("h1").inner_text().startswith("n1")
        # Every chart of the hour drawn, or one line saying why it has nothing (no engine's queue here).
        assert page.locator("main svg.chart").count() >= 3
        assert page.locator("main .charts > figure.chart, main .charts > p.chart-none").count() >= 6
        first = page.locator("main p.rendered").inner_text()
        page.evaluate("window.scrollTo(0, 300); window.__stayed = 'yes'")
        scrolled = page.evaluate("window.scrollY")
        assert scrolled > 0
        # The page's own timer swaps <main> every 15 s; wait for that event.
        page.wait_for_function(
            "initial => document.querySelector('main p.rendered').innerText !== initial", arg=first, timeout=60_000
        )
        assert page.evaluate("window.__stayed") == "yes"  # the same document: no reload
        assert len(navigations) == 1  # only the first load
        assert page.evaluate("window.scrollY") == scrolled
        # Every chart of the hour drawn, or one line saying why it has nothing (no engine's queue here).
        assert page.locator("main svg.chart").count() >= 3
        assert page.locator("main .charts > figure.chart, main .charts > p.chart-none").count() >= 6
        page.screenshot(path=str(ARTIFACTS / "node-page.png"), full_page=True)
        open_page(page, f"http://127.0.0.1:{fleet.pages_port}/")
        page.screenshot(path=str(ARTIFACTS / "cluster-page.png"), full_page=True)
    assert (ARTIFACTS / "node-page.png").stat().st_size > 10_000


def test_charts_fill_their_column_at_any_width(fleet: Fleet) -> None:
    """At 1,400 and 800 px, every chart of the node page is as wide as its
    column (two columns, then one), its value axis labelled without a
    repeated tick; a CPU node draws no GPU chart and no empty queue chart,
    a line saying why instead. Screenshots kept for the closing note."""
    fleet.start_control_plane()
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    ARTIFACTS.mkdir(exist_ok=True)
    for width, columns in ((1400, 2), (800, 1)):
        with browser_page(width, 900) as (page, _):
            open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/n1")
            # Redrawn for the column: drawn at the server's width nearest the column's (640 for a
            # 1,400 px page's half, 800 for a narrow page's whole), not the default 560 stretched.
            page.wait_for_function("w => document.querySelector('main svg.chart').viewBox.baseVal.width === w",
                                   arg=640 if columns == 2 else 800)  # fmt: skip
            charts = page.evaluate("""() => [...document.querySelectorAll('main .charts')].flatMap(section =>
                [...section.querySelectorAll(':scope > figure.chart')].map(f => ({
                    section: section.getBoundingClientRect().width, figure: f.getBoundingClientRect().width,
                    svg: f.querySelector('svg').getBoundingClientRect().width,
                    ticks: [...f.querySelectorAll('text.tick')].filter(t => t.getAttribute('text-anchor') === 'end')
                           .map(t => t.textContent)})))""")  # fmt: skip
            assert len(charts) >= 3, charts
            for chart in charts:
                assert abs(chart["svg"] - chart["figure"]) <= 1, chart  # the chart fills its column
                assert chart["svg"] >= chart["section"] / columns - 12, chart  # and the columns the section
                assert len(set(chart["ticks"])) == len(chart["ticks"]) == 3, chart
            text = page.locator("main").inner_text()
            assert "GPU utilisation by card" not in text
            assert "Requests waiting: no engine here exports a queue" in text
            page.screenshot(path=str(ARTIFACTS / f"node-page-{width}.png"), full_page=True)
            if columns == 2:  # narrowed: redrawn for the one column, without a reload
                page.evaluate("window.__stayed = 'yes'")
                page.set_viewport_size({"width": 800, "height": 900})
                page.wait_for_function("() => document.querySelector('main svg.chart').viewBox.baseVal.width === 800")
                assert page.evaluate("window.__stayed") == "yes"
    assert (ARTIFACTS / "node-page-800.png").stat().st_size > 10_000


def post_as(fleet: Fleet, node: str, path: str, body: dict[str, Any]) -> int:
    """A body to the agent listener, as node `node` (its token from the fleet's secret)."""
    import urllib.request

    token = subprocess.run(fleet.cli("token", node, "--secret-file", str(fleet.secret)), capture_output=True,
                           check=True).stdout.decode().strip()  # fmt: skip
    request = urllib.request.Request(f"http://127.0.0.1:{fleet.agent_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as r:
        return int(r.status)


def test_the_pointer_reads_each_series_value_in_its_unit(fleet: Fleet) -> None:
    """A node whose CPU was 37.5% on average and 100% at its highest:
    the pointer over that moment reads both in percent, a crosshair stands
    in every chart of the page at once, and the legend's key hides its
    series (and its readout)."""
    from tests.fakeclock_registry import _heartbeat

    fleet.start_control_plane()
    assert post_as(fleet, "h1", "/v1/register", {"node": "h1", "cpus": 64, "backend": "bpf"}) == 200
    body = _heartbeat("h1", None, [])
    now = time.time()
    body["window"] = {"start": now - 5, "end": now, "samples": 50}
    assert post_as(fleet, "h1", "/v1/heartbeat", body) == 200
    with browser_page(1400, 900) as (page, _):
        open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/h1")
        cpu = page.locator("main svg.chart[aria-label^='CPU']")
        # The column that holds the heartbeat (its last point), in the page's pixels.
        where = cpu.evaluate("""svg => {
            const col = svg.querySelector('path[data-v]').dataset.v.split(',').findIndex(v => v !== '');
            const box = svg.getBoundingClientRect(), scale = box.width / svg.viewBox.baseVal.width;
            return {x: box.left + (Number(svg.dataset.x0) + col + 0.5) * scale, y: box.top + box.height / 2};
        }""")  # fmt: skip
        page.mouse.move(where["x"], where["y"])
        tip = page.locator(".chart-tip")
        assert tip.is_visible()
        lines = tip.inner_text().splitlines()
        assert "mean: 37.5%" in lines and "max: 100.0%" in lines, lines
        charts = page.locator("main svg.chart[data-from]").count()
        assert charts >= 2 and page.locator("main svg.chart line.crosshair").count() == charts
        figure = page.locator("main figure.chart", has=page.locator("svg.chart[aria-label^='CPU']"))
        figure.locator(".legend .key", has_text="max").click()
        page.mouse.move(where["x"], where["y"] + 1)
        assert "max: 100.0%" not in tip.inner_text() and "mean: 37.5%" in tip.inner_text()
        # A refresh draws <main> anew: the series stays hidden, the readout is the new drawing's.
        before = page.evaluate("document.querySelector('main').dataset.renderedAt")
        page.evaluate("window.nodesamplerRefresh()")
        assert page.evaluate("document.querySelector('main').dataset.renderedAt") != before
        assert figure.locator(".legend .key.off", has_text="max").count() == 1
        assert figure.locator("svg.chart path[data-v]").evaluate_all(
            "paths => paths.map(p => p.style.display)") == ["", "none"]  # fmt: skip
        assert tip.is_visible() and "mean: 37.5%" in tip.inner_text() and "max:" not in tip.inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "pointer-readout.png"))


def test_the_live_view_draws_every_sample_as_it_arrives(fleet: Fleet) -> None:
    """The toggle on: the charts gain points window after window without a
    reload, with each window's mean, p95 and max drawn over them."""
    fleet.start_control_plane()
    fleet.start_agent("--hz", "10")
    fleet.wait_for(fresh_with_seq)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "live-view.png"
    with browser_page(1000, 900) as (page, navigations):
        open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/n1")
        toggle = page.locator("#live-toggle")
        assert toggle.is_visible()
        toggle.click()
        machine = "svg.live[data-key=machine] path.samples"
        page.wait_for_selector(machine, timeout=60_000)
        first = page.evaluate(f"document.querySelector('{machine}').getAttribute('d').split(/[ML]/).length")
        # More windows arrive: the same chart, more points.
        page.wait_for_function(
            f"n => document.querySelector('{machine}').getAttribute('d').split(/[ML]/).length > n",
            arg=first, timeout=60_000)  # fmt: skip
        for which in ("mean", "p95", "max"):
            assert page.locator(f"svg.live[data-key=machine] line.summary.{which}").count() >= 2
        assert page.locator("svg.live[data-key^='shard:']").count() >= 1
        assert "samples in the last minute" in page.locator("#live-status").inner_text()
        assert len(navigations) == 1  # no reload
        page.locator("#live").screenshot(path=str(shot))
        toggle.click()
        assert page.locator("#live-status").inner_text() == "Off."
    assert shot.stat().st_size > 5_000


def test_a_starved_engine_beside_a_healthy_one(fleet: Fleet, cpu_cgroup: CpuCgroup,
                                              group: list[subprocess.Popen[str]]) -> None:  # fmt: skip
    """Three busy threads capped at half a core, and one busy thread with the
    machine to itself: the agent measures both, the control plane judges them,
    the node page marks the first and says why."""
    cpu_cgroup.cap(0.5)
    # Each on a CPU of its own; the healthy one busy a third of the time, as a
    # fed engine is, and ahead of whatever else runs on its CPU (nice -10): a
    # CI machine's other work kept both CPUs busy and really starved it (it
    # waited 2.4 s for a CPU each second), and this test is of the judgment.
    cpus = sorted(os.sched_getaffinity(0))
    starved = start_group(busy_threads(3, cpus[0]))
    healthy = start_group(busy_threads(1, cpus[-1], duty=0.3, nice=-10))
    group += [starved, healthy]
    cpu_cgroup.add(starved.pid)
    config = fleet.tmp / "engines.toml"
    config.write_text(f'[[shard]]\nid = "s0"\nmodel = "capped-70b"\nreplica = "r1"\nselect = "pid:{starved.pid}"\n'
                      f'[[shard]]\nid = "s1"\nmodel = "roomy-8b"\nreplica = "r1"\nselect = "pid:{healthy.pid}"\n')
    fleet.start_control_plane()
    fleet.start_agent("--config", str(config))

    def judged(nodes: list[dict[str, Any]]) -> bool:
        if not fresh_with_seq(nodes):
            return False
        shards = {s["id"]: s for s in nodes[0]["heartbeat"]["shards"]}
        if "cpu_throttled_ratio" not in shards.get("s0", {}):
            return False  # the engines' first window: no throttled share yet (a rate needs two readings)
        verdicts = {sid: s.get("starved", {}) for sid, s in shards.items()}
        return bool(verdicts["s0"].get("cpu_starved") == 1 and verdicts.get("s1", {}).get("cpu_starved") == 0)

    fleet.wait_for(judged)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "starved-engines.png"
    with browser_page(1500, 400) as (page, _):
        rows, marked = page.locator("table.engines tbody tr"), page.locator("table.engines tr.starved")
        # The page shows the newest window; a window in which the machine's own work
        # (this browser starting) delayed the healthy engine is starved too: load again.
        for _ in range(30):
            seq = fleet.nodes()[0]["heartbeat"]["seq"]
            open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/n1")
            if marked.count() == 1 and "throttled" in marked.inner_text():
                break
            fleet.wait_for(lambda nodes: fresh_with_seq(nodes, seq))  # noqa: B023 (called here, at once)
        else:
            raise AssertionError(page.locator("table.engines").inner_text())
        assert rows.count() == 2 and "capped-70b" in marked.inner_text()
        assert marked.locator(".verdict").inner_text() == "CPU-starved"
        why = marked.locator(".why").inner_text()
        assert why.startswith("throttled in ") and "(quota 0.5 cores, 4 threads)" in why, why
        fed = rows.filter(has_text="roomy-8b")
        assert fed.locator(".verdict").inner_text() == "ok" and fed.locator(".why").count() == 0
        page.locator("table.engines").screenshot(path=str(shot))
    assert shot.stat().st_size > 5_000


# Each burst says the cores it had (its CPU time over its wall time): on a
# machine whose other work took half the CPU it ran at 0.5, and the page is
# right to draw 0.5.
BURST = ("import hashlib, sys, time\ndata = bytes(1 << 20)\nprint('ready', flush=True)\n"
         "for line in sys.stdin:\n    t, cpu = time.monotonic(), time.thread_time()\n"
         "    end = t + float(line)\n"
         "    while time.monotonic() < end:\n        hashlib.sha256(data).digest()\n"
         "    print('done', (time.thread_time() - cpu) / (time.monotonic() - t), flush=True)\n")  # fmt: skip


def test_every_sample_around_a_past_burst(fleet: Fleet, group: list[subprocess.Popen[str]]) -> None:
    """An engine idle but for a burst of one busy core at a moment the test
    knows; once the live minute and the window summaries are all that is
    left anywhere else, the node page's "every sample around here" draws the
    burst at its level, from the agent's ring, at 100 samples a second (the
    kernel backend: /proc's ticks are too coarse for that rate)."""
    if os.geteuid() != 0:
        unavailable("the kernel backend needs root")
    engine = subprocess.Popen([sys.executable, "-c", BURST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, process_group=0)  # fmt: skip
    group.append(engine)
    assert engine.stdin is not None and engine.stdout is not None and engine.stdout.readline() == "ready\n"
    config = fleet.tmp / "engines.toml"
    config.write_text(f'[[shard]]\nid = "s0"\nmodel = "bursty-8b"\nselect = "pid:{engine.pid}"\n')
    fleet.start_control_plane()
    fleet.start_agent("--config", str(config), "--hz", "100", "--backend", "bpf")
    fleet.wait_for(lambda nodes: fresh_with_seq(nodes, 2) and nodes[0]["heartbeat"]["backend"] == "bpf", timeout=120)
    began = time.time()
    engine.stdin.write("2\n")
    engine.stdin.flush()
    said, level = engine.stdout.readline().split()
    assert said == "done" and 0 < float(level) <= 1.0
    ended = time.time()
    at = (began + ended) / 2
    # The span is a minute around the burst: whole once the node's ring has passed its end.
    fleet.wait_for(lambda nodes: fresh_with_seq(nodes) and nodes[0]["heartbeat"]["window"]["end"] > at + 31,
                   timeout=90)  # fmt: skip
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "hindsight-around.png"
    with browser_page(1000, 1400) as (page, _):
        open_page(page, f"http://127.0.0.1:{fleet.pages_port}/node/n1")
        section = page.locator("#hindsight")
        chart = page.locator("main svg.chart[data-from]").first

        def click_at(t: float) -> None:
            """A click on the chart of the hour where it draws wall time t."""
            x = page.evaluate("([svg, t]) => { const d = svg.dataset;"
                              " const f = (t - Number(d.from)) / (Number(d.to) - Number(d.from));"
                              " const x = Number(d.x0) + f * (Number(d.x1) - Number(d.x0));"
                              " return x * svg.getBoundingClientRect().width / svg.viewBox.baseVal.width; }",
                              [chart.element_handle(), t])  # fmt: skip
            chart.click(position={"x": x, "y": 60})

        # A moment long before the agent started can never be fetched: the page says why (a 400).
        click_at(began - 1500)
        page.wait_for_function("document.getElementById('hindsight-status').textContent.includes('ring holds')",
                               timeout=10_000)  # fmt: skip
        assert page.evaluate("document.getElementById('hindsight').dataset.span === undefined")
        # A click on the burst asks for the minute around that moment.
        click_at(at)
        page.wait_for_function("document.getElementById('hindsight').dataset.span !== undefined", timeout=10_000)
        clicked = section.get_attribute("data-span")
        page.evaluate("t => { const i = document.getElementById('hindsight-at');"
                      " i.value = new Date(t * 1000 - new Date(t * 1000).getTimezoneOffset() * 60000)"
                      ".toISOString().slice(0, 19); }", at)  # fmt: skip
        page.locator("#hindsight-form button").click()
        page.wait_for_function(f"(() => {{ const s = document.getElementById('hindsight').dataset;"
                               f" return s.span !== '{clicked}' && s.state === 'done'; }})()", timeout=60_000)
        span_id = section.get_attribute("data-span")
        for key in ("machine", "shard:s0"):
            assert page.locator(f"#hindsight svg.live[data-key='{key}'] path.samples").get_attribute("d")
            for which in ("mean", "p95", "max"):
                assert page.locator(f"#hindsight svg.live[data-key='{key}'] line.summary.{which}").count() >= 30
        assert "samples from" in page.locator("#hindsight-status").inner_text()
        section.screenshot(path=str(shot))
    assert shot.stat().st_size > 5_000
    status, body = fleet.pages(f"/api/hindsight/{span_id}")
    assert status == 200
    got = json.loads(body)
    assert got["state"] == "done" and got["from"] == pytest.approx(at - 30, abs=1)  # the input holds whole seconds
    # The agent started seconds before the burst: the minute's start is before its ring, and said so.
    assert [m["why"] for m in got["missing"]] == ["older than the node keeps (its --hindsight)"]
    assert got["missing"][0]["to"] < began - 1
    cores = next(s["cpu_cores"] for s in got["shards"] if s["id"] == "s0")
    ends = got["from"] + cores["start"] + np.cumsum(cores["us"]) / 1e6
    values = np.array([np.nan if v is None else v for v in cores["v"]])
    held = at + 30 - got["missing"][0]["to"]
    assert len(values) > 50 * held  # every sample held, at 100 a second (a busy CI machine drops some)
    during = values[(ends > began + 0.3) & (ends < ended - 0.3)]
    before = values[ends < began - 1]
    assert np.nanmean(during) == pytest.approx(float(level), abs=0.2), (level, during)
    assert np.nanpercentile(during, 50) >= 0.8 * float(level) and np.nanmean(before) < 0.1
