"""AttentionMetadata: everything attention reads about one step's batch, as tensors.

Concept: attention's input contract. For the N (padded) token rows of a step and its R
(possibly padded) requests it holds each token's position and cache slot, where each
request's queries start, each request's sequence length and block table row, and the
row of each request's last token. The model and every attention backend read only this;
the worker builds it (``worker/attention_metadata.py`` for the index arithmetic,
``worker/input_buffers.py`` for the persistent tensors), so attention depends on nothing
in the worker.

Follows: seed 003 "KV cache物理内存分配" (``_prepare_inputs`` puts the step's facts into
``attn_metadata``); seed 000 "完整 CUDA 图捕获 & 热身" (``max_query_len`` tells a uniform
decode batch from a mixed one).
Mirrors: ``vllm/v1/attention/backends/utils.py`` (``CommonAttentionMetadata``).

Invariants: ``query_start_loc[-1]`` is the number of real token rows; rows after it are
padding (slot ``PAD_SLOT_ID``, position 0) and attention writes zeros there. Padded
requests (a FULL CUDA graph's fixed request count) have no query rows and ``seq_len`` 0.

NOTE 1 (ints are bounds): the Python ints are frozen into a CUDA graph at capture. So in a
step that replays a FULL graph they are the bounds of its ``BatchDescriptor``:
``max_query_len`` is the uniform query length of a uniform decode graph and the token
count of a mixed one (the seed's rule), and ``max_seq_len`` is ``max_model_len`` (ours);
in every other step they are exact. No kernel of ours reads them (ours choose their
routine from shapes); they matter because a backend may, and because the FULL replay
check compares them. The tensors carry the step's real values.
NOTE 2 (the layout is the model's, not the step's): ``AttentionLayout`` is what every layer's
attention looks like, the same each step: a backend's per-step plan needs it beside the
metadata to size its buffers and pick its tiles before any layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# --8<-- [start:metadata]
@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step (int32, except int64 positions and slots)."""

    positions: torch.Tensor  # [N_pad] int64; padding rows 0
    query_start_loc: torch.Tensor  # [R + 1] int32; last entry = the real token count
    seq_lens: torch.Tensor  # [R] int32; cached tokens including this step's (padded requests 0)
    slot_mapping: torch.Tensor  # [N_pad] int64; padding rows PAD_SLOT_ID
    block_table: torch.Tensor  # [R, max_num_blocks] int32; padded with PAD_BLOCK_ID
    logits_indices: torch.Tensor  # [R] int64; last scheduled row of each request
    max_query_len: int  # NOTE 1
    max_seq_len: int  # NOTE 1
    block_size: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_padded_tokens(self) -> int:
        return self.slot_mapping.shape[0]
# --8<-- [end:metadata]


@dataclass(frozen=True)
class AttentionLayout:
    """Every layer's attention shape (NOTE 2): vLLM's ``kv_cache_spec`` (block size, KV heads,
    head size, dtype) plus the query heads its metadata builders read from the model config."""

    num_heads: int  # H: query heads
    num_kv_heads: int  # Hkv
    head_size: int  # D
    block_size: int  # S: tokens per cache block
    dtype: torch.dtype  # the queries' and the cache's
    device: torch.device
