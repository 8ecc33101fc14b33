"""A real browser: headless Chromium (Debian's, driven by playwright) loads a
node page, waits for an in-place refresh, and keeps a screenshot."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_agent_processes import Fleet, fresh_with_seq

pytestmark = pytest.mark.live

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]  # fmt: skip


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def test_node_page_refreshes_in_place(fleet: Fleet) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium missing: make setup installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    fleet.start_control_plane()
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 500})
            navigations: list[str] = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url))
            page.goto(f"http://127.0.0.1:{fleet.pages_port}/node/n1")
            assert page.locator("h1").inner_text().startswith("n1")
            assert page.locator("main svg.chart").count() >= 5
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
            assert page.locator("main svg.chart").count() >= 5
            page.screenshot(path=str(ARTIFACTS / "node-page.png"), full_page=True)
            page.goto(f"http://127.0.0.1:{fleet.pages_port}/")
            page.screenshot(path=str(ARTIFACTS / "cluster-page.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "node-page.png").stat().st_size > 10_000
