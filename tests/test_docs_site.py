"""The built docs site works in a real browser, with no network.

The module loads the site built strictly into the folder ``$TINYVLLM_DOCS_SITE_DIR`` names
(``.ci/run`` builds it there in its docs step, before the tests, so CI builds the site once;
the folder must hold an ``index.html``), or, with the variable unset, builds it strictly into
a temporary directory itself (a local run). It serves the site on 127.0.0.1 and loads its
pages (every ``*.html`` the build wrote, except ``404.html``) in headless Chromium, driven by
Playwright, ``CRAWL_TABS`` pages at a time in tabs of one browser; each tab records its own
page's events. Of the generated code pages, one template around one file each, it loads a
sample and reads the rest as HTML (``_crawl_plan``): their links, anchors and fetched files
are checked, and they must fetch what the loaded ones fetch. Requests that leave 127.0.0.1
are recorded, and fail at a proxy where nothing listens (``_open_context``): nothing is
fetched. No request is routed through Playwright, so the browser's HTTP cache works across
pages. While the crawl runs the server answers the search index's URL with a cut index (see
``_crawl``); the search test loads the full one.
The tests then check, page by page (the links and other hosts on every page, loaded or read):

- every mermaid diagram was drawn as an SVG by the copy of mermaid the site serves;
- no console error, no uncaught error, no external request, no failed local request;
- every same-site link answers 200 and every ``#fragment`` names an element on its target;
- no code block is wider than its box at a 1400x900 viewport;
- the search box finds a Chinese word of a quoted seed sentence.

Chromium: Debian's ``/usr/bin/chromium`` (``apt-get install chromium``), or the binary named
by ``$TINYVLLM_CHROMIUM``; Playwright's own browser downloads are never used. Without a
browser the browser tests skip, unless ``TINYVLLM_REQUIRE_BROWSER=1`` (CI sets it): then
they fail. The first tests need no browser: they check the mermaid hook's download, integrity
check, cache and failure message.
"""

from __future__ import annotations

import base64
import collections
import functools
import hashlib
import html.parser
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK_FILE = ROOT / "docs_hooks" / "mermaid_assets.py"
VIEWPORT = {"width": 1400, "height": 900}
# The ```mermaid fences the pages had when this test was written: prefix_hashing,
# block_pool, kv_cache_manager (2), free_queue, thinking_budget, scheduler. Pages may add
# more; finding fewer means the test no longer detects diagrams.
MIN_DIAGRAMS = 7
# Pages loading at once in the crawl (tabs of one browser). On CI's two cores, 4 tabs take
# about half the time of one (bench/docs_site_crawl.py measures it); more gain nothing.
CRAWL_TABS = 4
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_HINT = (
    "install Debian's Chromium (apt-get update && apt-get install -y chromium) "
    "and the browser extra (pip install -e '.[browser]'), or point TINYVLLM_CHROMIUM at a "
    "Chromium binary; set TINYVLLM_REQUIRE_BROWSER=1 to fail instead of skipping"
)

# Material draws each diagram into a *closed* shadow root, which page scripts cannot read.
# This script runs before any page script and keeps a reference to every shadow root. It
# also counts uncaught errors, so the wait for diagrams ends early when one fails to draw.
RECORD_SHADOW_ROOTS = """
(() => {
  window.__tinyvllmErrors = 0;
  const count = () => { window.__tinyvllmErrors += 1; };
  window.addEventListener("error", count);
  window.addEventListener("unhandledrejection", count);
  const attach = Element.prototype.attachShadow;
  window.__tinyvllmShadowRoots = [];
  Element.prototype.attachShadow = function (init) {
    const root = attach.call(this, init);
    window.__tinyvllmShadowRoots.push([this, root]);
    return root;
  };
})();
"""
COUNT_DRAWN_DIAGRAMS = """
() => (window.__tinyvllmShadowRoots || []).filter(([host, root]) => {
  if (!host.isConnected || !host.classList.contains("mermaid")) return false;
  const svg = root.querySelector("svg");
  return svg !== null && svg.getAttribute("aria-roledescription") !== "error";
}).length
"""
OVERFLOWING_CODE = """
() => [...document.querySelectorAll("pre, pre > code")]
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => `<${e.tagName.toLowerCase()}> ${e.scrollWidth}px of content in a ${e.clientWidth}px box,`
            + ` first line: ${JSON.stringify((e.textContent.split("\\n")[0] || "").slice(0, 80))}`)
"""
LINKS = "() => [...document.querySelectorAll('a[href]')].map(a => a.href)"
ANCHORS = """
() => [...document.querySelectorAll('[id], [name]')]
  .flatMap(e => [e.id, e.getAttribute('name')]).filter(Boolean)
"""

