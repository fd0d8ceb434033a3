"""The worker's half of structured outputs: the grammar bitmask unpacked and applied to the
logits (``structured_output/bitmask.py``), in plain torch, without xgrammar. So these run on a
machine without it, the GPU machine included (the ``gpu`` twin applies the mask on the device).

The layout: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed,
one row per sampled position of each constrained request (k + 1 for k drafts); tokens past
the mask's words are refused; unconstrained rows are not touched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.structured_output.bitmask import apply_grammar_bitmask, unpack_bitmask


def test_unpack_bitmask_reads_32_tokens_per_word_and_refuses_tokens_past_it():
    words = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)  # [2, 2]: 64 tokens
    allowed = unpack_bitmask(words, 70)  # a vocabulary padded past the mask
    assert allowed.shape == (2, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 64)]
    assert allowed[1].nonzero().flatten().tolist() == [63]


def step_with_mask(req_ids, first_rows, mask_rows, spec=None) -> SchedulerOutput:
    return SchedulerOutput(
        (), (), {r: 1 + len((spec or {}).get(r, ())) for r in req_ids},
        sum(1 + len((spec or {}).get(r, ())) for r in req_ids), frozenset(), frozenset(),
        scheduled_spec_decode_tokens=spec or {}, structured_output_request_ids=first_rows,
        grammar_bitmask=np.array(mask_rows, dtype=np.int32),
    )  # fmt: skip


def test_apply_grammar_bitmask_masks_only_the_constrained_rows():
    logits = torch.arange(3 * 40, dtype=torch.float32).reshape(3, 40)
    before = logits.clone()
    step = step_with_mask(["a", "b", "c"], {"b": 0}, [[0b110, 0]])
    apply_grammar_bitmask(step, ["a", "b", "c"], logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 2]
    assert logits[1, 1] == before[1, 1]


def test_apply_grammar_bitmask_gives_each_draft_position_its_row():
    logits = torch.zeros(5, 32)  # "a": 1 row; "b": 1 + 2 drafts = rows 1-3; "c": row 4
    step = step_with_mask(["a", "b", "c"], {"b": 0}, [[1 << 3], [1 << 4], [1 << 5]], spec={"b": (7, 8)})
    apply_grammar_bitmask(step, ["a", "b", "c"], logits, {"a": 0, "b": 1, "c": 4})
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [
        list(range(32)), [3], [4], [5], list(range(32))
    ]


LAYOUTS = [
    (["a", "b", "c", "d"], {}),  # every row, in order: one slice written in place
    (["d", "a", "c", "b"], {}),  # mask rows in another order than the logits rows
    (["b", "d"], {}),  # rows 1 and 3: not one slice
    (["c", "a"], {"a": (9, 10)}),  # drafts: "a" has rows 0-2, "c" row 4
]


@pytest.mark.parametrize("constrained, spec", LAYOUTS)
def test_apply_grammar_bitmask_equals_a_token_by_token_reference(constrained, spec):
    """Whatever the rows, token t of a constrained row is -inf exactly when bit t % 32 of word
    t // 32 of its mask row is clear, tokens past the mask's 64 included; the rest is untouched."""
    req_ids, vocab = ["a", "b", "c", "d"], 70
    gen = torch.Generator().manual_seed(len(constrained) + len(spec))
    first_mask_row, row = {}, 0
    for rid in constrained:
        first_mask_row[rid], row = row, row + 1 + len(spec.get(rid, ()))
    words = torch.randint(-(2**31), 2**31, (row, 2), generator=gen, dtype=torch.int64).to(torch.int32)  # [G, 2]
    step = step_with_mask(req_ids, first_mask_row, words.tolist(), spec=spec)
    first_logits_row, at = {}, 0
    for rid in req_ids:
        first_logits_row[rid], at = at, at + 1 + len(spec.get(rid, ()))
    logits = torch.randn(at, vocab, generator=gen)
    expected = logits.clone()
    for rid in constrained:
        for i in range(1 + len(spec.get(rid, ()))):
            for token in range(vocab):
                word = int(words[first_mask_row[rid] + i, token // 32]) if token < 64 else 0
                if not (word >> (token % 32)) & 1:
                    expected[first_logits_row[rid] + i, token] = float("-inf")
    apply_grammar_bitmask(step, req_ids, logits, first_logits_row)
    assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_mask_is_applied_on_the_device_as_on_the_cpu(dtype):
    """Every layout of the reference test above, on CUDA logits: the same -inf entries as the
    same mask applied on the CPU, and the logits stay on the device."""
    for constrained, spec in LAYOUTS:
        req_ids = ["a", "b", "c", "d"]
        first_mask_row, row = {}, 0
        for rid in constrained:
            first_mask_row[rid], row = row, row + 1 + len(spec.get(rid, ()))
        words = torch.randint(-(2**31), 2**31, (row, 2), generator=torch.Generator().manual_seed(row), dtype=torch.int64)
        step = step_with_mask(req_ids, first_mask_row, words.to(torch.int32).tolist(), spec=spec)
        first_logits_row, at = {}, 0
        for rid in req_ids:
            first_logits_row[rid], at = at, at + 1 + len(spec.get(rid, ()))
        logits = torch.randn(at, 70, device="cuda", dtype=dtype)
        expected = logits.cpu().clone()
        apply_grammar_bitmask(step, req_ids, expected, first_logits_row)
        apply_grammar_bitmask(step, req_ids, logits, first_logits_row)
        assert logits.device.type == "cuda" and torch.equal(logits.cpu(), expected), (constrained, spec)
