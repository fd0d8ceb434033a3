"""Logprobs: the log-probabilities of the chosen tokens and of the most likely ones.

Concept: a request may ask, per output token, for the log-probability of the token it got,
that token's rank among the whole vocabulary, and the k most likely tokens with theirs
(``SamplingParams.logprobs=k``); and the same for every token of its prompt
(``prompt_logprobs=k``). Everything here is computed from the model's **raw** logits, before
any logits processor, penalty, temperature or top-k/top-p: what the model thinks, not what
sampling did with it (vLLM's default ``logprobs_mode="raw_logprobs"``).

Mirrors: ``vllm/v1/sample/sampler.py`` (``compute_logprobs``, ``gather_logprobs``),
``vllm/v1/outputs.py`` (``LogprobsTensors``, ``LogprobsLists``) and
``vllm/v1/sample/ops/logprobs.py`` (``batched_count_greater_than``, the rank).

Invariants: a ``LogprobsTensors`` has M rows: column 0 is the chosen token (its id, its
logprob), columns 1..K the top K in descending order; every logprob is <= 0; the rank of
the chosen token counts the tokens whose logprob is at least its own, so the most likely
token has rank 1 (a tie shares the worse rank, as vLLM's count ``>=``).

NOTE 1 (only the rows that ask): ``log_softmax`` over the vocabulary and a top-k are the
cost, [M, V] each; the sampler runs them on the rows whose request asked for logprobs
(``SamplingMetadata.num_logprobs``) and the runner on the prompt positions of requests
that asked for prompt logprobs, so a batch that asks none pays nothing.
NOTE 2 (one K per batch): the rows of one call may ask different k; the top K is taken with
the largest, and each row keeps its first ``k + 1`` columns when it is turned into Python
lists (``row_entries``).
``logprobs=-1`` asks for the whole vocabulary (the input batch turns it into the vocabulary's
size; ``LLM(max_logprobs=-1)`` must allow it), and then every position's text is decoded
for every token, as vLLM does: slow on a large vocabulary.
NOTE 3 (one transfer): ``row_entries`` brings ids, logprobs and ranks to the host in one
``tolist`` of one float64 tensor (exact for every id below 2**53 and every float32), not
three: on a GPU each ``tolist`` is a copy and a wait of its own.
Left out: ``logprobs_mode`` other than raw logprobs (processed logits, processed logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.outputs import LogprobEntry



# --8<-- [start:gather]
@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of M positions: the chosen token first, then the top K (module invariants)."""

    token_ids: torch.Tensor  # [M, 1 + K] int64
    logprobs: torch.Tensor  # [M, 1 + K] float32
    ranks: torch.Tensor  # [M] int64, the chosen token's rank (1 = the most likely)


def num_top(k: int, vocab_size: int) -> int:
    """How many top logprobs ``logprobs=k`` asks for: ``k``, or the whole vocabulary for -1."""
    return vocab_size if k == -1 else k


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the vocabulary, in float32: ``[M, V]`` -> ``[M, V]``."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """The chosen ``token_ids`` ``[M]``'s logprobs and ranks, and the ``num_top`` best of
    ``logprobs`` ``[M, V]``."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [M, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [M]: tokens at least as likely, itself included
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [M, K], [M, K]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1),
        logprobs=torch.cat([chosen, top_logprobs], dim=-1),
        ranks=ranks,
    )


def row_entries(tensors: LogprobsTensors, num_top: list[int]) -> list[LogprobEntry]:
    """Each row as a ``LogprobEntry``, row ``i`` keeping its own ``num_top[i]`` (NOTE 2)."""
    width = tensors.token_ids.shape[1]  # 1 + K
    # One transfer (NOTE 3): float64 holds every id, rank and float32 logprob exactly.
    parts = (tensors.token_ids.double(), tensors.logprobs.double(), tensors.ranks.double().unsqueeze(1))
    host = torch.cat(parts, dim=1).cpu()  # [M, 2 * (1 + K) + 1]
    ids = host[:, :width].long().tolist()
    values = host[:, width : 2 * width].tolist()
    ranks = host[:, 2 * width].long().tolist()
    return [(ids[i][: k + 1], values[i][: k + 1], ranks[i]) for i, k in enumerate(num_top)]
# --8<-- [end:gather]
