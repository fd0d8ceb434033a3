"""Unit tests of the KV-cache core's pieces, bad input, and the no-torch rule."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.prefix_hash import (
    EXTRA_KEYS,
    HASH_VALUE,
    TOKEN_IDS,
    builtin_hash,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    make_block_hash,
    none_hash,
    stable_bytes,
)
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams


SRC = str(Path(__file__).resolve().parents[1] / "src")


def make(request_id: str, tokens, **kw) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), **kw)


# -- prefix hashing --------------------------------------------------------------------


@pytest.mark.seed("002:1.2", "004:computed")
def test_prefix_caching_hash_value_collision_is_not_a_hit():
    """Equality compares the token ids too: a bare hash_value collision never hits."""
    always_zero = lambda obj: 0  # noqa: E731 - the worst possible hash function
    h1 = hash_block_tokens(always_zero, None, [1, 2, 3, 4])
    h2 = hash_block_tokens(always_zero, None, [5, 6, 7, 8])
    assert h1[HASH_VALUE] == h2[HASH_VALUE] == 0
    assert h1 != h2
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    block.block_hash = h1
    pool.cached_block_hash_to_block[h1] = {block.block_id: block}
    assert pool.get_cached_block(h1) is block
    assert pool.get_cached_block(h2) is None


@pytest.mark.seed("002:1.2", "004:computed")
def test_prefix_caching_builtin_hash_collision_is_not_a_hit():
    """A real collision of Python's ``hash`` (``hash(2**61) == hash(1)``: ints hash modulo
    2**61 - 1) gives two different blocks the same value; the manager still finds only
    the block whose tokens match (module NOTE 1), through its own hashing path."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64, hash_algo="builtin")
    a, b = make("a", [1, 2, 3, 4, 9]), make("b", [2**61, 2, 3, 4, 9])
    [ha], [hb] = hash_request_tokens(builtin_hash, 4, a), hash_request_tokens(builtin_hash, 4, b)
    assert ha[HASH_VALUE] == hb[HASH_VALUE] and ha != hb
    assert m.allocate_slots(a, 5) is not None
    assert m.get_computed_blocks(make("a2", [1, 2, 3, 4, 9])) == (m.req_to_blocks["a"][:1], 4)
    assert m.get_computed_blocks(b) == ([], 0)
    m.check_invariants()


@pytest.mark.seed("002:1.2")
def test_prefix_caching_block_hash_fields_sit_at_their_named_positions():
    """A block hash is the plain tuple (hash value, token ids, extra keys)."""
    fn = get_hash_fn("sha256")
    h = hash_block_tokens(fn, None, [1, 2, 3, 4], (("lora", "x"),))
    assert type(h) is tuple and h == make_block_hash(h[HASH_VALUE], (1, 2, 3, 4), (("lora", "x"),))
    value, token_ids, extra_keys = h
    assert (h[HASH_VALUE], h[TOKEN_IDS], h[EXTRA_KEYS]) == (value, token_ids, extra_keys)
    assert token_ids == (1, 2, 3, 4) and extra_keys == (("lora", "x"),)
    assert value == fn((none_hash(fn), (1, 2, 3, 4), (("lora", "x"),)))


@pytest.mark.seed("002:1.2", "003:hash")
@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_prefix_caching_block_hashes_are_not_tracked_by_the_gc(hash_algo):
    """Once collections have seen them, block hashes cost a full collection nothing: each
    is an exact tuple of untracked items, which the GC untracks (a NamedTuple, a tuple
    subclass, would stay tracked for ever: module NOTE 5)."""
    fn = get_hash_fn(hash_algo)
    m = KVCacheManager(block_size=4, num_gpu_blocks=20, max_model_len=64, hash_algo=hash_algo)
    plain, tagged = make("p", range(13)), make("t", range(100, 113), lora_name="x", cache_salt="s")
    for r in (plain, tagged):
        computed, n = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - n, computed) is not None
        r.num_computed_tokens = r.num_tokens
    plain.append_output_token_ids([20, 21, 22])  # decode fills block 3: the pool hashes it
    assert m.allocate_slots(plain, 3) is not None
    hashes = [
        *hash_request_tokens(fn, 4, tagged),
        hash_block_tokens(fn, None, [1, 2, 3, 4], (("salt", "s"),)),
        *m.block_pool.cached_block_hash_to_block,
        *(b.block_hash for b in m.block_pool.blocks if b.block_hash is not None),
        *(h for hs in m.req_to_block_hashes.values() for h in hs),
    ]
    assert len(m.block_pool.cached_block_hash_to_block) == 7  # 4 blocks of p, 3 of t
    for _ in range(3):  # one level of nesting per collection: ("lora", "x") in the extra keys in the key
        gc.collect()
    tracked = [h for h in hashes if gc.is_tracked(h)]
    assert not tracked, f"{len(tracked)} of {len(hashes)} block hashes are still tracked, e.g. {tracked[0]!r}"


