"""Presence, frequency and repetition penalties (``sample/penalties.py``): the formula
against numbers worked out by hand, and ``PenaltyState``, the per-row prompt masks and
output counts it reads, on its own (the persistent batch's use of it is in
``tests/test_input_batch.py``)."""

import pytest
import torch

from tinyvllm.sample.penalties import PenaltyState, apply_penalties, uses_penalties
from tinyvllm.sampling_params import SamplingParams

V = 6
INF = float("inf")


def test_apply_penalties_matches_a_hand_computation():
    logits = torch.tensor([
        [2.0, -1.0, 0.5, 3.0, 0.0, -INF],
        [2.0, -1.0, 0.5, 3.0, 0.0, 1.0],
    ])  # fmt: skip
    prompt_mask = torch.tensor([[True, True, False, False, False, True]] * 2)  # prompt {0, 1, 5}
    output_counts = torch.tensor([[0, 0, 1, 2, 0, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.int32)
    presence = torch.tensor([0.5, 0.0])
    frequency = torch.tensor([0.25, -1.0])
    repetition = torch.tensor([2.0, 0.5])
    out = apply_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition)
    # Row 0, by hand: 0 in the prompt: 2 / 2; 1 in the prompt: -1 * 2; 2 once in the output:
    # 0.5 / 2 - 0.25 * 1 - 0.5; 3 twice: 3 / 2 - 0.25 * 2 - 0.5; 4 never seen; 5 stays -inf.
    # Row 1 (repetition 0.5 < 1 raises seen tokens, frequency -1 rewards): 0: 2 / 0.5;
    # 1 in prompt and output: -1 * 0.5 + 1 * 1; 5 in the prompt: 1 / 0.5.
    expected = torch.tensor([
        [1.0, -2.0, -0.5, 0.5, 0.0, -INF],
        [4.0, 0.5, 0.5, 3.0, 0.0, 2.0],
    ])  # fmt: skip
    assert torch.equal(out, expected), out
    assert logits[0, 0].item() == 2.0  # the input is not edited


def test_zero_logits_and_neutral_rows_are_left_alone():
    logits = torch.tensor([[0.0, 1.5, -2.5]])
    out = apply_penalties(
        logits, torch.tensor([[True, True, True]]), torch.tensor([[3, 1, 2]], dtype=torch.int32),
        torch.zeros(1), torch.zeros(1), torch.ones(1),
    )  # fmt: skip
    assert torch.equal(out, logits)


@pytest.mark.parametrize(
    "kwargs, uses",
    [({}, False), ({"presence_penalty": 0.1}, True), ({"frequency_penalty": -0.1}, True),
     ({"repetition_penalty": 1.0}, False), ({"repetition_penalty": 0.9}, True)],
)  # fmt: skip
def test_uses_penalties(kwargs, uses):
    assert uses_penalties(SamplingParams(**kwargs)) is uses


def counts(state: PenaltyState, row: int) -> list[int]:
    return state.output_counts_of(row).tolist()


def bincount(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=V).tolist()


def test_state_counts_a_row_from_its_whole_output_then_only_the_new_tokens():
    state = PenaltyState(max_num_reqs=4, vocab_size=V, device="cpu")
    out = [3, 3]  # a request re-entering the batch brings its outputs so far
    state.add_row(0, SamplingParams(presence_penalty=1.0), [1, 2, 2], out)
    assert counts(state, 0) == bincount([3, 3])
    assert state.prompt_mask_of(0).tolist() == [False, True, True, False, False, False]
    out.append(4)
    assert counts(state, 0) == bincount([3, 3])  # not yet: the batch counts at refresh
    state.count_new_tokens()
    assert counts(state, 0) == bincount([3, 3, 4])
    state.count_new_tokens()  # a step that sampled nothing for the row (a partial prefill)
    assert counts(state, 0) == bincount([3, 3, 4])
    state.check_invariants()


def test_state_rows_move_swap_and_clear_and_a_reused_slot_starts_from_zero():
    state = PenaltyState(max_num_reqs=4, vocab_size=V, device="cpu")
    a, b = [1, 1], [5]
    state.add_row(0, SamplingParams(frequency_penalty=1.0), [0], a)
    state.add_row(2, SamplingParams(repetition_penalty=2.0), [4], b)
    state.move_row(2, 1)
    assert counts(state, 1) == bincount([5]) and 2 not in state.rows
    state.swap_rows(0, 1)
    assert counts(state, 0) == bincount([5]) and counts(state, 1) == bincount([1, 1])
    assert state.rows[0].repetition == 2.0 and state.rows[1].frequency == 1.0
    slot = state.rows[1].slot
    state.clear_row(1)
    state.add_row(3, SamplingParams(presence_penalty=0.5), [2], [])
    assert state.rows[3].slot == slot  # the freed slot is reused ...
    assert counts(state, 3) == [0] * V  # ... and holds nothing of its previous row
    assert state.prompt_mask_of(3).tolist() == [False, False, True, False, False, False]
    state.check_invariants()


def test_state_allocates_nothing_until_a_row_uses_penalties_and_grows_by_doubling():
    state = PenaltyState(max_num_reqs=5, vocab_size=V, device="cpu")
    assert state.capacity == 0 and state.output_counts.numel() == 0
    outs = [[row] for row in range(5)]
    for row in range(5):
        state.add_row(row, SamplingParams(presence_penalty=1.0), [0], outs[row])
    assert state.capacity == 5  # 1, 2, 4, then capped at max_num_reqs
    assert [counts(state, row) for row in range(5)] == [bincount([row]) for row in range(5)]
    state.check_invariants()


def test_state_applies_the_formula_to_its_rows_only():
    state = PenaltyState(max_num_reqs=4, vocab_size=V, device="cpu")
    state.add_row(2, SamplingParams(presence_penalty=1.0, repetition_penalty=2.0), [0], [1, 1])
    state.add_row(0, SamplingParams(frequency_penalty=0.5), [], [3])
    logits = torch.arange(3 * V, dtype=torch.float32).view(3, V) - 7.0  # [R, V], negative and positive
    expected = logits.clone()
    expected[2] = apply_penalties(
        logits[2:3], state.prompt_mask_of(2)[None], state.output_counts_of(2)[None],
        torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0]),
    )[0]  # fmt: skip
    expected[0, 3] -= 0.5
    out = state.apply(logits.clone())
    assert torch.equal(out, expected)
    assert torch.equal(out[1], logits[1])  # row 1 has no penalties


