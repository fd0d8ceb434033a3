# --8<-- [start:header]
"""KVCacheManager: which blocks each request holds, and prefix-cache hits.

Concept: the scheduler's one door to KV memory. It maps requests to their blocks
(``req_to_blocks``), finds a new request's longest cached prefix
(``get_computed_blocks``), grows a request's block table for the tokens scheduled this
step (``allocate_slots``), and gives blocks back (``free``). Block bookkeeping itself
(ref counts, free queue, hash map) is the ``BlockPool``'s.

Follows: seed 003 "KV cache block分配" (``allocate_slots`` steps 1-5) and "KV cache
block释放" (``free`` in reverse); seed 002 §2.5 (the manager's fields), §3.1 (computed /
new computed / new blocks; append-only block tables), §3.2 (the worked example);
seed 004 "Get Computed Blocks" and the review corner case (evictable computed blocks).
Mirrors: ``vllm/v1/core/kv_cache_manager.py`` (v0.8.x).

Invariants (``check_invariants``, on top of the pool's): each block a request holds has
ref_cnt == the number of requests holding it; no request holds more than
``max_num_blocks_per_req`` blocks; a request's first ``num_cached_block`` blocks carry
the request's own block hashes, in order.

NOTE 1 (never the whole prompt): a hit covers whole full blocks only, and at most
``num_tokens - 1`` tokens, so the last token is always computed and its logits exist.
NOTE 2 (check before touching): ``allocate_slots`` decides whether the free queue can
supply the new blocks *before* it changes anything. Hit blocks with ref_cnt 0 are still
counted in the queue, but touching them takes them out, so they are discounted (seed
004's review corner case). On failure it returns None and nothing has changed.
NOTE 3 (hashes outlive preemption): ``free`` releases blocks (finish or preemption) but
keeps the request's block hashes, which stay valid because tokens are only appended;
``free_block_hashes`` forgets them once the request is finished for good.
NOTE 4 (a cached block is written only once its step finished): ``allocate_slots`` caches
a block as soon as the step's tokens will fill it, so a later request of the *same* step
may hit it; that is safe because every layer writes the step's K/V before it attends.
But if the step then fails, the KV of those blocks was never (fully) written. So blocks
cached during a step stay "uncommitted" until the scheduler calls ``commit_step`` (the
forward finished); ``rollback_step`` drops the uncommitted ones from the prefix cache
after the failed step's requests were aborted. No later request can hit them.

NOTE 5 (lookahead slots for drafts): a verification step writes the KV of a request's
drafts beside its real tokens, so ``allocate_slots`` reserves ``num_draft_tokens`` slots
after them. A block is still cached only when full of the request's own tokens: a draft
may be rejected, and its KV must never be found under a hash. A kept draft's slot holds
the right KV (the target computed it for that very token), and its block is cached once
the kept tokens fill it; a rejected draft's slot is written again by the next step.
NOTE 6 (tokens still on the device: async scheduling, ``core/async_scheduler.py``): a step
may be scheduled before the last one's tokens are back, so a request may be scheduled past
its known tokens by ``num_output_placeholders``. Step 5 caches only blocks full of known
tokens; ``cache_blocks`` caches the rest once the tokens arrive. Two steps can be in flight,
so each step's uncommitted blocks are sealed when it is scheduled and committed in order.
Left out: sliding windows, hybrid KV specs, KV offloading.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinyvllm.arith import cdiv
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.free_queue import KVCacheBlock
from tinyvllm.core.prefix_hash import BlockHash, append_block_hashes, get_hash_fn
from tinyvllm.request import Request


# --8<-- [start:helpers]
def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return cdiv(num_tokens, block_size)


def max_cache_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most full blocks a request of ``num_tokens`` tokens may take from the cache:
    whole blocks, leaving at least its last token to compute (NOTE 1)."""
    return max(num_tokens - 1, 0) // block_size
