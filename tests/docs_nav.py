"""The docs site's nav, read from mkdocs.yml: what the tutorial-page and reading-path tests share.

``mkdocs.yml`` carries ``!!python/name:`` tags, which a safe YAML loader refuses; here they
read as None, since only the nav is wanted.
"""

from __future__ import annotations

from pathlib import Path

import yaml

MKDOCS_YML = Path(__file__).resolve().parents[1] / "mkdocs.yml"


class _NavLoader(yaml.SafeLoader):
    """A safe loader that reads every ``!!python/...`` tag as None."""


_NavLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav() -> list:
    """The ``nav`` list of mkdocs.yml, as written."""
    return yaml.load(MKDOCS_YML.read_text(encoding="utf-8"), Loader=_NavLoader)["nav"]


def nav_pages(entry) -> list[str]:
    """Every page file under a nav entry (a str, a one-key dict, or a list of them), in order."""
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [page for item in entry for page in nav_pages(item)]
    if isinstance(entry, dict):
        return [page for value in entry.values() for page in nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {entry!r}")
