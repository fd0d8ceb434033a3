"""The rejection sampler: which of a request's draft tokens the target model accepts.

Concept: a verification step runs the target model over each request's last token and its
k drafts at once, which gives k + 1 rows of logits: row j predicts the token after draft j
(row 0 the token after the last confirmed one), row k the token after the last draft, the
"bonus" row. Reading the rows in order, a draft is kept while the target agrees with it;
the first disagreement is replaced by the target's own token and ends the request's step;
if every draft is kept, the bonus row adds one more token. A step therefore yields between
1 and k + 1 tokens per request, and the output is distributed exactly as if the target had
sampled one token at a time.

- Greedy (temperature 0): a draft is kept when it is the row's argmax; the replacement is
  the argmax.
- Random: the n-gram drafter proposes one token with certainty (a one-hot draft
  distribution q), so the standard rule "keep d with probability min(1, p(d) / q(d))"
  becomes "keep d with probability p(d)"; on a rejection the replacement is drawn from
  p with d removed and renormalised, ``(p - q)+`` (NOTE 1). ``p`` is each row's target
  distribution after temperature, top-k and top-p.

Mirrors: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``,
``rejection_greedy_sample``, ``rejection_random_sample``, ``sample_recovered_tokens``; its
n-gram path has no draft probabilities, as here).

Invariants: request r's rows are ``offsets[r] .. offsets[r] + len(drafts[r])``; the tokens
returned for r are a prefix of its drafts followed by exactly one token of the target's.

NOTE 1 (why the output is the target's distribution): the first token is d with
probability p(d) (kept), and any other x with probability (1 - p(d)) * p(x) / (1 - p(d)) =
p(x) (rejected, then drawn from the rest). Each later row repeats the argument given the
tokens before it. ``test_rejection_sampling_draws_from_the_target`` checks it by counting.
NOTE 2 (seeded requests): the uniform draws and the replacement draws of a seeded request
come from its own ``torch.Generator``, in a fixed order (one uniform per draft, then one
draw), so the same seed and config give the same tokens whatever else runs.
NOTE 3 (one draw per request, in one batch): a random request draws exactly one token a
step: the replacement at its first rejected draft, or the bonus when it kept them all
(every request without drafts has only that row). All of them are drawn together by the
plain sampler's ``random_sample``, the rejected draft's probability set to 0 in its row
(the race ``argmax(p / q)`` needs no renormalising): one batched race instead of one
``clone`` and ``multinomial`` over the vocabulary per request, which cost 0.09 ms each for
the bonus rows alone on the CPU (12% of a batch-16 step of the shipped model).
NOTE 4 (every uniform at once): each draft's test ``u < p(draft)`` uses its own uniform,
independent of the others, so drawing all of them first and comparing them in one tensor
operation keeps the distribution of NOTE 1 (a uniform after the first rejection is drawn
and not used).
NOTE 5 (two waits at most): one ``tolist`` brings every row's argmax and every verdict to
the host together: on a GPU, one synchronisation a step, not one per draft. A step with
random requests waits once more, for the tokens drawn after the verdicts (NOTE 3); vLLM
draws every possible replacement before knowing which is needed, to wait only once.
Indices go up with ``upload`` (``tinyvllm/device_syncs.py``).
Left out: draft models with their own distribution (EAGLE, a small draft model), vLLM's
Triton kernels (the walk over each request's drafts is a Python loop over host lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tinyvllm.arith import spec_row_starts
from tinyvllm.device_syncs import fill_at, upload


# --8<-- [start:rejection]
def rejection_sample(
    probs: torch.Tensor | None,
    argmax: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    is_greedy: Sequence[bool],
    generators: Mapping[int, torch.Generator],
) -> list[list[int]]:
    """The tokens each request keeps this step (see the module header).

    ``probs`` ``[N, V]``: each row's target distribution (None when every request is greedy);
    ``argmax`` ``[N]``: each row's most likely token; request r owns ``len(drafts[r]) + 1``
    rows, in order; ``generators`` maps a request to its own generator (seeded requests).
    """
    firsts = spec_row_starts(draft_token_ids)  # each request's first row
    tested, passed = _accept_random_drafts(probs, draft_token_ids, is_greedy, generators, firsts)  # NOTE 1, NOTE 4
    # One transfer for the argmax [N] and the tests [M] (NOTE 5).
    host = torch.cat([argmax, passed.to(argmax.dtype)]).tolist() if tested else argmax.tolist()
    argmax_ids = host[: argmax.shape[0]]
    kept_draft = dict(zip(tested, map(bool, host[argmax.shape[0] :])))
    tokens: list[list[int]] = []
    draws: list[tuple[int, int, int | None]] = []  # (request, row, the rejected draft or None for the bonus)
    for r, drafts in enumerate(draft_token_ids):
        kept: list[int] = []
        for j, draft in enumerate(drafts):
            row = firsts[r] + j
            if is_greedy[r]:
                if argmax_ids[row] != draft:
                    kept.append(argmax_ids[row])  # the target's own token replaces the draft
                    break
            elif not kept_draft[row]:
                draws.append((r, row, draft))  # replaced by a draw from p without the draft
                break
            kept.append(draft)
        else:  # every draft kept: the bonus row adds one more
            bonus = firsts[r] + len(drafts)
            if is_greedy[r]:
                kept.append(argmax_ids[bonus])
            else:
                draws.append((r, bonus, None))
        tokens.append(kept)
    if draws:  # one token for each random request, all in one batch (NOTE 3)
        from tinyvllm.sample.sampler import random_sample  # here: sampler.py imports this module

        dist = probs[upload([row for _, row, _ in draws], torch.int64, probs.device)]  # [D, V], a copy
        rejected = [(i, draft) for i, (_, _, draft) in enumerate(draws) if draft is not None]
        if rejected:  # (p - q)+: the rejected draft removed; the race needs no renormalising
            at, drafts_out = upload(rejected, torch.int64, dist.device).unbind(1)
            fill_at(dist, (at, drafts_out), 0.0)
        own = {i: generators[r] for i, (r, _, _) in enumerate(draws) if r in generators}
        for (r, _, _), token in zip(draws, random_sample(dist, own).tolist()):
            tokens[r].append(token)
    return tokens


def _accept_random_drafts(
    probs: torch.Tensor | None,
    draft_token_ids: Sequence[Sequence[int]],
    is_greedy: Sequence[bool],
    generators: Mapping[int, torch.Generator],
    firsts: list[int],
) -> tuple[list[int], torch.Tensor | None]:
    """The draft rows of the random requests ``[M]``, and on the device whether each draft
    passes ``u < p(draft)`` ``[M]`` (NOTE 1): one uniform per draft row, all compared at
    once; a seeded request's from its generator (NOTE 2)."""
    spans = [(r, firsts[r], len(d)) for r, d in enumerate(draft_token_ids) if d and not is_greedy[r]]
    if not spans:
        return [], None
    rows = [first + j for _, first, k in spans for j in range(k)]
    drafts = [t for r, _, _ in spans for t in draft_token_ids[r]]
    device = probs.device
    u = torch.rand(len(rows), device=device)  # [M]: the unseeded requests' draws
    at = 0
    for r, _, k in spans:
        if r in generators:
            u[at : at + k] = torch.rand(k, generator=generators[r], device=device)
        at += k
    at, tokens = upload([rows, drafts], torch.int64, device)  # [M], [M]
    return rows, u < probs[at, tokens]  # p(draft) on its row
# --8<-- [end:rejection]
