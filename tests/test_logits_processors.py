"""Built-in logits processors, the container, process_dict_updates and the adapter
(seed 001 ch. 9, 10, 12; appendices N, R2, S2)."""

import math

import pytest
import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality
from tinyvllm.sample.logits_processors import (
    BUILTIN_LOGITS_PROCESSORS,
    AdapterLogitsProcessor,
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    process_dict_updates,
)
from tinyvllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8))


def update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size, list(removed), list(added), list(moved))


def added(index, output=None, prompt=None, **params):
    return (index, SamplingParams(**params), prompt, output if output is not None else [])


def bias_state(params, _prompt, _out):
    return params.logit_bias or None


# ---- appendix N: the five process_dict_updates scenarios -------------------------------

@pytest.mark.seed("001:N", "001:10")
def test_process_dict_updates_n1_added_with_bias():
    biases = {}
    changed = process_dict_updates(biases, update(1, added=[added(0, logit_bias={100: 0.5, 200: -0.3})]), bias_state)
    assert changed and biases == {0: {100: 0.5, 200: -0.3}}
    # and the processor's index tensors of N.1 step 3
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(1, added=[added(0, logit_bias={100: 0.5, 200: -0.3})]))
    assert proc.logits_slice[0].tolist() == [0, 0]
    assert proc.logits_slice[1].tolist() == [100, 200]
    assert proc.bias_tensor.tolist() == pytest.approx([0.5, -0.3])


@pytest.mark.seed("001:N")
def test_process_dict_updates_n2_removed():
    biases = {0: {100: 0.5}, 1: {200: -0.3}}
    assert process_dict_updates(biases, update(1, removed=[1]), bias_state)
    assert biases == {0: {100: 0.5}}


@pytest.mark.seed("001:N")
def test_process_dict_updates_n3_swap():
    biases = {0: {100: 0.5}, 1: {200: -0.3}}
    assert process_dict_updates(biases, update(2, moved=[(0, 1, SWAP)]), bias_state)
    assert biases == {0: {200: -0.3}, 1: {100: 0.5}}


@pytest.mark.seed("001:N")
def test_process_dict_updates_n4_unidirectional():
    biases = {0: {100: 0.5}, 2: {300: 0.8}}
    assert process_dict_updates(biases, update(3, moved=[(0, 1, UNI)]), bias_state)
    assert biases == {1: {100: 0.5}, 2: {300: 0.8}}


@pytest.mark.seed("001:N")
def test_process_dict_updates_n5_new_request_without_bias_clears_row():
    biases = {0: {100: 0.5}}
    assert process_dict_updates(biases, update(1, added=[added(0)]), bias_state)
    assert biases == {}


@pytest.mark.seed("001:10")
def test_process_dict_updates_no_change_returns_false():
    biases = {0: {1: 1.0}}
    assert process_dict_updates(biases, None, bias_state) is False
    assert process_dict_updates(biases, update(2, added=[added(1)]), bias_state) is False
    assert process_dict_updates(biases, update(2, moved=[(3, 4, UNI)]), bias_state) is False
    assert biases == {0: {1: 1.0}}


@pytest.mark.seed("001:10", "001:7")
def test_process_dict_updates_removed_before_added_on_same_row():
    # Our order is removed -> added -> moved: a row listed in both ends with the newcomer.
    biases = {1: {7: 1.0}}
    process_dict_updates(biases, update(2, removed=[1], added=[added(1, logit_bias={9: 2.0})]), bias_state)
    assert biases == {1: {9: 2.0}}


# ---- container --------------------------------------------------------------------------

@pytest.mark.seed("001:9")
def test_container_splits_by_argmax_invariance():
    procs = [cls(CONFIG, CPU, False) for cls in BUILTIN_LOGITS_PROCESSORS]
    container = LogitsProcessors(procs)
    assert [type(p) for p in container.argmax_invariant] == [MinPLogitsProcessor]
    assert [type(p) for p in container.non_argmax_invariant] == [MinTokensLogitsProcessor, LogitBiasLogitsProcessor]
    assert [type(p) for p in container.all] == [MinPLogitsProcessor, MinTokensLogitsProcessor, LogitBiasLogitsProcessor]
    assert list(LogitsProcessors().all) == []


# ---- MinP (ch. 10.1, appendix R2) ---------------------------------------------------------