def test_state_check_invariants_catches_a_wrong_count_and_a_shrunken_list():
    state = PenaltyState(max_num_reqs=2, vocab_size=V, device="cpu")
    out = [2]
    state.add_row(0, SamplingParams(presence_penalty=1.0), [0], out)
    state.output_counts[state.rows[0].slot, 4] += 1
    with pytest.raises(AssertionError, match="row 0"):
        state.check_invariants()
    state.output_counts[state.rows[0].slot, 4] -= 1
    state.check_invariants()
    out.clear()
    with pytest.raises(AssertionError, match="row 0"):
        state.check_invariants()


def test_state_refuses_logits_of_another_vocabulary():
    state = PenaltyState(max_num_reqs=2, vocab_size=V, device="cpu")
    state.add_row(0, SamplingParams(presence_penalty=1.0), [0], [])
    with pytest.raises(ValueError, match="vocabulary"):
        state.apply(torch.zeros(1, V + 1))


def test_penalties_of_draft_rows_equal_penalties_as_if_the_drafts_were_generated():
    """A speculative step (``PenaltyState.expand``, through ``SamplingMetadata.expand``):
    request r owns ``len(drafts[r]) + 1`` rows, and its row j is penalised exactly as the
    plain path penalises the request once drafts ``0 .. j - 1`` are in its output."""
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        None,  # request 1 uses no penalty: its rows are left alone
        SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.5),
    ]
    prompts, outputs = [[1, 2], [3], [0, 5]], [[3, 3], [4], [2]]
    drafts = [[2, 3], [1], [5]]  # rows 0-2, 3-4, 5-6
    state = PenaltyState(max_num_reqs=4, vocab_size=V, device="cpu")
    for row, p in enumerate(params):
        if p is not None:
            state.add_row(row, p, prompts[row], outputs[row])
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(0))
    got = state.expand(drafts).apply(logits.clone())
    starts = [0, 3, 5]
    for r, p in enumerate(params):
        for j in range(len(drafts[r]) + 1):
            row = logits[starts[r] + j : starts[r] + j + 1]
            if p is None:
                assert torch.equal(got[starts[r] + j], row[0])
                continue
            alone = PenaltyState(max_num_reqs=1, vocab_size=V, device="cpu")
            alone.add_row(0, p, prompts[r], [*outputs[r], *drafts[r][:j]])
            assert torch.equal(got[starts[r] + j], alone.apply(row.clone())[0]), (r, j)
    assert counts(state, 0) == bincount([3, 3])  # the drafts are counted on a copy, not in the state
    state.check_invariants()
