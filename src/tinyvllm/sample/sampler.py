"""The sampler: from the model's logits ``[R, V]`` to one token id per request ``[R]``.

Concept: the order of operations is the whole design.
1. logits to float32 (a copy: the caller's tensor is never edited);
2. non-argmax-invariant processors (MinTokens, LogitBias, custom ones): they may change
   any row's argmax, so they run for every row;
3. thinking-budget forcing (1e9 at the forced end token);
4. greedy rows (temperature 0) take the argmax here;
5. random rows: divide by temperature, run the argmax-invariant processors (MinP), apply
   top-k then top-p, and draw with the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``;
   a seeded request draws its ``q`` from its own ``torch.Generator``, so the same seed gives
   the same tokens whatever else is in the batch.

Seed: 001 ch. 9.2 (which processors run where), ch. 13.9 (forcing before sampling).
Mirrors: ``vllm/v1/sample/sampler.py`` and ``vllm/v1/sample/ops/topk_topp_sampler.py``.

Calling convention (the model runner, each step):
``input_batch.remove_request(...)``/``add_request(...)``, ``input_batch.condense()``,
``input_batch.refresh()``, then ``Sampler()(logits, input_batch) -> SamplerOutput``; the
caller appends each sampled token to its request's output list before the next refresh.
Left out: logprobs, penalties, speculative decoding's rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tinyvllm.worker.input_batch import InputBatch


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns: ``sampled_token_ids`` ``[R]`` int64, row order of the batch."""

    sampled_token_ids: torch.Tensor


# --8<-- [start:ops]
def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    ``logits`` ``[R, V]``; ``top_k`` ``[R]`` (0 = off); ``top_p`` ``[R]`` (1 = off). The most
    likely token always survives. Returns a new tensor.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)  # [R, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # [R, V]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs`` ``[R, V]``; rows in ``generators`` use their own RNG."""
    q = torch.empty_like(probs).exponential_()  # [R, V]
    for row, generator in generators.items():
        if row < q.shape[0]:
            q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)
# --8<-- [end:ops]


# --8<-- [start:sampler]
class Sampler:
    """Logits ``[R, V]`` + the persistent batch -> ``SamplerOutput`` (see the module header)."""

    def __call__(self, logits: torch.Tensor, input_batch: "InputBatch") -> SamplerOutput:
        num_reqs = input_batch.num_reqs
        if logits.shape[0] != num_reqs:
            raise ValueError(f"logits have {logits.shape[0]} rows, the batch has {num_reqs} requests")
        logits = logits.to(torch.float32, copy=True)  # [R, V]
        for proc in input_batch.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        if input_batch.thinking_budget is not None:
            logits = input_batch.thinking_budget.apply_to_logits(logits)
        greedy_tokens = logits.argmax(dim=-1)  # [R]
        temperature = input_batch.temperature[:num_reqs].to(logits.device)  # [R]
        is_greedy = temperature == 0  # [R]
        if bool(is_greedy.all()):
            return SamplerOutput(greedy_tokens)
        logits = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        for proc in input_batch.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        top_k, top_p = input_batch.top_k[:num_reqs], input_batch.top_p[:num_reqs]
        if bool((top_k > 0).any() or (top_p < 1).any()):  # the sort over V only when some row needs it
            logits = apply_top_k_top_p(logits, top_k.to(logits.device), top_p.to(logits.device))
        random_tokens = random_sample(logits.softmax(dim=-1), input_batch.generators)  # [R]
        return SamplerOutput(torch.where(is_greedy, greedy_tokens, random_tokens))
# --8<-- [end:sampler]
