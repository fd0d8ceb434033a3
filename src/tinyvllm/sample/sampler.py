# --8<-- [start:header]
"""The sampler: from the model's logits ``[R, V]`` to one token id per request ``[R]``.

Concept: the order of operations is the whole design.
0. logprobs, for the rows that ask, from the raw logits (``sample/logprobs.py``): what the
   model thinks, before anything below edits the logits (NOTE 3);
1. logits to float32 (a copy: the caller's tensor is never edited);
2. allowed token ids: in the rows that restrict their tokens, every other token gets -inf;
3. bad words: each row's banned tokens get -inf (``sample/bad_words.py``);
4. non-argmax-invariant processors (MinTokens, LogitBias, custom ones): they may change
   any row's argmax, so they run for every row;
5. penalties (presence, frequency, repetition) of the rows that use them
   (``sample/penalties.py``); steps 2-5 are ``apply_logits_processors`` (NOTE 4);
6. thinking-budget forcing (1e9 at the forced end token);
7. greedy rows (temperature 0) take the argmax here;
8. random rows: divide by temperature, run the argmax-invariant processors (MinP), apply
   top-k then top-p, and draw with the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``
   (``sample/ops/random_sample.py``; on the CPU ``q = -log(U)``, NOTE 2); a seeded row's
   ``q`` comes from a generator seeded with its draw key (``sample/draw_keys.py``).
A speculative step's rows take the same steps (NOTE 5).

Seed: 001 ch. 9.2 (which processors run where), ch. 13.9 (forcing before sampling).
Mirrors: ``vllm/v1/sample/sampler.py`` (``Sampler.forward``, ``apply_logits_processors``)
and ``vllm/v1/sample/ops/topk_topp_sampler.py``.
Called by the model runner each step, after ``refresh()``: ``Sampler()(logits, md)`` with
``md = input_batch.make_sampling_metadata()``, or ``md.expand(drafts)`` under speculation.

NOTE 1: the sampler reads only the frozen ``SamplingMetadata`` (``sample/metadata.py``),
never the worker's persistent batch (``sample/`` does not import ``worker/``); whether the
sort over V is needed is decided when the metadata is built.
NOTE 2 (the CPU draws differently): ``q = -log(U)``, ``U ~ U[tiny, 1)``, for ``exponential_``'s
draw at a fraction of the cost (``sample/ops/random_sample.py`` NOTE 1; docs/sampler_draw.md):
CPU and GPU streams differ for one seed, which makes a request reproducible on one device type.
NOTE 3 (logprobs before sampling, gathered after): the raw logprobs of the rows that ask are
computed first, since the steps below edit the logits, and gathered for the sampled tokens
last: ``SamplerOutput.logprobs`` row i is batch row ``logprob_rows[i]``. A batch that asks
none computes none.
NOTE 4 (steps 2-6, vLLM's order): vLLM V1 masks the allowed tokens, bans the bad words, runs
the non-argmax-invariant processors and applies the penalties, in that order, before the
greedy argmax, so greedy rows obey them too; each costs nothing in a batch that does not use
it. The forcing comes after the penalties, so no penalty can bring a forced logit down.
NOTE 5 (speculative decoding, the same steps): a request verifying k drafts owns k + 1
rows. ``SamplingMetadata.expand`` makes the step's record a record of rows
(``sample/metadata.py`` NOTE 4), so those rows take steps 1-8 like any other: allowed ids, bad words and penalties
see each row's output so far (the drafts before it as if generated), and each row draws as
a plain step would at its position. Only MinTokens is built then (seed 001 ch. 11.4); it
and the thinking budget judge each row by its position (``rows_per_request``). The runner
hands the rows' tokens to ``sample/rejection_sampler.py``.
NOTE 6 (no wait for the device before the tokens): every index goes up with ``upload``
(pinned, ``non_blocking``), never as a Python list; the path is chosen from host flags. The
one read is the sampled ids with their no-token verdicts, ``sampled_to_host``.
NOTE 7 (a row with no token): allowed ids, bad words, MinTokens and penalties can together
leave a row nothing (every logit -inf, or NaN). Argmax would still return a banned token, so
each row's final scores are checked (``rows_without_a_token``, read with the tokens) and such
a request gets no token; the scheduler ends it with ``finish_reason="error"``. What its
parameters alone forbid is refused when it is added (the input processor,
``engine/input_processor.py``).
NOTE 8: an all-greedy batch's argmax, verdicts and host ids come from ``sample/ops/greedy.py``
(one kernel on CUDA), the ids in ``SamplerOutput.host_ids``, so the runner makes them once.
"""
# --8<-- [end:header]

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.device_syncs import upload
from tinyvllm.sample import logprobs as logprob_ops
from tinyvllm.sample.bad_words import apply_bad_words
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.ops.greedy import NO_TOKEN, greedy, ids_for_host
from tinyvllm.sample.ops.greedy import greedy_impl as greedy_impl_from_env
from tinyvllm.sample.ops.random_sample import random_sample, rows_without_a_token
from tinyvllm.sample.top_k_top_p import apply_top_k_top_p


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns: ``sampled_token_ids`` ``[R]`` int64, row order of the batch,
    each row's no-token verdict (NOTE 7), and for the rows that asked, their logprobs (NOTE 3)."""

    sampled_token_ids: torch.Tensor
    no_token: torch.Tensor  # [R] bool: the row had no token to sample (NOTE 7)
    logprobs: logprob_ops.LogprobsTensors | None = None  # [M, 1 + K]: row i is batch row logprob_rows[i]
    logprob_rows: tuple[int, ...] = ()
    host_ids: torch.Tensor | None = None  # [R] int64, ``ids_for_host``'s values when made already (NOTE 8)