READ_PAGE = f"""
() => ({{drawn: ({COUNT_DRAWN_DIAGRAMS})(), links: ({LINKS})(), anchors: ({ANCHORS})(),
        overflowing: ({OVERFLOWING_CODE})()}})
"""


def _require_browser() -> bool:
    return os.environ.get("TINYVLLM_REQUIRE_BROWSER") == "1"


def _no_browser(reason: str):
    if _require_browser():
        pytest.fail(f"TINYVLLM_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason}; {INSTALL_HINT}")


def _find_chromium() -> str | None:
    named = os.environ.get("TINYVLLM_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _load_hook():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("mermaid_assets_under_test", HOOK_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _closed_port_url(path: str = "mermaid.tgz") -> str:
    """A URL on 127.0.0.1 where nothing listens: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/{path}"


def _fake_tarball(tmp_path: Path, script: bytes) -> tuple[Path, str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/dist/mermaid.min.js")
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script))
    path = tmp_path / "mermaid.tgz"
    path.write_bytes(buf.getvalue())
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(buf.getvalue()).digest()).decode()
    return path, integrity


# --- The mermaid hook, without a browser -------------------------------------------------


def test_mermaid_hook_pins_a_release_and_its_sha512(monkeypatch):
    hook = _load_hook()
    major, _minor, _patch = (int(part) for part in hook.MERMAID_VERSION.split("."))
    assert major >= 11, hook.MERMAID_VERSION
    algo, _, digest = hook.MERMAID_INTEGRITY.partition("-")
    assert algo == "sha512" and len(base64.b64decode(digest)) == 64, hook.MERMAID_INTEGRITY
    monkeypatch.delenv("TINYVLLM_NPM_REGISTRY", raising=False)
    assert hook.tarball_url() == (
        f"https://registry.npmjs.org/mermaid/-/mermaid-{hook.MERMAID_VERSION}.tgz"
    )


def test_mermaid_hook_extracts_a_verified_tarball_and_then_uses_its_cache(tmp_path):
    hook = _load_hook()
    tarball, integrity = _fake_tarball(tmp_path, b"window.mermaid = {};\n")
    cache = tmp_path / "cache"
    path = hook.mermaid_js(cache=cache, url=tarball.as_uri(), version="0.0.1", integrity=integrity)
    assert path == cache / "mermaid-0.0.1" / "mermaid.min.js"
    assert path.read_bytes() == b"window.mermaid = {};\n"
    # A second build reads the cache: the download address is never tried.
    again = hook.mermaid_js(cache=cache, url=_closed_port_url(), version="0.0.1", integrity=integrity)
    assert again == path


def test_mermaid_hook_rejects_a_tarball_that_fails_the_integrity_check(tmp_path):
    hook = _load_hook()
    from mkdocs.exceptions import PluginError

    tarball, _ = _fake_tarball(tmp_path, b"window.mermaid = {};\n")
    cache = tmp_path / "cache"
    with pytest.raises(PluginError, match="integrity mismatch"):
        hook.mermaid_js(cache=cache, url=tarball.as_uri(), version="0.0.1")  # pinned sha512
    assert not (cache / "mermaid-0.0.1" / "mermaid.min.js").exists()


def test_docs_build_without_network_or_cache_stops_with_one_line_saying_what_to_do(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    hook = _load_hook()
    cache = tmp_path / "empty-cache"
    env = dict(
        os.environ,
        NO_MKDOCS_2_WARNING="1",
        TINYVLLM_DOCS_CACHE=str(cache),
        TINYVLLM_NPM_REGISTRY=_closed_port_url("registry").rsplit("/", 1)[0],
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0, "the build succeeded with no mermaid download and no cache"
    lines = [line for line in proc.stderr.splitlines() if "mermaid_assets:" in line]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    for part in (f"mermaid {hook.MERMAID_VERSION}", "no cached copy", str(cache), "TINYVLLM_DOCS_CACHE"):
        assert part in line, f"{part!r} missing from: {line}"


# --- The site in a browser ----------------------------------------------------------------


SEARCH_INDEX = "search/search_index.json"


class _SiteServer(ThreadingHTTPServer):
    """Serves a built site on 127.0.0.1. While ``cut_search_index`` holds bytes, the search
    index's URL answers with them instead of the file (see ``_crawl``)."""

    daemon_threads = True
    cut_search_index: bytes | None = None


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass

    def send_head(self):
        cut = getattr(self.server, "cut_search_index", None)
        if cut is None or urllib.parse.urlsplit(self.path).path != "/" + SEARCH_INDEX:
            return super().send_head()
        if not (Path(self.directory) / SEARCH_INDEX).is_file():  # a missing index still fails
            return super().send_head()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(cut)))
        self.end_headers()
        return io.BytesIO(cut)


