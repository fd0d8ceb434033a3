"""The thinking budget (seed 001 ch. 13, appendices D, O, T2). Every test name says thinking_budget."""

import pytest
import torch

from tinyvllm.config import ReasoningConfig
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality
from tinyvllm.sample.thinking_budget import (
    FORCED_LOGIT,
    ThinkingBudgetStateHolder,
    compute_force_index,
    ends_with_sequence,
    maybe_create_thinking_budget_state_holder,
    token_row_offsets,
)
from tinyvllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
START, END1, END2 = 1, 2, 3
V = 16


def holder(end=(END1,), start=(START,), spec=0, max_num_seqs=4):
    return ThinkingBudgetStateHolder(ReasoningConfig(start, end), max_num_seqs, spec, CPU, False)


def add(h, index, budget, prompt=None, output=None, batch_size=None):
    out = output if output is not None else []
    h.sync_batch(BatchUpdate(batch_size or index + 1, [], [(index, SamplingParams(thinking_token_budget=budget), prompt, out)], []))
    return out


def step(h, outputs, model_tokens, spec=None):
    """One greedy decode step with a fake model preferring ``model_tokens[r]``; appends and returns the tokens."""
    h.update_state(outputs, spec)
    logits = torch.zeros(len(outputs), V)
    for row, tok in enumerate(model_tokens):
        logits[row, tok] = 5.0
    sampled = h.apply_to_logits(logits, False, spec).argmax(dim=-1).tolist()
    for out, tok in zip(outputs, sampled):
        out.append(tok)
    return sampled


# ---- appendix O.3: force_index ------------------------------------------------------------

@pytest.mark.seed("001:O", "001:D")
@pytest.mark.parametrize(
    "budget, think_count, spec_len, expected",
    [(10, 8, 3, [2]), (10, 10, 3, [0]), (10, 12, 3, [0]), (10, 7, 3, [3]), (10, 9, 0, [0]), (5, 4, 4, [1])],
)
def test_thinking_budget_force_index_table_o3(budget, think_count, spec_len, expected):
    assert compute_force_index(budget, think_count, spec_len) == expected


@pytest.mark.seed("001:O", "001:13", "001:D")
def test_thinking_budget_force_index_in_state_budget10_think8_spec3():
    # The diagram of O.3: drafts 0 and 1 are thinking tokens 9 and 10, draft 2 is forced.
    h = holder(spec=3)
    out = add(h, 0, budget=10, prompt=[START])  # thinking from the prompt on
    confirmed = [7] * 8
    h.update_state([confirmed + [7, 7, 7]], [[7, 7, 7]])
    state = h._state[0]
    assert state["think_count"] == 8 and state["in_end"] and state["force_index"] == [2]
    target = h.apply_to_logits(torch.zeros(3, V), predict_bonus_token=False, spec_token_ids=[[7, 7, 7]])
    assert target[2, END1].item() == FORCED_LOGIT and target[:2].abs().sum().item() == 0
    bonus = h.apply_to_logits(torch.zeros(1, V), predict_bonus_token=True, spec_token_ids=[[7, 7, 7]])
    assert bonus.abs().sum().item() == 0  # a draft row is forced in the target call only
    assert out == []


@pytest.mark.seed("001:13", "001:D")
def test_thinking_budget_bonus_position_forced_in_bonus_call():
    h = holder(spec=3)
    add(h, 0, budget=10, prompt=[START])
    h.update_state([[7] * 7 + [7, 7, 7]], [[7, 7, 7]])  # remaining 3 == spec_len -> bonus row
    assert h._state[0]["force_index"] == [3]
    assert h.apply_to_logits(torch.zeros(3, V), False, [[7, 7, 7]]).abs().sum().item() == 0
    bonus = h.apply_to_logits(torch.zeros(1, V), True, [[7, 7, 7]])
    assert bonus[0, END1].item() == FORCED_LOGIT


# ---- appendix O.2: transitions --------------------------------------------------------------

@pytest.mark.seed("001:O", "001:13")
def test_thinking_budget_transitions_o2_single_token_end():
    h = holder()
    out = add(h, 0, budget=2, prompt=[9])
    h.update_state([out])
    s = h._state[0]
    assert (s["in_think"], s["in_end"]) == (False, False)  # idle: no start yet
    out.append(START)
    h.update_state([out])
    assert (s["in_think"], s["in_end"], s["think_count"]) == (True, False, 0)  # start detected
    out.append(7)
    h.update_state([out])
    assert (s["in_think"], s["think_count"], s["check_count_down"], s["force_index"]) == (True, 1, 1, [])
    out.append(7)
    h.update_state([out])
    assert (s["in_think"], s["in_end"], s["end_count"], s["force_index"]) == (False, True, 0, [0])  # budget hit
    out.append(END1)
    h.update_state([out])
    assert (s["in_think"], s["in_end"], s["end_count"], s["check_count_down"]) == (False, False, 0, 2)  # done
    h.check_invariants()