@pytest.mark.seed("002:1.2", "003:hash")
def test_prefix_caching_hashes_chain_through_the_parent():
    fn = get_hash_fn("sha256")
    a = hash_request_tokens(fn, 4, make("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = hash_request_tokens(fn, 4, make("b", [0, 2, 3, 4, 5, 6, 7, 8]))
    assert len(a) == 2 and len(b) == 2  # the partial tail of a is not hashed
    assert a[1][TOKEN_IDS] == b[1][TOKEN_IDS] == (5, 6, 7, 8)
    assert a[1] != b[1]  # same tokens, different prefix
    assert a[1] == hash_block_tokens(fn, a[0][HASH_VALUE], [5, 6, 7, 8])


@pytest.mark.seed("003:hash")
def test_prefix_caching_sha256_is_stable_across_processes():
    code = (
        "from tinyvllm.core.prefix_hash import HASH_VALUE, get_hash_fn, hash_block_tokens;"
        "print(hash_block_tokens(get_hash_fn('sha256'), None, [1, 2, 3])[HASH_VALUE])"
    )
    env = {"PYTHONPATH": SRC, "PYTHONHASHSEED": "random"}
    out1 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    out2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    here = hash_block_tokens(get_hash_fn("sha256"), None, [1, 2, 3])[HASH_VALUE]
    assert int(out1.stdout) == int(out2.stdout) == here


@pytest.mark.seed("002:1.2")
def test_prefix_caching_extra_keys_lora_on_every_block_salt_on_first():
    r = make("r", range(12), lora_name="adapter", cache_salt="tenant-a")
    assert generate_block_hash_extra_keys(r, 0, 4) == (("lora", "adapter"), ("salt", "tenant-a"))
    assert generate_block_hash_extra_keys(r, 4, 8) == (("lora", "adapter"),)
    assert generate_block_hash_extra_keys(make("p", [1]), 0, 4) is None
    # A LoRA named like a salt is still a different key.
    assert generate_block_hash_extra_keys(make("l", [1], lora_name="x"), 0, 4) != generate_block_hash_extra_keys(
        make("s", [1], cache_salt="x"), 0, 4
    )


@pytest.mark.seed("002:1.2")
@pytest.mark.parametrize(
    ("kw_a", "kw_b", "hits"),
    [
        ({}, {}, 2),
        ({"cache_salt": "s1"}, {"cache_salt": "s1"}, 2),
        ({"cache_salt": "s1"}, {"cache_salt": "s2"}, 0),
        ({"cache_salt": "s1"}, {}, 0),
        ({"lora_name": "l1"}, {"lora_name": "l1"}, 2),
        ({"lora_name": "l1"}, {"lora_name": "l2"}, 0),
    ],
)
def test_prefix_caching_salt_and_lora_isolate_the_cache(kw_a, kw_b, hits):
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    a = make("a", range(10), **kw_a)
    got, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 10, got)
    found, _ = m.get_computed_blocks(make("b", range(10), **kw_b))
    assert len(found) == hits


@pytest.mark.seed("003:hash")
def test_prefix_caching_builtin_hash_fn_works_too():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64, hash_algo="builtin")
    a = make("a", range(9))
    m.allocate_slots(a, 9)
    found, n = m.get_computed_blocks(make("b", range(9)))
    assert n == 8


@pytest.mark.seed("002:1.2")
def test_prefix_caching_stable_bytes_tells_lookalike_inputs_apart():
    """Inputs that a careless concatenation would merge get different bytes."""
    lookalikes = [
        ("ab", "c"), ("a", "bc"), ("abc",),  # where one string ends
        (("lora", "x"),), (("salt", "x"),), (("lora", "x"), ("salt", "x")),  # the extra keys' tags
        (1, 2), ((1, 2),), ((1,), 2), (1, (2,)),  # nesting
        None, (), ((),), (None,), "", 0, "0", ("0",), (0,),  # empty and zero-like values
        -1, 255, 2**32 - 1, 2**64 - 1, -(2**63), 2**256 - 1,  # two's complement, widths
        (2**31,), (2**31 - 1,), (-(2**31),), (2**32,), (0, 2**31), (2**31, 0),  # past the packed ints
        (1, 2, 3), (1, 2, 3, 0), (0, 1, 2, 3), ("\ud800",), ("\ud801",),  # lone surrogates
    ]
    encoded = [stable_bytes(v) for v in lookalikes]
    assert len(set(encoded)) == len(lookalikes)
    assert stable_bytes((1, 2)) == stable_bytes((1, 2))  # a function of the value