def _serve(site_dir: Path) -> tuple[_SiteServer, str]:
    """Starts serving ``site_dir`` on a free port of 127.0.0.1; returns the server and its base URL."""
    server = _SiteServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site_dir)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def _open_context(pw, chromium: str, base: str):
    """Chromium, and a context of it set up for a crawl of the site served at ``base``.

    The browser's proxy is a port of 127.0.0.1 where nothing listens, bypassed only for the
    site's host: every request to another host, the machine's other loopback addresses
    included (``<-loopback>``), fails there and fetches nothing, while each is still reported
    (``request`` event) and recorded as external. Chromium's bypass rules match a host, not a
    port, so another port of the site's host would be reached, and still recorded.
    """
    host = urllib.parse.urlsplit(base).hostname
    proxy = {"server": _closed_port_url("").rstrip("/"), "bypass": f"<-loopback>,{host}"}
    browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, proxy=proxy)
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    context.add_init_script(RECORD_SHADOW_ROOTS)
    return browser, context


# The <link> relations a browser fetches (a canonical or alternate link is not a request).
FETCHED_LINK_RELS = {"stylesheet", "icon", "shortcut", "preload", "modulepreload", "manifest"}


class _Anchors(html.parser.HTMLParser):
    """Collects the id and name attributes of a page and counts its mermaid blocks; also its
    links (``<a href>``) and the files its HTML makes a browser fetch (``src`` of scripts,
    images, frames and sources; ``href`` of the fetched ``<link>`` relations), both as written."""

    def __init__(self):
        super().__init__()
        self.anchors: set[str] = set()
        self.mermaid = 0
        self.links: list[str] = []
        self.resources: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.anchors.add(attrs[key])
        if tag in ("pre", "div") and "mermaid" in (attrs.get("class") or "").split():
            self.mermaid += 1
        if tag == "a" and attrs.get("href") is not None:
            self.links.append(attrs["href"])
        if tag in ("script", "img", "iframe", "source", "video", "audio", "embed") and attrs.get("src"):
            self.resources.append(attrs["src"])
        if tag == "link" and attrs.get("href") and FETCHED_LINK_RELS & set((attrs.get("rel") or "").lower().split()):
            self.resources.append(attrs["href"])


def _parse(text: str) -> _Anchors:
    parser = _Anchors()
    parser.feed(text)
    return parser


@dataclass
class Page:
    url: str
    expected_diagrams: int
    drawn_diagrams: int = 0
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    anchors: set[str] = field(default_factory=set)
    overflowing_code: list[str] = field(default_factory=list)


@dataclass
class Site:
    base: str
    pages: dict[str, Page]  # the pages loaded in the browser
    context: object  # the Playwright browser context the pages were loaded in
    external_elsewhere: list[str] = field(default_factory=list)  # requests no crawled tab saw
    read: dict[str, Page] = field(default_factory=dict)  # code pages read as HTML, not loaded
    # The files each code page's HTML makes a browser fetch (absolute URLs), loaded or not.
    code_resources: dict[str, list[str]] = field(default_factory=dict)
    all_urls: list[str] = field(default_factory=list)  # every page of the site

    def every_page(self) -> list[Page]:
        return [*self.pages.values(), *self.read.values()]


def _page_urls(site_dir: Path, base: str) -> list[str]:
    urls = []
    for path in sorted(site_dir.rglob("*.html")):
        rel = path.relative_to(site_dir).as_posix()
        if rel == "404.html":
            continue
        urls.append(base + (rel[: -len("index.html")] if rel.endswith("index.html") else rel))
    return urls


CODE_PAGES = "code/"  # the generated page of every repository file (docs_hooks/site_pages.py)


