"""MkDocs hook: Chinese text in the search index.

Some pages quote Chinese source documents. The search plugin of Material for MkDocs splits
Chinese text into words with ``jieba`` when that package is installed, and joins the words
with zero-width spaces (so ``mkdocs.yml`` lists ``\\u200b`` in the search separator).
Without ``jieba``, a Chinese sentence is indexed as one long word and a search for one of
its words finds nothing. This hook turns that silent loss into a build warning (an error
under ``--strict``), and keeps jieba's start-up messages out of the build log.
"""

from __future__ import annotations

import logging

log = logging.getLogger("mkdocs.hooks.search_zh")


def on_config(config):
    try:
        import jieba  # noqa: F401  (the search plugin imports it itself)
    except ImportError:
        log.warning(
            "search_zh: the 'jieba' package is not installed, so search cannot find Chinese "
            "words; install the docs extra: pip install -e '.[docs]'"
        )
    else:
        logging.getLogger("jieba").setLevel(logging.WARNING)
    return config
