"""Property tests of the prefix-caching KV-cache core, against models written here.

Concept: drive ``KVCacheManager`` (and, alone, ``FreeKVCacheBlockQueue`` and
``hash_request_tokens``) with random operation sequences and compare every observable
with a small independent model that shares no code with the library:

- a block's identity is the tuple of *all* tokens up to the end of that block (plus the
  request's LoRA name and cache salt), not a chained hash;
- the free queue is a plain Python list of block ids, head first;
- hits, evictions, ref counts and the "cannot allocate" decision are simulated from
  those two structures alone.

Follows: seed 002 §2.2 (LRU free queue, tail of a chain evicted first), §3.1-3.2;
seed 003 ``allocate_slots`` steps 1-5, ``free`` in reverse, ``_touch``; seed 004
"Free", "Get Computed Blocks", "Duplication" and the review corner case (evictable hit
blocks are discounted before allocating); the classic semantics the docs page "The KV cache
manager" lists (no null block, append-only block tables, preallocation off by default).

Properties checked after every rule (``@invariant``): the library's own
``check_invariants``; free queue ids == model list; ref counts == model; num free +
distinct held blocks == num_gpu_blocks; each request's block table == model; the prefix
cache map groups exactly the model's cached blocks, in caching order. Rules check their
own results: hits == the model's longest cached full-block prefix (capped at
``(num_tokens - 1) // block_size``); ``allocate_slots`` returns None exactly when the
model says the pool is short, and then nothing changed; ``reset_prefix_cache`` is True
exactly when no block is in use. Teardown frees everything and checks every block is free.

NOTE 1 (why token-prefix keys): keying the model's cache by the whole prefix tuple is
what a chained hash is meant to be equivalent to, so the model checks the chaining
instead of re-implementing it.
NOTE 2 (the caller's job): as the scheduler does, the test advances
``request.num_computed_tokens`` by the hit tokens and the scheduled chunk only when
``allocate_slots`` succeeds, and appends a decode token before allocating its slot.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import assume, event, example, given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinyvllm.core.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.prefix_hash import (
    EXTRA_KEYS,
    HASH_VALUE,
    TOKEN_IDS,
    append_block_hashes,
    generate_block_hash_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    stable_bytes,
)
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams

ALPHABET = st.integers(min_value=0, max_value=2)  # tiny, so identical full blocks recur
MAX_LIVE_REQUESTS = 6


def _request(request_id: str, tokens: list[int], lora: str | None = None, salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=64), lora_name=lora, cache_salt=salt)


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------
# KVCacheManager state machine
# ---------------------------------------------------------------------------------------


@dataclass
class ModelRequest:
    """The model's view of one request: which block ids it holds and how many are cached."""

    request: Request
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    running: bool = False


