"""The documents' worked examples of prefix caching, replayed step by step.

Seed 002 §3.1 cases (1) and (2), seed 002 §3.2 steps 0-6 (block size 4, ten blocks),
seed 004 "Duplication", seed 004's review corner case, seed 003's ``allocate_slots``
walkthrough, and the "never the whole prompt" cap. Tokens are letters mapped to ints so
the tests read like the documents.
"""

import pytest

from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.prefix_hash import TOKEN_IDS
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams


def toks(text: str) -> list[int]:
    """'ABCD' -> [65, 66, 67, 68]; ' ' and '|' are ignored so blocks can be drawn."""
    return [ord(c) for c in text if c not in " |"]


def req(request_id: str, text: str, **kwargs) -> Request:
    return Request(request_id, toks(text), SamplingParams(), **kwargs)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def cached(m: KVCacheManager) -> dict[str, list[int]]:
    """The hash map as {block text: [block ids in caching order]}."""
    return {
        "".join(map(chr, h[TOKEN_IDS])): list(by_id) for h, by_id in m.block_pool.cached_block_hash_to_block.items()
    }


def admit(m: KVCacheManager, r: Request, num_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hits, num_hit_tokens = m.get_computed_blocks(r)
    n = r.num_tokens - num_hit_tokens if num_tokens is None else num_tokens
    new = m.allocate_slots(r, n, hits)
    assert new is not None
    r.num_computed_tokens = num_hit_tokens + n
    return hits, new


def step(m: KVCacheManager, r: Request, num_tokens: int):
    """What the scheduler does for a running request."""
    new = m.allocate_slots(r, num_tokens)
    assert new is not None
    r.num_computed_tokens += num_tokens
    return new


# -- seed 002 §3.2: the running example, block_size 4, 10 blocks ---------------------


@pytest.mark.seed("002:3.2")
def test_prefix_caching_seed002_walkthrough_steps_0_to_6():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    assert free_ids(m) == list(range(10))  # the queue starts in block-id order

    # step 0: req0 = ABCD|EFGH|IJKL|MNO, all prompt tokens scheduled.
    req0 = req("req0", "ABCD|EFGH|IJKL|MNO")
    hits, new = admit(m, req0)
    assert hits == []
    assert [b.block_id for b in new] == [0, 1, 2, 3]
    assert m.get_block_ids("req0") == [0, 1, 2, 3]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9]
    assert cached(m) == {"ABCD": [0], "EFGH": [1], "IJKL": [2]}  # block 3 is partial

    # steps 1-3: the prefill samples P, one decode step computes P and samples Q.
    req0.append_output_token_ids(ord("P"))
    assert step(m, req0, 1) == []  # P fits in block 3, which is now full and cached
    assert cached(m)["MNOP"] == [3]
    req0.append_output_token_ids(ord("Q"))
    assert [b.block_id for b in step(m, req0, 1)] == [4]
    assert m.get_block_ids("req0") == [0, 1, 2, 3, 4]
    assert free_ids(m) == [5, 6, 7, 8, 9]

    # step 4: req1 = ABCD|EFGH|IJkl|mn hits the first two blocks of req0.
    req1 = req("req1", "ABCD|EFGH|IJkl|mn")
    hits, new = admit(m, req1)
    assert [b.block_id for b in hits] == [0, 1]
    assert [b.block_id for b in new] == [5, 6]
    assert m.get_block_ids("req1") == [0, 1, 5, 6]
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert free_ids(m) == [7, 8, 9]
    assert cached(m) == {"ABCD": [0], "EFGH": [1], "IJKL": [2], "MNOP": [3], "IJkl": [5]}

    # step 5a: req0 finishes; blocks 0 and 1 stay with req1, 4 3 2 go to the tail, reversed.
    m.free(req0)
    assert free_ids(m) == [7, 8, 9, 4, 3, 2]
    assert "IJKL" in cached(m) and "MNOP" in cached(m)  # freed, but still cached

    # step 5b: req1 finishes too.
    m.free(req1)
    assert free_ids(m) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    # step 6: req2 = ABCD|EFGH|IJKL|0-3|4-7|8-11|12-15|16 (29 tokens) hits 0 1 2 from the
    # free queue; its new blocks come from the head: 7 8 9 4 3. Block 3 held MNOP: evicted.
    tail = "".join(chr(0x100 + i) for i in range(17))
    req2 = req("req2", "ABCD|EFGH|IJKL" + tail)
    assert req2.num_tokens == 29
    hits, new = admit(m, req2)
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert [b.block_id for b in new] == [7, 8, 9, 4, 3]
    assert m.get_block_ids("req2") == [0, 1, 2, 7, 8, 9, 4, 3]
    assert free_ids(m) == [6, 5]
    assert "MNOP" not in cached(m)  # the LRU victim
    assert cached(m)["IJkl"] == [5]  # still cached in a free block
    assert m.block_pool.blocks[3].block_hash is None  # block 3 now holds the partial tail
    m.check_invariants()


