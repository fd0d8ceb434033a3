"""Values in the appendix tables of the sampling pages (seed 001, appendices O, P, R2, S2, U2)
that no other test asserts.

Two small models of the document's listings live here, written from their description
(added -> removed -> moved, MinP's count moved case by case). They let the tests show
where the document's order and ours give the same result (every update the persistent
batch produces) and where they part (appendix R2's hand-built update).
"""

import dataclasses
import inspect
import random

import numpy as np
import pytest
import torch

from tinyvllm.config import EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality
from tinyvllm.sample.logits_processors import (
    AdapterLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    build_logitsprocs,
)
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder, compute_force_index
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
MAX = 6
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=MAX))
START, END = 1, 2


# ---- models of the document's listings ----------------------------------------------------

def listing_minp_update(values: np.ndarray, count: int, upd: BatchUpdate) -> int:
    """MinP's update as the document lists it (ch. 10.1): added first, then, only while the
    count is non-zero, removed and moved, with the count adjusted case by case. Edits
    ``values`` in place and returns the new count."""
    for row, params, _, _ in upd.added:
        old, new = values[row], np.float32(params.min_p)
        if old != new:
            values[row] = new
            count += int(new != 0) - int(old != 0)
    if not count:
        return count
    for row in upd.removed:
        if values[row]:
            values[row] = 0
            count -= 1
    for a, b, direction in upd.moved:
        va, vb = values[a], values[b]
        if va == vb:
            continue  # the listing skips a move between equal values
        values[b] = va
        if direction == SWAP:
            values[a] = vb
        else:
            if va:
                values[a] = 0
            if vb:
                count -= 1  # b's old non-zero value was overwritten
    return count


def listing_dict_update(entries: dict, upd: BatchUpdate, new_state) -> None:
    """``process_dict_updates`` in the document's order (ch. 10.4): added, then removed, then moved."""
    for row, params, prompt, output in upd.added:
        state = new_state(params, prompt, output)
        if state is not None:
            entries[row] = state
        else:
            entries.pop(row, None)
    if not entries:
        return
    for row in upd.removed:
        entries.pop(row, None)
    for a, b, direction in upd.moved:
        a_entry, b_entry = entries.pop(a, None), entries.pop(b, None)
        if a_entry is not None:
            entries[b] = a_entry
        if b_entry is not None and direction == SWAP:
            entries[a] = b_entry


def bias_state(params, _prompt, _output):
    return params.logit_bias or None


# ---- R2: where the two orders part, and why it never happens in a real batch --------------

def r2_start():
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(BatchUpdate(3, [], [
        (0, SamplingParams(min_p=0.1), None, []),
        (1, SamplingParams(), None, []),
        (2, SamplingParams(min_p=0.05), None, []),
    ], []))
    return proc


def as_list(values, n=4):
    return [round(float(v), 4) for v in values[:n]]


@pytest.mark.seed("001:R2")
def test_seed001_r2_ours_phase_by_phase():
    # Our order removed -> added -> moved, one phase per update; the single update of R2
    # must end where the three phases end.
    proc = r2_start()
    assert as_list(proc.min_p_cpu) == [0.1, 0.0, 0.05, 0.0] and proc.min_p_count == 2
    proc.update_state(BatchUpdate(4, [1], [], []))
    assert as_list(proc.min_p_cpu) == [0.1, 0.0, 0.05, 0.0] and proc.min_p_count == 2
    proc.update_state(BatchUpdate(4, [], [(1, SamplingParams(min_p=0.2), None, []), (3, SamplingParams(), None, [])], []))
    assert as_list(proc.min_p_cpu) == [0.1, 0.2, 0.05, 0.0] and proc.min_p_count == 3
    proc.update_state(BatchUpdate(4, [], [], [(2, 3, UNI)]))
    assert as_list(proc.min_p_cpu) == [0.1, 0.2, 0.0, 0.05] and proc.min_p_count == 3
    proc.check_invariants()
    whole = r2_start()
    whole.update_state(BatchUpdate(4, [1], [(1, SamplingParams(min_p=0.2), None, []), (3, SamplingParams(), None, [])], [(2, 3, UNI)]))
    assert as_list(whole.min_p_cpu) == as_list(proc.min_p_cpu) and whole.min_p_count == 3


