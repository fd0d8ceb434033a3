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
come from its own ``torch.Generator``, in a fixed order (one uniform per draft examined,
then one draw), so the same seed and config give the same tokens whatever else runs.
NOTE 3 (the bonus draws in one batch): with random sampling most rows of a step are bonus
rows (every request without drafts has only that row), so they are drawn together by the
plain sampler's ``random_sample``, one batched race instead of one ``multinomial`` per
request (which cost 0.09 ms each on the CPU, 12% of a batch-16 step of the shipped model).
A seeded request's bonus draw still comes after its draft draws, from its own generator.
Left out: draft models with their own distribution (EAGLE, a small draft model), vLLM's
Triton kernels (a loop over requests here: a step has few requests and k is small).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


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
    argmax_ids = argmax.tolist()  # [N]
    tokens: list[list[int]] = []
    bonus_rows: list[tuple[int, int]] = []  # (request, row) of the random requests that keep every draft
    offset = 0
    for r, drafts in enumerate(draft_token_ids):
        generator = generators.get(r)
        kept: list[int] = []
        for j, draft in enumerate(drafts):
            row = offset + j
            if is_greedy[r]:
                if argmax_ids[row] != draft:
                    kept.append(argmax_ids[row])  # the target's own token replaces the draft
                    break
            else:
                u = torch.rand((), generator=generator, device=probs.device)
                if u >= probs[row, draft]:  # kept with probability p(draft) (NOTE 1)
                    rest = probs[row].clone()
                    rest[draft] = 0.0
                    kept.append(int(torch.multinomial(rest, 1, generator=generator)))  # (p - q)+, renormalised
                    break
            kept.append(draft)
        else:  # every draft kept: the bonus row adds one more
            bonus = offset + len(drafts)
            if is_greedy[r]:
                kept.append(argmax_ids[bonus])
            else:
                bonus_rows.append((r, bonus))  # drawn below, all in one batch (NOTE 3)
        tokens.append(kept)
        offset += len(drafts) + 1
    if bonus_rows:
        from tinyvllm.sample.sampler import random_sample  # here: sampler.py imports this module

        rows = torch.tensor([row for _, row in bonus_rows], device=probs.device)
        own = {i: generators[r] for i, (r, _) in enumerate(bonus_rows) if r in generators}
        for (r, _), token in zip(bonus_rows, random_sample(probs[rows], own).tolist()):
            tokens[r].append(token)
    return tokens
# --8<-- [end:rejection]