class PrefixCachingKVCacheManagerMachine(RuleBasedStateMachine):
    """KVCacheManager under admit / chunked prefill / decode / preempt / free / reset."""

    # -- set-up ----------------------------------------------------------------------

    @initialize(
        block_size=st.integers(1, 4),
        num_gpu_blocks=st.one_of(st.integers(4, 10), st.integers(4, 24)),  # small pools twice as often
        max_model_len=st.integers(8, 64),
        enable_caching=st.sampled_from([True, True, True, False]),
        preallocate_blocks=st.sampled_from([0, 0, 1, 2]),
        hash_algo=st.sampled_from(["sha256", "builtin"]),
        log_stats=st.booleans(),
        data=st.data(),
    )
    def set_up_prefix_caching(
        self,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        enable_caching: bool,
        preallocate_blocks: int,
        hash_algo: str,
        log_stats: bool,
        data: st.DataObject,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.max_blocks_per_req = _ceil_div(max_model_len, block_size)
        self.mgr = KVCacheManager(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            num_preallocate_tokens=preallocate_blocks * block_size,
            hash_algo=hash_algo,
            log_stats=log_stats,
        )
        self.preallocate_blocks = preallocate_blocks
        # A few "documents" (system prompts) that prompts start from, 1-5 full blocks long.
        self.documents: list[list[int]] = data.draw(
            st.lists(st.lists(ALPHABET, min_size=block_size + 1, max_size=5 * block_size), min_size=1, max_size=4),
            label="documents",
        )
        # -- the model --
        self.m_free: list[int] = list(range(num_gpu_blocks))  # head first
        self.m_ref: list[int] = [0] * num_gpu_blocks
        self.m_content: list[tuple | None] = [None] * num_gpu_blocks  # key of a cached block
        self.m_cache: dict[tuple, list[int]] = {}  # key -> block ids, in caching order
        self.reqs: dict[str, ModelRequest] = {}
        self.history: list[list[int]] = []  # token lists of earlier requests
        self.next_id = 0
        self.m_stats = [0, 0, 0]  # requests, queried tokens, hit tokens
        # Start with one live request, so that every rule can be chosen from the first step.
        self.admit_new_request(data)

    # -- model helpers -----------------------------------------------------------------

    def _key(self, req: Request, block_index: int) -> tuple:
        """The identity of a request's block: LoRA, salt, and every token up to its end."""
        end = (block_index + 1) * self.block_size
        return (req.lora_name, req.cache_salt, tuple(req.all_token_ids[:end]))

    def _model_hits(self, req: Request) -> list[int]:
        if not self.enable_caching:
            return []
        cap = max(req.num_tokens - 1, 0) // self.block_size
        hits: list[int] = []
        for i in range(cap):
            ids = self.m_cache.get(self._key(req, i))
            if not ids:
                break
            hits.append(ids[0])
        return hits

    def _model_pop_new(self, n: int) -> list[int]:
        popped = self.m_free[:n]
        del self.m_free[:n]
        for b in popped:
            key = self.m_content[b]
            if key is not None:
                event("a cached block is evicted")
                self.m_cache[key].remove(b)
                if not self.m_cache[key]:
                    del self.m_cache[key]
                self.m_content[b] = None
            assert self.m_ref[b] == 0, f"model: popped block {b} has ref {self.m_ref[b]}"
            self.m_ref[b] = 1
        return popped

    def _model_cache_full(self, mreq: ModelRequest, total_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_full = total_tokens // self.block_size
        for i in range(mreq.num_cached, num_full):
            b = mreq.blocks[i]
            assert self.m_content[b] is None, f"model: block {b} filled twice"
            key = self._key(mreq.request, i)
            self.m_content[b] = key
            if key in self.m_cache:
                event("duplicate: content already cached in another block")
            self.m_cache.setdefault(key, []).append(b)
        mreq.num_cached = max(mreq.num_cached, num_full)

    def _model_free(self, mreq: ModelRequest) -> None:
        for b in reversed(mreq.blocks):
            self.m_ref[b] -= 1
            if self.m_ref[b] == 0:
                self.m_free.append(b)
        mreq.blocks = []
        mreq.num_cached = 0
        mreq.running = False

    def _snapshot(self) -> tuple:
        """Everything allocate_slots must leave untouched when it returns None."""
        pool = self.mgr.block_pool
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            {h: tuple(by_id) for h, by_id in pool.cached_block_hash_to_block.items()},
            {rid: [b.block_id for b in bs] for rid, bs in self.mgr.req_to_blocks.items()},
            dict(self.mgr.num_cached_block),
            {rid: list(hs) for rid, hs in self.mgr.req_to_block_hashes.items()},
        )

    def _ids_of(self, state: str) -> list[str]:
        want_running = state == "running"
        return sorted(rid for rid, m in self.reqs.items() if m.running == want_running)

    # -- the two halves of admission ------------------------------------------------------

    def _admit(self, mreq: ModelRequest, data: st.DataObject) -> None:
        """get_computed_blocks, then allocate_slots for a chunk of what is left."""
        req = mreq.request
        assert req.num_computed_tokens == 0, f"{req.request_id}: admitted with {req.num_computed_tokens} computed"
        expected_hits = self._model_hits(req)
        before = self._snapshot()
        blocks, num_hit_tokens = self.mgr.get_computed_blocks(req)
        after = self._snapshot()
        assert before[:6] == after[:6], f"{req.request_id}: get_computed_blocks changed block state"
        hit_ids = [b.block_id for b in blocks]
        assert hit_ids == expected_hits, (
            f"{req.request_id} tokens={req.all_token_ids} bs={self.block_size}: hits {hit_ids}, "
            f"model expects {expected_hits} (cached keys: {sorted(self.m_cache, key=lambda k: len(k[2]))})"
        )
        assert num_hit_tokens == len(expected_hits) * self.block_size, (
            f"{req.request_id}: {num_hit_tokens} hit tokens for {len(expected_hits)} blocks of {self.block_size}"
        )
        assert len(hit_ids) <= (req.num_tokens - 1) // self.block_size, (
            f"{req.request_id}: {len(hit_ids)} hit blocks for {req.num_tokens} tokens exceed the cap"
        )
        event(f"admission hits: {'some' if expected_hits else 'none'}")
        if self.enable_caching:
            self.m_stats[0] += 1
            self.m_stats[1] += req.num_tokens
            self.m_stats[2] += num_hit_tokens

        remaining = req.num_tokens - num_hit_tokens
        chunk = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)), label="chunk")
        total = num_hit_tokens + chunk
        num_new = _ceil_div(total, self.block_size) - len(expected_hits)
        num_evictable_hits = sum(1 for b in expected_hits if self.m_ref[b] == 0)
        expect_fail = num_new > len(self.m_free) - num_evictable_hits
        if num_evictable_hits:
            event("admission hits a block in the free queue")
        note(f"admit {req.request_id}: hits={expected_hits} chunk={chunk} new={num_new} free={len(self.m_free)}")

        before = self._snapshot()
        result = self.mgr.allocate_slots(req, chunk, blocks)
        event(f"admission allocate_slots: {'None' if expect_fail else 'ok'}")
        if expect_fail:
            assert result is None, (
                f"{req.request_id}: allocate_slots gave {result} but {num_new} new blocks > "
                f"{len(self.m_free)} free - {num_evictable_hits} evictable hits"
            )
            assert self._snapshot() == before, f"{req.request_id}: a failed allocate_slots changed state"
            return
        assert result is not None, (
            f"{req.request_id}: allocate_slots gave None but {num_new} new blocks <= "
            f"{len(self.m_free)} free - {num_evictable_hits} evictable hits"
        )
        # Model: touch the hits, then pop new blocks, then cache what is full.
        for b in expected_hits:
            if self.m_ref[b] == 0:
                self.m_free.remove(b)
            self.m_ref[b] += 1
        mreq.blocks = list(expected_hits)
        mreq.num_cached = len(expected_hits)
        self._model_allocate_new(mreq, num_new, result)
        req.num_computed_tokens = total
        mreq.running = True
        self._model_cache_full(mreq, total)

    def _model_allocate_new(self, mreq: ModelRequest, num_new: int, result: list[KVCacheBlock]) -> None:
        expected_new: list[int] = []
        if num_new > 0:
            num_to_get = min(
                num_new + self.preallocate_blocks,
                len(self.m_free),
                self.max_blocks_per_req - len(mreq.blocks),
            )
            expected_new = self._model_pop_new(num_to_get)
        got = [b.block_id for b in result]
        assert got == expected_new, f"{mreq.request.request_id}: new blocks {got}, model expects {expected_new}"
        mreq.blocks.extend(expected_new)

    def _extend(self, mreq: ModelRequest, num_tokens: int) -> bool:
        """allocate_slots for ``num_tokens`` more tokens of a running request."""
        req = mreq.request
        total = req.num_computed_tokens + num_tokens
        num_new = _ceil_div(total, self.block_size) - len(mreq.blocks)
        expect_fail = num_new > len(self.m_free)
        note(f"extend {req.request_id} by {num_tokens}: new={num_new} free={len(self.m_free)}")
        event(f"extend allocate_slots: {'None' if expect_fail else 'ok'}")
        before = self._snapshot()
        result = self.mgr.allocate_slots(req, num_tokens)
        if expect_fail:
            assert result is None, f"{req.request_id}: got {result} though {num_new} new > {len(self.m_free)} free"
            assert self._snapshot() == before, f"{req.request_id}: a failed allocate_slots changed state"
            return False
        assert result is not None, f"{req.request_id}: None though {num_new} new <= {len(self.m_free)} free"
        self._model_allocate_new(mreq, num_new, result)
        req.num_computed_tokens = total
        self._model_cache_full(mreq, total)
        return True

    # -- rules ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.reqs) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def admit_new_request(self, data: st.DataObject) -> None:
        """A new prompt: a cut of a document or of an earlier request, plus a random tail;
        then admission."""
        # Prefixes come from the documents and from earlier requests' whole token lists
        # (outputs included), so hits on freed, still-cached blocks are common.
        doc = data.draw(st.sampled_from(self.documents + self.history), label="document")
        cut_back = data.draw(st.integers(0, len(doc)), label="tokens cut off the document")
        tail = data.draw(st.lists(ALPHABET, max_size=3 * self.block_size + 1), label="tail")
        tokens = (doc[: len(doc) - cut_back] + tail)[: self.max_model_len - 1] or [0]
        lora = data.draw(st.sampled_from([None, None, None, "x"]), label="lora")
        salt = data.draw(st.sampled_from([None, None, None, "x", "y"]), label="salt")
        rid = f"r{self.next_id}"
        self.next_id += 1
        mreq = ModelRequest(_request(rid, tokens, lora, salt))
        self.reqs[rid] = mreq
        self.history.append(tokens)
        self._admit(mreq, data)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), token=ALPHABET)
    def advance_request(self, data: st.DataObject, token: int) -> None:
        """One scheduler step for one live request, whatever it needs next:
        - waiting (admission failed, or preempted): retry admission;
        - partly computed: the next chunk of its chunked prefill (or the decode token
          whose allocation failed);
        - fully computed: decode, i.e. append ``token`` then allocate one slot;
        - at ``max_model_len``: finished (length capped), freed.
        """
        mreq = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)), label="request")]
        req = mreq.request
        if not mreq.running:
            self._admit(mreq, data)
        elif req.num_computed_tokens < req.num_tokens:
            remaining = req.num_tokens - req.num_computed_tokens
            chunk = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)), label="chunk")
            self._extend(mreq, chunk)
        elif req.num_tokens < self.max_model_len:
            req.append_output_token_ids(token)
            # On failure the token stays uncomputed; the next step retries it as a chunk.
            self._extend(mreq, 1)
        else:
            self._finish(mreq)

    # --8<-- [start:preempt_rule]
    @precondition(lambda self: any(m.running for m in self.reqs.values()))
    @rule(data=st.data())
    def preempt_request(self, data: st.DataObject) -> None:
        """Free the blocks but keep the block hashes; the request waits to be re-admitted."""
        mreq = self.reqs[data.draw(st.sampled_from(self._ids_of("running")), label="preempted request")]
        self.mgr.free(mreq.request)
        self._model_free(mreq)
        rid = mreq.request.request_id
        assert rid not in self.mgr.req_to_blocks, f"{rid} still has blocks after free"
        if self.enable_caching:
            assert rid in self.mgr.req_to_block_hashes, f"{rid} lost its block hashes on preemption"
        mreq.request.num_computed_tokens = 0
        mreq.request.num_preemptions += 1
    # --8<-- [end:preempt_rule]

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="finished request")
        self._finish(self.reqs[rid])

    def _finish(self, mreq: ModelRequest) -> None:
        rid = mreq.request.request_id
        del self.reqs[rid]
        self.history.append(list(mreq.request.all_token_ids))
        self.mgr.free(mreq.request)
        self.mgr.free_block_hashes(mreq.request)
        self._model_free(mreq)
        assert rid not in self.mgr.req_to_blocks, f"{rid} still has blocks after free"
        assert rid not in self.mgr.req_to_block_hashes, f"{rid} still has hashes after free_block_hashes"

    @rule(drain_first=st.booleans())
    def reset_prefix_cache(self, drain_first: bool) -> None:
        """Reset the prefix cache, either now (refused while any block is in use) or, as
        an operator would, after every request has finished. Draining checks on the way
        that once every request is freed, every block is free."""
        if drain_first:
            for mreq in [self.reqs[rid] for rid in sorted(self.reqs)]:
                self._finish(mreq)
            self._check_all_blocks_free()
        in_use = [b for b in range(self.num_gpu_blocks) if self.m_ref[b] > 0]
        before = self._snapshot()
        ok = self.mgr.reset_prefix_cache()
        event(f"reset_prefix_cache: {ok}")
        assert ok == (not in_use), f"reset_prefix_cache gave {ok} with blocks {in_use} in use"
        if not ok:
            assert self._snapshot() == before, "a refused reset_prefix_cache changed state"
            return
        assert self.mgr.block_pool.cached_block_hash_to_block == {}, (
            f"hash map not empty after reset: {self.mgr.block_pool.cached_block_hash_to_block}"
        )
        hashed = [b.block_id for b in self.mgr.block_pool.blocks if b.block_hash is not None]
        assert not hashed, f"blocks {hashed} still carry a hash after reset"
        self.m_cache.clear()
        self.m_content = [None] * self.num_gpu_blocks

    # -- invariants ------------------------------------------------------------------------

    # --8<-- [start:invariant]
    @invariant()
    def prefix_caching_state_matches_model(self) -> None:
        mgr = self.mgr
        pool = mgr.block_pool
        mgr.check_invariants()
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert free_ids == self.m_free, f"free queue {free_ids} != model {self.m_free}"
        refs = [b.ref_cnt for b in pool.blocks]
        assert refs == self.m_ref, f"ref counts {refs} != model {self.m_ref}"
        held = {b.block_id for blocks in mgr.req_to_blocks.values() for b in blocks}
        assert pool.get_num_free_blocks() + len(held) == self.num_gpu_blocks, (
            f"{pool.get_num_free_blocks()} free + {len(held)} held by live requests != {self.num_gpu_blocks} blocks"
        )
        for rid, mreq in self.reqs.items():
            got = mgr.get_block_ids(rid)
            assert got == mreq.blocks, f"{rid}: block table {got} != model {mreq.blocks}"
        # --8<-- [end:invariant]
        # The cache map groups exactly the model's cached blocks, in caching order.
        lib_groups = sorted(tuple(by_id) for by_id in pool.cached_block_hash_to_block.values())
        model_groups = sorted(tuple(ids) for ids in self.m_cache.values())
        assert lib_groups == model_groups, f"cached groups {lib_groups} != model {model_groups}"
        for key, ids in self.m_cache.items():
            hashes = {pool.blocks[b].block_hash for b in ids}
            assert len(hashes) == 1, f"blocks {ids} share content {key} but carry {len(hashes)} hashes"
            assert pool.blocks[ids[0]].block_hash[TOKEN_IDS] == key[2][-self.block_size :], (
                f"block {ids[0]} caches tokens {pool.blocks[ids[0]].block_hash[TOKEN_IDS]}, model {key[2]}"
            )
        if self.log_stats and self.enable_caching:
            s = mgr.prefix_cache_stats
            assert (s.requests, s.queries, s.hits) == tuple(self.m_stats), f"stats {s} != model {self.m_stats}"

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: when a rule has already failed, its
        # exception is the report, and checking a broken state here would only add a
        # second, distinct failure for Hypothesis to shrink separately.
        if not hasattr(self, "mgr") or sys.exc_info()[0] is not None:
            return
        for mreq in [self.reqs[rid] for rid in sorted(self.reqs)]:
            self._finish(mreq)
        self._check_all_blocks_free()
        assert self.mgr.reset_prefix_cache() is True, "reset_prefix_cache refused with every block free"

    def _check_all_blocks_free(self) -> None:
        self.mgr.check_invariants()
        pool = self.mgr.block_pool
        not_free = [b.block_id for b in pool.blocks if b.ref_cnt != 0]
        assert pool.get_num_free_blocks() == self.num_gpu_blocks and not not_free, (
            f"after freeing every request, {pool.get_num_free_blocks()} of {self.num_gpu_blocks} are free; "
            f"blocks {not_free} still referenced"
        )
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert free_ids == self.m_free, f"final free queue {free_ids} != model {self.m_free}"
        assert self.mgr.req_to_blocks == {} and self.mgr.req_to_block_hashes == {}, (
            f"leftover tables {self.mgr.req_to_blocks} / hashes {list(self.mgr.req_to_block_hashes)}"
        )


