"""Top-k and top-p: which tokens a random row may still draw, with a sort only where needed.

Concept: top-k keeps a row's k most likely tokens; top-p then keeps the best-ranked tokens
until they hold p of the probability (renormalised after top-k): a token survives while
the tokens ranked above it hold less than p, so the most likely one always does. Both read
the row in rank order. A sort of the whole vocabulary gives that order, at O(V log V) per
row: on two CPU cores 4.8 ms for 32 rows of 6,144 tokens and 171 ms at 151,936, more than
the model's forward. But a row with top-k needs only its k best tokens in order, which
``topk`` finds without sorting the rest, and its top-p is decided among those k; a row
with neither needs nothing. So only the rows with top-p and no top-k are sorted. Which
row takes which path is known on the host, from the batch's own values
(``TopKTopPPlan``), so choosing costs no wait for the device.

Follows: seed 001 ch. 9.2 (the argmax-invariant processors run after the temperature,
before this filter, in the sampler's order). Mirrors:
``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``: one sort of every
row as soon as any row has top-p; ``apply_top_k_only``: a threshold from ``topk`` when no
row has). Ours goes one step further by splitting the rows.

Invariants: a plan's ``top_k_rows`` and ``top_p_rows`` are disjoint and increasing;
``top_k_rows`` are the rows with ``top_k > 0``, ``top_p_rows`` those with ``top_p < 1``
and no top-k; ``max_top_k`` is the largest k of ``top_k_rows`` (0 when there is none).

NOTE 1 (the same mask as one sort): ``topk(m)`` returns a row's m best logits in
descending order, the first m entries of the sorted row; masking ranks at or past the
row's own k and then computing top-p on the softmax of what is left is what the sorted
row gives, since the masked ranks have probability 0 there too. Ties at the k-th value
keep exactly k tokens either way; which of the tied ones is unspecified in both.
NOTE 2 (k above the vocabulary): a k of V or more keeps every token, as in the sort.
NOTE 3 (on the device, rows picked on the host): the plan's rows go up with ``upload``;
without a plan the function makes one from the tensors, which reads them (tests, and
callers that hold no host copy).
Left out: FlashInfer's sampling kernels, which vLLM uses on CUDA to avoid the sort.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinyvllm.device_syncs import upload


# --8<-- [start:plan]
@dataclass(frozen=True)
class TopKTopPPlan:
    """Which rows take which path (module header), decided on the host."""

    top_k_rows: tuple[int, ...]  # top_k > 0: topk(max_top_k), then the row's top-p among those
    top_p_rows: tuple[int, ...]  # top_p < 1 and no top-k: a sort over the vocabulary
    max_top_k: int


def plan_top_k_top_p(top_k: Sequence[int] | None, top_p: Sequence[float] | None) -> TopKTopPPlan:
    """The plan for rows with these values (0 = no top-k, 1 = no top-p; None = off for all)."""
    n = len(top_k if top_k is not None else top_p or ())
    ks = list(top_k) if top_k is not None else [0] * n
    ps = list(top_p) if top_p is not None else [1.0] * n
    k_rows = tuple(i for i in range(n) if ks[i] > 0)
    p_rows = tuple(i for i in range(n) if ks[i] <= 0 and ps[i] < 1)
    return TopKTopPPlan(k_rows, p_rows, max((ks[i] for i in k_rows), default=0))
# --8<-- [end:plan]


# --8<-- [start:apply]
def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, plan: TopKTopPPlan | None = None
) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    ``logits`` ``[R, V]``; ``top_k`` ``[R]`` (0 = off; None = off for every row); ``top_p``
    ``[R]`` (1 = off; None = off for every row). The most likely token always survives.
    Returns a new tensor.
    """
    out = logits.clone()
    if top_k is None and top_p is None:
        return out
    if plan is None:  # NOTE 3: a read of the values
        plan = plan_top_k_top_p(None if top_k is None else top_k.tolist(), None if top_p is None else top_p.tolist())
    vocab = logits.shape[-1]
    if plan.top_k_rows:
        rows = upload(plan.top_k_rows, torch.int64, logits.device)  # [T]
        k = top_k[rows]  # [T]
        p = None if top_p is None else top_p[rows]
        values, ids = logits[rows].topk(min(plan.max_top_k, vocab), dim=-1)  # [T, m]: descending (NOTE 1)
        kept = _mask_ranked(values, k, p)  # [T, m]
        out[rows] = torch.full((len(plan.top_k_rows), vocab), float("-inf"), dtype=logits.dtype,
                               device=logits.device).scatter_(-1, ids, kept)  # fmt: skip
    if plan.top_p_rows:
        rows = upload(plan.top_p_rows, torch.int64, logits.device)  # [S]
        ranked, order = logits[rows].sort(dim=-1, descending=True)  # [S, V]
        out[rows] = torch.empty_like(ranked).scatter_(-1, order, _mask_ranked(ranked, None, top_p[rows]))
    return out


def _mask_ranked(ranked: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Rows of logits in descending order ``[S, m]``: -inf at ranks ``>= k`` (``k = 0`` off),
    then wherever the better-ranked tokens already hold ``p`` (``p = 1`` off)."""
    if k is not None:
        ranks = torch.arange(ranked.shape[-1], device=ranked.device).expand_as(ranked)  # [S, m]
        k = torch.where(k > 0, k, torch.full_like(k, ranked.shape[-1])).unsqueeze(1)  # [S, 1] (NOTE 2)
        ranked = ranked.masked_fill(ranks >= k, float("-inf"))
    if p is not None:
        probs = ranked.softmax(dim=-1)  # [S, m]
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
        outside = (mass_before >= p.unsqueeze(1)) & (p < 1).unsqueeze(1)  # [S, m]
        ranked = ranked.masked_fill(outside, float("-inf"))
    return ranked
# --8<-- [end:apply]
