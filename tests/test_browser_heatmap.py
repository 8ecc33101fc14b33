"""The fleet's picture in a real browser (headless Chromium, as
tests/test_browser.py drives it): the pages' app serving 1,000 nodes with
their hour, a burst on one of them in one window. The burst's cell is the
palette's top colour, the pointer there names the node and its value, a
click opens that node at that moment; the picture fills its column at
1,400 and 800 px; a fleet without GPUs offers no GPU picture and draws no
GPU chart. Screenshots kept for the closing note."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from urllib.parse import parse_qs, urlparse

import pytest
from aiohttp import web

from controlplane import pages_api
from controlplane.history.backends import EmbeddedHistory
from controlplane.history.heatmap import LEVELS, MEASURES, heatmap, level_colour
from controlplane.state.registry import NodeRegistry
from tests.heatmap_fleet import fleet_with_history, node_name
from tests.test_browser import ARTIFACTS, browser_page, open_page
from web.pages import add_pages

pytestmark = [pytest.mark.live, pytest.mark.timing]

BURST = node_name(421)


@contextlib.contextmanager
def serving(registry: NodeRegistry, history: EmbeddedHistory) -> Iterator[int]:
    """The pages' app on a port of 127.0.0.1, its loop on a thread of its own."""
    app = pages_api.create_app(registry, history=history)
    add_pages(app, history)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)


def test_a_burst_on_one_node_in_a_thousand_is_seen_and_opened() -> None:
    registry, history, _ = fleet_with_history(1000, 60, {BURST: 3})
    ARTIFACTS.mkdir(exist_ok=True)
    with serving(registry, history) as port, browser_page(1400, 1000) as (page, navigations):
        open_page(page, f"http://127.0.0.1:{port}/")
        img = page.locator("main #heatmap img.heatmap")
        img.evaluate("img => img.decode()")
        end = float(parse_qs(urlparse(img.get_attribute("src") or "").query)["end"][0])
        picture = heatmap(history, MEASURES["cpu"], end, history.interval)  # the one the page drew (kept)
        [row] = [i for i, r in enumerate(picture.rows) if BURST in r.nodes]
        [column] = [c for c in range(picture.columns) if picture.rows[row].levels[c] == LEVELS - 1]
        # The cell's pixel, read back from the image the browser decoded.
        pixel = img.evaluate("""(img, at) => {
            const canvas = document.createElement('canvas');
            canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
            const g = canvas.getContext('2d');
            g.drawImage(img, 0, 0);
            return [...g.getImageData(at.column, at.row, 1, 1).data.slice(0, 3)];
        }""", {"row": row, "column": column})  # fmt: skip
        assert tuple(pixel) == level_colour(LEVELS - 1)
        box = img.bounding_box()
        assert box is not None
        section = page.locator("main #heatmap").bounding_box()
        assert section is not None and box["width"] >= section["width"] * 0.8  # the picture fills its column
        x = box["x"] + (column + 0.5) * box["width"] / picture.columns
        y = box["y"] + (row + 0.5) * box["height"] / len(picture.rows)
        page.mouse.move(x, y)
        readout = page.locator("#heatmap-readout")
        page.wait_for_function("() => document.querySelector('#heatmap-readout').innerText.includes('100%')")
        assert BURST in readout.inner_text() and "5 nodes of" in readout.inner_text()
        page.screenshot(path=str(ARTIFACTS / "cluster-heatmap-1400.png"))
        page.mouse.click(x, y)
        page.wait_for_url(f"**/node/{BURST}?at=*")
        assert page.locator("#moment").is_visible()
        assert "from the fleet's picture" in page.locator("#moment").inner_text()
        at = float(parse_qs(urlparse(page.url).query)["at"][0])
        assert picture.start + column * picture.step < at < picture.start + (column + 1) * picture.step
        assert len(navigations) == 2  # the cluster page, then the node's (the cell's 303 followed)
    with serving(registry, history) as port, browser_page(800, 1000) as (page, _):
        open_page(page, f"http://127.0.0.1:{port}/")
        img = page.locator("main #heatmap img.heatmap")
        img.evaluate("img => img.decode()")
        box, section = img.bounding_box(), page.locator("main #heatmap").bounding_box()
        assert box is not None and section is not None and box["width"] >= section["width"] * 0.7
        page.screenshot(path=str(ARTIFACTS / "cluster-heatmap-800.png"))


def test_a_fleet_without_gpus_has_no_gpu_picture_or_chart() -> None:
    registry, history, _ = fleet_with_history(50, 10, gpus=False)
    with serving(registry, history) as port, browser_page(1400, 900) as (page, _):
        open_page(page, f"http://127.0.0.1:{port}/?measure=gpu")
        text = page.locator("main").inner_text()
        assert "GPU charts: no GPUs on this fleet's fresh nodes" in text
        assert "GPU utilisation" not in text and "SMs busy" not in text
        assert page.locator("main svg.chart").count() == 0
        assert page.locator("main #heatmap img.heatmap").count() == 1
