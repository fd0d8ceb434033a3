"""Benchmark: the docs-site browser test's crawl (tests/test_docs_site.py), one tab against several.

What it measures: the seconds of a strict ``mkdocs build`` (skipped with ``--site DIR``, a
site built already), of starting Chromium, and of loading every page of the site with the test
module's own ``_crawl`` (the same checks per page) at each tab count of ``--tabs``; the 15
slowest pages of a one-tab crawl. Run it from the repository root, with no other pytest run:

    python bench/docs_site_crawl.py --site /tmp/site --tabs 1 2 3 4

It needs what the test needs: Debian's Chromium and the browser extra.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_docs_site as t  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one, timed)")
    parser.add_argument("--tabs", type=int, nargs="+", default=[1, t.CRAWL_TABS])
    parser.add_argument("--every", type=int, default=1, help="crawl every n-th page only (a quick look)")
    args = parser.parse_args()
    site_dir = args.site
    if site_dir is None:
        site_dir = Path(tempfile.mkdtemp(prefix="site-"))
        atexit.register(shutil.rmtree, site_dir, ignore_errors=True)  # a built site is megabytes
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)], cwd=ROOT,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), capture_output=True, check=True)
        print(f"build {time.monotonic() - start:.1f} s", flush=True)
    server, base = t._serve(site_dir)
    urls = t._page_urls(site_dir, base)[:: args.every]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        start = time.monotonic()
        browser, first = t._open_context(pw, t._find_chromium(), base)  # the test's browser and proxy
        print(f"launch {time.monotonic() - start:.1f} s", flush=True)
        first.close()  # each tab count below starts from a fresh context (an empty HTTP cache)
        for tabs in args.tabs:
            context = browser.new_context(viewport=t.VIEWPORT)
            context.set_default_timeout(30_000)
            context.add_init_script(t.RECORD_SHADOW_ROOTS)
            start = time.monotonic()
            if tabs == 1:  # one page at a time, timed page by page
                times = []
                for url in urls:
                    page_start = time.monotonic()
                    t._crawl(context, server, site_dir, base, [url], tabs=1)
                    times.append((time.monotonic() - page_start, url[len(base):]))
            else:
                t._crawl(context, server, site_dir, base, urls, tabs=tabs)
            print(f"tabs {tabs}: {len(urls)} pages in {time.monotonic() - start:.1f} s", flush=True)
            if tabs == 1:
                for seconds, rel in sorted(times, reverse=True)[:15]:
                    print(f"  {seconds:.2f} {rel}")
            context.close()
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main()
