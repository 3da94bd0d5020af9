"""The documentation site as a reader gets it: built strictly, read in headless Chromium.

The site is built once for this module (``mkdocs build --strict``, as ``make
docs`` does) and served on 127.0.0.1; Debian's Chromium, driven by Playwright,
opens it with every request that would leave localhost refused and recorded.
With ``MDB_DOCS_SCREENSHOTS=DIR`` the home page, the search for "backout" and the
poison-messages guide are kept as screenshots in DIR (docs/images/ holds the ones of the notes).
"""

from __future__ import annotations

import functools
import html
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import urlopen

import pytest

from tests.conftest import ROOT

# One worker builds and serves the site for every test of the module.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.xdist_group("docs-site")]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
# An element that loads something: its address attribute.
LOADS = re.compile(r"<(?:script|link|img|iframe|source|video|audio|embed)\b[^>]*?\b(?:src|href|srcset)"
                   r"=[\"']?(?P<url>[^\"' >]+)", re.IGNORECASE)


def _missing(what: str) -> None:
    if os.environ.get("MDB_REQUIRE_SERVICES"):
        pytest.fail(f"{what} is missing (MDB_REQUIRE_SERVICES=1: a missing tool is a failure)")
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs`` builds it, into a folder of this test run."""
    folder = tmp_path_factory.mktemp("site")
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        _missing("mkdocs (pip install 'mdbcontainer[docs]'; make install installs it)")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                            "--site-dir", str(folder)], cwd=ROOT, capture_output=True, text=True,
                           timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return folder


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install 'mdbcontainer[test]')")
    if not Path(CHROMIUM).exists():
        _missing("chromium (apt-get install chromium; .ci/run installs it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, served: str) -> Iterator[Any]:
    """A page whose requests may go to the site's server only; the others are refused and kept."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    outside: list[str] = []

    def route(request_route: Any) -> None:
        url = request_route.request.url
        if urlparse(url).hostname == "127.0.0.1" or url.startswith(("data:", "blob:")):
            request_route.continue_()
        else:
            outside.append(url)
            request_route.abort()

    context.route("**/*", route)
    page = context.new_page()
    # a loaded machine: the search index is built by a web worker after the page loads
    page.set_default_timeout(30_000)
    from playwright.sync_api import expect

    expect.set_options(timeout=30_000)
    page.outside = outside
    yield page
    context.close()
    assert outside == [], f"requests left localhost: {outside}"


def screenshot(page: Any, name: str) -> None:
    folder = os.environ.get("MDB_DOCS_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=False)


def test_no_page_loads_anything_from_outside(site: Path) -> None:
    outside = []
    for built in site.rglob("*"):
        if built.suffix == ".html":
            urls = [m["url"] for m in LOADS.finditer(built.read_text(encoding="utf-8"))]
        elif built.suffix == ".css":
            urls = re.findall(r"url\(\s*[\"']?([^\"')]+)", built.read_text(encoding="utf-8"))
            urls += re.findall(r"@import\s+[\"']([^\"']+)", built.read_text(encoding="utf-8"))
        else:
            continue
        outside += [f"{built.relative_to(site)}: {url}" for url in urls if re.match(r"^(https?:)?//", url)]
    assert outside == []
    assert (site / "index.html").exists() and (site / "search" / "search_index.json").exists()


def test_the_home_page_renders(page: Any, served: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{served}/index.html")
    expect(page).to_have_title(re.compile("mdbcontainer"))
    expect(page.locator("article h1")).to_have_text(re.compile("mdbcontainer"))
    expect(page.get_by_role("link", name="Getting started").first).to_be_visible()
    # the theme's own stylesheet and script are there, served by the site itself
    assert page.evaluate("getComputedStyle(document.querySelector('.md-header')).position") == "sticky"
    assert page.evaluate("typeof document$ !== 'undefined'")
    screenshot(page, "site-home.png")


def test_the_navigation_reaches_every_guide(page: Any, served: str) -> None:
    from playwright.sync_api import expect

    assert len(GUIDES) >= 12
    page.goto(f"{served}/index.html")
    links = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link[href]",
                                      "links => links.map(a => a.href)")
    reached = {urlparse(link).path.lstrip("/") for link in links}
    pages = {str(md.relative_to(ROOT / "docs").with_suffix(".html")) for md in (ROOT / "docs").rglob("*.md")
             if "_hooks" not in md.parts}
    assert pages - reached == set(), "every page of docs/ is in the navigation"
    for guide in GUIDES:
        address = f"guides/{guide.stem}.html"
        assert address in reached, f"the navigation has no link to {address}"
        title = next(line[2:] for line in guide.read_text(encoding="utf-8").splitlines()
                     if line.startswith("# "))
        with urlopen(f"{served}/{address}") as answer:  # each page as served; one in the browser below
            heading = re.search(r"<h1[^>]*>(.*?)</h1>", answer.read().decode(), re.DOTALL)
        assert heading, address
        text = html.unescape(re.sub(r"<[^>]+>", "", heading[1])).replace("¶", "").strip()
        assert text == re.sub(r"[`*]", "", title), address
    # a reader's click: the navigation's link to a guide opens that guide
    page.locator("nav.md-nav--primary a.md-nav__link[href$='guides/poison-messages.html']").first.click()
    expect(page).to_have_url(re.compile(r"guides/poison-messages\.html$"))
    expect(page.locator("article h1")).to_contain_text("Poison messages")


def test_search_for_backout_finds_the_poison_messages_guide(page: Any, served: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{served}/index.html")
    page.locator("input.md-search__input").fill("backout")
    results = page.locator(".md-search-result__item a")
    expect(results.first).to_be_visible()
    found = results.evaluate_all("links => links.map(a => a.href)")
    assert any("guides/poison-messages.html" in link for link in found), found
    screenshot(page, "site-search.png")
    page.goto(f"{served}/guides/poison-messages.html")
    expect(page.locator("article h1")).to_contain_text("Poison messages")
    screenshot(page, "site-poison.png")
