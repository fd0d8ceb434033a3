"""Reading a model folder within bounds: regular files inside it, of bounded size, and
weights that fit in the memory there is.

Concept: a model folder comes from anywhere (a download, the hub cache, someone's disk),
and each of its names may be a link to ``/dev/zero``, a FIFO, or a consistent but absurd
checkpoint. Every file the loader (``models/loader.py``) or the hub lookup
(``models/hub.py``) reads goes through ``read_model_file``, every file it only hands on
(to safetensors, to transformers' tokenizer) through ``check_model_file``, and the
weights through ``check_weights_fit`` before any tensor is read. ``read_json_object``
reads a JSON file that must hold an object (``config.json``, ``generation_config.json``,
...) through ``read_model_file``: the loader and ``sampling_defaults.py`` share it;
``read_model_config`` is ``config.json`` with vLLM's ``hf_overrides`` laid over it
(``check_hf_overrides``), what every reader of the model's config reads.

Mirrors: nothing one-to-one. vLLM lets transformers and safetensors open the files and
learns that weights do not fit when an allocation fails inside ``load_model``.

Invariants:
- A file is opened only when ``os.stat`` (following links) says it is a regular file
  (NOTE 1) and its resolved path is inside the folder, or inside the repository's
  ``blobs/`` for a hub snapshot (NOTE 2); anything else is refused without opening it.
- At most ``MAX_BYTES[kind]`` bytes are read: the size is checked before reading and the
  bytes read after (a file that grows in between is refused too).
- The weights' bytes, from the safetensors headers, are at most the memory available on
  the device they are read into, or nothing is read (NOTE 3).
- A JSON file read is valid UTF-8 JSON with an object at the top, or a ``ValueError``.
- Every refusal is one ``ValueError`` naming the file (its path names the model folder)
  or, for the weights, the folder, the bytes needed and the bytes available.

NOTE 1 (why stat first): opening a FIFO blocks until a writer comes, and reading
``/dev/zero`` never ends; ``os.stat`` answers without opening. The file is then opened
with ``O_NONBLOCK`` and checked again with ``fstat`` on what was opened, so a name
swapped for a FIFO in between is refused too, not waited on.
NOTE 2 (inside): a hub snapshot's files are links ``snapshots/<rev>/x -> ../../blobs/<hash>``
by design, so a snapshot's inside is its repository's ``blobs/`` as well. The same rule
covers the weight files (loader NOTE 3) and the hub's ``refs/<revision>`` (inside the
repository folder of the cache).
NOTE 3 (weights vs memory): ``llama.load_model`` reads every tensor into CPU memory
before it copies them to the device, so the CPU check is the one that always applies; the
bytes compared are a floor (the model's own copy comes on top). ``vocab_size`` 2**31 - 1
with a matching sparse file passes every shape check and is caught here, from the
headers, with no byte of the file read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MIB = 2**20
# The most bytes read from a file of each kind; real ones are far smaller (a config is a
# few KiB, the largest tokenizer.json files some tens of MiB, a hub ref 40 bytes).
MAX_BYTES: dict[str, int] = {
    "config": 16 * MIB,  # config.json, generation_config.json
    "index": 64 * MIB,  # model.safetensors.index.json
    "tokenizer": 256 * MIB,  # tokenizer.json, vocab.json, merges.txt, tokenizer.model, ...
    "hub ref": 1024,  # refs/<revision> of the hub cache: a commit hash
    "hub tree": 64 * MIB,  # trees/<commit>.json of the hub cache: a file listing
}
# Bytes per element of each safetensors dtype code (sub-byte codes count as one).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_KINDS = {
    stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
}  # fmt: skip


def format_bytes(num_bytes: int) -> str:
    """``512.0 GiB (549755813888 bytes)``: a size for a person, and exact."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit} ({num_bytes} bytes)"
    return f"{num_bytes} bytes"


def _resolve_inside(path: Path, folder: Path) -> Path:
    """``path`` resolved, refused unless it is inside ``folder`` (NOTE 2)."""
    try:
        root, real = folder.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise ValueError(f"{path} cannot be resolved: {e}") from None
    if real.is_relative_to(root):
        return real
    if root.parent.name == "snapshots" and real.is_relative_to(root.parent.parent / "blobs"):
        return real  # the Hugging Face hub cache: snapshots/<rev>/x -> ../../blobs/<hash>
    raise ValueError(f"{path} resolves to {real}, outside the model folder {folder}")


