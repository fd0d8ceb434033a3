"""Every tutorial is in the docs and its golden output is what it prints today.

For each numbered script ``tutorials/NN_name.py``:

- ``docs/generated/NN_name.txt`` exists and equals the script's stdout exactly;
- ``docs/tutorials/NN_name.md`` exists and includes the script (in a python block) and the
  golden file (in a text block) with snippets, so the page cannot drift from either;
- the page is listed in ``mkdocs.yml``'s nav beside its chapter: in the same nav group as
  a chapter page that links to it (the nav follows the home page's reading path, where
  each tutorial sits next to the chapter it replays);
- at least one chapter page links to it: a page of the nav other than the home page, the
  glossary and the tutorials that is a file in ``docs/`` (a page the build generates is
  not a chapter).

Each script runs once per session (``tutorial_runner.tutorial_output``): the tests that
check a tutorial's key lines (``tests/test_tutorial_*.py``) reuse the same run.

After a deliberate change to what a tutorial prints, regenerate its golden file with
``python tutorials/regenerate_golden.py NN`` (or with no number, for all of them).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
from docs_nav import nav, nav_pages
from serve_fixtures import imports_serve_packages, require_serve_extra
from tutorial_runner import tutorial_output

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "tutorials").glob("[0-9][0-9]_*.py"))
STEMS = [script.stem for script in SCRIPTS]
REGENERATOR = "tutorials/regenerate_golden.py"
NOT_CHAPTERS = ("index.md", "glossary.md")  # and every tutorials/ page
NEEDS = {"12_structured_outputs": "xgrammar"}  # a package a tutorial needs that the GPU machine's venv lacks


def _regenerate(stem: str) -> str:
    return f"`python {REGENERATOR} {stem[:2]}`"


def _groups(entry) -> list[list[str]]:
    """The pages of every nav group (a titled list), nested groups included."""
    if isinstance(entry, list):
        return [group for item in entry for group in _groups(item)]
    if isinstance(entry, dict):
        return [group for value in entry.values() if isinstance(value, list) for group in [nav_pages(value), *_groups(value)]]
    return []


def _is_chapter(page: str) -> bool:
    return page not in NOT_CHAPTERS and not page.startswith("tutorials/") and (REPO / "docs" / page).is_file()


def _links_to(page: str, stem: str) -> bool:
    link = re.compile(rf"\]\(tutorials/{re.escape(stem)}\.md(#[\w-]*)?\)")
    return bool(link.search((REPO / "docs" / page).read_text(encoding="utf-8")))


def test_tutorials_folder_holds_numbered_tutorials_and_the_regenerator():
    assert STEMS, "no tutorials/NN_name.py found"
    others = sorted(
        p.name for p in (REPO / "tutorials").glob("*.py") if p.stem not in STEMS and p.name != Path(REGENERATOR).name
    )
    assert not others, f"tutorials/ holds scripts that are not numbered tutorials: {others}"
    assert len({stem[:2] for stem in STEMS}) == len(STEMS), f"two tutorials share a number: {STEMS}"


@pytest.mark.parametrize("stem", STEMS)
@pytest.mark.slow
def test_tutorial_output_matches_golden_file(stem: str):
    golden = REPO / "docs" / "generated" / f"{stem}.txt"
    assert golden.exists(), f"{golden.relative_to(REPO)} is missing; write it with {_regenerate(stem)}"
    expected = golden.read_text(encoding="utf-8")
    if imports_serve_packages(REPO / "tutorials" / f"{stem}.py"):
        require_serve_extra()  # the serving tutorial: skips without the serve extra, as on the GPU machine
    if stem in NEEDS:
        pytest.importorskip(NEEDS[stem])
    output = tutorial_output(f"{stem}.py")
    if output != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True), output.splitlines(keepends=True),
                f"docs/generated/{stem}.txt", f"python tutorials/{stem}.py",
            )
        )  # fmt: skip
        pytest.fail(
            f"tutorials/{stem}.py prints something other than docs/generated/{stem}.txt. If the change "
            f"is intended, regenerate the file with {_regenerate(stem)} and read the page "
            f"docs/tutorials/{stem}.md again.\n{diff}"
        )


@pytest.mark.parametrize("stem", STEMS)
def test_tutorial_page_includes_script_and_golden_output(stem: str):
    page = REPO / "docs" / "tutorials" / f"{stem}.md"
    assert page.exists(), f"{page.relative_to(REPO)} is missing"
    text = page.read_text(encoding="utf-8")
    script = f'```python\n--8<-- "tutorials/{stem}.py"\n```'
    golden = f'```text\n--8<-- "docs/generated/{stem}.txt"\n```'
    assert script in text, f"{page.name} does not include the script in a python block:\n{script}"
    assert golden in text, f"{page.name} does not include the golden output in a text block:\n{golden}"
    assert REGENERATOR in text, f"{page.name} does not say how to regenerate its golden output"


@pytest.mark.parametrize("stem", STEMS)
def test_tutorial_page_is_in_the_nav_beside_its_chapter(stem: str):
    page = f"tutorials/{stem}.md"
    groups = [group for group in _groups(nav()) if page in group]
    assert groups, f"{page} is in no group of mkdocs.yml's nav"
    beside = [p for group in groups for p in group if _is_chapter(p) and _links_to(p, stem)]
    assert beside, f"{page} sits in a nav group with no chapter that links to it: {groups}"


@pytest.mark.parametrize("stem", STEMS)
def test_tutorial_page_is_linked_from_a_chapter(stem: str):
    chapters = [page for page in nav_pages(nav()) if _is_chapter(page)]  # generated pages are not files
    assert chapters, "the nav lists no chapter pages"
    linking = [page for page in chapters if _links_to(page, stem)]
    assert linking, f"no chapter page links to tutorials/{stem}.md (checked {len(chapters)} pages)"
