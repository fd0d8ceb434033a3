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

NOTE 1 (why the token ids sit inside the key): a ``BlockHash`` is the tuple of the hash
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

NOTE 4 (the bytes sha256 reads): ``sha256_hash`` hashes ``stable_bytes`` of the key
``(parent hash value, token ids, extra keys)``: every field starts with a one-byte type tag
and every variable-length field with its length, so the bytes decode back to exactly one
value and two different keys never share their bytes. Token ids are packed 32-bit ints, so
a 16-token block's key without extra keys is at most 113 bytes, two sha256 rounds.
``append_block_hashes`` (behind ``hash_request_tokens`` and the block pool) builds those
bytes inline for sha256 and passes the key tuple to any other hash function: the values
are ``hash_block_tokens``'s either way.

NOTE 5 (a plain tuple, not a NamedTuple, not bytes): a full ``gc.collect()`` walks every
tracked object, and a full prefix cache holds one block hash per block. CPython stops
tracking an exact ``tuple`` once a collection finds only untracked items in it (one level of
nesting per collection), but a NamedTuple, a tuple subclass, stays tracked for ever. So
``BlockHash`` is the plain tuple, and ``HASH_VALUE``, ``TOKEN_IDS`` and ``EXTRA_KEYS`` name
its positions: a cached block costs the collector 2 tracked objects, not 3. Bytes (vLLM's
choice) are never tracked and are smaller, but were no faster to collect, and the tuple is
the documents' (hash value, token ids, extra keys) as it stands, NOTE 1 included.
``gc.freeze()`` after start-up (vLLM's ``freeze_gc_heap``) is the engine's choice, not this
module's. Figures: ``bench/hashing.py``'s ``gc`` section in bench/README.md.

Left out: multimodal extra keys (image hashes) and hybrid-model block sizes.
"""
# --8<-- [end:header]

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinyvllm.request import Request

HashFn = Callable[[Any], int]  # from a key tuple (parent value, token ids, extra keys) to an int


# --8<-- [start:block_hash]
# The key of one full block in the prefix cache: the plain tuple
# (hash_value, token_ids, extra_keys), not a NamedTuple (NOTE 5).
BlockHash = tuple[int, tuple[int, ...], tuple | None]
HASH_VALUE, TOKEN_IDS, EXTRA_KEYS = 0, 1, 2  # each field's position: block_hash[HASH_VALUE]


def make_block_hash(hash_value: int, token_ids: tuple[int, ...], extra_keys: tuple | None = None) -> BlockHash:
    """The ``BlockHash`` of a block: ``hash_value`` chains it to its whole prefix;
    ``token_ids`` and ``extra_keys`` take part in equality, so a bare ``hash_value``
    collision between blocks of different content is never mistaken for a hit (NOTE 1)."""
    return (hash_value, token_ids, extra_keys)
# --8<-- [end:block_hash]


# --8<-- [start:stable_bytes]
def _length(n: int) -> bytes:
    """A length field: 4 bytes, little-endian (OverflowError past 2**32 - 1, never a wrap)."""
    return n.to_bytes(4, "little")


def _pack_int32s(values: tuple) -> bytes | None:
    """``values`` as little-endian 32-bit ints, or None if one is not an int in range."""
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error:
        return None


def stable_bytes(obj: Any) -> bytes:
    """The canonical bytes of ``obj``: None, an int, a str, or a tuple of these (NOTE 4).

    Tags: ``n`` None; ``i`` int (length, then two's complement, little-endian); ``s`` str
    (length, then UTF-8); ``a`` a tuple of ints that all fit in 32 bits (count, then the
    packed ints); ``t`` any other tuple (count, then each item's bytes). The encoding is
    a function of the value, and each field says where it ends, so the bytes can be
    decoded back: different values never share their bytes.
    """
    if obj is None:
        return b"n"
    if isinstance(obj, int):
        size = (obj.bit_length() + 8) >> 3  # room for the sign bit
        return b"i" + _length(size) + obj.to_bytes(size, "little", signed=True)
    if isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")  # every str, lone surrogates included
        return b"s" + _length(len(data)) + data
    if isinstance(obj, tuple):
        packed = _pack_int32s(obj)
        if packed is not None:
            return b"a" + _length(len(obj)) + packed
        return b"t" + _length(len(obj)) + b"".join(stable_bytes(x) for x in obj)
    raise TypeError(f"stable_bytes takes None, int, str or tuples of them, got {type(obj).__name__}")
# --8<-- [end:stable_bytes]


# --8<-- [start:hash_fns]
def sha256_hash(obj: Any) -> int:
    """Collision-resistant hash of a nested tuple (its ``stable_bytes``), as a 256-bit int."""
    return int.from_bytes(hashlib.sha256(stable_bytes(obj)).digest(), "big")


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
    return make_block_hash(value, token_ids, extra_keys)
# --8<-- [end:hash_block_tokens]


# --8<-- [start:extra_keys]
def generate_block_hash_extra_keys(request: "Request", start_token_idx: int, end_token_idx: int) -> tuple | None:
    """Extra keys of the block spanning ``[start_token_idx, end_token_idx)``.

    The LoRA name goes on every block (a different adapter computes different KV for
    the same tokens); the cache salt goes on the first block only: since every later
    hash chains through the first, salting it isolates the whole sequence. So the keys
    of every block but the first are the same (``append_block_hashes`` relies on it).
    """
    lora = (("lora", request.lora_name),) if request.lora_name is not None else ()
    salt = (("salt", request.cache_salt),) if start_token_idx == 0 and request.cache_salt is not None else ()
    return lora + salt or None
# --8<-- [end:extra_keys]


# --8<-- [start:hash_request_tokens]
def hash_request_tokens(hash_fn: HashFn, block_size: int, request: "Request") -> list[BlockHash]:
    """The chain of block hashes of a request's full blocks (a partial tail is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    append_block_hashes(hash_fn, block_size, request, hashes, request.num_tokens // block_size)
    return hashes


_TRIPLE_INT = b"t" + _length(3) + b"i"  # stable_bytes of a key tuple, up to its parent's length
_LENGTHS = [_length(n) for n in range(64)]  # the length fields of ints up to 63 bytes, ready-made
_PACKERS: dict[int, tuple[bytes, Callable[..., bytes]]] = {}  # block_size -> (b"a" + count, pack ids)


def append_block_hashes(
    hash_fn: HashFn, block_size: int, request: "Request", block_hashes: list[BlockHash], num_blocks: int
) -> None:
    """Extend ``block_hashes``, the hashes of the request's first full blocks, to its first
    ``num_blocks`` blocks, each chained to the one before.

    Each value is ``hash_block_tokens``'s, computed without its call layers: the extra keys
    once per call, and for sha256 the key's ``stable_bytes`` built inline (NOTE 4). Each
    ``BlockHash`` is written as the tuple literal ``make_block_hash`` returns, without its call.
    """
    first = len(block_hashes)
    if num_blocks <= first:
        return
    token_ids = request.all_token_ids
    assert num_blocks * block_size <= len(token_ids), f"block {num_blocks - 1} is not full"
    parent = block_hashes[-1][HASH_VALUE] if first else none_hash(hash_fn)
    keys = generate_block_hash_extra_keys(request, block_size, 2 * block_size)  # every block but the first
    if hash_fn is not sha256_hash:
        for i in range(first, num_blocks):
            block = tuple(token_ids[i * block_size : (i + 1) * block_size])
            block_keys = keys if i else generate_block_hash_extra_keys(request, 0, block_size)
            parent = hash_fn((parent, block, block_keys))
            block_hashes.append((parent, block, block_keys))
        return
    # sha256_hash((parent, block, block_keys)), inlined: the stable_bytes of the key, piece by piece.
    packer = _PACKERS.get(block_size)
    if packer is None:
        packer = _PACKERS[block_size] = (b"a" + _length(block_size), struct.Struct(f"<{block_size}i").pack)
    tokens_head, pack = packer
    keys_bytes = b"n" if keys is None else stable_bytes(keys)
    sha256, from_bytes, append = hashlib.sha256, int.from_bytes, block_hashes.append  # locals: faster
    for i in range(first, num_blocks):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        block_keys, block_keys_bytes = keys, keys_bytes
        if i == 0:  # the first block may carry the cache salt
            block_keys = generate_block_hash_extra_keys(request, 0, block_size)
            block_keys_bytes = stable_bytes(block_keys)
        try:
            head, packed = tokens_head, pack(*block)
        except struct.error:  # an id past 32 bits: the general encoding
            head, packed = b"", stable_bytes(block)
        size = (parent.bit_length() + 8) >> 3  # room for the sign bit, as in stable_bytes(parent)
        data = (_TRIPLE_INT, _LENGTHS[size] if size < 64 else _length(size),
                parent.to_bytes(size, "little", signed=True), head, packed, block_keys_bytes)  # fmt: skip
        parent = from_bytes(sha256(b"".join(data)).digest(), "big")
        append((parent, block, block_keys))
# --8<-- [end:hash_request_tokens]
