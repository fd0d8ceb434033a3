# --8<-- [start:header]
"""KVCacheBlock and FreeKVCacheBlockQueue: block metadata and the LRU list of free blocks.

Concept: a ``KVCacheBlock`` is the bookkeeping of one physical block (its id, how many
requests use it, the hash of its content once full); it stores no KV itself. The
``FreeKVCacheBlockQueue`` is a doubly linked list threaded through the blocks with
ref_cnt 0, in eviction order: the head is evicted (reused) first.

Follows: seed 003 "KV block管理" (the ``KVCacheBlock`` fields) and
"FreeKVCacheBlockQueue详细介绍" (``popleft`` / ``remove`` / ``append``); seed 002 §2.2
(free blocks with and without KV, why a doubly linked list, LRU from the head).
Mirrors: ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``).

Invariants (``check_invariants``): walking ``next_free_block`` from the head visits
exactly ``num_free_blocks`` blocks and ends at the tail; every ``prev_free_block`` is the
mirror of a ``next_free_block``; a block is linked if and only if it is in the queue.

NOTE 1 (why not ``collections.deque``): a prefix-cache hit on a free block must take
that block out of the *middle* of the queue. A deque removes from the middle in O(n);
the links stored on the blocks themselves make ``remove`` O(1) and cost no wrapper
objects. The queue starts in block-id order.

NOTE 2 (order is the policy): this class only pops from the head and appends at the
tail. The eviction policy lives in who appends what when: the KV cache manager frees a
request's blocks in reverse, so a chain's tail (its longest, least shareable prefix) is
evicted before its head.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyvllm.core.prefix_hash import BlockHash


# --8<-- [start:kv_cache_block]
class KVCacheBlock:
    """Metadata of one KV-cache block: id, reference count, hash, free-list links."""

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        # Only FreeKVCacheBlockQueue touches these two.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def incr_ref(self) -> None:
        self.ref_cnt += 1

    def decr_ref(self) -> None:
        assert self.ref_cnt > 0, f"block {self.block_id}: decr_ref with ref_cnt {self.ref_cnt}"
        self.ref_cnt -= 1

    @property
    def block_hash(self) -> BlockHash | None:
        """The hash of the block's content; set once when the block becomes full."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        assert self._block_hash is None, (
            f"block {self.block_id} already carries a hash; reset_hash() it before reuse"
        )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the content hash (the block is being evicted and reused)."""
        self._block_hash = None

    def __repr__(self) -> str:
        hashed = "hashed" if self._block_hash is not None else "unhashed"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {hashed})"
# --8<-- [end:kv_cache_block]


# --8<-- [start:queue_init]
class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the head is the next to be reused."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.free_list_head: KVCacheBlock | None = blocks[0] if blocks else None
        self.free_list_tail: KVCacheBlock | None = blocks[-1] if blocks else None
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
    # --8<-- [end:queue_init]

    # --8<-- [start:contains]
    def _contains(self, block: KVCacheBlock) -> bool:
        """O(1): a block is in the list iff it is linked or is the (single) head."""
        return block.prev_free_block is not None or block is self.free_list_head
    # --8<-- [end:contains]

    # --8<-- [start:popleft]
    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the least recently freed)."""
        block = self.free_list_head
        if block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block
    # --8<-- [end:popleft]

    # --8<-- [start:remove]
    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the list in O(1)."""
        if not self._contains(block):
            raise ValueError(f"block {block.block_id} is not in the free queue")
        if block.prev_free_block is not None:
            block.prev_free_block.next_free_block = block.next_free_block
        if block.next_free_block is not None:
            block.next_free_block.prev_free_block = block.prev_free_block
        if block is self.free_list_head:
            self.free_list_head = block.next_free_block
        if block is self.free_list_tail:
            self.free_list_tail = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
    # --8<-- [end:remove]

    # --8<-- [start:append]
    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (it will be reused last)."""
        if self._contains(block):
            raise ValueError(f"block {block.block_id} is already in the free queue")
        if self.free_list_tail is None:
            self.free_list_head = self.free_list_tail = block
        else:
            self.free_list_tail.next_free_block = block
            block.prev_free_block = self.free_list_tail
            self.free_list_tail = block
        block.next_free_block = None
        self.num_free_blocks += 1
    # --8<-- [end:append]

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.free_list_head
        while block is not None:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail (O(n); for tests, tracing and the docs)."""
        return list(self)

    # --8<-- [start:check_invariants]
    def check_invariants(self, all_blocks: Iterable[KVCacheBlock] | None = None) -> None:
        """Assert the list is well formed; with ``all_blocks``, that the unlisted are unlinked."""
        seen: set[int] = set()
        prev: KVCacheBlock | None = None
        for block in self:
            assert block.block_id not in seen, f"block {block.block_id} appears twice in the free list"
            assert block.prev_free_block is prev, f"block {block.block_id}: prev link does not mirror next link"
            seen.add(block.block_id)
            prev = block
        assert prev is self.free_list_tail, "walking from the head does not end at the tail"
        assert len(seen) == self.num_free_blocks, (
            f"num_free_blocks {self.num_free_blocks} is out of sync with the free list of length {len(seen)}"
        )
        for block in all_blocks or ():
            if block.block_id not in seen:
                assert block.prev_free_block is None and block.next_free_block is None, (
                    f"block {block.block_id} is not in the free list but still carries links"
                )
    # --8<-- [end:check_invariants]