def _not_regular(path: Path, mode: int) -> ValueError:
    what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return ValueError(f"{path} cannot be read: it is not a regular file but {what}")


def check_model_file(path: Path, folder: Path, kind: str | None = None) -> Path:
    """Check, without opening it, that ``path`` is a regular file inside ``folder`` of at
    most ``MAX_BYTES[kind]`` bytes (no cap when ``kind`` is None: weights); its real path."""
    if not os.path.lexists(path):
        raise ValueError(f"{path} is missing")
    real = _resolve_inside(path, folder)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise ValueError(f"{path} is a symbolic link to {real}, which is missing") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    if kind is not None and info.st_size > MAX_BYTES[kind]:
        raise _too_big(path, info.st_size, kind)
    return real


def _too_big(path: Path, size: int | str, kind: str) -> ValueError:
    return ValueError(f"{path} is {size} bytes, more than the {format_bytes(MAX_BYTES[kind])} a {kind} file may have")


def read_model_file(path: Path, folder: Path, kind: str) -> bytes:
    """The bytes of ``path``, a regular file inside ``folder`` of at most
    ``MAX_BYTES[kind]`` bytes (NOTE 1); anything else is a ValueError naming it."""
    real = check_model_file(path, folder, kind)
    cap = MAX_BYTES[kind]
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped since the stat
            raise _not_regular(path, mode)
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    if len(data) > cap:
        raise _too_big(path, f"more than {cap}", kind)
    return data


def require_model_folder(folder: str | Path) -> Path:
    """``folder`` as a ``Path``; a ValueError naming it unless it is a directory."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist or is not a directory")
    return path


def read_json_object(path: Path, folder: Path, kind: str = "config") -> dict[str, Any]:
    """A JSON file of ``folder`` holding an object, read within bounds (``read_model_file``);
    any other content is a ValueError naming the file."""
    data = read_model_file(path, folder, kind)  # missing, not a regular file, outside, too big
    try:
        value = json.loads(data)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object {{...}}, got {json_type(value)}")
    return value


def read_model_config(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The folder's ``config.json`` object with ``overrides`` (vLLM's ``hf_overrides``) laid
    over its top-level fields: what every reader of the model's config reads."""
    root = require_model_folder(folder)
    return {**read_json_object(root / "config.json", root), **(overrides or {})}


def check_hf_overrides(value: object) -> dict[str, Any] | None:
    """vLLM's ``hf_overrides`` as a dict of config.json fields (a str is parsed as JSON); a
    ValueError naming it otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"hf_overrides must be a JSON object, got {value!r}: {error}") from None
    if value is not None and not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        raise ValueError(f"hf_overrides must be a dict of config.json fields (str keys) or None, got {value!r}")
    return None if value is None else dict(value)


def json_type(value: object) -> str:
    """What a JSON value is, for a message: "an object", "a list", "null", ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a bool", int: "an integer", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# -- weights against memory (NOTE 3) ---------------------------------------------------------


def weights_nbytes(infos: Iterable[Any]) -> int:
    """The bytes of the tensors the safetensors headers describe (``TensorInfo`` values)."""
    return sum(math.prod(info.shape) * DTYPE_BYTES.get(info.dtype, 1) for info in infos)


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Bytes free for new tensors on ``device`` now: the free device memory on CUDA, else
    MemAvailable of /proc/meminfo, else the free physical pages, else all of them (macOS
    has neither: an upper bound, which still catches the absurd); None when unknown."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            continue
    return None


def check_weights_fit(infos: Iterable[Any], folder: str | Path, device: str = "cpu") -> int:
    """Refuse weights larger than the memory available on ``device``, before any tensor
    is read; returns their bytes. The ValueError names the folder and both sizes."""
    needed = weights_nbytes(infos)
    available = available_memory_bytes(device)
    if available is not None and needed > available:
        raise ValueError(
            f"the weights of {folder} need {format_bytes(needed)} of memory to be read, but only "
            f"{format_bytes(available)} is available on {device}"
        )
    return needed