def _html_file(site_dir: Path, base: str, url: str) -> Path:
    rel = url[len(base):]
    return site_dir / (rel + "index.html" if rel == "" or rel.endswith("/") else rel)


def _crawl_plan(site_dir: Path, base: str, urls: list[str], root: Path = ROOT) -> tuple[list[str], list[str]]:
    """Splits ``urls`` into the pages the browser loads and the code pages read as HTML only.

    Every page outside ``code/`` is loaded. The code pages (368 of 444 pages, 2026-11-30) are
    one template around one escaped file each, so the browser loads a sample that covers it:
    the largest page of each folder, the page of the repository file with the longest line
    (the one most likely to overflow its box), and any page whose HTML holds a diagram or a
    trace. The rest are read from their HTML (``_read_html``): their links and anchors are
    checked like a loaded page's, their fetched files must be the loaded code pages' files
    (``test_docs_code_pages_not_loaded_fetch_what_the_loaded_ones_fetch``), so the scripts
    that ran without an error on the sample are the ones they run.
    """
    code = [url for url in urls if url[len(base):].startswith(CODE_PAGES)]
    sample: set[str] = set()
    largest: dict[str, tuple[int, str]] = {}
    longest: tuple[int, str] | None = None
    for url in code:
        path = _html_file(site_dir, base, url)
        text = path.read_text(encoding="utf-8")
        if "tinyvllm-trace" in text or _parse(text).mermaid:
            sample.add(url)
        folder = url.rstrip("/").rsplit("/", 1)[0]
        largest[folder] = max(largest.get(folder, (0, "")), (path.stat().st_size, url))
        source = root / url[len(base) + len(CODE_PAGES):].rstrip("/")
        if source.is_file():
            width = max((len(line) for line in source.read_text(encoding="utf-8", errors="replace").splitlines()), default=0)
            longest = max(longest or (0, ""), (width, url))
    sample.update(url for _, url in largest.values())
    if longest is not None:
        sample.add(longest[1])
    loaded = [url for url in urls if url not in code or url in sample]
    return loaded, [url for url in code if url not in sample]


def _read_html(site_dir: Path, base: str, url: str) -> tuple[Page, list[str]]:
    """A page read from its HTML, not loaded: its links and anchors (resolved as a browser
    would), its diagrams, and the absolute URLs of the files it would fetch. Requests to
    other hosts among those are recorded as the page's external requests."""
    parsed = _parse(_html_file(site_dir, base, url).read_text(encoding="utf-8"))
    resources = sorted({urllib.parse.urljoin(url, src) for src in parsed.resources})
    page = Page(url=url, expected_diagrams=parsed.mermaid, anchors=parsed.anchors,
                links=[urllib.parse.urljoin(url, href) for href in parsed.links],
                external_requests=[r for r in resources if not r.startswith(base)])
    return page, resources


@dataclass
class _Visit:
    """One page being loaded in its own tab; ``closing`` is set when the tab is closed."""

    page: Page
    tab: object
    in_flight: set = field(default_factory=set)
    closing: bool = False  # requests cut short by closing the tab are not failures


def _small_search_index(site_dir: Path) -> bytes:
    """The site's search index cut to its config and first document (a few hundred bytes)."""
    index = json.loads((site_dir / SEARCH_INDEX).read_text(encoding="utf-8"))
    return json.dumps({"config": index["config"], "docs": index["docs"][:1]}).encode()


