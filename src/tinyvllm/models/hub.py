"""Resolving ``model``: a local folder, or a Hugging Face model id fetched into the hub cache.

Concept: ``resolve_model(model, revision)`` turns what a user types after ``--model`` (or
passes as ``LLM(model=...)``) into the local folder the loader reads (``models/loader.py``).
A local folder is returned as it is. Any other valid hub id (``name`` or ``org/name``) is
looked up in the Hugging Face cache and, unless offline, downloaded into it with
``huggingface_hub.snapshot_download``, fetching only what tinyvllm reads (config, generation
config, tokenizer files, safetensors weights). Whatever goes wrong (no such model or
revision, a gated model, offline with an empty cache, no network) is one ``ValueError`` line
naming the id, the revision and what to do.

Mirrors: vLLM's ``--model`` (a local path or a hub id; ``vllm/transformers_utils/config.py``)
and ``download_weights_from_hf`` in ``vllm/model_executor/model_loader/weight_utils.py``
(``snapshot_download`` with the weight format's allow-patterns, ``local_files_only`` offline).

Invariants:
- A local folder wins, and the hub is then never imported (NOTE 1). Only a ``str`` can be a
  hub id; an ``os.PathLike`` is always a folder.
- Nothing but ``ALLOW_PATTERNS`` is fetched, nothing below the top folder
  (``IGNORE_PATTERNS``): never pickled weights (``*.bin``, ``*.pt``, ``*.pth``) nor other
  frameworks' (``*.h5``, ``*.msgpack``, ``*.onnx``, ``*.gguf``) (NOTE 2).
- Offline (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``) nothing leaves the machine (NOTE 3);
  the cache folder and the switch are read at each call, not at import (NOTE 4).
- A failure the user can fix is a one-line ``ValueError`` whose ``__cause__`` is the hub's
  error; anything else (a bug) propagates as it is (NOTE 5).
- The snapshot has safetensors weights, or it is refused naming the id (NOTE 6); the cache
  files the hub reads to find it are checked first (NOTE 7).
- No torch, transformers, fastapi or uvicorn: the CLI checks a model before the engine loads.

Left out: ``repo_type`` other than models, ``local_dir`` downloads, tokens as arguments
(the hub reads ``HF_TOKEN``), ``--tokenizer(-revision)``, ModelScope, ``*.bin`` fallbacks.

NOTE 1 (a local folder wins): ``org/name`` is both a hub id and a relative path; as in vLLM
and transformers an existing folder is what is meant, and a ``revision`` with it is a
ValueError, not a warning: a folder has one version, and the user would otherwise run the
wrong weights unknowingly. Neither a folder nor a valid id (``/abs/path``, ``./x``,
``a/b/c``, ``""``) is a missing folder; the hub is not asked.
NOTE 2 (what is fetched): a file is kept when it matches ``allow_patterns`` and no
``ignore_patterns`` (``fnmatch``: ``*`` matches ``/`` too). The allow-list names every file
the loader and tokenizer read; ``*/*`` drops subfolders, which the loader never reads and
where repositories keep other formats (Llama's ``original/*.pth``, ``onnx/``).
NOTE 3 (offline): huggingface_hub reads ``HF_HUB_OFFLINE`` (else ``TRANSFORMERS_OFFLINE``)
once, at import; ``local_files_only=True`` makes the offline path explicit and independent
of when the variable was set: the snapshot ``refs/<revision>`` names (or the commit given)
comes from the cache, or ``LocalEntryNotFoundError`` is raised.
NOTE 4 (the cache folder): ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else
``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``
(empty means unset): the hub's rule, evaluated at each call and passed as ``cache_dir``.
NOTE 5 (errors): the classes are ``huggingface_hub.errors`` (0.24+; ``IncompleteSnapshotError``
only in 2.x, looked up by name), checked most specific first: ``GatedRepoError`` is a
``RepositoryNotFoundError``; that and ``RevisionNotFoundError`` are ``HfHubHTTPError``s,
``OSError``s; ``IncompleteSnapshotError`` is a ``LocalEntryNotFoundError``. A connection error
escaping the hub is known by its class's module (``httpx(2)``, ``requests``, ``urllib3``).
NOTE 6 (no safetensors): a repository with only ``pytorch_model.bin`` downloads no weights, and
a cache filled by another tool may hold ``*.bin``: refused, naming id, revision and files.
NOTE 7 (the cache's own files): the hub reads ``refs/<revision>`` and joins it to ``snapshots/``
(a binary ref would be a bare ``UnicodeDecodeError``, ``../..`` the cache root, a FIFO a
hang); 2.x also reads ``trees/<commit>.json``. Both go through ``models/model_files.py``
first, the ref must be a 40-hex commit, and a refusal names the id and the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tinyvllm.models.model_files import check_model_file, read_model_file

# --8<-- [start:patterns]
# What snapshot_download may fetch (NOTE 2): the config, the generation config, every
# tokenizer file transformers reads, and the safetensors weights with their shard index.
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
IGNORE_PATTERNS = ("*/*",)  # nothing from a subfolder: the loader reads the top folder only
# --8<-- [end:patterns]
DEFAULT_REVISION = "main"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # the first one set decides (NOTE 3)
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's spelling of true, any case
_HTTP_LIBRARIES = ("httpx", "httpx2", "requests", "urllib3")  # NOTE 5
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")  # what refs/<revision> holds, as huggingface_hub writes it


def check_revision(revision: object) -> str | None:
    """``revision`` as given: None or a non-empty str (a branch, tag or commit hash)."""
    if revision is None:
        return None
    if not isinstance(revision, str):
        raise TypeError(
            "revision must be a str (a branch, tag or commit hash) or None, "
            f"got {revision!r} ({type(revision).__name__})"
        )
    if not revision.strip():
        raise ValueError(f"revision must be a branch, tag or commit hash, got {revision!r}")
    return revision


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder the environment names now (NOTE 4)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def offline_variable() -> str | None:
    """``"HF_HUB_OFFLINE=1"`` (the variable and its value) when the hub is offline, else None (NOTE 3)."""
    for name in OFFLINE_VARIABLES:
        value = os.environ.get(name)
        if value:  # the first one set decides, as in huggingface_hub
            return f"{name}={value}" if value.upper() in _TRUE else None
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else None  # set when the hub was imported


def is_hub_id(model: str) -> bool:
    """Whether ``model`` is spelled as a hub model id (``name`` or ``org/name``), by huggingface_hub's rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


