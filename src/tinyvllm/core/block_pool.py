# --8<-- [start:header]
"""BlockPool: every KV-cache block of the device, the free queue, and the prefix cache.

Concept: the pool owns all ``num_gpu_blocks`` ``KVCacheBlock`` objects and the two
structures that index them: the ``FreeKVCacheBlockQueue`` (blocks with ref_cnt 0, in
eviction order) and ``cached_block_hash_to_block`` (full blocks by content hash). It
knows nothing of requests; the KV cache manager decides who gets which block.

Follows: seed 004 "Data Structure" (block pool, free block queue, cached block map,
"when cache hit, we always allocate the first block in the list") and "Duplication";
seed 002 §2.1-2.4; seed 003 ``_get_new_blocks`` / ``_touch`` / eviction.
Mirrors: ``vllm/v1/core/block_pool.py``.

Invariants (``check_invariants``):
- every block is either free (ref_cnt 0, in the queue) or in use (ref_cnt > 0, not in it);
- the queue's length equals ``num_free_blocks``;
- every entry ``cached_block_hash_to_block[h][i]`` is block ``i`` and carries hash ``h``;
  every block carrying a hash is in the map under it (no orphan hashes).

NOTE 1 (no null block): today's vLLM reserves block 0 as a "null block" for padding;
the documents' pool has none, so a pool of N blocks hands out ids 0..N-1.
NOTE 2 (duplicates): block tables are append-only, so the same content may be cached
in two blocks (seed 004 "Duplication"); the map keeps both, in caching order, and a
lookup returns the first, so references aggregate on one copy.
NOTE 3 (lazy eviction): a freed block keeps its hash and its place in the map; it is
evicted only when ``get_new_blocks`` pops it for new content.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tinyvllm.core.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from tinyvllm.core.prefix_hash import BlockHash, HashFn, append_block_hashes

if TYPE_CHECKING:
    from tinyvllm.request import Request


# --8<-- [start:pool_init]
class BlockPool:
    """All KV-cache blocks, the free queue over them, and the hash -> block map."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # {block_hash: {block_id: block}}; inner dicts keep caching order (NOTE 2).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # --8<-- [end:pool_init]

    # -- prefix cache -------------------------------------------------------------

    # --8<-- [start:get_cached_block]
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The first block cached under ``block_hash``, or None on a miss."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))
    # --8<-- [end:get_cached_block]

    # --8<-- [start:cache_full_blocks]
    def cache_full_blocks(
        self,
        request: "Request",
        blocks: Sequence[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        hash_fn: HashFn,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]``, which have just become full.

        ``block_hashes`` is the request's list of known full-block hashes. Blocks past
        its end were filled by generated tokens: their hashes are computed here from the
        request's tokens, chained to the previous block, and appended to the list.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        append_block_hashes(hash_fn, block_size, request, block_hashes, num_full_blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
    # --8<-- [end:cache_full_blocks]

    # --8<-- [start:evict]
    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the prefix cache if it is there; True if it was."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        same_hash = self.cached_block_hash_to_block.get(block_hash)
        assert same_hash is not None and block.block_id in same_hash, (
            f"block {block.block_id} carries a hash that the cache map does not know"
        )
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True
    # --8<-- [end:evict]

    def uncache_block(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s content: drop it from the prefix cache (a failed step's blocks,
        whose KV was never written). True if it was cached."""
        return self._maybe_evict_cached_block(block)

    # -- allocation ----------------------------------------------------------------

    # --8<-- [start:get_new_blocks]
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evicting their old
        content from the prefix cache; each comes back with ref_cnt 1."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            self._maybe_evict_cached_block(block)
            block.incr_ref()
            new_blocks.append(block)
        return new_blocks
    # --8<-- [end:get_new_blocks]

    # --8<-- [start:touch]
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit still in the free queue leaves it
        (seed 003 ``_touch``), so it cannot be evicted while in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.incr_ref()
    # --8<-- [end:touch]

    # --8<-- [start:free_blocks]
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given; a block reaching ref_cnt
        0 goes to the tail of the free queue, still cached (NOTE 3)."""
        for block in ordered_blocks:
            block.decr_ref()
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
    # --8<-- [end:free_blocks]

    # --8<-- [start:reset_prefix_cache]
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since a
        running request's full blocks must stay findable for the requests after it."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used > 0:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        return True
    # --8<-- [end:reset_prefix_cache]

    # -- statistics and checks -----------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks

    # --8<-- [start:check_invariants]
    def check_invariants(self) -> None:
        self.free_block_queue.check_invariants(self.blocks)
        free_ids = {block.block_id for block in self.free_block_queue}
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt {block.ref_cnt}"
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor referenced"
            if block.block_hash is not None:
                assert block.block_id in self.cached_block_hash_to_block.get(block.block_hash, {}), (
                    f"block {block.block_id} carries a hash but is missing from the cache map"
                )
        for block_hash, by_id in self.cached_block_hash_to_block.items():
            assert by_id, "an empty entry was left in the cache map"
            for block_id, block in by_id.items():
                assert block is self.blocks[block_id], f"cache map entry {block_id} is not block {block_id}"
                assert block.block_hash == block_hash, f"block {block_id} is cached under a hash it does not carry"
    # --8<-- [end:check_invariants]
