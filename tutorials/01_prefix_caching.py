"""Tutorial 01: prefix caching, step by step (seed 002 §3.2).

Replays the worked example of seed 002 §3.2 ("运作流程图例"), which is the example of
vLLM's design page on automatic prefix caching: block_size 4, a pool of 10 blocks, and
three requests that share the prefix ABCD|EFGH|... . The document's figures did not
survive in its text, so this script prints, after every step, what they drew:

- every live request's block table (block ids, and the tokens each block holds),
- the free block queue from head (reused first) to tail,
- the prefix cache: the tokens of each cached full block -> the block ids holding them.

It drives ``KVCacheManager`` and ``Request`` directly, doing by hand the two things the
scheduler does around ``allocate_slots``: it advances ``request.num_computed_tokens``
after a successful allocation, and it appends the token the model "sampled" with
``request.append_output_token_ids``. There is no model: the sampled tokens are given.

Tokens are letters and small numbers, mapped to token ids so they can be printed back:
a letter is its code point (``A`` -> 65, ``k`` -> 107), the number n of req2 is
``1000 + n``. The output is deterministic (no hash values, no addresses), so the docs
embed it and a test checks it:

    run:         PYTHONPATH=src python tutorials/01_prefix_caching.py
    regenerate:  python tutorials/regenerate_golden.py 01
    checked by:  tests/test_tutorial_pages.py, tests/test_tutorial_01_prefix_caching.py

The step numbers are the document's figure labels (step 0, 3, 4, 5, 6), not engine
steps: the figures skip the decode steps between 0 and 3.
"""

from __future__ import annotations

from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.prefix_hash import TOKEN_IDS
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 10
NUMBER_BASE = 1000  # req2's numbers 0..16 become token ids 1000..1016


# -- tokens as letters --------------------------------------------------------------


def tokens(text: str) -> list[int]:
    """Letters to token ids: ``"ABCD"`` -> ``[65, 66, 67, 68]``."""
    return [ord(ch) for ch in text]


def numbers(first: int, last: int) -> list[int]:
    """The numbers ``first..last`` (inclusive) as token ids."""
    return [NUMBER_BASE + n for n in range(first, last + 1)]


def label(token_id: int) -> str:
    """A token id back to what the document writes: a letter or a number."""
    if token_id >= NUMBER_BASE:
        return str(token_id - NUMBER_BASE)
    return chr(token_id)


def show_block(token_ids: list[int] | tuple[int, ...]) -> str:
    """``ABCD`` for letters, ``0 1 2 3`` for numbers; empty slots of a partial block as ``_``."""
    labels = [label(t) for t in token_ids]
    labels += ["_"] * (BLOCK_SIZE - len(labels))
    if any(t >= NUMBER_BASE for t in token_ids):
        return " ".join(labels)
    return "".join(labels)


# -- printing the manager's state ---------------------------------------------------