# -- seed 002 §3.1: computed / new computed / new blocks -----------------------------


def _cache_abcd_efgh(m: KVCacheManager) -> None:
    """Leave ABCD|EFGH cached in free blocks, as both §3.1 cases assume."""
    r = req("earlier", "ABCD|EFGH|X")
    admit(m, r)
    m.free(r)


@pytest.mark.seed("002:3.1")
def test_prefix_caching_seed002_case1_waiting_request_hits_two_blocks():
    m = KVCacheManager(block_size=4, num_gpu_blocks=8, max_model_len=64)
    _cache_abcd_efgh(m)
    req1 = req("req1", "ABCD|EFGH|IJ")
    hits, num_hit_tokens = m.get_computed_blocks(req1)
    assert req1.num_computed_tokens == 0  # <computed>: 0 for every waiting request
    assert len(hits) == 2 and num_hit_tokens == 8  # <new computed>: ABCD | EFGH
    before = cached(m)
    new = m.allocate_slots(req1, 2, hits)  # <new>: 1 block for IJ
    assert len(new) == 1
    assert cached(m) == before  # <new full>: 0, nothing new to cache
    assert m.get_block_ids("req1") == [b.block_id for b in hits] + [new[0].block_id]


@pytest.mark.seed("002:3.1", "004:duplication")
def test_prefix_caching_seed002_case2_running_request_never_rehits_append_only():
    m = KVCacheManager(block_size=4, num_gpu_blocks=8, max_model_len=64)
    _cache_abcd_efgh(m)
    cached_efgh = cached(m)["EFGH"][0]
    req1 = req("req1", "ABCD|EFGH|IJ")
    hits, _ = m.get_computed_blocks(req1)
    # First scheduling: only ABCDEF fit the budget. ABCD is reused; EF gets a new block.
    new = m.allocate_slots(req1, 2, hits[:1])
    req1.num_computed_tokens = 6
    assert len(new) == 1 and new[0].block_id != cached_efgh
    # Second scheduling: GHIJ. EFGH is now full in req1's own block; it is not swapped
    # for the cached copy (append-only), so the map holds EFGH twice.
    step(m, req1, 4)
    table = m.get_block_ids("req1")
    assert table[1] == new[0].block_id
    assert cached(m)["EFGH"] == [cached_efgh, new[0].block_id]
    assert m.block_pool.get_cached_block(hits[1].block_hash).block_id == cached_efgh  # first one wins
    m.check_invariants()


# -- seed 004: duplication and the review corner case --------------------------------


@pytest.mark.seed("004:duplication", "002:2.3")
def test_prefix_caching_seed004_duplication_two_blocks_one_hash_later_hit_gets_first():
    bs = 16
    prompt = list(range(1000, 1000 + 3 * bs + 14))  # three full blocks and 14/16
    m = KVCacheManager(block_size=bs, num_gpu_blocks=8, max_model_len=256)
    req1 = Request("req1", prompt, SamplingParams())
    admit(m, req1)
    assert m.get_block_ids("req1") == [0, 1, 2, 3]  # Time 1: block 3 is 14/16
    req1.append_output_token_ids(7)
    step(m, req1, 1)  # Time 2: req1 15/16 ...
    req2 = Request("req2", prompt, SamplingParams())
    hits, _ = admit(m, req2)  # ... and req2 arrives: the partial block cannot be shared
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert m.get_block_ids("req2") == [0, 1, 2, 4]
    req1.append_output_token_ids(8)
    step(m, req1, 1)  # Time 3: block 3 is full and shareable
    req2.append_output_token_ids(7)
    step(m, req2, 1)
    req2.append_output_token_ids(8)
    step(m, req2, 1)  # Time 4: block 4 is full with the same content as block 3
    block3_hash = m.block_pool.blocks[3].block_hash
    assert block3_hash is not None and m.block_pool.blocks[4].block_hash == block3_hash
    assert list(m.block_pool.cached_block_hash_to_block[block3_hash]) == [3, 4]
    # Another request hitting that hash always gets block 3.
    req3 = Request("req3", prompt + [7, 8, 9], SamplingParams())
    hits, _ = m.get_computed_blocks(req3)
    assert [b.block_id for b in hits] == [0, 1, 2, 3]
    # Block 4 is freed once req2 is done; block 3 stays with req1. The duplicate goes to the
    # tail of the free queue like any freed block, still cached, and is not reused first.
    m.free(req2)
    assert free_ids(m) == [5, 6, 7, 4] and 3 not in free_ids(m)
    assert list(m.block_pool.cached_block_hash_to_block[block3_hash]) == [3, 4]
    m.check_invariants()


