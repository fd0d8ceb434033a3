"""mkdocs hook: pages generated from the repository, and links from the pages to the code.

At build time this hook
- adds one page per source, test, tutorial and bench file (``code/<path>.md``): the file with
  line numbers, every line an anchor, and a link to the file on GitHub;
- adds the seed matrix page (``matrix.md``): seed section -> docs page -> tests -> tutorial,
  read from the tests' ``seed`` markers (``catalog.py``);
- replaces ``<!-- tinyvllm:status -->`` on a page with the status table;
- writes "Source:" links under the title of each walkthrough page (``catalog.PAGE_SOURCES``);
- turns inline code that names a test (`` `test_name` ``, `` `tests/x.py::test_name` ``) or a
  repository file (`` `tinyvllm/core/block_pool.py` ``) into a link to its code page. A name
  that looks like a test id but is no test of the suite, or is defined in two files, is a
  warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import catalog  # noqa: E402

log = logging.getLogger("mkdocs.plugins.tinyvllm")

STATUS_MARK = "<!-- tinyvllm:status -->"
MATRIX_PAGE = "matrix.md"
TEST_ID = re.compile(r"^(?:(?P<path>(?:tests|property_tests)/[\w/]+\.py)::)?(?P<name>(?:test_|Test)\w+)(?:\[[^\]]*\])?$")
FILE_REF = re.compile(r"^(?P<path>(?:src/)?tinyvllm/[\w/]+\.py|(?:tests|property_tests|tutorials|bench)/[\w/.-]+\.(?:py|sh))$")
INLINE_CODE = re.compile(r"(?<![`\\])`(?P<code>[^`\n]+)`(?!`)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")

_state: dict = {}


def _repo_url(config) -> str:
    return (config.get("repo_url") or "").rstrip("/")


def on_files(files, config):
    refs = catalog.scan_tests()
    _state["refs"] = refs
    _state["by_name"] = catalog.tests_by_name(refs)
    _state["code_files"] = set(catalog.code_files())
    for problem in catalog.unknown_seed_keys(refs):
        log.warning(problem)
    for path in sorted(_state["code_files"]):
        files.append(File.generated(config, catalog.code_page(path), content=_code_page(path, config)))
    files.append(File.generated(config, MATRIX_PAGE, content=_matrix_page()))
    return files


def _explained_on(path: str) -> list[str]:
    return [page for page, sources in catalog.PAGE_SOURCES.items() if path in sources]


def _code_page(path: str, config) -> str:
    text = (catalog.REPO / path).read_text(encoding="utf-8")
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    here = posixpath.dirname(catalog.code_page(path))
    notes = []
    pages = _explained_on(path)
    if pages:
        notes.append("Explained on: " + ", ".join(f"[{p[:-3].replace('_', ' ')}]({posixpath.relpath(p, here)})" for p in pages))
    if _repo_url(config):
        notes.append(f"[This file on GitHub]({_repo_url(config)}/blob/main/{path})")
    lang = "python" if path.endswith(".py") else "bash"
    return (
        "---\nsearch:\n  exclude: true\n---\n\n"
        f"# `{path}`\n\n" + (" · ".join(notes) + "\n\n" if notes else "")
        + f'{fence}{lang} linenums="1"\n{text}{"" if text.endswith(chr(10)) else chr(10)}{fence}\n'
    )


def _site_link(from_page: str):
    here = posixpath.dirname(from_page)

    def link(kind: str, target) -> str:
        if kind == "page":
            return f"[{target[:-3]}]({posixpath.relpath(target, here)})"
        if kind == "tutorial":
            if not (catalog.REPO / "docs" / "tutorials" / f"{target}.md").is_file():
                return f"`tutorials/{target}.py`"
            return f"[{target}]({posixpath.relpath(f'tutorials/{target}.md', here)})"
        if kind == "test":
            page = posixpath.relpath(catalog.code_page(target.path), here)
            return f"[`{target.name}`]({page}#{catalog.line_anchor(target.line)})"
        if kind == "file":
            return f"[`{target}`]({posixpath.relpath(catalog.code_page(target), here)})"
        raise ValueError(kind)

    return link


def _matrix_page() -> str:
    refs = _state["refs"]
    return (
        "# Seed matrix\n\n"
        "Each section of the five source documents that tinyvllm follows: the page that explains\n"
        "it, the tests that pin it down, and the tutorial that replays it. The page is generated\n"
        "when the site is built, from the `seed` markers on the tests "
        "(`@pytest.mark.seed(\"002:3.2\")`), so it always shows the suite as it is. "
        "An empty cell reads \"not yet\".\n\n" + catalog.render_matrix(refs, _site_link(MATRIX_PAGE))
        + "\n**Next:** [Start here](index.md#start-here): the reading path, from the beginning.\n"
    )


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    if src.startswith(catalog.CODE_PREFIX + "/"):
        return markdown
    if STATUS_MARK in markdown:
        markdown = markdown.replace(STATUS_MARK, catalog.render_status(_state["refs"], _site_link(src)))
    if src in catalog.PAGE_SOURCES:
        markdown = _add_source_line(markdown, src)
    return _link_inline_code(markdown, src)


def _add_source_line(markdown: str, src: str) -> str:
    here = posixpath.dirname(src)
    links = ", ".join(f"[`{p}`]({posixpath.relpath(catalog.code_page(p), here)})" for p in catalog.PAGE_SOURCES[src])
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("# "):
            lines.insert(i + 1, f"\n**Source:** {links}")
            break
    return "\n".join(lines)


def _resolve(code: str, src: str) -> str | None:
    """The link target for one inline code span, or None to leave it alone."""
    here = posixpath.dirname(src)
    m = TEST_ID.match(code)
    if m:
        candidates = _state["by_name"].get(m["name"], [])
        if m["path"]:
            candidates = [r for r in candidates if r.path == m["path"]]
        files_ = {r.path for r in candidates}
        if not candidates:
            if m["name"].startswith("test_"):
                log.warning(f"{src}: `{code}` names no test in tests/ or property_tests/")
            return None
        if len(files_) > 1:
            log.warning(f"{src}: `{code}` is defined in {sorted(files_)}; write `path::name`")
            return None
        ref = candidates[0]
        return f"{posixpath.relpath(catalog.code_page(ref.path), here)}#{catalog.line_anchor(ref.line)}"
    m = FILE_REF.match(code)
    if m:
        path = m["path"] if not m["path"].startswith("tinyvllm/") else "src/" + m["path"]
        if path in _state["code_files"]:
            return posixpath.relpath(catalog.code_page(path), here)
    return None


def _link_inline_code(markdown: str, src: str) -> str:
    out = []
    fence = None
    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
                fence = None
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        if line.lstrip().startswith("--8<--"):
            out.append(line)
            continue

        def sub(match: re.Match) -> str:
            start, end = match.span()
            before = line[:start]
            if before.rfind("[") > before.rfind("]"):
                return match.group(0)  # inside a link's text already
            target = _resolve(match["code"], src)
            return f"[{match.group(0)}]({target})" if target else match.group(0)

        out.append(INLINE_CODE.sub(sub, line))
    return "\n".join(out)
