"""The docs site reads as one path: the nav's order, each page's Next: line, the home page's list.

- every page of ``mkdocs.yml``'s nav ends with one ``**Next:**`` line, and its link names
  the page that follows it in the nav; the last page's points back at the home page's
  reading path (the seed matrix is generated: its line is in ``docs_hooks/site_pages.py``);
- a runnable start (install, ``tinyvllm generate``, an ``LLM()`` call, ``tinyvllm trace``)
  and the architecture page lie within the first eight pages of the nav;
- the GPU pages form one "Performance on a GPU" section after speculative decoding, and the
  trace tool's page is in the Reference section;
- the home page's "Start here" list names every page of the path, in the nav's order;
- a chapter split into pages a reader can finish (issue 41) lists its pages one after the
  other in the nav, none over 450 lines, and every link from the docs into one of them
  with an anchor lands on a heading of that page.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import pytest
from docs_nav import nav, nav_pages

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NEXT = re.compile(r"^\*\*Next:\*\* \[[^\]]*\]\((?P<target>[^)#\s]*)(?:#[^)]*)?\)", re.M)
GENERATED_NEXT = {"matrix.md": ROOT / "docs_hooks" / "site_pages.py"}  # pages the build writes


def _sections() -> dict[str, list[str]]:
    """Each titled nav section (a title over a list) and its pages."""
    return {title: nav_pages(value) for item in nav() for title, value in item.items() if isinstance(value, list)}


NAV = nav_pages(nav())


def _next_targets(page: str) -> list[str]:
    """The docs-relative target of each Next: line of a page (anchors dropped)."""
    source = GENERATED_NEXT.get(page, DOCS / page)
    text = source.read_text(encoding="utf-8").replace("\\n", "\n")  # the hook writes its line in a string
    here = posixpath.dirname(page) if page not in GENERATED_NEXT else ""
    return [posixpath.normpath(posixpath.join(here, m["target"])) for m in NEXT.finditer(text)]


def test_reading_path_nav_lists_each_page_once():
    assert len(NAV) == len(set(NAV)), [p for p in NAV if NAV.count(p) > 1]
    assert NAV[0] == "index.md"


@pytest.mark.parametrize("position", range(len(NAV)), ids=NAV)
def test_reading_path_next_line_names_the_page_that_follows_in_the_nav(position: int):
    page = NAV[position]
    expected = NAV[position + 1] if position + 1 < len(NAV) else "index.md"
    targets = _next_targets(page)
    assert len(targets) == 1, f"docs/{page} has {len(targets)} Next: lines (a dead end, or two ways on): {targets}"
    assert targets[0] == expected, f"docs/{page}'s Next: names {targets[0]}, but the nav's next page is {expected}"


def test_reading_path_starts_with_a_runnable_start_and_the_architecture_page():
    first = NAV[:8]
    assert "architecture.md" in first, first

    def runnable(page: str) -> bool:
        text = (DOCS / page).read_text(encoding="utf-8")
        for snippet in re.findall(r'--8<-- "([^"]+)"', text):  # included code counts as the page's
            path, _, region = snippet.partition(":")
            source = (ROOT / path).read_text(encoding="utf-8")
            if region:
                source = source.split(f"[start:{region}]", 1)[1].split(f"[end:{region}]", 1)[0]
            text += source
        return all(s in text for s in ("pip install -e .", "tinyvllm generate", "LLM(", "tinyvllm trace"))

    assert [page for page in first if runnable(page)], f"no page among the first eight of the nav is a runnable start: {first}"


def test_reading_path_gpu_pages_are_one_section_after_speculative_decoding_and_tracing_is_reference():
    sections = _sections()
    titles = list(sections)
    gpu = sections.get("Performance on a GPU")
    assert gpu is not None, f"no 'Performance on a GPU' section: {titles}"
    assert set(gpu) == {"rms_norm.md", "rotary.md", "activation.md", "dependent_launch.md", "device_syncs.md", "running_on_a_gpu.md"}, gpu
    assert titles.index("Performance on a GPU") > titles.index("Speculative decoding"), titles
    assert "tracing.md" in sections["Reference"], sections["Reference"]


def test_reading_path_home_page_lists_the_path_in_nav_order():
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    start_here = text.split("## Start here", 1)[1].split("\n## ", 1)[0]
    links = list(dict.fromkeys(m for m in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", start_here)))
    assert set(links) == set(NAV) - {"index.md"}, sorted(set(NAV) - {"index.md"} ^ set(links))
    path = [link for link in links if link not in {"tracing.md", "glossary.md", "matrix.md"}]  # the reference pages, last
    assert path == [page for page in NAV if page in path], "the home page's reading path and the nav disagree on the order"


# Chapters split into pages a reader can finish (issue 41): their pages, in reading order.
SPLIT_CHAPTERS: dict[str, tuple[str, ...]] = {
    "sampler": ("sampler.md", "sampler_draw.md", "sampler_penalties.md", "sampler_logprobs.md"),
    "generating_text": ("generating_text.md", "generating_text_generate.md", "generating_text_cli.md"),
    "serving": ("serving.md", "serving_async.md", "serving_endpoints.md", "serving_structured.md", "serving_reasoning.md",
                "serving_embeddings.md"),
}
MAX_PAGE_LINES = 450


def _heading_anchors(page: str) -> set[str]:
    """The ids mkdocs' toc gives the headings of a page (its default slugify)."""
    anchors = set()
    in_fence = False
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else re.match(r"^#{1,6} (.+?)\s*$", line)
        if match:
            text = re.sub(r"[^\w\s-]", "", match.group(1).replace("`", "")).strip().lower()
            anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


@pytest.mark.parametrize("chapter", sorted(SPLIT_CHAPTERS))
def test_reading_path_a_split_chapter_is_pages_in_a_row_none_over_the_limit(chapter: str):
    pages = SPLIT_CHAPTERS[chapter]
    assert all(page in NAV for page in pages), [page for page in pages if page not in NAV]
    start = NAV.index(pages[0])
    assert tuple(NAV[start : start + len(pages)]) == pages, f"the nav does not list {pages} one after the other"
    lengths = {page: len((DOCS / page).read_text(encoding="utf-8").splitlines()) for page in pages}
    assert all(n <= MAX_PAGE_LINES for n in lengths.values()), lengths


@pytest.mark.parametrize("chapter", sorted(SPLIT_CHAPTERS))
def test_reading_path_links_into_a_split_chapter_land_on_a_heading(chapter: str):
    pages = set(SPLIT_CHAPTERS[chapter])
    anchors = {page: _heading_anchors(page) for page in pages}
    broken, checked = [], 0
    for source in sorted(DOCS.rglob("*.md")):
        here = posixpath.dirname(source.relative_to(DOCS).as_posix())
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", source.read_text(encoding="utf-8")):
            page = posixpath.normpath(posixpath.join(here, target)) if target else source.relative_to(DOCS).as_posix()
            if page in pages:
                checked += 1
                if anchor not in anchors[page]:
                    broken.append(f"{source.relative_to(ROOT)} -> {page}#{anchor}")
    assert checked, f"no link into the {chapter} pages has an anchor: the scan is broken"
    assert not broken, broken

