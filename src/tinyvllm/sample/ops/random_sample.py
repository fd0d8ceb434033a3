"""The draw: one token per row from probabilities, and the rows that had none to draw.

Concept: the last two operations of every sampling step, plain or speculative. A random row
draws by the exponential race ``argmax(p / q)``, ``q ~ Exp(1)`` per entry, which picks
token i with probability ``p_i``; a seeded row draws its ``q`` from a generator seeded with
its draw key (``sample/draw_keys.py``), so its token ignores the rest of the batch. Before
the draw, or on the final scores of a greedy row, ``rows_without_a_token`` says which rows
have nothing left to pick (``sample/sampler.py`` NOTE 7).

Mirrors: ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``random_sample``); the no-token check
is ours (vLLM returns whatever argmax gives).
Used by: ``Sampler.sample`` (step 8) and the benches of the draw.

Invariants: ``random_sample`` returns ``[R]`` int64 row indices of ``probs`` ``[R, V]``; a
row whose probabilities are a one-hot returns that token whatever its noise (NOTE 1); the
rows in ``draw_keys`` draw the same tokens whatever the other rows are.

NOTE 1 (the CPU draws differently): on a GPU ``q`` comes from ``exponential_``; on the CPU
``q = -log(U)`` with ``U`` from ``uniform_`` over ``[tiny, 1)``, the same distribution for a
fraction of the cost, never an exact 0 (which would score a masked token like a kept one).
The figures: docs/sampler_draw.md, "Random sampling on the CPU".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, ~1.2e-38


# --8<-- [start:ops]
def rows_without_a_token(scores: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: the rows of ``scores`` ``[R, V]`` (logits or probabilities) with nothing
    to pick: every entry ``-inf``, or a NaN anywhere (``sample/sampler.py`` NOTE 7). One
    reduction over V."""
    return no_token_from_max(scores.amax(dim=-1))


def no_token_from_max(row_max: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool from each row's maximum ``[R]`` (NaN if the row holds one, as ``amax`` and
    ``max`` give it): the row has nothing to pick. A greedy batch takes the maximum with its
    argmax in one reduction (``torch.max``) and reads its verdict here."""
    return ~(row_max > float("-inf"))  # NaN > -inf is False


def random_sample(probs: torch.Tensor, draw_keys: Mapping[int, int]) -> torch.Tensor:
    """One token per row from ``probs`` ``[R, V]``; the rows in ``draw_keys`` draw their noise
    from a generator seeded with their key (``sample/draw_keys.py``), the others from the
    global generator.

    The race ``argmax(p / q)`` with ``q ~ Exp(1)`` per entry. On the CPU ``q = -log(U)``,
    ``U ~ U[0, 1)``: the same distribution, drawn about 4x cheaper than ``exponential_``
    (NOTE 1).
    """
    keyed = torch.Generator(device=probs.device) if draw_keys else None  # reseeded for each keyed row
    if probs.device.type != "cpu":
        q = torch.empty_like(probs).exponential_()  # [R, V]
        for row, key in draw_keys.items():
            q[row].exponential_(generator=keyed.manual_seed(key))
        return probs.div(q).argmax(dim=-1)
    q = torch.empty_like(probs).uniform_(_TINY, 1.0)  # [R, V], U in [tiny, 1): never 0 (NOTE 1)
    for row, key in draw_keys.items():
        q[row].uniform_(_TINY, 1.0, generator=keyed.manual_seed(key))
    q.log_().neg_()  # q = -log(U) ~ Exp(1), finite and > 0
    return torch.div(probs, q, out=q).argmax(dim=-1)
# --8<-- [end:ops]