@pytest.mark.seed("001:10")
def test_min_p_masks_below_scaled_max_probability():
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(2, added=[added(0, min_p=0.3), added(1)]))
    probs = torch.tensor([[0.5, 0.2, 0.14, 0.16], [0.5, 0.2, 0.14, 0.16]])
    out = proc.apply(probs.log().clone())
    # row 0: threshold 0.5 * 0.3 = 0.15 drops 0.14 only; row 1 has min_p 0: untouched
    assert torch.isinf(out[0]).tolist() == [False, False, True, False]
    assert torch.equal(out[1], probs[1].log())
    proc.check_invariants()


@pytest.mark.seed("001:R2")
def test_min_p_r2_count_matches_rows():
    # Appendix R2: rows [0.1, 0.0, 0.05]; then remove 1, add min_p 0.2 at 1 and 0 at 3,
    # move 2 -> 3 one way. The document's walkthrough ends with count 1 and row 1 empty;
    # ours ends with every non-zero row counted.
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(3, added=[added(0, min_p=0.1), added(1), added(2, min_p=0.05)]))
    assert proc.min_p_count == 2
    proc.update_state(update(4, removed=[1], added=[added(1, min_p=0.2), added(3)], moved=[(2, 3, UNI)]))
    assert proc.min_p_cpu[:4].tolist() == pytest.approx([0.1, 0.2, 0.0, 0.05])
    assert proc.min_p_count == 3
    assert proc.min_p.shape == (4, 1)
    proc.check_invariants()


@pytest.mark.seed("001:R2", "001:10")
def test_min_p_unidirectional_move_onto_equal_value_clears_source():
    # Both rows hold the same min_p: the listing in the document skips the move (the
    # values compare equal) and leaves the source row set; ours empties it.
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(2, added=[added(0, min_p=0.1), added(1, min_p=0.1)]))
    proc.update_state(update(1, moved=[(1, 0, UNI)]))
    assert proc.min_p_cpu[:2].tolist() == pytest.approx([0.1, 0.0])
    assert proc.min_p_count == 1
    proc.check_invariants()


@pytest.mark.seed("001:10")
def test_min_p_swap_and_removal_keep_count():
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(3, added=[added(0, min_p=0.1), added(1), added(2, min_p=0.2)]))
    proc.update_state(update(3, moved=[(0, 1, SWAP)]))
    assert proc.min_p_cpu[:3].tolist() == pytest.approx([0.0, 0.1, 0.2])
    proc.update_state(update(2, removed=[2]))
    assert proc.min_p_count == 1 and proc.min_p.shape == (2, 1)
    proc.check_invariants()


@pytest.mark.seed("001:10")
def test_min_p_fast_path_returns_logits_untouched():
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(1, added=[added(0)]))
    logits = torch.tensor([[3.0, -20.0]])
    assert proc.apply(logits) is logits and torch.equal(logits, torch.tensor([[3.0, -20.0]]))


# ---- LogitBias (ch. 10.2, appendix S2) ----------------------------------------------------

@pytest.mark.seed("001:S2", "001:10")
def test_logit_bias_s2_index_tensors_and_apply():
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(3, added=[added(0, logit_bias={100: 0.5, 200: -0.3}), added(1), added(2, logit_bias={50: 1.0})]))
    assert proc.logits_slice[0].tolist() == [0, 0, 2]
    assert proc.logits_slice[1].tolist() == [100, 200, 50]
    assert proc.bias_tensor.tolist() == pytest.approx([0.5, -0.3, 1.0])
    logits = torch.zeros(3, 256)
    out = proc.apply(logits)
    expected = torch.zeros(3, 256)
    expected[0, 100], expected[0, 200], expected[2, 50] = 0.5, -0.3, 1.0
    assert torch.allclose(out, expected)


@pytest.mark.seed("001:10")
def test_logit_bias_follows_moves():
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(2, added=[added(0, logit_bias={3: 1.0}), added(1)]))
    proc.update_state(update(2, moved=[(0, 1, SWAP)]))
    out = proc.apply(torch.zeros(2, 5))
    assert out[1, 3].item() == 1.0 and out[0].abs().sum().item() == 0


# ---- MinTokens (ch. 10.3) ---------------------------------------------------------------

