"""The repository stands on its own, and what the docs say about the suite is the suite.

- every ``seed`` marker names a section the catalog knows (``docs_hooks/catalog.py``), and
  every section the catalog lists points at a docs page and tutorial that exist;
- the scanner that builds the seed matrix finds each test where it is defined;
- the README's status table is the one the catalog renders now;
- the README's set-up command asks only for extras that ``pyproject.toml`` defines;
- nothing in the repository points at files that live outside it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs_hooks"))
import catalog  # noqa: E402


@pytest.fixture(scope="module")
def refs():
    return catalog.scan_tests()


def test_docs_catalog_every_seed_marker_names_a_known_section(refs):
    assert catalog.unknown_seed_keys(refs) == []
    assert any(r.seeds for r in refs), "no test carries a seed marker: the scanner is broken"


def test_docs_catalog_sections_point_at_pages_and_tutorials_that_exist():
    keys = [s.key for s in catalog.SEED_SECTIONS]
    assert len(keys) == len(set(keys)), "duplicate section keys"
    for section in catalog.SEED_SECTIONS:
        assert section.seed in catalog.SEEDS, section.key
        assert (REPO / "docs" / section.page).is_file(), f"{section.key}: docs/{section.page} is missing"
        if section.tutorial:
            assert (REPO / "tutorials" / f"{section.tutorial}.py").is_file(), f"{section.key}: {section.tutorial}"
    for page, sources in catalog.PAGE_SOURCES.items():
        assert (REPO / "docs" / page).is_file(), page
        for source in sources:
            assert (REPO / source).is_file(), f"{page}: {source}"


def test_docs_catalog_scanner_finds_each_test_at_its_definition(refs):
    assert len(refs) > 300
    for ref in refs:
        lines = (REPO / ref.path).read_text(encoding="utf-8").splitlines()[ref.line - 1 :]
        line = lines[0]
        if line.lstrip().startswith("@"):  # the marks first; the definition follows them
            line = next(t for t in lines[:80] if re.match(rf"\s*(async def |def |class ){ref.name}\b", t))
        assert re.match(rf"(async def |def |class ){ref.name}\b|{ref.name} = ", line.lstrip()), (ref, line)
    names = {(r.path, r.name) for r in refs}
    assert ("tests/test_docs_catalog.py", "test_docs_catalog_scanner_finds_each_test_at_its_definition") in names


def test_docs_catalog_reads_module_class_and_state_machine_marks(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_example.py").write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.seed('002:1.2'), pytest.mark.gpu]\n"
        "@pytest.mark.seed('002:3.2')\n"
        "@pytest.mark.parametrize('x', [1])\n"
        "def test_one(x): pass\n"
        "class TestGroup:\n"
        "    @pytest.mark.seed('003:free')\n"
        "    def test_two(self): pass\n"
        "TestMachine = pytest.mark.seed('001:R2')(object)\n"
        "def helper(): pass\n",
        encoding="utf-8",
    )
    found = catalog.scan_test_file(tmp_path / "tests" / "test_example.py", tmp_path)
    assert [(r.name, r.line, r.seeds, r.gpu) for r in found] == [
        ("test_one", 3, ("002:1.2", "002:3.2"), True),
        ("test_two", 7, ("002:1.2", "003:free"), True),
        ("TestMachine", 9, ("002:1.2", "001:R2"), True),
    ]


def test_docs_catalog_status_marks_untested_sections_not_yet():
    one = catalog.TestRef("test_x", "tests/test_x.py", 3, ("002:3.2",))
    gpu = catalog.TestRef("test_y", "tests/test_y.py", 4, ("000:capture",), gpu=True)
    table = catalog.render_status([one, gpu], catalog.readme_link)
    rows = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
    assert "built, 1 test ([`test_x.py`](tests/test_x.py))" in rows["§3.2"]
    assert "built, 1 test, on a GPU only" in rows["完整 CUDA 图捕获 & 热身"]
    assert "not yet" in rows["§2.4"]


# Sections explained in prose that the status table once left out (issue 41): the page
# that explains each, and whether a test pins it (False: the catalog says why none does).
ADDED_SECTIONS = {
    "000:overview": ("概述", "cuda_graphs.md", False),
    "000:passes": ("分段编译和完整图自定义通道", "cuda_graphs_wrapper.md", False),
    "000:performance": ("关于性能", "cuda_graphs_backends.md", True),
    "001:7.5": ("ch. 7.5", "persistent_batch.md", True),
    "001:C": ("appendix C", "persistent_batch.md", False),
    "001:D": ("appendix D", "thinking_budget.md", True),
}


@pytest.mark.parametrize("key", sorted(ADDED_SECTIONS))
def test_docs_catalog_lists_each_section_the_docs_explain(refs, key):
    name, page, tested = ADDED_SECTIONS[key]
    section = catalog.SECTION_BY_KEY.get(key)
    assert section is not None, f"the catalog has no section {key}"
    assert (section.section, section.page) == (name, page)
    text = " ".join((REPO / "docs" / page).read_text(encoding="utf-8").split()).lower()
    assert name.lower() in text, f"docs/{page} does not cite {name!r}"
    marked = catalog.tests_by_section(refs).get(key, [])
    assert bool(marked) == tested, f"{key}: tests {[r.name for r in marked]}, expected {'some' if tested else 'none'}"
    assert (section.prose_only is None) == tested, f"{key}: prose_only={section.prose_only!r}"


def test_docs_catalog_prose_only_sections_have_no_test_and_say_why(refs):
    by_key = catalog.tests_by_section(refs)
    prose = [s for s in catalog.SEED_SECTIONS if s.prose_only]
    assert prose, "no section is marked prose_only"
    for section in prose:
        assert not by_key.get(section.key), f"{section.key} is prose_only but tests mark it: drop the reason"
    rows = {line.split(" | ")[1]: line for line in catalog.render_status([], catalog.readme_link).splitlines()[2:]}
    assert f"explained, no test of its own: {catalog.SECTION_BY_KEY['000:passes'].prose_only}" in rows["分段编译和完整图自定义通道"]
    assert "not yet" in rows["§2.4"] and "explained" not in rows["§2.4"]
    matrix = catalog.render_matrix([], lambda kind, target: str(target))
    assert "| appendix C |" in matrix and "explained, no test of its own: the document's diagram is lost" in matrix


def test_docs_catalog_readme_status_table_is_current(refs):
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert catalog.readme_status_block(refs) in text, (
        "README.md's status table is stale: run `python docs_hooks/catalog.py` and commit README.md"
    )


def test_docs_catalog_readme_setup_command_uses_extras_pyproject_defines():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    installs = re.findall(r"pip install -e '\.\[([^\]]*)\]'", readme)
    assert installs, "the README shows no `pip install -e '.[...]'` command"
    for group in installs:
        for extra in group.split(","):
            assert extra.strip() in extras, f"README installs extra {extra!r}, pyproject.toml has {sorted(extras)}"
    # Self-references such as ci = ["tinyvllm[cpu,dev,docs]"] must name extras that exist too.
    for name, requirements in extras.items():
        for requirement in requirements:
            m = re.match(r"tinyvllm\[([^\]]*)\]", requirement)
            if m:
                for extra in m.group(1).split(","):
                    assert extra.strip() in extras, f"extra {name!r} asks for tinyvllm[{extra}]"
    # Every triton requirement carries a platform marker: triton has wheels for Linux only.
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for requirement in project["dependencies"] + [r for rs in extras.values() for r in rs]:
        if requirement.startswith("triton"):
            assert "platform_system == 'Linux'" in requirement, requirement


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        return [REPO / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        skip = {".git", ".venv", "site", "__pycache__", ".hypothesis", ".pytest_cache"}
        return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


def test_docs_catalog_repository_points_at_nothing_outside_it():
    # The patterns are spelled in pieces so that this file does not match itself.
    forbidden = re.compile("|".join(re.escape(a + b) for a, b in [("shared", "/"), ("DESIGN", ".md"), ("STYLE", ".md")]))
    hits = []
    for path in _tracked_files():
        if not path.is_file() or path.suffix in {".png", ".svg", ".safetensors", ".bin"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if forbidden.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert hits == []