@pytest.mark.seed("001:R2")
def test_seed001_r2_listing_order_loses_the_new_request_but_keeps_its_count():
    # R2's update lists row 1 as removed AND added. Run in the listing's order, the new
    # request's 0.2 is wiped by the removal; the count (2) still matches the non-zero rows.
    # The walkthrough's count of 1 is not what its own listing computes.
    upd = BatchUpdate(4, [1], [(1, SamplingParams(min_p=0.2), None, []), (3, SamplingParams(), None, [])], [(2, 3, UNI)])
    values = np.array([0.1, 0.0, 0.05, 0.0, 0.0, 0.0], dtype=np.float32)
    count = listing_minp_update(values, 2, upd)
    assert as_list(values) == [0.1, 0.0, 0.0, 0.05] and count == 2
    ours = r2_start()
    ours.update_state(upd)
    assert as_list(ours.min_p_cpu) == [0.1, 0.2, 0.0, 0.05] and ours.min_p_count == 3


@pytest.mark.seed("001:10", "001:N")
def test_seed001_listing_order_drops_a_dict_entry_listed_as_removed_and_added():
    # The same hand-built shape through process_dict_updates' two orders.
    upd = BatchUpdate(2, [1], [(1, SamplingParams(logit_bias={9: 2.0}), None, [])], [])
    listing = {1: {7: 1.0}}
    listing_dict_update(listing, upd, bias_state)
    assert listing == {}
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(BatchUpdate(2, [], [(1, SamplingParams(logit_bias={7: 1.0}), None, [])], []))
    proc.update_state(upd)
    assert proc.biases == {1: {9: 2.0}}


def random_stream(seed, steps=40):
    """Yield (batch, BatchUpdate) for a random stream of removals, additions, condensing and swaps."""
    rng = random.Random(seed)
    batch = InputBatch(MAX, CPU, build_logitsprocs(CONFIG, CPU, False, False))
    live, next_id = [], 0
    for _ in range(steps):
        for req_id in rng.sample(live, k=rng.randint(0, len(live))):
            batch.remove_request(req_id)
            live.remove(req_id)
        for _ in range(rng.randint(0, MAX - len(live))):
            params = SamplingParams(
                min_p=rng.choice([0.0, 0.1, 0.5]),
                logit_bias=rng.choice([None, {rng.randrange(8): 1.0}]),
            )
            batch.add_request(f"q{next_id}", params, None, [])
            live.append(f"q{next_id}")
            next_id += 1
        batch.condense()
        if batch.num_reqs >= 2 and rng.random() < 0.5:
            batch.swap_states(*rng.sample(range(batch.num_reqs), 2))
        yield batch, batch.refresh()


@pytest.mark.seed("001:8", "001:U2")
@pytest.mark.parametrize("seed", range(4))
def test_seed001_builder_updates_never_share_a_row_between_removed_and_added(seed):
    # pop_removed takes a filled hole out of `removed`, and condense only moves rows into holes.
    seen_removed_and_added = 0
    for _batch, upd in random_stream(seed):
        if upd is None:
            continue
        added_rows = {row for row, *_ in upd.added}
        assert not added_rows & set(upd.removed), upd
        for a, b, direction in upd.moved:
            if direction == UNI:
                assert b in upd.removed and a not in added_rows, upd
        seen_removed_and_added += bool(upd.removed and upd.added)
    assert seen_removed_and_added > 0  # the stream did exercise steps with both