def _start_visit(context, site_dir: Path, base: str, url: str) -> _Visit:
    """Opens a tab, hooks its events and starts loading ``url``; returns before the page loads.

    Each tab records its own page's requests that leave ``base`` (its ``request`` event),
    however many tabs are loading at once; the browser's proxy (``_open_context``) makes
    them fail, so none is fetched. No request is routed through Playwright: a route would
    turn the browser's HTTP cache off, and every page would fetch the theme's scripts, styles
    and fonts again, each request a round trip through this process.
    """
    html_file = _html_file(site_dir, base, url)
    page = Page(url=url, expected_diagrams=_parse(html_file.read_text(encoding="utf-8")).mermaid)
    visit = _Visit(page=page, tab=context.new_page())

    def started(request):
        if request.url.startswith(base):
            visit.in_flight.add(request)
        else:
            page.external_requests.append(request.url)

    def answered(response):
        if response.url.startswith(base) and response.status >= 400:
            page.failed_requests.append(f"{response.url} -> HTTP {response.status}")

    def finished(request):
        visit.in_flight.discard(request)

    def failed(request):  # requests to other hosts fail at the proxy and are reported separately
        visit.in_flight.discard(request)
        if request.url.startswith(base) and not visit.closing:
            page.failed_requests.append(f"{request.url} -> {request.failure}")

    def console(message):
        if message.type == "error":
            where = message.location.get("url") or ""
            page.console_errors.append(f"{message.text} ({where})" if where else message.text)

    tab = visit.tab
    tab.on("console", console)
    tab.on("pageerror", lambda e: page.page_errors.append(str(e)))
    tab.on("request", started)
    tab.on("response", answered)
    tab.on("requestfinished", finished)
    tab.on("requestfailed", failed)
    try:
        # "commit": the response has started; the load itself is awaited in _finish_visit,
        # while the other tabs in flight load too.
        tab.goto(url, wait_until="commit")
    except BaseException:
        visit.closing = True
        tab.close()
        raise
    return visit


def _finish_visit(visit: _Visit) -> Page:
    """Waits for the page's load, its diagrams and its local requests, reads it, closes the tab."""
    page, tab = visit.page, visit.tab
    try:
        tab.wait_for_load_state("load")
        if page.expected_diagrams:
            try:
                tab.wait_for_function(
                    f"() => window.__tinyvllmErrors > 0"
                    f" || ({COUNT_DRAWN_DIAGRAMS})() >= {page.expected_diagrams}",
                    timeout=30_000,
                )
            except Exception:  # reported through drawn_diagrams
                pass
        # Let the requests made after "load" (the search index) finish, for up to 10 s, so
        # that a failed one is seen. Waiting on this tab lets the other tabs' events run.
        deadline = time.monotonic() + 10
        while visit.in_flight and time.monotonic() < deadline:
            tab.wait_for_timeout(25)
        read = tab.evaluate(READ_PAGE)  # one round trip to the browser, not four
        page.drawn_diagrams = read["drawn"]
        page.links = read["links"]
        page.anchors = set(read["anchors"])
        page.overflowing_code = read["overflowing"]
    finally:
        visit.closing = True
        tab.close()
    page.failed_requests = sorted(set(page.failed_requests))
    return page


def _crawl(context, server: _SiteServer, site_dir: Path, base: str, urls: list[str],
           tabs: int = CRAWL_TABS) -> dict[str, Page]:
    """Loads every url, ``tabs`` at a time (a sliding window: the oldest page is finished
    while the newer ones load), and returns the pages in the order of ``urls``.

    While it runs, ``server`` answers the search index's URL with the index cut short
    (``_small_search_index``): every page fetches the 1.5 MB index after "load" and its search
    worker then spends CPU building it, which the crawl never uses and which slows the other
    tabs in flight. A wrong index URL still fails (the server answers only the right one, and
    only while the file exists); test_docs_search_finds_chinese_words searches the full index.
    """
    if tabs < 1:
        raise ValueError(f"tabs must be at least 1, got {tabs}")
    done: dict[str, Page] = {}
    window: collections.deque[_Visit] = collections.deque()
    server.cut_search_index = _small_search_index(site_dir)
    try:
        for url in urls:
            window.append(_start_visit(context, site_dir, base, url))
            if len(window) >= tabs:
                visit = window.popleft()
                done[visit.page.url] = _finish_visit(visit)
        while window:
            visit = window.popleft()
            done[visit.page.url] = _finish_visit(visit)
    finally:
        server.cut_search_index = None
        for visit in window:  # only after an error: close what is still open
            visit.closing = True
            visit.tab.close()
    return {url: done[url] for url in urls}


def _built_site(tmp_path_factory) -> Path:
    """The site to test: the folder named by ``$TINYVLLM_DOCS_SITE_DIR`` when set (CI's strict
    build, so the site is built once), else a strict build made here."""
    given = os.environ.get("TINYVLLM_DOCS_SITE_DIR")
    if given:
        site_dir = Path(given)
        assert (site_dir / "index.html").is_file(), (
            f"TINYVLLM_DOCS_SITE_DIR={given} holds no index.html: build the site there "
            f"(mkdocs build --strict -d {given}) or unset the variable"
        )
        return site_dir
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        # No -q: with -q, mkdocs drops warnings before --strict counts them.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)],
        cwd=ROOT, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return site_dir