Test_prefix_caching_KVCacheManager = pytest.mark.seed("002:2.5", "002:2.4", "004:data", "004:algorithms")(PrefixCachingKVCacheManagerMachine.TestCase)


@pytest.mark.seed("004:corner")
@given(
    block_size=st.integers(1, 4),
    prompt=st.lists(ALPHABET, min_size=2, max_size=16),
    tail=st.lists(ALPHABET, min_size=1, max_size=12),
    data=st.data(),
)
def test_prefix_caching_allocate_discounts_evictable_hits(
    block_size: int, prompt: list[int], tail: list[int], data: st.DataObject
) -> None:
    """Seed 004's review corner case, aimed at directly: a request whose hits sit in the
    free queue needs a pool of all its blocks, hits included, since touching the hits
    takes them out of the queue. Request A computes ``prompt`` and finishes; B =
    ``prompt + tail`` then hits A's full blocks (all ref_cnt 0) in a pool of ``N``."""
    assume(len(prompt) >= block_size + 1)
    blocks_a = _ceil_div(len(prompt), block_size)
    longer = prompt + tail
    blocks_b = _ceil_div(len(longer), block_size)
    num_gpu_blocks = data.draw(st.integers(blocks_a, blocks_b + 1), label="num_gpu_blocks")
    mgr = KVCacheManager(block_size, num_gpu_blocks, max_model_len=64)
    a = _request("a", prompt)
    assert mgr.get_computed_blocks(a) == ([], 0), "hits in an empty cache"
    assert mgr.allocate_slots(a, len(prompt)) is not None, f"{blocks_a} blocks did not fit a pool of {num_gpu_blocks}"
    a.num_computed_tokens = len(prompt)
    mgr.free(a)
    mgr.free_block_hashes(a)

    b = _request("b", longer)
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    expected_hits = min(len(prompt) // block_size, (len(longer) - 1) // block_size)
    assert len(hits) == expected_hits, f"{len(hits)} hits, expected {expected_hits} (bs {block_size})"
    assert all(h.ref_cnt == 0 for h in hits), f"hits {hits} should all be free"
    num_new = blocks_b - expected_hits
    free_before = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    result = mgr.allocate_slots(b, len(longer) - num_hit_tokens, hits)
    should_fit = num_new <= num_gpu_blocks - expected_hits  # i.e. blocks_b <= num_gpu_blocks
    if not should_fit:
        assert result is None, (
            f"allocate_slots gave {result}: {num_new} new blocks, pool {num_gpu_blocks}, "
            f"{expected_hits} evictable hits"
        )
        free_after = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
        assert free_after == free_before, f"a failed allocation changed the free queue {free_before} -> {free_after}"
        assert all(blk.ref_cnt == 0 for blk in mgr.block_pool.blocks), "a failed allocation took references"
    else:
        assert result is not None and len(result) == num_new, (
            f"allocate_slots gave {result}, expected {num_new} new blocks in a pool of {num_gpu_blocks}"
        )
        assert mgr.get_block_ids("b")[:expected_hits] == [h.block_id for h in hits], "hits are not b's first blocks"
        assert all(h.ref_cnt == 1 for h in hits), f"hits {hits} should be touched once"
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# FreeKVCacheBlockQueue alone
# ---------------------------------------------------------------------------------------


class PrefixCachingFreeQueueMachine(RuleBasedStateMachine):
    """FreeKVCacheBlockQueue against a Python list (head first)."""

    @initialize(num_blocks=st.integers(0, 10))
    def set_up_prefix_caching_queue(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.queue = FreeKVCacheBlockQueue(self.blocks)
        self.model: list[int] = list(range(num_blocks))

    def _outside(self) -> list[int]:
        return [b.block_id for b in self.blocks if b.block_id not in self.model]

    @rule()
    def popleft(self) -> None:
        if not self.model:
            with pytest.raises(ValueError):
                self.queue.popleft()
            return
        block = self.queue.popleft()
        expected = self.model.pop(0)
        assert block.block_id == expected, f"popleft gave {block.block_id}, model head {expected}"

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove_from_anywhere(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.model), label="removed")
        self.queue.remove(self.blocks[block_id])
        self.model.remove(block_id)

    @precondition(lambda self: len(self._outside()) > 0)
    @rule(data=st.data())
    def append_at_tail(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self._outside()), label="appended")
        self.queue.append(self.blocks[block_id])
        self.model.append(block_id)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def append_a_member_is_refused(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.model), label="member")
        with pytest.raises(ValueError):
            self.queue.append(self.blocks[block_id])

    @precondition(lambda self: len(self._outside()) > 0)
    @rule(data=st.data())
    def remove_a_non_member_is_refused(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self._outside()), label="non-member")
        with pytest.raises(ValueError):
            self.queue.remove(self.blocks[block_id])

    @invariant()
    def prefix_caching_queue_matches_list(self) -> None:
        self.queue.check_invariants(self.blocks)
        ids = [b.block_id for b in self.queue.get_all_free_blocks()]
        assert ids == self.model, f"queue {ids} != model {self.model}"
        assert self.queue.num_free_blocks == len(self.model), (
            f"num_free_blocks {self.queue.num_free_blocks} != model length {len(self.model)}"
        )
        head = self.queue.free_list_head.block_id if self.queue.free_list_head else None
        tail = self.queue.free_list_tail.block_id if self.queue.free_list_tail else None
        want = (self.model[0], self.model[-1]) if self.model else (None, None)
        assert (head, tail) == want, f"head/tail {(head, tail)} != model {want}"