def print_state(manager: KVCacheManager, live: list[Request]) -> None:
    pool = manager.block_pool
    print("  block tables: block id[tokens it holds], _ = empty slot")
    if not live:
        print("    (no live requests)")
    for req in live:
        # A block holds the request's tokens that have (or are getting) their KV in the
        # cache: the first num_computed_tokens tokens, cut into blocks.
        computed = req.all_token_ids[: req.num_computed_tokens]
        cells = []
        for i, block_id in enumerate(manager.get_block_ids(req.request_id)):
            chunk = computed[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            cells.append(f"{block_id}[{show_block(chunk)}]")
        print(f"    {req.request_id}: " + "  ".join(cells))
    shared = [b.block_id for b in pool.blocks if b.ref_cnt > 1]
    if shared:
        print("    shared (ref_cnt > 1): " + ", ".join(f"{i} (ref_cnt {pool.blocks[i].ref_cnt})" for i in shared))

    free = pool.free_block_queue.get_all_free_blocks()
    cells = []
    for block in free:
        if block.block_hash is None:
            cells.append(str(block.block_id))
        else:
            cells.append(f"{block.block_id}*[{show_block(block.block_hash[TOKEN_IDS])}]")
    print(f"  free queue, head (reused first) -> tail: {len(free)} free, * = still cached")
    print("    " + ("  ".join(cells) if cells else "(empty)"))

    print("  prefix cache: tokens of a cached full block -> the block(s) holding them")
    if not pool.cached_block_hash_to_block:
        print("    (empty)")
    for block_hash, by_id in pool.cached_block_hash_to_block.items():
        ids = ", ".join(str(i) for i in by_id)
        noun = "blocks" if len(by_id) > 1 else "block"
        print(f"    {show_block(block_hash[TOKEN_IDS]):<12} -> {noun} {ids}")
    manager.check_invariants()


def cached_contents(manager: KVCacheManager) -> dict[tuple[int, ...], list[int]]:
    return {h[TOKEN_IDS]: list(by_id) for h, by_id in manager.block_pool.cached_block_hash_to_block.items()}


def header(title: str) -> None:
    print()
    print("=" * 78)
    print(title)
    print("=" * 78)


# -- what the scheduler does around allocate_slots ----------------------------------


def admit(manager: KVCacheManager, req: Request) -> None:
    """A waiting request, all of its prompt scheduled: look up hits, then allocate."""
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    hit_ids = [b.block_id for b in hits]
    print(f"  get_computed_blocks({req.request_id}) -> blocks {hit_ids}, {num_hit_tokens} tokens")
    num_new_tokens = req.num_tokens - num_hit_tokens
    before = cached_contents(manager)
    new_blocks = manager.allocate_slots(req, num_new_tokens, hits)
    assert new_blocks is not None, f"{req.request_id} did not fit"
    print(f"  allocate_slots({req.request_id}, {num_new_tokens}, hits {hit_ids}) -> new blocks {[b.block_id for b in new_blocks]}")
    report_evictions(before, manager)
    # The scheduler's job after a successful allocation: the hits and the scheduled
    # tokens now count as computed.
    req.num_computed_tokens = num_hit_tokens + num_new_tokens


def decode(manager: KVCacheManager, req: Request) -> None:
    """A running request: schedule its one uncomputed token (the last sampled one)."""
    num_new_tokens = req.num_tokens - req.num_computed_tokens
    new_blocks = manager.allocate_slots(req, num_new_tokens)
    assert new_blocks is not None, f"{req.request_id} did not fit"
    token = label(req.all_token_ids[-1])
    print(f"  allocate_slots({req.request_id}, {num_new_tokens})  [token {token}] -> new blocks {[b.block_id for b in new_blocks]}")
    req.num_computed_tokens += num_new_tokens


def sample(req: Request, text: str) -> None:
    """The model's output for ``req`` this step (given, not computed)."""
    req.append_output_token_ids(tokens(text))
    print(f"  the model samples {text} for {req.request_id}")


def report_evictions(before: dict[tuple[int, ...], list[int]], manager: KVCacheManager) -> None:
    after = cached_contents(manager)
    for content, ids in before.items():
        gone = [i for i in ids if i not in after.get(content, [])]
        if gone:
            print(f"  evicted: {show_block(content)} (block {', '.join(map(str, gone))}) leaves the prefix cache")


# -- the example --------------------------------------------------------------------


def main() -> None:
    manager = KVCacheManager(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, max_model_len=64)
    params = SamplingParams(max_tokens=8)
    live: list[Request] = []
    print(f"block_size {BLOCK_SIZE}, {NUM_BLOCKS} blocks (ids 0-{NUM_BLOCKS - 1}, no reserved null block)")
    print_state(manager, live)

    header("step 0: req0 = ABCD|EFGH|IJKL|MNO arrives; all 15 prompt tokens are scheduled")
    req0 = Request("req0", tokens("ABCDEFGHIJKLMNO"), params)
    live.append(req0)
    admit(manager, req0)
    print_state(manager, live)
    sample(req0, "P")

    header("step 3: two forward passes later (1 prefill + 1 decode); block 3 is full, block 4 is new")
    print("  decode: P is scheduled and fills block 3 (MNOP), which is cached at once")
    decode(manager, req0)
    sample(req0, "Q")
    print("  decode: Q is scheduled; it needs a fifth block")
    decode(manager, req0)
    print_state(manager, live)

    header("step 4: req1 = ABCD|EFGH|IJkl|mn arrives; all 14 prompt tokens are scheduled")
    print("  (req0 keeps decoding in a real engine; like the document's figure we leave it out)")
    req1 = Request("req1", tokens("ABCDEFGHIJklmn"), params)
    live.append(req1)
    admit(manager, req1)
    print_state(manager, live)

    header("step 5: req0 finishes; its blocks are freed tail first (4, 3, 2, then 1, 0)")
    manager.free(req0)
    manager.free_block_hashes(req0)
    live.remove(req0)
    print("  blocks 0 and 1 are still held by req1: only 4, 3, 2 reach the free queue")
    print_state(manager, live)

    header("step 5 (cont.): req1 finishes; its blocks are freed tail first (6, 5, 1, 0)")
    manager.free(req1)
    manager.free_block_hashes(req1)
    live.remove(req1)
    print_state(manager, live)

    header("step 6: req2 = ABCD|EFGH|IJKL|0-3|4-7|8-11|12-15|16 arrives (29 tokens, all scheduled)")
    req2 = Request("req2", tokens("ABCDEFGHIJKL") + numbers(0, 16), params)
    live.append(req2)
    admit(manager, req2)
    print("  touch took the hits 0, 1, 2 out of the free queue first (leaving 7 8 9 4 3 6 5);")
    print("  the 5 new blocks were then popped from its head: 7 8 9 4 3, and 3 lost MNOP")
    print_state(manager, live)


if __name__ == "__main__":
    main()