# --8<-- [start:resolve_model]
def resolve_model(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder ``model`` names: itself if it is a folder (NOTE 1), else the hub
    snapshot of the model id at ``revision`` (default ``"main"``), from the cache or
    downloaded into it. A TypeError or ValueError names the model and the revision."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local folder or a Hugging Face model id (a str), got {model!r}")
    revision = check_revision(revision)
    spelled = os.fspath(model)
    if spelled and os.path.isdir(spelled):  # "" would be the working directory
        if revision is not None:
            raise ValueError(
                f"revision {revision!r} was given, but model {spelled!r} is a local folder, which has one "
                "version: drop the revision, or name a Hugging Face model id"
            )
        return Path(model)
    if not isinstance(model, str) or not is_hub_id(model):
        what = "exists but is not a folder" if os.path.exists(spelled) else "does not exist"
        raise ValueError(
            f"model folder {spelled!r} {what}, and it is not a Hugging Face model id ('name' or 'org/name')"
        )
    return _snapshot(model, revision)
# --8<-- [end:resolve_model]


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision``, fetched unless offline."""
    import huggingface_hub

    offline = offline_variable()
    cache = hub_cache_dir()
    _check_cache_files(cache, repo_id, revision or DEFAULT_REVISION)  # NOTE 7: before the hub reads them
    # --8<-- [start:snapshot_download]
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline is not None,  # NOTE 3
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except Exception as error:
        message = _explain(error, repo_id, revision or DEFAULT_REVISION, cache, offline)
        if message is None:
            raise  # not the user's doing: a bug keeps its traceback
        raise ValueError(message) from error
    # --8<-- [end:snapshot_download]
    path = Path(folder)
    _check_has_safetensors(path, repo_id, revision or DEFAULT_REVISION)
    return path


def _check_cache_files(cache: Path, repo_id: str, revision: str) -> None:
    """The files of the cache huggingface_hub reads to find a snapshot (NOTE 7): ``refs/<revision>``
    a commit hash, the tree listing ``trees/<commit>.json`` a bounded regular file."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    at = f"model {repo_id!r} (revision {revision!r})"
    ref = repo / "refs" / revision
    commit = revision if COMMIT_HASH.fullmatch(revision) else None
    try:
        if commit is None and os.path.lexists(ref):
            text = read_model_file(ref, repo, "hub ref")
            if not COMMIT_HASH.fullmatch(text.decode("ascii", "replace")):
                raise ValueError(f"{ref} does not hold a commit hash (40 hex digits) but {text[:60]!r}")
            commit = text.decode("ascii")
        tree = repo / "trees" / f"{commit}.json"
        if commit is not None and os.path.lexists(tree):
            check_model_file(tree, repo, "hub tree")
    except ValueError as error:
        raise ValueError(
            f"{at} cannot be looked up in the Hugging Face cache: {error}; delete that file "
            "(or the whole cache folder of the model) and download it again"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _hub_error(name: str) -> type[BaseException]:
    """huggingface_hub's error class ``name``, or a class nothing raises if this version lacks it."""
    from huggingface_hub import errors

    return getattr(errors, name, _Absent)


class _Absent(Exception):
    """Stands in for an error class the installed huggingface_hub does not define."""


def _from_http_library(error: BaseException) -> bool:
    return any(cls.__module__.split(".")[0] in _HTTP_LIBRARIES for cls in type(error).__mro__)


def _explain(error: Exception, repo_id: str, revision: str, cache: Path, offline: str | None) -> str | None:
    """One line saying what went wrong and what to do, or None when ``error`` is not the user's (NOTE 5)."""
    at = f"model {repo_id!r} (revision {revision!r})"
    download = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision != DEFAULT_REVISION else "`")
    reason = _one_line(str(error)) or type(error).__name__
    if isinstance(error, _hub_error("GatedRepoError")):
        return (
            f"model {repo_id!r} is gated on the Hugging Face hub: accept its conditions on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or set HF_TOKEN)"
        )
    if isinstance(error, _hub_error("RepositoryNotFoundError")):
        return (
            f"model {repo_id!r} is neither a local folder nor a model on the Hugging Face hub "
            "(or it is private: log in with `hf auth login`, or set HF_TOKEN)"
        )
    if isinstance(error, _hub_error("RevisionNotFoundError")):
        return f"model {repo_id!r} has no revision {revision!r} on the Hugging Face hub (a branch, tag or commit hash)"
    if isinstance(error, _hub_error("IncompleteSnapshotError")):
        return f"the cached snapshot of {at} is incomplete and cannot be completed now: {reason}"
    if isinstance(error, _hub_error("LocalEntryNotFoundError")):
        missing = f"{at} is neither a local folder nor in the Hugging Face cache {cache}"
        if offline is not None:
            return f"{missing}, and {offline} forbids downloading it: run {download} first, or pass a local folder"
        cause = error.__cause__
        why = f" ({type(cause).__name__}: {_one_line(str(cause))})" if cause is not None else ""
        return (
            f"{missing}, and the Hugging Face hub could not be reached{why}: check the network, or pass a local folder"
        )
    if isinstance(error, _hub_error("HfHubHTTPError")):
        return f"could not fetch {at} from the Hugging Face hub: {reason}"
    if _from_http_library(error) or isinstance(error, (ConnectionError, TimeoutError)):
        return (
            f"could not fetch {at}: the Hugging Face hub could not be reached ({type(error).__name__}: {reason}): "
            "check the network, or pass a local folder"
        )
    if isinstance(error, OSError):  # the cache folder: no permission, disk full
        return f"could not fetch {at} into the Hugging Face cache {cache}: {reason}"
    return None


def _check_has_safetensors(path: Path, repo_id: str, revision: str) -> None:
    """Refuse a snapshot without safetensors weights, naming the pickled files it has (NOTE 6)."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        return
    pickled = sorted(p.name for p in path.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    found = f" (it has {pickled})" if pickled else ""
    raise ValueError(
        f"model {repo_id!r} (revision {revision!r}) has no *.safetensors weights{found} in {path}: tinyvllm never "
        "downloads or loads pickled weights (*.bin, *.pt, *.pth); use a repository with safetensors, or convert them"
    )