Test_prefix_caching_FreeKVCacheBlockQueue = pytest.mark.seed("002:2.2", "003:free_queue")(PrefixCachingFreeQueueMachine.TestCase)


# ---------------------------------------------------------------------------------------
# hash_request_tokens
# ---------------------------------------------------------------------------------------

SHA256 = get_hash_fn("sha256")
HASH_FNS = st.sampled_from([get_hash_fn("sha256"), get_hash_fn("builtin")])
TOKENS = st.lists(ALPHABET, min_size=0, max_size=40)


def _hashes(tokens: list[int], block_size: int, hash_fn=SHA256, lora=None, salt=None) -> list:
    return hash_request_tokens(hash_fn, block_size, _request("h", tokens, lora, salt))


@pytest.mark.seed("002:1.1", "003:hash")
@given(tokens=TOKENS.filter(bool), block_size=st.integers(1, 6), hash_fn=HASH_FNS)
def test_prefix_caching_hash_count_is_full_blocks(tokens: list[int], block_size: int, hash_fn) -> None:
    hashes = _hashes(tokens, block_size, hash_fn)
    assert len(hashes) == len(tokens) // block_size, (
        f"{len(hashes)} hashes for {len(tokens)} tokens with block_size {block_size}"
    )
    for i, h in enumerate(hashes):
        want = tuple(tokens[i * block_size : (i + 1) * block_size])
        assert h[TOKEN_IDS] == want, f"block {i}: token_ids {h[TOKEN_IDS]} != {want}"
        assert h[EXTRA_KEYS] is None, f"block {i}: extra keys {h[EXTRA_KEYS]} without lora or salt"


