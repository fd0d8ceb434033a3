"""The rejection sampler: which of a request's draft tokens the target model accepts.

Concept: a verification step runs the target model over each request's last token and its
k drafts at once, which gives k + 1 rows of logits: row j predicts the token after draft j
(row 0 the token after the last confirmed one), row k the token after the last draft, the
"bonus" row. The sampler draws one token from every row, as a step without drafts would
draw at that position (the same ``Sampler`` steps, on ``SamplingMetadata.expand``'s rows,
``sample/sampler.py`` NOTE 5); reading the rows in order, a draft is
kept while the row's own token equals it, and the first row whose token differs ends the
request's step with that token; if every draft is kept, the bonus row adds its token. A
step therefore yields between 1 and k + 1 tokens per request, each the target's own.

- Greedy (temperature 0): a row's token is its argmax, so a draft is kept when it is the
  argmax, and the replacement is the argmax.
- Random: a row's token is drawn from its target distribution p (after temperature, top-k
  and top-p) by the race of ``random_sample``. The draft is kept when the draw equals it,
  which happens with probability p(draft): the acceptance rule of rejection sampling for a
  one-hot draft distribution q, ``min(1, p(d) / q(d)) = p(d)``; and the token that replaces
  a rejected draft is a draw from p conditioned on not being the draft, ``(p - q)+``
  renormalised (NOTE 1).

Mirrors: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``,
``rejection_greedy_sample``, ``rejection_random_sample``, ``sample_recovered_tokens``; its
n-gram path has no draft probabilities, as here). vLLM draws a uniform per draft and a
separate recovered token; tinyvllm couples them into one draw per row (NOTE 2).

Invariants: request r's rows are ``offsets[r] .. offsets[r] + len(drafts[r])``; the tokens
returned for r are a prefix of its drafts followed by exactly one token of the target's,
and each returned token is the token its row drew; or None, when r reaches a row with no
token to sample (``sample/sampler.py`` NOTE 7), and then none of its drafts is kept.

NOTE 1 (why the output is the target's distribution): the first token is x with
probability p(x), whatever the draft d: kept as d when x = d (probability p(d)), else x
itself, a draw from p given x != d. Each later row repeats the argument given the tokens
before it. ``test_rejection_sampling_draws_from_the_target`` checks it by counting.
NOTE 2 (one draw per row, keyed by position): because each row's token is the draw a step
without drafts would make at the same position, with the same noise for a seeded request
(``sample/draw_keys.py``), a seeded request's tokens are the same with drafts, with fewer
drafts (a budget that trims them) or with none. A uniform per draft and a separate
replacement draw give the same distribution but not the same tokens: the count of draws
depended on how many drafts the step verified. The price: every row of a random request
draws over the vocabulary, where one row used to (measured in ``bench/rejection_sampler.py``).
NOTE 3 (one wait): the rows' tokens reach the host in one ``tolist``, taken by the caller;
this walk over each request's drafts is plain Python on host lists.
Left out: draft models with their own distribution (EAGLE, a small draft model), vLLM's
Triton kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyvllm.arith import spec_row_starts


# --8<-- [start:rejection]
def rejection_sample(
    target_token_ids: Sequence[int], no_token: Sequence[bool] | None, draft_token_ids: Sequence[Sequence[int]]
) -> list[list[int] | None]:
    """The tokens each request keeps this step (see the module header).

    ``target_token_ids`` ``[N]``: the token each row drew (its argmax for a greedy request);
    ``no_token`` ``[N]`` (None: every row has one): the rows that had no token to sample;
    request r owns ``len(draft_token_ids[r]) + 1`` rows, in order. A request that reaches
    such a row gets None: it ends this step with an error (``sample/sampler.py`` NOTE 7).
    """
    firsts = spec_row_starts(draft_token_ids)  # each request's first row, and the total
    if len(target_token_ids) != firsts[-1] or (no_token is not None and len(no_token) != firsts[-1]):
        raise ValueError(f"{len(target_token_ids)} target tokens for {firsts[-1]} rows of drafts")
    tokens: list[list[int] | None] = []
    for first, drafts in zip(firsts, draft_token_ids):
        kept: list[int] | None = []
        for j in range(len(drafts) + 1):
            if no_token is not None and no_token[first + j]:
                kept = None  # nothing this row could pick: the request ends here
                break
            kept.append(target_token_ids[first + j])  # the row's own token
            if j == len(drafts) or kept[-1] != drafts[j]:
                break  # the bonus row, or the first disagreement, ends the request's step
        tokens.append(kept)
    return tokens
# --8<-- [end:rejection]