@pytest.mark.seed("001:10", "001:R2")
@pytest.mark.parametrize("seed", range(4))
def test_seed001_listing_order_matches_ours_on_every_builder_update(seed):
    # On updates the persistent batch produces, the document's order and ours agree:
    # same MinP values, same count, same LogitBias entries.
    values = np.zeros(MAX, dtype=np.float32)
    count = 0
    biases: dict = {}
    for batch, upd in random_stream(seed):
        if upd is not None:
            count = listing_minp_update(values, count, upd)
            listing_dict_update(biases, upd, bias_state)
        minp = next(p for p in batch.logitsprocs.all if isinstance(p, MinPLogitsProcessor))
        bias = next(p for p in batch.logitsprocs.all if isinstance(p, LogitBiasLogitsProcessor))
        assert minp.min_p_cpu.tolist() == values.tolist()
        assert minp.min_p_count == count == int(np.count_nonzero(values))
        assert bias.biases == biases


# ---- U2.3: frozen, but not hashable --------------------------------------------------------

@pytest.mark.seed("001:U2", "001:7")
def test_seed001_u2_batch_update_is_frozen_but_not_hashable():
    upd = BatchUpdate(1, [0], [], [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        upd.removed = []
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        hash(upd)  # the builder hands over lists; a frozen dataclass hashes its fields


# ---- U2.1 under vLLM's condense: the holes it fills are not in `removed` -----------------

def listing_sync_batch_moves(state: dict, upd: BatchUpdate) -> None:
    """The moved part of ``sync_batch`` as ch. 13.5 lists it: a one-way move pops only the
    source, so whatever the destination held stays there unless the source had state."""
    for i1, i2, direction in upd.moved:
        if direction == SWAP:
            s1, s2 = state.get(i1), state.get(i2)
            if s1 is not None:
                state[i2] = s1
            if s2 is not None:
                state[i1] = s2
        elif (s := state.pop(i1, None)) is not None:
            state[i2] = s


@pytest.mark.seed("001:U2", "001:10", "001:13")
def test_seed001_u2_vllm_style_condense_update_leaves_no_stale_state():
    # U2.1 step 3: rows r0-r5, r0, r2 and r5 leave. Our condense() leaves the holes it fills
    # in `removed` ([5, 2, 0], test_condense_moves_highest_rows_into_lowest_holes); vLLM's pops
    # each one, so its update lists only [5] with the same moves, and rows 0 and 2 still hold
    # the departed requests' state when the moves are read. Every consumer of ours drops it
    # at the move; the thinking budget's sync_batch as listed in ch. 13.5 would not.
    departing = SamplingParams(min_p=0.1, logit_bias={5: 1.0}, thinking_token_budget=3)
    params = [departing, SamplingParams(min_p=0.2), departing, SamplingParams(), SamplingParams(), SamplingParams()]
    start = BatchUpdate(6, [], [(i, p, [START], []) for i, p in enumerate(params)], [])
    vllm_update = BatchUpdate(3, [5], [], [(4, 0, UNI), (3, 2, UNI)])

    minp = MinPLogitsProcessor(CONFIG, CPU, False)
    bias = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    holder = ThinkingBudgetStateHolder(ReasoningConfig((START,), (END,)), MAX, 0, CPU, False)
    for upd in (start, vllm_update):
        minp.update_state(upd)
        bias.update_state(upd)
        holder.sync_batch(upd)
    assert as_list(minp.min_p_cpu, 6) == [0.0, 0.2, 0.0, 0.0, 0.0, 0.0] and minp.min_p_count == 1
    minp.check_invariants()
    assert bias.biases == {}
    assert holder._state == {}  # NOTE 2: both rows of a move are popped

    holder = ThinkingBudgetStateHolder(ReasoningConfig((START,), (END,)), MAX, 0, CPU, False)
    holder.sync_batch(start)
    listing = dict(holder._state)
    for row in vllm_update.removed:
        listing.pop(row, None)
    listing_sync_batch_moves(listing, vllm_update)
    assert sorted(listing) == [0, 2]  # r0's and r2's states now sit under r4 and r3


# ---- S2: the index tensors' types ------------------------------------------------------------

@pytest.mark.seed("001:S2")
def test_seed001_s2_index_tensors_are_int64_and_bias_float32():
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(BatchUpdate(3, [], [
        (0, SamplingParams(logit_bias={100: 0.5, 200: -0.3}), None, []),
        (2, SamplingParams(logit_bias={50: 1.0}), None, []),
    ], []))
    assert [t.dtype for t in proc.logits_slice] == [torch.int64, torch.int64]
    assert proc.bias_tensor.dtype == torch.float32


# ---- O.1 / O.3: the thinking-budget state --------------------------------------------------

@pytest.mark.seed("001:O")
def test_seed001_o1_initial_state_fields():
    plain = ThinkingBudgetStateHolder(ReasoningConfig((START,), (END,)), MAX, 0, CPU, False)
    assert plain._init_state_entry(None, 3) == {
        "in_think": False, "in_end": False, "check_count_down": 3, "think_count": 0, "end_count": 0,
        "prompt_tok_ids": None, "output_tok_ids": [], "thinking_token_budget": 3, "prev_output_length": 0,
        "spec_token_ids": [], "force_index": [], "start_thinking": -1, "end_thinking": -1,
        "in_spec_mode": False, "bonus_token_forced": False, "continue_thinking": False,
    }
    spec = ThinkingBudgetStateHolder(ReasoningConfig((START,), (END,)), MAX, 2, CPU, False)
    assert spec._init_state_entry(None, 3)["in_spec_mode"] is True
    # a prompt ending inside a think section: start_thinking is an offset into the prompt (< 0)
    s = plain._init_state_entry([5, START, 7, 7, 7], 5)
    assert (s["think_count"], s["start_thinking"], s["check_count_down"]) == (3, -4, 2)


@pytest.mark.seed("001:O", "001:D")
def test_seed001_o3_remaining_above_spec_len_forces_nothing_yet():
    h = ThinkingBudgetStateHolder(ReasoningConfig((START,), (END,)), MAX, 3, CPU, False)
    h.sync_batch(BatchUpdate(1, [], [(0, SamplingParams(thinking_token_budget=10), [START], [])], []))
    h.update_state([[7] * 6 + [7, 7, 7]], [[7, 7, 7]])  # 6 confirmed thinking tokens, 3 drafts
    s = h._state[0]
    assert (s["think_count"], s["in_think"], s["in_end"], s["force_index"], s["check_count_down"]) == (6, True, False, [], 4)
    assert compute_force_index(10, 11, 3) == [0]  # over budget already: force from draft row 0


# ---- P.3: the parameter count decides how a callable is called ----------------------------

class _Three:
    """Shaped like appendix P.3's ThreeParamProcessor."""

    def __call__(self, input_ids, logits, **kwargs):
        return logits


class _Two:
    """Shaped like appendix P.3's TwoParamProcessor."""

    def __call__(self, logits, **kwargs):
        return logits


class _Adapter(AdapterLogitsProcessor):
    def __init__(self, config, device, is_pin_memory, req_lp=None):
        super().__init__(config, device, is_pin_memory)
        self.req_lp = req_lp

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        return self.req_lp


@pytest.mark.seed("001:P")
@pytest.mark.parametrize("req_lp, n_params", [(_Three(), 3), (_Two(), 2)])
def test_seed001_p3_example_signatures_do_not_fit_the_arity_rule(req_lp, n_params):
    # **kwargs counts as a parameter: P.3's classes are bound as (prompt, output) and
    # (output) and then called with one more positional argument than they take.
    assert len(inspect.signature(req_lp).parameters) == n_params
    proc = _Adapter(CONFIG, CPU, False, req_lp)
    proc.update_state(BatchUpdate(1, [], [(0, SamplingParams(), [1, 2], [3])], []))
    with pytest.raises(TypeError, match="positional arguments"):
        proc.apply(torch.zeros(1, 4))