@pytest.mark.seed("003:hash")
def test_prefix_caching_block_of_16_tokens_hashes_in_two_sha256_rounds():
    """sha256 compresses 64 bytes per round and pads 9: a message of <= 119 bytes takes two."""
    data = stable_bytes((2**256 - 1, tuple(range(16)), None))  # the widest sha256 parent
    assert len(data) == 113


@pytest.mark.seed("002:1.2")
def test_prefix_caching_hashes_ids_past_32_bits_through_the_general_encoding():
    fn = get_hash_fn("sha256")
    tokens = [1, 2, 3, 4, 5, 2**40, 7, 8, 2**31, 10, 11, 12]
    hashes = hash_request_tokens(fn, 4, make("big", tokens))
    parent = None
    for i, h in enumerate(hashes):
        assert h == hash_block_tokens(fn, parent, tokens[4 * i : 4 * i + 4])
        parent = h[HASH_VALUE]
    wrapped = hash_request_tokens(fn, 4, make("wrapped", [1, 2, 3, 4, 5, 0, 7, 8, 0, 10, 11, 12]))
    assert hashes[0] == wrapped[0] and hashes[1][HASH_VALUE] != wrapped[1][HASH_VALUE]


@pytest.mark.seed("002:1.2")
def test_prefix_caching_preempted_request_hashes_only_its_new_blocks():
    """Its kept hashes stay the same objects; the blocks filled since are appended, chained."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    r = make("r", range(9))
    m.get_computed_blocks(r)
    kept = list(m.req_to_block_hashes["r"])
    assert len(kept) == 2
    r.append_output_token_ids([20, 21, 22, 23])  # it decoded, was preempted, and comes back
    m.get_computed_blocks(r)
    grown = m.req_to_block_hashes["r"]
    assert len(grown) == 3 and all(a is b for a, b in zip(grown, kept))
    assert grown == hash_request_tokens(m.hash_fn, 4, make("fresh", list(range(9)) + [20, 21, 22, 23]))


# -- the free queue and the block --------------------------------------------------------


@pytest.mark.seed("002:2.2", "003:free_queue")
def test_prefix_caching_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # from the middle
    q.remove(blocks[4])  # the tail
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3]
    q.append(blocks[4])
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 0]
    assert q.num_free_blocks == 4
    q.check_invariants(blocks)
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    q.check_invariants(blocks)


@pytest.mark.seed("003:free_queue")
def test_prefix_caching_free_queue_rejects_double_append_and_foreign_remove():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="block 1 is already in the free queue"):
        q.append(blocks[1])
    popped = q.popleft()
    with pytest.raises(ValueError, match="block 0 is not in the free queue"):
        q.remove(popped)
    q.check_invariants(blocks)


@pytest.mark.seed("002:2.1", "003:blocks")
def test_prefix_caching_block_hash_is_set_once():
    block = KVCacheBlock(7)
    h = make_block_hash(1, (1, 2), None)
    block.block_hash = h
    with pytest.raises(AssertionError, match="block 7 already carries a hash"):
        block.block_hash = h
    block.reset_hash()
    assert block.block_hash is None


@pytest.mark.seed("002:2.4")
def test_prefix_caching_pool_reset_refuses_while_blocks_are_in_use():
    m = KVCacheManager(block_size=4, num_gpu_blocks=6, max_model_len=64)
    a = make("a", range(9))
    m.allocate_slots(a, 9)
    assert m.reset_prefix_cache() is False
    assert len(m.block_pool.cached_block_hash_to_block) == 2
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.block_pool.cached_block_hash_to_block == {}
    assert m.get_computed_blocks(make("b", range(9))) == ([], 0)
    m.check_invariants()


@pytest.mark.seed("002:2.4")
def test_prefix_caching_usage_and_stats():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64, log_stats=True)
    assert m.usage == 0.0
    a = make("a", range(10))
    m.get_computed_blocks(a)
    m.allocate_slots(a, 10)
    assert m.usage == pytest.approx(0.3)
    b = make("b", range(10))
    m.get_computed_blocks(b)
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert KVCacheManager(4, 10, 64).prefix_cache_stats is None


@pytest.mark.seed("002:2.5")
def test_prefix_caching_disabled_never_hits_and_caches_nothing():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64, enable_caching=False)
    a = make("a", range(10))
    m.allocate_slots(a, 10)
    assert m.block_pool.cached_block_hash_to_block == {}
    assert m.get_computed_blocks(make("b", range(10))) == ([], 0)
    m.free(a)
    assert m.block_pool.get_num_free_blocks() == 10
    m.check_invariants()


# -- bad input: ValueError naming the value, nothing changed ------------------------------


@pytest.mark.seed("002:2.5")
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size must be an int >= 1, got 0"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be an int >= 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be an int >= 1, got 0"),
        ({"hash_algo": "md5"}, "unknown hash_algo 'md5'"),
        ({"num_preallocate_tokens": -1}, "num_preallocate_tokens must be an int >= 0, got -1"),
    ],
)
def test_prefix_caching_manager_rejects_bad_config(kwargs, match):
    args = {"block_size": 4, "num_gpu_blocks": 10, "max_model_len": 64} | kwargs
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**args)


@pytest.mark.seed("003:allocate")
@pytest.mark.parametrize("num_tokens", [0, -3])
def test_prefix_caching_allocate_rejects_non_positive_num_tokens(num_tokens):
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    with pytest.raises(ValueError, match=f"num_tokens must be a positive int, got {num_tokens}"):
        m.allocate_slots(make("a", range(5)), num_tokens)
    assert m.block_pool.get_num_free_blocks() == 10 and m.req_to_blocks == {}


@pytest.mark.seed("003:allocate")
def test_prefix_caching_allocate_rejects_request_longer_than_max_model_len():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=8)
    with pytest.raises(ValueError, match="9 tokens exceed max_model_len 8"):
        m.allocate_slots(make("a", range(9)), 9)
    assert m.block_pool.get_num_free_blocks() == 10 and m.req_to_blocks == {}
    m.check_invariants()


@pytest.mark.seed("003:allocate")
def test_prefix_caching_allocate_rejects_more_tokens_than_the_request_has():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    with pytest.raises(ValueError, match="it has only 5 tokens"):
        m.allocate_slots(make("a", range(5)), 6)
    assert m.block_pool.get_num_free_blocks() == 10


@pytest.mark.seed("003:allocate")
def test_prefix_caching_decode_inside_the_last_block_keeps_every_check():
    """A decode step with room in its last block still gets every check of the five steps,
    and the block that a decode step fills is cached."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=6)
    a = make("a", range(5))
    m.allocate_slots(a, 5)  # 2 blocks: 8 slots for a request that may reach 6 tokens
    a.num_computed_tokens = 5
    with pytest.raises(ValueError, match="it has only 5 tokens"):
        m.allocate_slots(a, 1)  # its 6th token is not appended yet
    a.append_output_token_ids(9)
    assert m.allocate_slots(a, 1) == [] and m.num_cached_block["a"] == 1
    a.num_computed_tokens = 6
    a.append_output_token_ids(9)
    with pytest.raises(ValueError, match="7 tokens exceed max_model_len 6"):
        m.allocate_slots(a, 1)  # room in the block, but past max_model_len
    m.check_invariants()
    m2 = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    b = make("b", range(7))
    m2.allocate_slots(b, 7)
    b.num_computed_tokens = 7
    b.append_output_token_ids(9)
    assert m2.allocate_slots(b, 1) == []  # token 8 fills block 1: it is cached
    assert m2.num_cached_block["b"] == 2 and m2.block_pool.get_cached_block(m2.req_to_block_hashes["b"][1])
    m2.check_invariants()


@pytest.mark.seed("003:allocate", "002:3.1")
def test_prefix_caching_allocate_rejects_hits_for_a_running_request():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    a = make("a", range(9))
    m.allocate_slots(a, 9)
    b = make("b", range(12))
    hits, _ = m.get_computed_blocks(b)
    m.allocate_slots(b, 4, hits)
    b.num_computed_tokens = 8
    with pytest.raises(ValueError, match="prefix hits can only be added at admission"):
        m.allocate_slots(b, 4, hits)
    m.check_invariants()


@pytest.mark.seed("002:2.4")
def test_prefix_caching_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_gpu_blocks must be an int >= 1, got 0"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot get 3 blocks: only 2 are free"):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2


def test_prefix_caching_core_never_imports_torch():
    code = (
        "import sys, pkgutil, importlib, tinyvllm.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__): importlib.import_module('tinyvllm.core.' + m.name)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))\n"
        "print(len(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "tinyvllm.core imported torch"