def _chromium_and_playwright() -> str:
    """The Chromium binary to drive; skips (or fails, see _no_browser) without it or Playwright."""
    chromium = _find_chromium()
    if chromium is None:
        named = os.environ.get("TINYVLLM_CHROMIUM")
        _no_browser(
            f"TINYVLLM_CHROMIUM={named} is not an executable file" if named
            else "no Chromium binary was found (looked for /usr/bin/chromium and chromium on PATH)"
        )
    if importlib.util.find_spec("playwright") is None:
        _no_browser("the Python package 'playwright' is not installed")
    return chromium


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    chromium = _chromium_and_playwright()
    from playwright.sync_api import sync_playwright

    pytest.importorskip("mkdocs")

    site_dir = _built_site(tmp_path_factory)
    server, base = _serve(site_dir)
    in_context: list[str] = []  # every request of the context that leaves the site

    def external(request):
        if not request.url.startswith(base):
            in_context.append(request.url)

    try:
        with sync_playwright() as pw:
            browser, context = _open_context(pw, chromium, base)
            context.on("request", external)
            urls = _page_urls(site_dir, base)
            loaded, read_only = _crawl_plan(site_dir, base, urls)
            pages = _crawl(context, server, site_dir, base, loaded)
            # A request the context saw and no crawled tab recorded (a worker's of its own, say).
            elsewhere = collections.Counter(in_context) - collections.Counter(
                url for page in pages.values() for url in page.external_requests)
            read, code_resources = {}, {}
            for url in urls:
                if url[len(base):].startswith(CODE_PAGES):
                    page, code_resources[url] = _read_html(site_dir, base, url)
                    if url in read_only:
                        read[url] = page
            yield Site(base=base, pages=pages, context=context, external_elsewhere=sorted(elsewhere.elements()),
                       read=read, code_resources=code_resources, all_urls=urls)
            browser.close()
    finally:
        server.shutdown()
        server.server_close()


def test_crawl_records_a_broken_pages_requests_and_errors_and_fetches_nothing_elsewhere(tmp_path):
    """The crawl's negative control, on a two-page site: the broken page's request to another
    server, its request for a missing file and its console error are each recorded on it, the
    other server is never reached (the proxy), the clean page records nothing, and the search
    index is served cut while the crawl runs and whole after it."""
    chromium = _chromium_and_playwright()
    from playwright.sync_api import sync_playwright

    reached: list[str] = []

    class Elsewhere(_QuietHandler):
        def do_GET(self):
            reached.append(self.path)
            self.send_error(404)

    elsewhere = ThreadingHTTPServer(("127.0.0.2", 0), Elsewhere)  # another host of this machine
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    spy_url = f"http://127.0.0.2:{elsewhere.server_address[1]}/spy.png"
    (tmp_path / "search").mkdir()
    docs = [{"location": "", "title": "a", "text": ""}, {"location": "b/", "title": "b", "text": ""}]
    (tmp_path / SEARCH_INDEX).write_text(json.dumps({"config": {"lang": ["en"]}, "docs": docs}))
    (tmp_path / "index.html").write_text(
        f'<!doctype html><html><body><a id="top" href="b/">b</a><img src="{spy_url}"><img src="missing.png">'
        '<script>console.error("boom"); const x = new XMLHttpRequest(); x.open("GET", "search/search_index.json", false);'
        ' x.send(); document.body.id = "docs-" + JSON.parse(x.responseText).docs.length;</script></body></html>'
    )  # fmt: skip
    (tmp_path / "favicon.ico").write_bytes(b"")  # the browser asks for it
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "index.html").write_text('<!doctype html><html><body><p id="x">fine</p></body></html>')
    server, base = _serve(tmp_path)
    try:
        with sync_playwright() as pw:
            browser, context = _open_context(pw, chromium, base)
            try:
                pages = _crawl(context, server, tmp_path, base, _page_urls(tmp_path, base), tabs=2)
            finally:
                browser.close()
        with urllib.request.urlopen(base + SEARCH_INDEX, timeout=30) as response:
            served_after = json.loads(response.read())
    finally:
        for s in (server, elsewhere):
            s.shutdown()
            s.server_close()
    broken, clean = pages[base], pages[base + "b/"]
    assert broken.external_requests == [spy_url] and reached == []
    assert broken.failed_requests == [f"{base}missing.png -> HTTP 404"]
    assert any(error.startswith("boom") for error in broken.console_errors), broken.console_errors
    assert {"top", "docs-1"} <= broken.anchors and base + "b/" in broken.links  # the cut index: 1 doc
    assert served_after["docs"] == docs
    assert (clean.external_requests, clean.failed_requests, clean.console_errors, clean.page_errors) == ([], [], [], [])
    assert clean.anchors == {"x"}


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(problems)


