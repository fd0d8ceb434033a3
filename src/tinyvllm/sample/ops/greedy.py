"""The greedy draw in one kernel: each row's argmax, its no-token verdict and the host's id.

Concept: a greedy row takes the argmax of its final scores ``[R, V]`` (float32, after every
processor). Around it the sampler needs two more facts: whether the row had a token at all
(``sampler.py`` NOTE 7: every score ``-inf``, or a NaN anywhere) and the one ``[R]`` int64
tensor the host reads, the token or ``NO_TOKEN`` (``sampler.py`` NOTE 6). With torch ops that is four
kernels after the scores: ``max`` (the maximum and its index in one reduction), ``gt`` and
``bitwise_not`` (the verdict), ``where`` (the host's ids). ``greedy_triton`` makes the three
tensors in one kernel, one program a row. On a GPU each kernel outside the step's graph is a
launch the host pays for while the device may wait: three fewer a decode step.

``greedy`` picks the kernel for CUDA tensors and the torch ops otherwise;
``TINYVLLM_GREEDY=torch`` (or ``triton``) forces one, for an A/B on one machine
(``greedy_impl``, read when the sampler is built; ``platform.py``).

Mirrors: vLLM's ``Sampler.greedy_sample`` (``logits.argmax(dim=-1)``); the verdict and the
host's id are ours (``sampler.py`` NOTE 7), and so is the fused form.

Invariants: ``greedy_triton(s) == greedy_torch(s)`` for every row that has a token: the
index of the first maximum, as ``torch.max`` gives it; the verdicts equal everywhere; a row
without a token gets ``NO_TOKEN`` in the host's ids and, as its token, the index of its first
NaN, or 0 when all its scores are ``-inf``: a real id, since the next step may read it on the
device before the host learns the request ended (``model_runner.py`` NOTE 12).

NOTE 1 (one program a row, blocks of ``BLOCK`` scores): a decode batch has few rows and a
vocabulary of 150k scores a row: each program keeps its row's best score and index over the
blocks, taking a later block's maximum only when strictly greater, so the first maximum wins
ties, as in ``torch.max``. NaN is kept apart: its first index, and the row has no token.
Left out: splitting a row over several programs (one more kernel, or atomics, for the merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.platform import impl_from_env, triton_can_run_on, uses_kernel
from tinyvllm.sample.ops.random_sample import no_token_from_max

IMPL_ENV = "TINYVLLM_GREEDY"
NO_TOKEN = -1  # the host's id of a row with no token (``sampler.py`` NOTE 7): no token id is negative
BLOCK = 8192  # scores per block of a row (NOTE 1)
NUM_WARPS = 16  # 16 scores a thread a block


def ids_for_host(tokens: torch.Tensor, no_token: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: each row's token, ``NO_TOKEN`` where it has none; one tensor to read
    (``sampler.py`` NOTE 6)."""
    return torch.where(no_token, NO_TOKEN, tokens)


# --8<-- [start:torch]
def greedy_torch(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference, four kernels on a GPU: ``[R]`` int64 tokens, ``[R]`` bool verdicts (no
    token), ``[R]`` int64 host ids (the token, or ``NO_TOKEN``)."""
    row_max, tokens = scores.max(dim=-1)  # [R], [R]: the argmax and its score, one reduction
    no_token = no_token_from_max(row_max)  # [R]
    return tokens, no_token, ids_for_host(tokens, no_token)
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def _greedy_kernel(
    scores_ptr,  # *T, [R, V]: the final scores
    tokens_ptr,  # *int64, [R]
    no_token_ptr,  # *bool, [R]
    host_ids_ptr,  # *int64, [R]
    vocab,  # V
    stride_r,  # elements between rows
    BLOCK: tl.constexpr,  # scores per block (NOTE 1)
    NO_TOKEN_ID: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py)
):
    """One program a row: the first maximum over its blocks, NaN apart (NOTE 1)."""
    wait_for_the_kernel_ahead(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # the row's maximum so far
    best_at = tl.min(tl.full([BLOCK], 0, tl.int32), axis=0)  # its first index
    first_nan = tl.min(tl.full([BLOCK], 0, tl.int32), axis=0) + vocab  # vocab: no NaN yet
    for start in range(0, vocab, BLOCK):
        at = start + cols  # [BLOCK]
        x = tl.load(scores_ptr + row * stride_r + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        nan = x != x  # [BLOCK]
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, at, vocab), axis=0))
        x = tl.where(nan, float("-inf"), x)
        block_max = tl.max(x, axis=0)
        block_at = tl.min(tl.where((x == block_max) & (at < vocab), at, vocab), axis=0)  # its first index
        later = block_max > best  # strictly: an earlier block keeps a tie
        best_at = tl.where(later, block_at, best_at)
        best = tl.where(later, block_max, best)
    has_nan = first_nan < vocab
    token = tl.where(has_nan, first_nan, best_at).to(tl.int64)
    no_token = has_nan | (best == float("-inf"))  # as no_token_from_max: NaN, or nothing above -inf
    tl.store(tokens_ptr + row, token)
    tl.store(no_token_ptr + row, no_token)
    tl.store(host_ids_ptr + row, tl.where(no_token, NO_TOKEN_ID, token))
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def greedy_triton(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton version of ``greedy_torch``: the same three tensors, one launch."""
    if scores.dim() != 2 or scores.stride(1) != 1 or not scores.is_floating_point():
        raise ValueError(f"scores {tuple(scores.shape)} {scores.dtype}, strides {scores.stride()}: "
                         "must be [R, V] floating point, unit stride last")  # fmt: skip
    if not triton_can_run_on(scores.device):
        raise ValueError(f"device {scores.device}: Triton needs CUDA or TRITON_INTERPRET=1")
    rows, vocab = scores.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=scores.device)
    no_token = torch.empty(rows, dtype=torch.bool, device=scores.device)
    host_ids = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        _greedy_kernel[(rows,)](
            scores, tokens, no_token, host_ids, vocab, scores.stride(0), BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
            NO_TOKEN_ID=NO_TOKEN, num_warps=NUM_WARPS, **launch_options(scores.device),
        )  # fmt: skip
    return tokens, no_token, host_ids
# --8<-- [end:launcher]


# --8<-- [start:choose]
def greedy_impl() -> str:
    """The implementation ``TINYVLLM_GREEDY`` asks for ("auto" when unset; ``platform.py``)."""
    return impl_from_env(IMPL_ENV)


def greedy(scores: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``greedy_triton`` for CUDA scores it takes (or when ``impl`` is "triton"), ``greedy_torch``
    otherwise (or when ``impl`` is "torch")."""
    if uses_kernel(impl, scores.is_cuda and scores.dim() == 2 and scores.stride(-1) == 1):
        return greedy_triton(scores)
    return greedy_torch(scores)
# --8<-- [end:choose]
