"""Tutorial 05: a tiny paged KV cache, its block table and slot mapping, and attention
through it with both backends.

Run: ``PYTHONPATH=src python tutorials/05_paged_attention.py`` (on a CPU the Triton kernel
runs under the interpreter; this script sets ``TRITON_INTERPRET=1`` when there is no GPU).

Seed 003 "KV cache物理内存分配": one tensor per layer, shaped
``(2, num_blocks, block_size, num_kv_heads, head_size)``; the scheduler's block ids become
slots ``block_id * block_size + offset`` in it.

The output is the same on every machine, so the docs embed it
(``docs/generated/05_paged_attention.txt``) and a test compares the two. The random
inputs are drawn on the CPU and then moved to the device, so a GPU run sees the same
numbers; the difference between the two backends is printed as a comparison with a fixed
bound, not as a figure, because its last digits depend on the device and the build.
Regenerate it with ``python tutorials/regenerate_golden.py 05``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from tinyvllm.attention import reference, triton_attention  # noqa: E402
from tinyvllm.attention.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton  # noqa: E402
from tinyvllm.worker.attention_metadata import build_attention_metadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE = 8, 16, 2, 4, 64
TOLERANCE = 1e-4  # fp32; the equivalence tests use the same bound


def main() -> None:
    torch.manual_seed(0)
    # One layer's cache, as seed 003 allocates it: index 0 holds keys, 1 values.
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE)
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [B, S, Hkv, D] views
    print(f"kv_cache shape {tuple(kv_cache.shape)} = (2, num_blocks, block_size, Hkv, D)")

    # Step 1: request A prefills 20 prompt tokens (blocks 5, 2); B prefills 3 (blocks 7, 3).
    # Step 2: A decodes its 21st token; B prefills its next 14 tokens (chunked prefill).
    block_ids = [[5, 2], [7, 3]]
    steps = [([0, 0], [20, 3]), ([20, 3], [1, 14])]
    for step, (computed, scheduled) in enumerate(steps, start=1):
        md = build_attention_metadata(computed, scheduled, block_ids, BLOCK_SIZE, num_padded_tokens=sum(scheduled) + 2, device=DEVICE)
        print(f"\nstep {step}: num_computed_tokens={computed} num_scheduled_tokens={scheduled}")
        print(f"  block_table     {md.block_table.tolist()}")
        print(f"  query_start_loc {md.query_start_loc.tolist()}")
        print(f"  seq_lens        {md.seq_lens.tolist()}")
        print(f"  positions       {md.positions.tolist()}")
        print(f"  slot_mapping    {md.slot_mapping.tolist()}")
        print(f"  logits_indices  {md.logits_indices.tolist()}")

        n_pad = md.num_padded_tokens
        # Drawn on the CPU, then moved: the same numbers on every device.
        query = torch.randn(n_pad, NUM_HEADS, HEAD_SIZE).to(DEVICE)  # [N, H, D]
        key = torch.randn(n_pad, NUM_KV_HEADS, HEAD_SIZE).to(DEVICE)  # [N, Hkv, D]
        value = torch.randn(n_pad, NUM_KV_HEADS, HEAD_SIZE).to(DEVICE)  # [N, Hkv, D]

        # Write this step's K/V with both writers into copies; they must agree.
        copy = kv_cache.clone()
        write_kv_cache_torch(key, value, copy[0], copy[1], md.slot_mapping)
        write_kv_cache_triton(key, value, key_cache, value_cache, md.slot_mapping)
        print(f"  write_kv_cache: triton == torch: {torch.equal(copy, kv_cache)}")

        args = (query, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table, HEAD_SIZE**-0.5)
        ref = reference.paged_attention(*args)
        tri = triton_attention.paged_attention(*args)
        err = (ref - tri).abs().max().item()
        print(f"  paged_attention: max |reference - triton| < {TOLERANCE:.0e}: {err < TOLERANCE}")
        print(f"  padding rows are zero: {bool((tri[sum(scheduled):] == 0).all())}")


if __name__ == "__main__":
    main()
