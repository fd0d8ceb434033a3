"""MkDocs hook: the site serves its own copy of mermaid, so diagrams render offline.

Material for MkDocs draws ```mermaid fences with the global ``mermaid`` object. When no
such object exists, its bundle loads mermaid from unpkg.com. This hook defines the global
first, from a file the site itself serves:

1. ``on_config`` obtains ``dist/mermaid.min.js`` of the pinned release below. It reads the
   cached copy when there is one; otherwise it downloads the npm tarball, checks it
   against the pinned ``integrity`` (sha512, as the registry publishes it), extracts the
   one file and caches it. The cache lives in ``$TINYVLLM_DOCS_CACHE``
   (default ``~/.cache/tinyvllm-docs``), outside the repository, so nothing is committed.
2. ``on_files`` adds the file to the site as ``assets/javascripts/mermaid.min.js``
   (so ``mkdocs serve`` serves it as well).
3. ``on_post_page`` adds ``<script src=".../mermaid.min.js">`` just before ``</body>`` of
   each page that has a diagram (the file is 3.5 MB; other pages do not load it). A plain
   script there runs before ``DOMContentLoaded``, which is when Material's bundle looks
   for diagrams and checks for ``mermaid``. (With Material's ``navigation.instant``, pages
   reached by instant navigation keep the first page's scripts; that feature is off.)

With no cached copy and no download, the build stops with one line that says what to do.
To move to another release, change both ``MERMAID_VERSION`` and ``MERMAID_INTEGRITY``
(``npm view mermaid@<version> dist.integrity`` prints the second).
``$TINYVLLM_NPM_REGISTRY`` replaces ``https://registry.npmjs.org`` (for a mirror); the
integrity check still applies.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from mkdocs.utils import get_relative_url

MERMAID_VERSION = "11.17.2"
MERMAID_INTEGRITY = (
    "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
)
SITE_PATH = "assets/javascripts/mermaid.min.js"
_MEMBER = "package/dist/mermaid.min.js"
_DEFAULT_REGISTRY = "https://registry.npmjs.org"
# What pymdownx.superfences writes for a ```mermaid fence: <pre class="mermaid">.
_HAS_DIAGRAM = re.compile(r"""<(?:pre|div)\b[^>]*\bclass="(?:[^"]*\s)?mermaid[\s"]""")

_state: dict[str, Path] = {}


def cache_dir() -> Path:
    """Where fetched files are kept between builds."""
    return Path(os.environ.get("TINYVLLM_DOCS_CACHE") or "~/.cache/tinyvllm-docs").expanduser()


def tarball_url(version: str = MERMAID_VERSION) -> str:
    registry = (os.environ.get("TINYVLLM_NPM_REGISTRY") or _DEFAULT_REGISTRY).rstrip("/")
    return f"{registry}/mermaid/-/mermaid-{version}.tgz"


def check_integrity(data: bytes, integrity: str) -> None:
    """Raise ValueError unless ``data`` matches an npm ``sha512-<base64>`` integrity string."""
    algo, _, expected = integrity.partition("-")
    if algo != "sha512":
        raise ValueError(f"unsupported integrity algorithm {algo!r}")
    actual = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if actual != expected:
        raise ValueError(f"integrity mismatch: expected sha512-{expected}, got sha512-{actual}")


def extract_mermaid(tarball: bytes) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(_MEMBER)
        if member is None:
            raise ValueError(f"{_MEMBER} is not a file in the tarball")
        return member.read()


def mermaid_js(
    cache: Path | None = None,
    url: str | None = None,
    version: str = MERMAID_VERSION,
    integrity: str = MERMAID_INTEGRITY,
    timeout: float = 120.0,
) -> Path:
    """Return the path of the cached ``mermaid.min.js``, downloading it first if needed.

    Raises PluginError (one line) when the file is not cached and cannot be fetched.
    """
    cache = cache_dir() if cache is None else cache
    target = cache / f"mermaid-{version}" / "mermaid.min.js"
    if target.is_file() and target.stat().st_size > 0:
        return target
    url = tarball_url(version) if url is None else url
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            tarball = response.read()
        check_integrity(tarball, integrity)
        script = extract_mermaid(tarball)
    except Exception as exc:  # network, HTTP, integrity or archive error: all end the build
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise PluginError(
            f"mermaid_assets: cannot get mermaid {version} from {url} ({reason}) and there is "
            f"no cached copy at {target}. Build once with access to the npm registry, or put "
            f"dist/mermaid.min.js of mermaid {version} there (set TINYVLLM_DOCS_CACHE to use "
            f"another cache directory)."
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so an interrupted build never leaves a truncated file behind.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".mermaid-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(script)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def on_config(config):
    _state["path"] = mermaid_js()
    return config


def on_files(files, config):
    files.append(File.generated(config, SITE_PATH, abs_src_path=str(_state["path"])))
    return files


def on_post_page(output, page, config):
    if not _HAS_DIAGRAM.search(output):
        return output
    src = get_relative_url(SITE_PATH, page.url)
    head, body_end, tail = output.rpartition("</body>")
    if not body_end:
        raise PluginError(f"mermaid_assets: no </body> in the HTML of {page.file.src_uri}")
    return f'{head}<script src="{src}"></script>\n{body_end}{tail}'