@pytest.mark.seed("002:1.1", "002:1.2")
@given(
    shared=TOKENS,
    tail_a=TOKENS,
    tail_b=TOKENS,
    block_size=st.integers(1, 6),
    hash_fn=HASH_FNS,
)
def test_prefix_caching_hash_equal_iff_prefix_equal(
    shared: list[int], tail_a: list[int], tail_b: list[int], block_size: int, hash_fn
) -> None:
    """Block i of two requests has the same hash exactly when their first i+1 blocks match."""
    a, b = shared + tail_a, shared + tail_b
    assume(a and b)
    ha, hb = _hashes(a, block_size, hash_fn), _hashes(b, block_size, hash_fn)
    for i in range(min(len(ha), len(hb))):
        end = (i + 1) * block_size
        same_prefix = a[:end] == b[:end]
        if same_prefix:
            assert ha[i] == hb[i], f"block {i}: equal prefixes {a[:end]} hash differently"
        elif hash_fn is SHA256:
            assert ha[i][HASH_VALUE] != hb[i][HASH_VALUE], (
                f"block {i}: prefixes {a[:end]} and {b[:end]} share hash value {ha[i][HASH_VALUE]}"
            )


@pytest.mark.seed("002:1.2")
@given(tokens=TOKENS, block_size=st.integers(1, 6), data=st.data())
def test_prefix_caching_hash_changed_token_changes_block_and_all_later(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    assume(len(tokens) >= block_size)
    pos = data.draw(st.integers(0, len(tokens) - 1), label="changed position")
    new_tok = data.draw(ALPHABET.filter(lambda t: t != tokens[pos]), label="new token")
    changed = tokens[:pos] + [new_tok] + tokens[pos + 1 :]
    ha, hb = _hashes(tokens, block_size), _hashes(changed, block_size)
    first_changed = pos // block_size
    for i in range(len(ha)):
        if i < first_changed:
            assert ha[i] == hb[i], f"block {i} before changed position {pos} changed its hash"
        else:
            assert ha[i][HASH_VALUE] != hb[i][HASH_VALUE], (
                f"block {i} at/after changed position {pos} (block {first_changed}) kept hash {ha[i][HASH_VALUE]}"
            )


@pytest.mark.seed("002:1.2")
@given(tokens=TOKENS.filter(bool), block_size=st.integers(1, 6), lora=st.sampled_from(["x", "y", "adapter"]))
def test_prefix_caching_hash_lora_on_every_block(tokens: list[int], block_size: int, lora: str) -> None:
    plain, with_lora = _hashes(tokens, block_size), _hashes(tokens, block_size, lora=lora)
    again = _hashes(tokens, block_size, lora=lora)
    other = _hashes(tokens, block_size, lora=lora + "2")
    assert with_lora == again, f"lora {lora!r}: hashes are not deterministic"
    for i in range(len(plain)):
        assert with_lora[i][EXTRA_KEYS] is not None and ("lora", lora) in with_lora[i][EXTRA_KEYS], (
            f"block {i}: extra keys {with_lora[i][EXTRA_KEYS]} lack the lora {lora!r}"
        )
        assert with_lora[i][HASH_VALUE] != plain[i][HASH_VALUE], f"block {i}: lora {lora!r} left the hash unchanged"
        assert with_lora[i][HASH_VALUE] != other[i][HASH_VALUE], f"block {i}: loras {lora!r} and {lora + '2'!r} collide"


@pytest.mark.seed("002:1.2")
@given(tokens=TOKENS.filter(bool), block_size=st.integers(1, 6), salt=st.sampled_from(["x", "y", "tenant-7"]))
def test_prefix_caching_hash_salt_first_block_only_changes_all(tokens: list[int], block_size: int, salt: str) -> None:
    plain, salted = _hashes(tokens, block_size), _hashes(tokens, block_size, salt=salt)
    other = _hashes(tokens, block_size, salt=salt + "2")
    for i in range(len(plain)):
        keys = salted[i][EXTRA_KEYS] or ()
        if i == 0:
            assert ("salt", salt) in keys, f"first block's extra keys {keys} lack the salt {salt!r}"
        else:
            assert not any(k[0] == "salt" for k in keys), f"block {i} carries salt keys {keys}"
        assert salted[i][HASH_VALUE] != plain[i][HASH_VALUE], f"block {i}: salt {salt!r} left the hash unchanged"
        assert salted[i][HASH_VALUE] != other[i][HASH_VALUE], f"block {i}: salts {salt!r} and {salt + '2'!r} collide"


@pytest.mark.seed("002:1.2")
@given(tokens=TOKENS.filter(bool), block_size=st.integers(1, 6), name=st.sampled_from(["x", "shared"]))
def test_prefix_caching_hash_lora_and_salt_of_same_name_differ(tokens: list[int], block_size: int, name: str) -> None:
    by_lora, by_salt = _hashes(tokens, block_size, lora=name), _hashes(tokens, block_size, salt=name)
    for i in range(len(by_lora)):
        assert by_lora[i][HASH_VALUE] != by_salt[i][HASH_VALUE], (
            f"block {i}: lora {name!r} and salt {name!r} give the same hash {by_lora[i][HASH_VALUE]}"
        )


# ---------------------------------------------------------------------------------------
# stable_bytes and the fast chain
# ---------------------------------------------------------------------------------------


def _decode(data: bytes, pos: int = 0) -> tuple[object, int]:
    """Read back one value written by ``stable_bytes``; returns it and where it ended."""
    tag, pos = data[pos : pos + 1], pos + 1
    if tag == b"n":
        return None, pos
    n, pos = int.from_bytes(data[pos : pos + 4], "little"), pos + 4
    if tag == b"i":
        return int.from_bytes(data[pos : pos + n], "little", signed=True), pos + n
    if tag == b"s":
        return data[pos : pos + n].decode("utf-8", "surrogatepass"), pos + n
    if tag == b"a":
        ints = [int.from_bytes(data[p : p + 4], "little", signed=True) for p in range(pos, pos + 4 * n, 4)]
        return tuple(ints), pos + 4 * n
    assert tag == b"t", f"unknown tag {tag!r} at byte {pos - 1}"
    items = []
    for _ in range(n):
        item, pos = _decode(data, pos)
        items.append(item)
    return tuple(items), pos


HASHABLE = st.recursive(
    st.none() | st.integers() | st.text(st.characters(codec=None)),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=12,
)


@pytest.mark.seed("002:1.2")
@given(value=HASHABLE)
def test_prefix_caching_stable_bytes_decode_back_to_the_value(value) -> None:
    """The bytes can be read back, so two different values never share their bytes."""
    data = stable_bytes(value)
    decoded, end = _decode(data)
    assert end == len(data), f"{len(data) - end} bytes left over after {decoded!r}"
    assert decoded == value and type(decoded) is type(value), f"{value!r} came back as {decoded!r}"


@pytest.mark.seed("002:1.2")
@given(a=HASHABLE, b=HASHABLE)
def test_prefix_caching_stable_bytes_equal_iff_values_equal(a, b) -> None:
    assert (stable_bytes(a) == stable_bytes(b)) == (a == b), f"{a!r} vs {b!r}"


@pytest.mark.seed("002:1.2", "003:hash")
@given(
    tokens=st.lists(ALPHABET, min_size=1, max_size=30),
    big=st.none() | st.tuples(st.integers(0, 29), st.sampled_from([2**31 - 1, 2**31, 2**40, 2**63])),
    block_size=st.integers(1, 6),
    hash_fn=HASH_FNS,
    lora=st.sampled_from([None, "x"]),
    salt=st.sampled_from([None, "x", "tenant"]),
    splits=st.lists(st.integers(0, 30), max_size=4),
)
@example(tokens=[1, 2, 3, 4], big=None, block_size=2, hash_fn=SHA256, lora="x", salt="x", splits=[1])
@example(tokens=[1, 2, 3, 4], big=(3, 2**40), block_size=2, hash_fn=SHA256, lora=None, salt="x", splits=[1])
def test_prefix_caching_fast_chain_equals_hash_block_tokens(
    tokens, big, block_size, hash_fn, lora, salt, splits
) -> None:
    """``hash_request_tokens`` and ``append_block_hashes`` (in any number of steps) give the
    hashes ``hash_block_tokens`` gives block by block."""
    if big is not None:  # one id past 32 bits: those blocks take the general encoding
        tokens[big[0] % len(tokens)] = big[1]
    request = _request("h", tokens, lora, salt)
    want, parent = [], None
    for i in range(len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        extra = generate_block_hash_extra_keys(request, start, end)
        want.append(hash_block_tokens(hash_fn, parent, tokens[start:end], extra))
        parent = want[-1][HASH_VALUE]
    assert hash_request_tokens(hash_fn, block_size, request) == want
    stepped: list = []
    for n in sorted(min(s, len(want)) for s in splits) + [len(want)]:
        append_block_hashes(hash_fn, block_size, request, stepped, n)
        assert stepped == want[:n], f"after extending to {n} blocks"