def test_docs_site_has_pages(site):
    assert any(url == site.base for url in site.pages), f"no home page among {list(site.pages)}"
    assert len(site.pages) >= 10, list(site.pages)
    # Every page is loaded or read, and every page outside code/ is loaded.
    assert sorted([*site.pages, *site.read]) == sorted(site.all_urls)
    assert all(url[len(site.base):].startswith(CODE_PAGES) for url in site.read)


def test_docs_code_pages_not_loaded_fetch_what_the_loaded_ones_fetch(site):
    loaded = {tuple(files) for url, files in site.code_resources.items() if url in site.pages}
    assert loaded, "no code page was loaded in the browser"
    assert all(files for files in loaded), "a loaded code page names no script or stylesheet"
    problems = [f"{url}: fetches {files}, no loaded code page fetches that"
                for url in site.read if tuple(site.code_resources[url]) not in loaded]
    assert not problems, _report(problems, "code pages unlike the loaded ones")
    unread = [p.url for p in site.read.values() if p.expected_diagrams]
    assert not unread, f"pages with diagrams must be loaded: {unread}"


def test_crawl_plan_loads_every_page_but_code_and_a_sample_of_code(tmp_path):
    """On a small site: pages outside code/ are all loaded; of the code pages, the largest of
    each folder, the one of the file with the longest line, and one with a diagram."""
    root = tmp_path / "repo"
    files = {"src/a.py": "x = 1\n", "src/b.py": "y = 2\n" * 100, "src/c.py": "z" * 300 + "\n",
             "src/d.py": "w\n", "tests/t.py": "t\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    site_dir = tmp_path / "site"
    for rel, body in {"index.html": "home", "guide/index.html": "guide",
                      **{f"code/{name}/index.html": "p" * len(text) for name, text in files.items()},
                      "code/src/d.py/index.html": '<div class="mermaid">graph</div>'}.items():
        (site_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (site_dir / rel).write_text(body)
    base = "http://127.0.0.1:1/"
    urls = _page_urls(site_dir, base)
    loaded, read_only = _crawl_plan(site_dir, base, urls, root=root)
    code = base + "code/"
    assert loaded == [code + "src/b.py/", code + "src/c.py/", code + "src/d.py/", code + "tests/t.py/",
                      base + "guide/", base]
    assert read_only == [code + "src/a.py/"]


def test_docs_every_mermaid_diagram_is_drawn_as_svg(site):
    problems = [
        f"{p.url}: {p.drawn_diagrams} of {p.expected_diagrams} diagrams drawn as SVG"
        for p in site.pages.values()
        if p.drawn_diagrams != p.expected_diagrams
    ]
    assert not problems, _report(problems, "pages with undrawn mermaid diagrams")
    total = sum(p.expected_diagrams for p in site.pages.values())
    assert total >= MIN_DIAGRAMS, f"only {total} mermaid diagrams found in the built site"


def test_docs_pages_log_no_errors(site):
    problems = [
        f"{p.url}: {kind}: {text}"
        for p in site.pages.values()
        for kind, texts in (("console error", p.console_errors), ("uncaught error", p.page_errors))
        for text in texts
    ]
    assert not problems, _report(problems, "errors")


def test_docs_pages_request_nothing_outside_the_site(site):
    problems = [
        f"{p.url}: requested {request}" for p in site.every_page() for request in p.external_requests
    ] + [f"(no crawled tab saw it): requested {request}" for request in site.external_elsewhere]
    assert not problems, _report(problems, "requests to other hosts")


def test_docs_pages_have_no_failed_local_requests(site):
    problems = [f"{p.url}: {failure}" for p in site.pages.values() for failure in p.failed_requests]
    assert not problems, _report(problems, "failed requests")


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_docs_internal_links_and_anchors_resolve(site):
    statuses: dict[str, int] = {}
    anchors = {p.url: p.anchors for p in site.every_page()}
    problems = []
    checked = 0
    for page in site.every_page():
        for link in sorted(set(page.links)):
            if not link.startswith(site.base):
                continue
            target, _, fragment = link.partition("#")
            if target not in statuses:
                statuses[target] = _status(target)
            if statuses[target] != 200:
                problems.append(f"{page.url}: link {link} -> HTTP {statuses[target]}")
                continue
            checked += 1
            if not fragment:
                continue
            if target not in anchors:  # not a crawled page: read its HTML as served
                with urllib.request.urlopen(target, timeout=30) as response:
                    anchors[target] = _parse(response.read().decode("utf-8", "replace")).anchors
            name = urllib.parse.unquote(fragment)
            if name not in anchors[target]:
                problems.append(f"{page.url}: link {link}: no element with id or name {name!r} on {target}")
    assert not problems, _report(problems, "broken links")
    assert checked >= len(site.all_urls), f"only {checked} internal links checked"


def test_docs_code_blocks_fit_at_1400x900(site):
    problems = [f"{p.url}: {block}" for p in site.pages.values() for block in p.overflowing_code]
    assert not problems, _report(problems, "code blocks that overflow horizontally")


def test_docs_search_finds_chinese_words(site):
    # Two words of the seed sentence quoted on the thinking budget page.
    tab = site.context.new_page()
    try:
        tab.goto(site.base, wait_until="load")
        box = tab.locator("input.md-search__input")
        box.click()
        for term in ("思考", "预算"):
            box.fill(term)
            # Material searches on keyup; fill() types without key events, so send one.
            box.press("End")
            hit = tab.locator(".md-search-result__item a[href*='thinking_budget/']")
            try:
                hit.first.wait_for(state="attached", timeout=15_000)
            except Exception:
                shown = tab.locator(".md-search-result").inner_text()
                pytest.fail(f"searching {term!r} on {site.base} found no link to thinking_budget/;"
                            f" the results read: {shown!r}", pytrace=False)
            box.fill("")
            box.press("End")
            hit.first.wait_for(state="detached", timeout=15_000)
    finally:
        tab.close()



# The pages that embed a trace of the engine's steps (docs_hooks/trace_pages.py): tracing,
# kv_cache_manager, block_pool, persistent_batch, scheduler, kv_cache_memory, the CUDA-graph
# pages. Pages may add more; finding fewer means the markers were lost.
MIN_TRACE_VIEWERS = 7
MIN_TRACE_STILLS = 5
# How much of a screenshot is not white, and how many colours it has (PNG decoded by a canvas).
PIXEL_STATS = """
async (b64) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + b64;
  await img.decode();
  const canvas = document.createElement('canvas');
  canvas.width = img.width; canvas.height = img.height;
  const ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, img.width, img.height).data;
  let ink = 0; const colours = new Set();
  for (let i = 0; i < d.length; i += 4) {
    if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) ink += 1;
    colours.add((d[i] >> 4) * 256 + (d[i + 1] >> 4) * 16 + (d[i + 2] >> 4));
  }
  return {ink: ink / (d.length / 4), colours: colours.size, width: img.width, height: img.height};
}
"""


def test_docs_embedded_traces_are_drawn_not_blank(site):
    pages = []
    for url in site.pages:
        with urllib.request.urlopen(url, timeout=30) as response:
            if "tinyvllm-trace" in response.read().decode("utf-8", "replace"):
                pages.append(url)
    tab = site.context.new_page()
    problems, viewers, stills = [], 0, 0
    try:
        for url in pages:
            tab.goto(url, wait_until="load")
            for kind, selector in (("viewer", "iframe.tinyvllm-trace"), ("still", "figure.tinyvllm-trace-still img")):
                for element in tab.locator(selector).all():
                    element.scroll_into_view_if_needed()
                    if kind == "viewer":
                        viewers += 1
                        frame = element.element_handle().content_frame()
                        frame.wait_for_function("() => window.tinyvllmTrace && window.tinyvllmTrace.count > 0")
                    else:
                        stills += 1
                        tab.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=element.element_handle())
                    shot = base64.b64encode(element.screenshot()).decode()
                    stats = tab.evaluate(PIXEL_STATS, shot)
                    if stats["ink"] < 0.03 or stats["colours"] < 4:
                        problems.append(f"{url}: a {kind} looks blank: {stats}")
    finally:
        tab.close()
    assert not problems, _report(problems, "blank traces")
    assert viewers >= MIN_TRACE_VIEWERS and stills >= MIN_TRACE_STILLS, (viewers, stills, pages)