# --8<-- [start:sampler]
class Sampler:
    """Logits ``[R, V]`` + this step's ``SamplingMetadata`` -> ``SamplerOutput`` (see the module header)."""

    def __init__(self, greedy_impl: str | None = None) -> None:
        self.greedy_impl = greedy_impl_from_env() if greedy_impl is None else greedy_impl  # NOTE 8

    def __call__(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        md = sampling_metadata
        if logits.shape[0] != md.num_reqs:
            raise ValueError(f"logits have {logits.shape[0]} rows, the sampling metadata has {md.num_reqs} requests")
        rows = sorted(md.num_logprobs)  # NOTE 3: the raw logprobs first, of the rows that ask
        at = upload(rows, torch.int64, logits.device) if rows else None  # [M]: indices already up (NOTE 6)
        raw_logprobs = logprob_ops.compute_logprobs(logits[at]) if rows else None  # [M, V]
        sampled, no_token, host_ids = self.sample(logits, md)  # [R], [R], [R] or None
        if raw_logprobs is None:
            return SamplerOutput(sampled, no_token, host_ids=host_ids)
        num_top = max(md.num_logprobs.values())
        tensors = logprob_ops.gather_logprobs(raw_logprobs, sampled[at], num_top)
        return SamplerOutput(sampled, no_token, tensors, tuple(rows), host_ids)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Steps 1-8 of the module header: one token id per row ``[R]``, whether the row had no
        token to sample ``[R]`` (NOTE 7), and the host's ids ``[R]`` when made here (NOTE 8)."""
        logits = self.apply_logits_processors(logits.to(torch.float32, copy=True), md)  # [R, V]
        if md.thinking_budget is not None:
            logits = md.thinking_budget.apply_to_rows(logits, md.rows_per_request)
        if md.all_greedy:  # the argmax, the verdict and the host's ids: one kernel on CUDA (NOTE 8)
            return greedy(logits, self.greedy_impl)
        no_token = rows_without_a_token(logits)  # [R]: a greedy row's verdict
        greedy_tokens = None if md.all_random else logits.argmax(dim=-1)  # [R]
        temperature = md.temperature.to(logits.device)  # [R]
        is_greedy = temperature == 0  # [R]
        logits = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        for proc in md.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        if md.top_k is not None or md.top_p is not None:  # only when some row needs it (sample/top_k_top_p.py)
            top_k = None if md.top_k is None else md.top_k.to(logits.device)
            top_p = None if md.top_p is None else md.top_p.to(logits.device)
            logits = apply_top_k_top_p(logits, top_k, top_p, md.top_k_top_p_plan)
        probs = logits.softmax(dim=-1)  # [R, V]
        random_tokens = random_sample(probs, md.draw_keys())  # [R]
        no_token = torch.where(is_greedy, no_token, rows_without_a_token(probs))
        if greedy_tokens is None:
            return random_tokens, no_token, None
        return torch.where(is_greedy, greedy_tokens, random_tokens), no_token, None

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 2-5 on float32 logits ``[R, V]``, in place where it can: whatever may
        change a row's argmax, each step only when some row uses it (NOTE 4)."""
        if md.allowed_token_ids_mask is not None:
            rows = md.allowed_token_ids_rows  # [P]
            logits[rows] = logits[rows].masked_fill(md.allowed_token_ids_mask, float("-inf"))
        if md.bad_words_token_ids:
            logits = apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        for proc in md.logitsprocs.non_argmax_invariant:  # MinTokens alone when rows are not requests (NOTE 5)
            if md.rows_per_request is None:
                logits = proc.apply(logits)
            else:
                logits = proc.apply_with_spec_decode(logits, list(md.rows_per_request))
        if md.penalties is not None:
            logits = md.penalties.apply(logits)
        return logits
# --8<-- [end:sampler]


def split_host_ids(host: list[int]) -> tuple[list[int], list[bool]]:
    """``ids_for_host``'s values, read: each row's token and its no-token verdict."""
    return host, [t == NO_TOKEN for t in host]


def sampled_to_host(
    tokens: torch.Tensor, no_token: torch.Tensor, host_ids: torch.Tensor | None = None
) -> tuple[list[int], list[bool]]:
    """Each row's token and its no-token verdict on the host, in one transfer (NOTE 6); from
    ``host_ids`` when the sampler made them (NOTE 8)."""
    return split_host_ids((ids_for_host(tokens, no_token) if host_ids is None else host_ids).tolist())
