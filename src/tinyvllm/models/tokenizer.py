"""The tokenizer and the EOS ids of a Hugging Face model folder.

Concept: the folder's tokenizer through transformers' ``AutoTokenizer``, and the token ids
that end a request (``generation_config.json``'s ``eos_token_id``, else the tokenizer's),
each file checked first so that a problem is one ``ValueError`` naming the file, the field
and the value, never an exception from deep inside transformers.

Mirrors: ``vllm/transformers_utils/tokenizer.py`` (``get_tokenizer``) and the EOS ids vLLM
reads from ``generation_config.json`` (``ModelConfig.try_get_generation_config``).

What is checked: the folder has tokenizer files (NOTE 1), each a regular file inside the
folder of bounded size (``models/model_files.py``), those in JSON parse; what transformers
then refuses is wrapped in a ValueError naming the folder. ``generation_config.json``:
``eos_token_id`` an int >= 0 or a list of them (its sampling fields are
``sampling_defaults.py``'s), and every EOS id a row of the vocabulary (NOTE 2).

NOTE 1 (no tokenizer files): transformers v5 builds the class ``config.json`` names with
its default one-token vocabulary (``{"<|endoftext|>": 0}``), which turns every prompt
into nothing. We ask for ``tokenizer.json``, ``tokenizer.model`` or ``vocab.json`` with
``merges.txt`` first.
NOTE 2 (EOS ids in the vocabulary): they become stop tokens of every request, which would
otherwise all be refused for a field their users never set.
"""

from __future__ import annotations

import os
from pathlib import Path

from tinyvllm.models.model_files import check_model_file, read_json_object, require_model_folder


# The tokenizer's JSON files, each parsed first so that a broken one is named.
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")
# Every file of the folder transformers' AutoTokenizer may open: each checked first (bounded reads).
TOKENIZER_FILES = (*_TOKENIZER_JSON, "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")  # fmt: skip


def check_tokenizer_files(folder: str | Path) -> None:
    """Refuse a folder with no tokenizer files (NOTE 1) instead of a one-token tokenizer,
    and name the tokenizer's JSON file that does not parse (transformers would not)."""
    path = require_model_folder(folder)
    for name in ("config.json", *TOKENIZER_FILES):  # transformers would open them unchecked
        if os.path.lexists(path / name):
            check_model_file(path / name, path, "config" if name == "config.json" else "tokenizer")
    present = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    if not (present or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())):
        raise ValueError(
            f"no tokenizer files in {path}: expected tokenizer.json, tokenizer.model, or vocab.json with merges.txt"
        )
    for name in _TOKENIZER_JSON:
        if (path / name).exists():
            read_json_object(path / name, path, "tokenizer")


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, through transformers' ``AutoTokenizer``; any failure to read
    the tokenizer files is a ValueError naming the folder."""
    path = require_model_folder(folder)
    check_tokenizer_files(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers and tokenizers raise many types on a bad file
        reason = " ".join(str(e).split())
        raise ValueError(f"cannot load a tokenizer from {path} ({type(e).__name__}: {reason})") from e


def _eos_id(value: object, gen: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{gen}: field 'eos_token_id' must be a token id (an integer >= 0), got {value!r}")
    return value


def load_eos_token_ids(folder: str | Path, tokenizer=None) -> list[int]:
    """EOS ids from ``generation_config.json`` if present, else the tokenizer's."""
    gen = require_model_folder(folder) / "generation_config.json"
    if os.path.lexists(gen):  # a dangling link is named, not taken for no file
        eos = read_json_object(gen, Path(folder)).get("eos_token_id")
        if eos is not None:
            return [_eos_id(e, gen) for e in eos] if isinstance(eos, list) else [_eos_id(eos, gen)]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return []


def check_eos_token_ids(folder: str | Path, eos_token_ids: list[int], tokenizer_eos: int | None, vocab_size: int) -> None:
    """Every EOS id must be a row of the model's vocabulary (NOTE 2); the message names
    where the id came from."""
    gen = Path(folder) / "generation_config.json"
    source = str(gen) if gen.is_file() else "the tokenizer"  # where load_eos_token_ids read them
    named = [(token_id, source) for token_id in eos_token_ids]
    if tokenizer_eos is not None:
        named.append((tokenizer_eos, "the tokenizer's eos_token"))
    for token_id, where in named:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{where}: eos_token_id {token_id} is outside the model's vocabulary [0, {vocab_size}) "
                "(config.json's vocab_size)"
            )
