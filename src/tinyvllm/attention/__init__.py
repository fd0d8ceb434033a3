"""Paged attention: writing new K/V into the paged cache, a torch reference, a batched
torch (SDPA) backend and a Triton kernel with the same signature (seed 003 "KV cache物理内存分配")."""