# --8<-- [end:helpers]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since start: requests looked up, tokens queried, tokens hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Requests' block tables over a ``BlockPool``, with prefix caching."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        num_preallocate_tokens: int = 0,
        hash_algo: str = "sha256",
        log_stats: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        if not isinstance(num_preallocate_tokens, int) or num_preallocate_tokens < 0:
            raise ValueError(f"num_preallocate_tokens must be an int >= 0, got {num_preallocate_tokens!r}")
        # --8<-- [start:manager_fields]
        self.hash_fn = get_hash_fn(hash_algo)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.enable_caching = enable_caching
        self.num_preallocate_tokens = num_preallocate_tokens
        self.num_preallocate_blocks = cdiv(num_preallocate_tokens, block_size)
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # request id -> its blocks, in block-table order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> hashes of its full blocks (may run ahead of its blocks).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # request id -> how many of its leading blocks are in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Blocks cached by steps still running, oldest step first: their KV is not yet written
        # (NOTE 4); ``_sealed_counts`` cuts the list into the steps sealed so far (NOTE 6).
        self.uncommitted_blocks: list[KVCacheBlock] = []
        self._sealed_counts: deque[int] = deque()
        self._stats = PrefixCacheStats()
        # --8<-- [end:manager_fields]

    # -- lookups -------------------------------------------------------------------

    # --8<-- [start:get_computed_blocks]
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the start of ``request``, and the
        number of tokens they hold. Changes no block."""
        if not self.enable_caching:
            return [], 0
        # First admission: hash every full block. A preempted request keeps its hashes
        # (NOTE 3); only the blocks it has filled since are hashed, chained to the last.
        block_hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        append_block_hashes(self.hash_fn, self.block_size, request, block_hashes, request.num_tokens // self.block_size)
        if request.skip_reading_prefix_cache:
            return [], 0  # every prompt position must be computed (prompt logprobs, a MEAN pooling): no hit
        computed: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_cache_hit_blocks(request.num_tokens, self.block_size)]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        if self.log_stats:
            s = self._stats
            self._stats = PrefixCacheStats(s.requests + 1, s.queries + request.num_tokens, s.hits + num_computed_tokens)
        return computed, num_computed_tokens
    # --8<-- [end:get_computed_blocks]

    # -- allocation ----------------------------------------------------------------

    # --8<-- [start:allocate_slots]
    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_draft_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow ``request``'s blocks to hold ``num_tokens`` more tokens after its computed
        ones and the ``new_computed_blocks`` prefix hits (seed 003's five steps), plus
        ``num_draft_tokens`` lookahead slots for speculative drafts (NOTE 5).

        Returns the newly allocated blocks (possibly none), or None, changing nothing,
        when the pool cannot supply them.
        """
        hits = new_computed_blocks or ()
        req_id = request.request_id
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"request {req_id!r}: num_tokens must be a positive int, got {num_tokens!r}")
        req_blocks = self.req_to_blocks.get(req_id)  # None before the first allocation
        if hits and (req_blocks or request.num_computed_tokens):
            raise ValueError(
                f"request {req_id!r}: prefix hits can only be added at admission, but it already "
                f"holds {len(req_blocks or ())} blocks and {request.num_computed_tokens} computed tokens"
            )
        if hits and not self.enable_caching:
            raise ValueError(f"request {req_id!r}: new_computed_blocks given with prefix caching disabled")

        # --8<-- [start:allocate_step1]
        # Step 1: how many new blocks the computed, hit and scheduled tokens need.
        num_computed_tokens = request.num_computed_tokens + len(hits) * self.block_size
        total_tokens = num_computed_tokens + num_tokens
        if total_tokens + num_draft_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: {total_tokens} tokens exceed max_model_len {self.max_model_len}"
            )
        if total_tokens > request.num_tokens + request.num_output_placeholders:  # NOTE 6: tokens still coming
            raise ValueError(
                f"request {req_id!r}: {num_tokens} tokens scheduled after {num_computed_tokens} computed, "
                f"but it has only {request.num_tokens} tokens (+{request.num_output_placeholders} still coming)"
            )
        num_required_blocks = num_blocks_needed(total_tokens + num_draft_tokens, self.block_size)
        num_new_blocks = num_required_blocks - len(req_blocks or ()) - len(hits)
        # --8<-- [end:allocate_step1]

        # --8<-- [start:allocate_step2]
        # Step 2: can the free queue supply them once evictable hits are taken out? (NOTE 2)
        num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0) if hits else 0
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        # --8<-- [end:allocate_step2]

        # --8<-- [start:allocate_step3]
        # Step 3: touch the hits so they cannot be evicted.
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
        if hits:
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
        # --8<-- [end:allocate_step3]

        # --8<-- [start:allocate_step4]
        # Step 4: pop new blocks from the head (evicting old content), with preallocation.
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            num_to_get = min(
                num_new_blocks + self.num_preallocate_blocks,
                self.block_pool.get_num_free_blocks(),
                self.max_num_blocks_per_req - len(req_blocks),
            )
            new_blocks = self.block_pool.get_new_blocks(num_to_get)
            req_blocks.extend(new_blocks)
        # --8<-- [end:allocate_step4]

        # --8<-- [start:allocate_step5]
        # Step 5: cache every block that is now full, for later requests of this very batch.
        # Full of the request's own known tokens: never a draft's slot (NOTE 5), nor a token
        # the device has not handed back yet (NOTE 6).
        if self.enable_caching:
            num_cached = self.num_cached_block.get(req_id, len(hits))
            num_full = min(total_tokens, request.num_tokens) // self.block_size
            if num_full > num_cached:  # most decode steps fill no block: nothing to do
                block_hashes = self.req_to_block_hashes.setdefault(req_id, [])
                self.block_pool.cache_full_blocks(
                    request, req_blocks, block_hashes, num_cached, num_full, self.block_size, self.hash_fn
                )
                self.uncommitted_blocks.extend(req_blocks[num_cached:num_full])  # NOTE 4
                num_cached = num_full
            self.num_cached_block[req_id] = num_cached
        # --8<-- [end:allocate_step5]
        return new_blocks
    # --8<-- [end:allocate_slots]

    # --8<-- [start:free]
    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a chain's tail is evicted before
        its head (seed 002 §2.2(2)). Safe on a request that holds none."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)
    # --8<-- [end:free]

    # --8<-- [start:free_block_hashes]
    def free_block_hashes(self, request: Request) -> None:
        """Forget a finished request's block hashes (NOTE 3)."""
        self.req_to_block_hashes.pop(request.request_id, None)
    # --8<-- [end:free_block_hashes]

    # --8<-- [start:commit]
    def seal_step(self) -> None:
        """The step being scheduled is complete: the blocks cached since the last seal are
        its own, committed by the ``commit_step`` that answers it (NOTE 6)."""
        self._sealed_counts.append(len(self.uncommitted_blocks) - sum(self._sealed_counts))

    def commit_step(self) -> None:
        """The oldest running step finished: the blocks it cached hold their KV (NOTE 4).
        With no step sealed (a manager driven by hand), everything uncommitted is committed."""
        if self._sealed_counts:
            del self.uncommitted_blocks[: self._sealed_counts.popleft()]
        else:
            self.uncommitted_blocks.clear()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's blocks that ``num_computed_tokens`` known, computed tokens fill,
        beyond those cached already. For tokens whose KV a finished step wrote, so the blocks
        are committed at once: under async scheduling, the tokens that were still on the device
        when their block was allocated (NOTE 6)."""
        req_id = request.request_id
        if not self.enable_caching or req_id not in self.req_to_blocks:
            return
        num_cached = self.num_cached_block.get(req_id, 0)
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full > num_cached:
            block_hashes = self.req_to_block_hashes.setdefault(req_id, [])
            self.block_pool.cache_full_blocks(
                request, self.req_to_blocks[req_id], block_hashes, num_cached, num_full, self.block_size, self.hash_fn
            )
            self.num_cached_block[req_id] = num_full

    def uncache_unscheduled(self, request: Request) -> list[int]:
        """``request`` was scheduled in the step being scheduled and then taken out of it (a
        preemption victim: ``scheduler.py`` NOTE 7): the blocks it cached in this step will get
        no KV, so they leave the prefix cache now (NOTE 4). Call it before ``free``. Returns their ids."""
        start = sum(self._sealed_counts)  # the unsealed tail: this step's blocks
        held = {id(block) for block in self.req_to_blocks.get(request.request_id, [])}
        mine = [block for block in self.uncommitted_blocks[start:] if id(block) in held]
        for block in mine:
            assert block.ref_cnt == 1, f"block {block.block_id} cached this step is shared (ref_cnt {block.ref_cnt})"
            self.block_pool.uncache_block(block)
        self.uncommitted_blocks[start:] = [b for b in self.uncommitted_blocks[start:] if id(b) not in held]
        return [block.block_id for block in mine]

    def rollback_step(self) -> list[int]:
        """Drop the blocks cached by a failed step from the prefix cache (NOTE 4).

        Call it after the failed step's requests were aborted, so nothing holds these
        blocks; they stay in the free queue, without a hash. Returns their ids.
        """
        dropped = []
        for block in self.uncommitted_blocks:
            assert block.ref_cnt == 0, (
                f"block {block.block_id} of a failed step is still held (ref_cnt {block.ref_cnt}): "
                "abort the step's requests first"
            )
            if self.block_pool.uncache_block(block):
                dropped.append(block.block_id)
        self.uncommitted_blocks.clear()
        self._sealed_counts.clear()
        return dropped
    # --8<-- [end:commit]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    # -- views ---------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Lookups, queried tokens, hit tokens and hit rate; None unless ``log_stats``."""
        return self._stats if self.log_stats else None

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            assert len(blocks) <= self.max_num_blocks_per_req, (
                f"request {req_id!r} holds {len(blocks)} blocks > max {self.max_num_blocks_per_req}"
            )
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
            num_cached = self.num_cached_block.get(req_id, 0)
            assert num_cached <= len(blocks), f"request {req_id!r}: {num_cached} cached of {len(blocks)} blocks"
            hashes = self.req_to_block_hashes.get(req_id, [])
            for i in range(num_cached if self.enable_caching else 0):
                assert blocks[i].block_hash == hashes[i], f"request {req_id!r}: block {i} carries a foreign hash"
        for block_id, count in holders.items():
            ref_cnt = self.block_pool.blocks[block_id].ref_cnt
            assert ref_cnt == count, f"block {block_id} has ref_cnt {ref_cnt} but {count} requests hold it"
