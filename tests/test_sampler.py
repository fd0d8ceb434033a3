"""The sampler: order of operations, greedy / random rows, top-k / top-p, seeds, forcing."""

import pytest
import torch

from tinyvllm.config import EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.sampler import Sampler, SamplerOutput, apply_top_k_top_p, random_sample
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
V = 10


def make_batch(reasoning=None, max_num_reqs=8):
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=max_num_reqs))
    holder = ThinkingBudgetStateHolder(reasoning, max_num_reqs, 0, CPU, False) if reasoning else None
    return InputBatch(max_num_reqs, CPU, build_logitsprocs(config, CPU, False, False), holder)


def test_greedy_rows_take_argmax_after_non_argmax_invariant_processors():
    batch = make_batch()
    batch.add_request("bias", SamplingParams(temperature=0, logit_bias={7: 10.0}), None, [])
    batch.add_request("mint", SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(2,)), None, [])
    batch.add_request("plain", SamplingParams(temperature=0), None, [])
    batch.refresh()
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0
    out = Sampler()(logits, batch)
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids.tolist()[0] == 7 and out.sampled_token_ids.tolist()[2] == 2
    assert out.sampled_token_ids.tolist()[1] != 2  # EOS-like stop token held back
    assert logits[0, 7].item() == 0.0  # the caller's logits were not edited


def test_logits_are_cast_to_float32():
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0), None, [])
    batch.refresh()
    logits = torch.zeros(1, V, dtype=torch.bfloat16)
    logits[0, 4] = 1.0
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [4]


def test_row_count_mismatch_raises():
    batch = make_batch()
    batch.add_request("a", SamplingParams(), None, [])
    batch.refresh()
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(torch.zeros(2, V), batch)


def test_top_k_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3).log()
    out = apply_top_k_top_p(probs, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 1.0]))
    assert torch.isinf(out).tolist() == [[False, False, True, True], [False, False, True, True], [False] * 4]
    assert logits.shape == out.shape


def test_top_p_always_keeps_the_most_likely_token():
    out = apply_top_k_top_p(torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isinf(out).tolist() == [[False, True, True]]


def test_random_sample_follows_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.8, 0.2, 0.0]]).repeat(4000, 1)
    tokens = random_sample(probs, {})
    assert set(tokens.tolist()) <= {1, 2}
    assert 0.75 < (tokens == 1).float().mean().item() < 0.85


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    def run(others: int, position_first: bool) -> list[int]:
        batch = make_batch()
        mine = []
        if position_first:
            batch.add_request("mine", SamplingParams(temperature=1.0, seed=1234), None, mine)
        for i in range(others):
            batch.add_request(f"o{i}", SamplingParams(temperature=0.8), None, [])
        if not position_first:
            batch.add_request("mine", SamplingParams(temperature=1.0, seed=1234), None, mine)
        batch.refresh()
        row = batch.req_id_to_index["mine"]
        tokens = []
        for _ in range(6):
            tokens.append(Sampler()(torch.zeros(batch.num_reqs, V), batch).sampled_token_ids[row].item())
        return tokens

    alone = run(0, True)
    assert alone == run(3, False) == run(5, True)
    assert len(set(alone)) > 1  # uniform logits: it really is random


def test_min_p_applies_to_random_rows_only():
    batch = make_batch()
    batch.add_request("r", SamplingParams(temperature=1.0, min_p=0.5, seed=0), None, [])
    batch.refresh()
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0]])
    tokens = {Sampler()(logits, batch).sampled_token_ids.item() for _ in range(50)}
    assert tokens == {0, 1}


def test_thinking_budget_forcing_in_sampler_beats_greedy_and_random_rows():
    batch = make_batch(ReasoningConfig((1,), (2, 3)))
    greedy_out, random_out = [], []
    batch.add_request("g", SamplingParams(temperature=0, thinking_token_budget=1), [1], greedy_out)
    batch.add_request("r", SamplingParams(temperature=1.0, top_k=3, min_p=0.2, thinking_token_budget=0, seed=3), [1], random_out)
    logits = torch.zeros(2, V)
    logits[:, 5] = 8.0
    for _ in range(4):
        batch.refresh()
        tokens = Sampler()(logits, batch).sampled_token_ids.tolist()
        greedy_out.append(tokens[0])
        random_out.append(tokens[1])
    assert greedy_out == [5, 2, 3, 5]
    assert random_out[:2] == [2, 3]
