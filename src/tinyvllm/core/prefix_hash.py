# --8<-- [start:header]
"""Prefix hashing: the identity of a full KV-cache block.

Concept: a full block of ``block_size`` tokens is identified by a ``BlockHash`` chained
through its parent block's hash value, so two blocks are "the same" only when their
whole prefix is the same (seed 002 §1.1 question 2: the KV of a token depends on every
token before it, in every layer).

Follows: seed 002 §1.2 "block的hash值" (hash = (parent hash, block tokens, extra keys);
only full blocks are hashed); seed 003 "KV block hash" (``hash_request_tokens``).
Mirrors: ``vllm/v1/core/kv_cache_utils.py`` (``BlockHash``, ``hash_block_tokens``,
``hash_request_tokens``, ``generate_block_hash_extra_keys``, ``NONE_HASH``).

Invariants: a ``BlockHash`` only ever describes a full block; ``hash_request_tokens``
returns ``num_tokens // block_size`` hashes, each chained to the previous one's value.

NOTE 1 (why the token ids sit inside the key): ``BlockHash`` is a tuple of the hash
value, the block's token ids and its extra keys, and the prefix cache is a dict keyed by
the whole tuple. Two different blocks whose ``hash_value`` collide still compare unequal
because their token ids (or extra keys) differ, so such a collision can never produce a
false cache hit. What the tuple cannot see is the prefix: two blocks with the same tokens
under different prefixes differ only through the chained parent value. That is why the
default hash is sha256 (a collision there is not a practical event) and why Python's
``hash`` is offered only for speed where every tenant trusts every other.

NOTE 2 (the root value): the first block of a sequence has no parent; we chain it to a
root value ``none_hash(hash_fn)`` = ``hash_fn(("tinyvllm.none_hash", seed))``, with the
seed read once from the environment variable ``TINYVLLM_HASH_SEED`` (default ``"0"``).
A fixed default keeps hashes reproducible from process to process (tests, tutorials,
comparing traces); an operator who fears crafted collisions sets a secret seed, so no
outsider can predict any block hash. vLLM makes the same choice from ``PYTHONHASHSEED``
(random bytes when it is unset).

NOTE 3 (extra keys are tagged): the LoRA adapter and the cache salt both change a
block's identity. They enter the key as ``("lora", name)`` and ``("salt", salt)`` so a
LoRA called "x" can never be confused with a salt "x".

Left out: multimodal extra keys (image hashes) and hybrid-model block sizes.
"""
# --8<-- [end:header]

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from tinyvllm.request import Request

HashFn = Callable[[Any], int]


# --8<-- [start:block_hash]
class BlockHash(NamedTuple):
    """The key of one full block in the prefix cache.

    ``hash_value`` chains the block to its whole prefix; ``token_ids`` and
    ``extra_keys`` take part in equality, so a bare ``hash_value`` collision between
    blocks of different content is never mistaken for a hit (module NOTE 1).
    """

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None
# --8<-- [end:block_hash]


def _stable_bytes(obj: Any) -> bytes:
    """A canonical byte string for nested tuples of ints, strings and None.

    ``repr`` of these types is fixed by the language and does not depend on
    ``PYTHONHASHSEED`` or on the process, which is all sha256 needs here.
    """
    return repr(obj).encode("utf-8")


# --8<-- [start:hash_fns]
def sha256_hash(obj: Any) -> int:
    """Collision-resistant hash of a nested tuple, as a 256-bit int."""
    return int.from_bytes(hashlib.sha256(_stable_bytes(obj)).digest(), "big")


def builtin_hash(obj: Any) -> int:
# --8<-- [end:hash_fns]
    """Python's ``hash``: fast, but collisions can be crafted. Single-tenant use only."""
    return hash(obj)


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_hash, "builtin": builtin_hash}


# --8<-- [start:get_hash_fn]
def get_hash_fn(name: str) -> HashFn:
    """The hash function called ``name``: ``"sha256"`` (default) or ``"builtin"``."""
    try:
        return _HASH_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown hash_algo {name!r}; choose one of {sorted(_HASH_FNS)}") from None
# --8<-- [end:get_hash_fn]


# --8<-- [start:none_hash]
_HASH_SEED: str = os.environ.get("TINYVLLM_HASH_SEED", "0")
_NONE_HASH_CACHE: dict[HashFn, int] = {}


def none_hash(hash_fn: HashFn) -> int:
    """The root value that the first block of every sequence chains to (module NOTE 2)."""
    value = _NONE_HASH_CACHE.get(hash_fn)
    if value is None:
        value = hash_fn(("tinyvllm.none_hash", _HASH_SEED))
        _NONE_HASH_CACHE[hash_fn] = value
    return value
# --8<-- [end:none_hash]


# --8<-- [start:hash_block_tokens]
def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash_value: int | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash one full block, chained to its parent (None for the first block)."""
    if parent_block_hash_value is None:
        parent_block_hash_value = none_hash(hash_fn)
    token_ids = tuple(curr_block_token_ids)
    value = hash_fn((parent_block_hash_value, token_ids, extra_keys))
    return BlockHash(value, token_ids, extra_keys)
# --8<-- [end:hash_block_tokens]


# --8<-- [start:extra_keys]
def generate_block_hash_extra_keys(request: "Request", start_token_idx: int, end_token_idx: int) -> tuple | None:
    """Extra keys of the block spanning ``[start_token_idx, end_token_idx)``.

    The LoRA name goes on every block (a different adapter computes different KV for
    the same tokens); the cache salt goes on the first block only: since every later
    hash chains through the first, salting it isolates the whole sequence.
    """
    keys: list[tuple[str, str]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None
# --8<-- [end:extra_keys]


# --8<-- [start:hash_request_tokens]
def hash_request_tokens(hash_fn: HashFn, block_size: int, request: "Request") -> list[BlockHash]:
    """The chain of block hashes of a request's full blocks (a partial tail is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    token_ids = request.all_token_ids
    hashes: list[BlockHash] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = generate_block_hash_extra_keys(request, start, end)
        block_hash = hash_block_tokens(hash_fn, parent, token_ids[start:end], extra)
        hashes.append(block_hash)
        parent = block_hash.hash_value
    return hashes
# --8<-- [end:hash_request_tokens]