@pytest.mark.seed("001:13")
def test_thinking_budget_multi_token_end_forced_one_per_step():
    h = holder(end=(END1, END2, 4))
    out = add(h, 0, budget=1, prompt=[START])
    tokens = [step(h, [out], [7])[0] for _ in range(6)]
    assert tokens == [7, END1, END2, 4, 7, 7]


@pytest.mark.seed("001:13")
def test_thinking_budget_rolled_back_forced_token_is_forced_again():
    h = holder(end=(END1, END2))
    out = add(h, 0, budget=0, prompt=[START])
    h.update_state([out])
    assert h._state[0]["in_end"] and h._state[0]["force_index"] == [0]
    out.append(7)  # the forced token did not make it (e.g. rejected): force from the start
    h.update_state([out])
    s = h._state[0]
    assert s["in_end"] and s["end_count"] == 0
    out.append(END1)
    h.update_state([out])
    assert s["end_count"] == 1


@pytest.mark.seed("001:13")
def test_thinking_budget_model_closing_section_itself_restores_budget():
    h = holder()
    out = add(h, 0, budget=5, prompt=[START])
    out.extend([7, 7, END1, 7])
    h.update_state([out])
    s = h._state[0]
    assert (s["in_think"], s["in_end"], s["think_count"], s["end_thinking"]) == (False, False, 0, 2)


@pytest.mark.seed("001:13")
def test_thinking_budget_zero_forces_right_after_start():
    h = holder(end=(END1, END2))
    out = add(h, 0, budget=0, prompt=[5])
    assert [step(h, [out], [t])[0] for t in (START, 7, 7, 7)] == [START, END1, END2, 7]


# ---- _init_state_entry --------------------------------------------------------------------

@pytest.mark.seed("001:13")
def test_thinking_budget_prompt_inside_think_section_counts():
    h = holder(start=(START, 6))
    s = h._init_state_entry([5, START, 6, 7, 7, 7], thinking_token_budget=5)
    assert (s["in_think"], s["think_count"], s["check_count_down"], s["continue_thinking"]) == (True, 3, 2, True)
    s = h._init_state_entry([START, 6, 7, 7, 7], thinking_token_budget=3)
    assert (s["in_think"], s["in_end"], s["force_index"]) == (False, True, [0])  # exhausted in the prompt
    s = h._init_state_entry([START, 6, 7, END1, 7], thinking_token_budget=3)
    assert (s["in_think"], s["in_end"], s["think_count"]) == (False, False, 0)  # closed in the prompt
    s = h._init_state_entry(None, thinking_token_budget=3)
    assert (s["in_think"], s["in_end"], s["check_count_down"], s["start_thinking"]) == (False, False, 3, -1)


@pytest.mark.seed("001:13")
def test_thinking_budget_start_sequence_straddling_prompt_and_output():
    h = holder(start=(START, 6), end=(END1,))
    out = add(h, 0, budget=1, prompt=[5, START])
    assert step(h, [out], [6]) == [6]  # completes the start sequence
    assert step(h, [out], [7]) == [7]  # one thinking token
    assert step(h, [out], [7]) == [END1]


@pytest.mark.seed("001:13")
def test_thinking_budget_find_last_sequence_index_and_ends_with():
    f = ThinkingBudgetStateHolder._find_last_sequence_index
    assert f([1, 2, 1, 2, 3], [1, 2]) == 2 and f([1, 2], []) == -1 and f([1], [1, 2]) == -1
    assert ends_with_sequence([4, 1], [2, 3], 0, [1, 2]) and not ends_with_sequence(None, [2], 0, [1, 2])


# ---- sync_batch, layout, apply (appendix T2) ------------------------------------------------