@pytest.mark.seed("004:corner")
def test_prefix_caching_seed004_review_corner_case_evictable_hits_are_not_free_blocks():
    """b0 and b1 are cached but sit in the free queue (ref_cnt 0) and are the only free
    blocks. A request hitting both and needing one more block must be refused: touching
    the hits takes them out of the queue, leaving nothing for the new block."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=3, max_model_len=64)
    a = req("a", "ABCD|EFGH|x")
    admit(m, a)
    m.free(a)  # queue: 2 1 0, with 0 = ABCD and 1 = EFGH still cached
    c = req("c", "QRST|u")
    admit(m, c, num_tokens=4)  # takes block 2 from the head
    assert free_ids(m) == [1, 0]
    b = req("b", "ABCD|EFGH|YZ")
    hits, _ = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and all(h.ref_cnt == 0 for h in hits)
    snapshot = (free_ids(m), cached(m), [blk.ref_cnt for blk in m.block_pool.blocks])
    assert m.allocate_slots(b, 2, hits) is None
    assert (free_ids(m), cached(m), [blk.ref_cnt for blk in m.block_pool.blocks]) == snapshot
    assert "b" not in m.req_to_blocks
    m.check_invariants()
    # Once c leaves, the same allocation fits.
    m.free(c)
    new = m.allocate_slots(b, 2, hits)
    assert new is not None and [blk.block_id for blk in new] == [2]
    m.check_invariants()


# -- seed 003: allocate_slots step by step -------------------------------------------


@pytest.mark.seed("003:allocate", "003:blocks", "004:algorithms")
def test_prefix_caching_seed003_allocate_slots_preallocates_and_then_needs_no_new_blocks():
    # Step 1 can give a negative number of new blocks: preallocated ones cover it.
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64, num_preallocate_tokens=8)
    assert m.num_preallocate_blocks == 2
    r = req("r", "ABCD|EF")
    new = m.allocate_slots(r, 6)
    assert [b.block_id for b in new] == [0, 1, 2, 3]  # 2 needed + 2 preallocated
    r.num_computed_tokens = 6
    for tok in "GHIJKLMNO":
        r.append_output_token_ids(ord(tok))
    assert m.allocate_slots(r, 9) == []  # 15 tokens fit in the 4 blocks already held
    r.num_computed_tokens = 15
    assert cached(m) == {"ABCD": [0], "EFGH": [1], "IJKL": [2]}


@pytest.mark.seed("003:blocks")
def test_prefix_caching_seed003_preallocation_is_capped_by_max_blocks_per_request():
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=12, num_preallocate_tokens=64)
    r = req("r", "ABCD|EF")
    new = m.allocate_slots(r, 6)
    assert len(new) == 3 == m.max_num_blocks_per_req


@pytest.mark.seed("003:allocate", "004:algorithms")
def test_prefix_caching_seed003_full_blocks_are_cached_at_once_for_the_same_batch():
    """Step 5: a block is cached when allocated full, before its KV is even computed, so
    a request later in the same step already hits it."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    first = req("first", "ABCD|EFGH|I")
    admit(m, first)
    second = req("second", "ABCD|EFGH|J")
    hits, _ = m.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1]


@pytest.mark.seed("003:allocate", "003:free_queue")
def test_prefix_caching_seed003_touch_removes_free_hits_from_the_queue():
    m = KVCacheManager(block_size=4, num_gpu_blocks=6, max_model_len=64)
    a = req("a", "ABCD|EFGH|I")
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    b = req("b", "ABCD|EFGH|Z")
    admit(m, b)
    assert free_ids(m) == [4, 5, 2]  # 0 and 1 touched out of the middle, 3 popped
    assert m.get_block_ids("b") == [0, 1, 3]


@pytest.mark.seed("003:free", "002:2.2", "004:algorithms")
def test_prefix_caching_seed003_free_releases_in_reverse_order():
    m = KVCacheManager(block_size=4, num_gpu_blocks=6, max_model_len=64)
    a = req("a", "ABCD|EFGH|IJKL|M")
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [4, 5, 3, 2, 1, 0]
    m.free(a)  # freeing again (or a request that never got blocks) is harmless
    assert free_ids(m) == [4, 5, 3, 2, 1, 0]


# -- the cap: never the whole prompt ---------------------------------------------------


@pytest.mark.seed("002:1.1", "004:computed")
@pytest.mark.parametrize(
    ("prompt", "expected_hit_blocks"),
    [("ABCD|EFGH", 1), ("ABCD|EFGH|I", 2), ("ABCD|EFG", 1), ("ABCD", 0), ("ABC", 0)],
)
def test_prefix_caching_never_hits_the_whole_prompt(prompt, expected_hit_blocks):
    m = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    admit(m, req("warm", "ABCD|EFGH|IJKL"))
    hits, num_hit_tokens = m.get_computed_blocks(req("probe", prompt))
    assert len(hits) == expected_hit_blocks
    assert num_hit_tokens == 4 * expected_hit_blocks < len(toks(prompt))
