"""The built docs site, opened in headless Chromium: pages render, navigation, search, links.

Skipped where Debian's Chromium (``/usr/bin/chromium``) or Playwright is missing; ``.ci/run``
installs Chromium. Playwright drives that browser (no browser download).
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
playwright_api = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "",
    "architecture/",
    "tutorials/internvl-vlm/",
    "tutorials/llava-towers/",
    "tutorials/batch-sizes-and-memory/",
    "tutorials/attention-backends/",
    "tutorials/tensor-parallel/",
    "tutorials/writing-an-adapter/",
    "tutorials/open-clip/",
    "tutorials/sentence-transformers/",
    "troubleshooting/",
    "coverage/",
    "benchmarks/",
    "benchmark-runs/",
    "releasing/",
    "reference/hooks/",
    "reference/api/",
]
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built with ``mkdocs build --strict``, served on a local port."""
    directory = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(directory)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    class QuietServer(http.server.ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a page left before its
                super().handle_error(request, client_address)  # images came is not an error

    server = QuietServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser(site: str) -> Iterator[object]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=BROWSER_ARGS
        )
        yield browser
        browser.close()


def test_every_page_renders_without_script_errors(site: str, browser: object) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on(
        "requestfailed",
        lambda request: (
            None  # a load cut short by the next navigation is not a failure
            if "ERR_ABORTED" in (request.failure or "")
            else errors.append(f"request failed: {request.url} ({request.failure})")
        ),
    )
    for path in PAGES:
        response = page.goto(site + path)
        assert response is not None and response.status == 200, path
        heading = page.locator("article h1").first
        assert heading.is_visible(), path
        assert heading.inner_text().strip(), path
    assert errors == []


def test_navigation_leads_to_the_plugin_tutorial(site: str, browser: object) -> None:
    page = browser.new_page()
    page.goto(site)
    page.locator("nav.md-nav--primary a", has_text="Writing an adapter plugin").first.click()
    page.wait_for_url("**/tutorials/writing-an-adapter/")
    heading = page.locator("article h1").inner_text().strip().removesuffix("¶")
    assert heading == "Writing an adapter plugin"
    assert "register_adapters" in page.locator("article").inner_text()


def test_search_finds_a_hook(site: str, browser: object) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(site)
    search = page.locator("input.md-search__input")
    search.click()
    search.press_sequentially("attention_metadata")
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=60000)
    assert results.count() > 0
    assert "attention_metadata" in page.locator(".md-search-result").inner_text()


def test_no_broken_links(site: str, browser: object) -> None:
    page = browser.new_page()
    targets: set[str] = set()
    for path in PAGES:
        page.goto(site + path)
        for attribute, selector in (("href", "a[href]"), ("src", "img[src]")):
            for value in page.eval_on_selector_all(
                selector, f"elements => elements.map(e => e['{attribute}'])"
            ):
                if value.startswith(site):
                    targets.add(urllib.parse.urldefrag(value).url)
    broken = []
    for target in sorted(targets):
        try:
            urllib.request.urlopen(target, timeout=10).close()
        except urllib.error.HTTPError as error:
            broken.append(f"{target}: {error.code}")
    assert len(targets) > 15 and broken == []


def test_the_current_benchmarks_page_needs_no_horizontal_scroll_at_1280_px(
    site: str, browser: object
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(site + "benchmarks/")
    tables = page.eval_on_selector_all(  # a table, and the box the theme scrolls it in
        "article table, article .md-typeset__scrollwrap",
        "boxes => boxes.map(box => [box.scrollWidth, box.clientWidth])",
    )
    assert tables and all(scroll <= client for scroll, client in tables), tables