@pytest.mark.seed("001:10")
def test_min_tokens_masks_until_output_reaches_min_tokens():
    proc = MinTokensLogitsProcessor(CONFIG, CPU, False)
    out = [11]
    proc.update_state(update(2, added=[added(0, out, min_tokens=3, stop_token_ids=(2, 4)), added(1, stop_token_ids=(2,))]))
    logits = proc.apply(torch.zeros(2, 6))
    assert torch.isinf(logits[0]).tolist() == [False, False, True, False, True, False]
    assert not torch.isinf(logits[1]).any()
    out.append(12)  # 2 outputs < 3: still masked, no BatchUpdate needed
    proc.update_state(None)
    assert torch.isinf(proc.apply(torch.zeros(2, 6))[0, 2])
    out.append(13)  # 3 outputs: the live reference releases the mask
    proc.update_state(None)
    assert proc.min_toks == {}
    assert not torch.isinf(proc.apply(torch.zeros(2, 6))).any()


@pytest.mark.seed("001:10")
def test_min_tokens_apply_with_spec_decode_docstring_layout():
    # num_draft_tokens [2, 3, 1]: request 0 owns rows 0-1, request 1 rows 2-4, request 2 row 5.
    proc = MinTokensLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(update(3, added=[
        added(0, [1], min_tokens=2, stop_token_ids=(0,)),       # 1 more masked position
        added(1, [], min_tokens=5, stop_token_ids=(0, 3)),      # all 3 draft rows masked
        added(2, [], min_tokens=1, stop_token_ids=(3,)),        # its single row masked
    ]))
    logits = proc.apply_with_spec_decode(torch.zeros(6, 4), [2, 3, 1])
    masked = {(r, t) for r, t in zip(*torch.isinf(logits).nonzero(as_tuple=True)) for r, t in [(r.item(), t.item())]}
    assert masked == {(0, 0), (2, 0), (2, 3), (3, 0), (3, 3), (4, 0), (4, 3), (5, 3)}


# ---- adapter (ch. 12, appendix P) -----------------------------------------------------

class _Adapter(AdapterLogitsProcessor):
    """Requests with extra_args {"ban": tok} get a per-request callable."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if "ban" in args:
            ban = args["ban"]

            def two(output_ids, logits):
                logits[ban] = -math.inf  # in place
                logits[len(output_ids) % logits.shape[0]] += 1.0
                return logits

            return two
        if "prompt_len" in args:

            def three(prompt_ids, output_ids, logits):
                new = logits.clone()  # a new tensor: written back by the adapter
                new[0] = float(len(prompt_ids) + len(output_ids))
                return new

            return three
        return None


@pytest.mark.seed("001:12", "001:P")
def test_adapter_two_and_three_parameter_callables_see_live_lists():
    proc = _Adapter(CONFIG, CPU, False)
    out0, out1 = [], [7]
    proc.update_state(update(3, added=[
        added(0, out0, extra_args={"ban": 3}),
        added(1, out1, prompt=[1, 2, 3], extra_args={"prompt_len": True}),
        added(2),
    ]))
    assert set(proc.req_info) == {0, 1}
    logits = proc.apply(torch.zeros(3, 5))
    assert logits[0].tolist() == [1.0, 0.0, 0.0, -math.inf, 0.0]
    assert logits[1, 0].item() == 4.0  # 3 prompt + 1 output
    assert logits[2].abs().sum().item() == 0
    out0.append(9)
    out1.extend([8, 8])
    logits = proc.apply(torch.zeros(3, 5))
    assert logits[0, 1].item() == 1.0  # saw the new output length 1
    assert logits[1, 0].item() == 6.0


@pytest.mark.seed("001:12", "001:P")
def test_adapter_three_parameter_callable_without_prompt_raises():
    proc = _Adapter(CONFIG, CPU, False)
    with pytest.raises(ValueError, match="prompt token ids"):
        proc.update_state(update(1, added=[added(0, extra_args={"prompt_len": True})]))


@pytest.mark.seed("001:12")
def test_adapter_follows_moves():
    proc = _Adapter(CONFIG, CPU, False)
    proc.update_state(update(2, added=[added(0, extra_args={"ban": 1}), added(1)]))
    proc.update_state(update(1, removed=[0], moved=[(1, 0, UNI)]))
    assert proc.req_info == {}