@pytest.mark.seed("001:13")
def test_thinking_budget_sync_batch_remove_swap_move():
    h = holder()
    add(h, 0, 3)
    add(h, 1, None)
    add(h, 2, 4)
    assert set(h._state) == {0, 2} and h.has_tracked_requests()
    b0, b2 = h._state[0], h._state[2]
    h.sync_batch(BatchUpdate(3, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    assert h._state == {1: b0, 2: b2}  # swap with an untracked row leaves row 0 empty
    h.sync_batch(BatchUpdate(2, [1], [], [(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert h._state == {1: b2}
    h.sync_batch(BatchUpdate(2, [], [(1, SamplingParams(), None, [])], []))
    assert not h.has_tracked_requests()


@pytest.mark.seed("001:T2")
def test_thinking_budget_t2_layout_offsets():
    assert token_row_offsets(3, [], False, False) == {0: 0, 1: 1, 2: 2}
    assert token_row_offsets(3, [[7, 7], [7, 7, 7], [7]], True, False) == {0: 0, 1: 2, 2: 5}
    assert token_row_offsets(3, [[7, 7], [7, 7, 7], [7]], True, True) == {0: 0, 1: 1, 2: 2}


@pytest.mark.seed("001:T2")
def test_thinking_budget_t2_forcing_writes_1e9_and_clears_mask_each_call():
    h = holder(end=(END1, END2))
    outs = [add(h, 0, 0, prompt=[START]), [], add(h, 2, 0, prompt=[START], batch_size=3)]
    h.update_state(outs)
    logits = h.apply_to_logits(torch.zeros(3, V))
    assert logits[0, END1].item() == FORCED_LOGIT and logits[2, END1].item() == FORCED_LOGIT
    assert logits[1].abs().sum().item() == 0 and h.mask.sum().item() == 2
    outs[0].append(END1)
    h.update_state(outs)
    logits = h.apply_to_logits(torch.zeros(3, V))
    assert logits[0, END2].item() == FORCED_LOGIT and logits[2, END1].item() == FORCED_LOGIT
    assert logits[0, END1].item() == 0


def test_thinking_budget_apply_to_rows_one_call_layout_and_plain_rows():
    """What the sampler calls: with ``rows_per_request`` (each request's draft rows, then its
    bonus row, in one call) a forcing request is forced at ``offset + force_index``; with
    None (one row per request) it forces what the plain ``apply_to_logits`` forces."""
    h = holder(spec=3)
    add(h, 0, budget=10, prompt=[START], batch_size=3)  # request 0: 1 draft, thinking
    add(h, 1, budget=10, prompt=[START], batch_size=3)  # request 1: 2 drafts, runs out at its draft 1
    h.update_state([[7] * 9 + [7], [7] * 9 + [7, 7], [7]], [[7], [7, 7], []])
    assert h._state[1]["force_index"] == [1] and h._state[0]["force_index"] == [1]
    logits = h.apply_to_rows(torch.zeros(6, V), [2, 3, 1])  # rows 0-1, 2-4, 5
    # request 0's force_index 1 is its bonus row (row 1); request 1's is its row 2 + 1 = 3
    assert (logits.max(dim=-1).values >= FORCED_LOGIT).nonzero().flatten().tolist() == [1, 3]
    assert logits[3, END1].item() == FORCED_LOGIT and h.mask.nonzero().flatten().tolist() == [1, 3]
    plain = holder(end=(END1, END2))
    outs = [add(plain, 0, 0, prompt=[START]), [], add(plain, 2, 0, prompt=[START], batch_size=3)]
    plain.update_state(outs)
    assert torch.equal(plain.apply_to_rows(torch.zeros(3, V)), plain.apply_to_logits(torch.zeros(3, V)))


@pytest.mark.seed("001:13")
def test_thinking_budget_spec_mode_draft_tokens_stripped_and_multi_token_end():
    h = holder(end=(END1, END2), spec=2)
    add(h, 0, budget=2, prompt=[START])
    h.update_state([[7, 7, 9, 9]], [[9, 9]])  # confirmed [7, 7]: budget spent
    s = h._state[0]
    assert s["output_tok_ids"] == [7, 7] and s["force_index"] == [0]
    assert h.apply_to_logits(torch.zeros(2, V), False, [[9, 9]])[0, END1].item() == FORCED_LOGIT
    h.update_state([[7, 7, END1, 9, 9]], [[9, 9]])
    assert s["end_count"] == 1
    assert h.apply_to_logits(torch.zeros(2, V), False, [[9, 9]])[0, END2].item() == FORCED_LOGIT


@pytest.mark.seed("001:13")
def test_thinking_budget_disabled_without_end_tokens_or_config():
    assert maybe_create_thinking_budget_state_holder(None, 4, 0, CPU, False) is None
    h = maybe_create_thinking_budget_state_holder(ReasoningConfig((START,), ()), 4, 0, CPU, False)
    out = add(h, 0, 0, prompt=[START])
    h.update_state([out])
    assert h._state[0]["thinking_token_budget"] == -1
    logits = torch.zeros(1, V)
    assert torch.equal(h.apply_to_logits(logits), torch.zeros(1, V))
