"""Top-k and top-p (tinyvllm/sample/top_k_top_p.py): the rows split by the plan (topk for
rows with top-k, a sort for the rows with top-p alone, nothing for the rest) mask exactly
what one sort of every row masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.sample.logits_processors import LogitsProcessors
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.top_k_top_p import TopKTopPPlan, apply_top_k_top_p, plan_top_k_top_p


def sort_every_row(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The specification: one descending sort of every row, top-k then top-p on ranks."""
    if top_k is None and top_p is None:
        return logits.clone()
    vocab = logits.shape[-1]
    ranked, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(vocab).expand_as(ranked)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        ranked = ranked.masked_fill(ranks >= k, float("-inf"))
    if top_p is not None:
        probs = ranked.softmax(dim=-1)
        outside = (probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        ranked = ranked.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ranked)


def test_the_plan_sends_each_row_its_own_way():
    plan = plan_top_k_top_p([0, 20, 0, 5, 0], [1.0, 0.95, 0.9, 1.0, 1.0])
    assert plan == TopKTopPPlan(top_k_rows=(1, 3), top_p_rows=(2,), max_top_k=20)
    assert plan_top_k_top_p(None, [1.0, 0.5]) == TopKTopPPlan((), (1,), 0)
    assert plan_top_k_top_p([3, 0], None) == TopKTopPPlan((0,), (), 3)


def test_a_speculative_step_spreads_the_plan_over_each_requests_rows():
    plan = TopKTopPPlan(top_k_rows=(0, 2), top_p_rows=(1,), max_top_k=7)
    md = SamplingMetadata(
        temperature=torch.ones(3), all_greedy=False, all_random=True, top_p=torch.tensor([1.0, 0.9, 1.0]),
        top_k=torch.tensor([7, 0, 3]), seeds={}, logitsprocs=LogitsProcessors(), thinking_budget=None,
        top_k_top_p_plan=plan,
    )  # fmt: skip
    drafts = [[11, 12], [], [13]]  # rows 0-2, 3, 4-5
    rows = md.expand(drafts)  # the plan of the step's rows (SamplingMetadata.expand)
    assert rows.top_k_top_p_plan == TopKTopPPlan(top_k_rows=(0, 1, 2, 4, 5), top_p_rows=(3,), max_top_k=7)
    assert rows.top_k.tolist() == [7, 7, 7, 0, 3, 3] and rows.top_p.tolist() == pytest.approx([1, 1, 1, 0.9, 1, 1])


def test_a_row_with_top_k_and_top_p_keeps_the_nucleus_of_its_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [0.0, 3.0, 1.0, 2.0, -1.0]])
    # row 0: top-2 keeps {1, 3}; among them p(1) = e^3 / (e^3 + e^2) = 0.73 >= 0.7: token 1 alone.
    # row 1, no top-k: over all five p(1) = 0.64 < 0.7, so token 3 stays too.
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([0.7, 0.7]))
    assert torch.isinf(out).tolist() == [[True, False, True, True, True], [True, False, True, False, True]]
    assert out[0, 1] == 3.0 and out[1, 3] == 2.0  # kept logits are unchanged


@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    ks=st.lists(st.sampled_from([0, 0, 1, 2, 3, 7, 50]), min_size=6, max_size=6),
    ps=st.lists(st.sampled_from([1.0, 1.0, 0.01, 0.3, 0.8, 0.99]), min_size=6, max_size=6),
    which=st.sampled_from(["both", "top_k", "top_p"]),
)
def test_split_rows_mask_what_one_sort_of_every_row_masks(rows, vocab, seed, ks, ps, which):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))  # no ties, almost surely
    top_k = None if which == "top_p" else torch.tensor(ks[:rows])
    top_p = None if which == "top_k" else torch.tensor(ps[:rows])
    expected = sort_every_row(logits, top_k, top_p)
    plan = plan_top_k_top_p(None if top_k is None else top_k.tolist(), None if top_p is None else top_p.tolist())
    for got in (apply_top_k_top_p(logits, top_k, top_p, plan), apply_top_k_top_p(logits, top_k, top_p)):
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])  # survivors keep their logits
