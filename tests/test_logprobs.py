"""Logprobs (``sample/logprobs.py``): the sampled token's logprob and rank plus the top k per
output token, ``prompt_logprobs`` per prompt token, and ``cumulative_logprob``, all from the
model's raw logits: checked against ``log_softmax`` of transformers' logits for the same
model and positions."""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.detokenizer import decode_text
from tinyvllm.outputs import Logprob
from tinyvllm.sample.logprobs import compute_logprobs, gather_logprobs, row_entries
from tinyvllm.sampling_params import MAX_LOGPROBS
from tinyvllm.sampling_params import RequestOutputKind

PROMPTS = [[(11 * i + 3) % 300 + 10 for i in range(n)] for n in (3, 9, 22)]
ATOL = 2e-4  # float32 on both sides; the two forward passes group the sums differently


def test_gather_logprobs_puts_the_chosen_token_first_with_its_rank():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 0.0, 1.0, -1.0]]), dim=-1)
    out = gather_logprobs(logprobs, torch.tensor([2, 0]), num_top=2)
    assert out.token_ids.tolist() == [[2, 1, 3], [0, 0, 2]]
    assert torch.allclose(out.logprobs[:, 0], logprobs[[0, 1], [2, 0]])
    assert out.ranks.tolist() == [3, 1]  # row 0: two tokens tie above it; row 1: the best
    assert row_entries(out, [0, 1]) == [
        ([2], [out.logprobs[0, 0].item()], 3),
        ([0, 0], out.logprobs[1, :2].tolist(), 1),
    ]
    tie = gather_logprobs(logprobs, torch.tensor([1, 0]), num_top=1)
    assert tie.ranks.tolist() == [2, 1]  # a tie shares the worse rank, as vLLM counts ">="
    assert (compute_logprobs(torch.zeros(1, 4)) == -math.log(4)).all()


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``ids``: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len(ids), V]


def make_llm(folder, **kw) -> LLM:
    return LLM(folder, device="cpu", max_model_len=64, block_size=4, **kw)


def check_position(entry: dict[int, Logprob], chosen: int, reference: torch.Tensor, k: int, tok) -> None:
    """One position's logprobs against transformers' ``reference`` ``[V]``."""
    assert abs(entry[chosen].logprob - reference[chosen].item()) < ATOL
    assert entry[chosen].rank == int((reference >= reference[chosen] - 1e-6).sum())
    top = reference.topk(k).indices.tolist()
    assert set(entry) == set(top) | {chosen}
    assert [entry[tid].rank for tid in top] == list(range(1, k + 1))
    for tid, lp in entry.items():
        assert lp.logprob <= 0 and abs(lp.logprob - reference[tid].item()) < ATOL
        assert lp.decoded_token == decode_text(tok, [tid], skip_special_tokens=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_logprobs_equal_transformers_log_softmax(folder, hf, temperature):
    llm = make_llm(folder)
    k = 3
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=6, ignore_eos=True, logprobs=k)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        reference = hf_logprobs(hf, prompt + completion.token_ids)
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, token, reference[len(prompt) + i - 1], k, tok)
            if temperature == 0:
                assert entry[token].rank == 1  # greedy takes the most likely token
        total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total)


@pytest.mark.parametrize("caching, budget", [(False, 8192), (True, 8), (True, 8192)])
def test_prompt_logprobs_equal_transformers_log_softmax(folder, hf, caching, budget):
    """Chunked prefills (a budget of 8) and a prompt whose blocks are cached by an earlier
    request both give every position's logprob: a request with ``prompt_logprobs`` computes
    its whole prompt, as vLLM's (it takes no prefix-cache hit)."""
    llm = make_llm(folder, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    prompt = PROMPTS[2]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)  # warms the cache when caching is on
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    reference = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        check_position(out.prompt_logprobs[p], prompt[p], reference[p - 1], 2, llm.get_tokenizer())
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_survive_a_preemption(folder, hf):
    """A request preempted after its prompt is done recomputes it without sending its prompt
    logprobs twice; one preempted halfway through its prompt still gets every position."""
    llm = make_llm(folder, num_gpu_blocks_override=17, max_num_batched_tokens=8, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    prompts = [PROMPTS[2], PROMPTS[2][::-1], PROMPTS[1] * 2]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        reference = hf_logprobs(hf, prompt)
        assert len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[p][prompt[p]].logprob - reference[p - 1, prompt[p]].item()) < ATOL


def test_delta_outputs_carry_the_logprobs_of_their_own_tokens(folder):
    llm = make_llm(folder)
    engine = llm.engine
    kinds = {"delta": RequestOutputKind.DELTA, "final": RequestOutputKind.FINAL_ONLY}
    for name, kind in kinds.items():
        engine.add_request(name, PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                            logprobs=1, output_kind=kind))  # fmt: skip
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "delta":
                assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
                deltas.extend(out.outputs[0].logprobs)
            else:
                final = out.outputs[0]
    assert len(deltas) == len(final.logprobs) == 5
    for mine, theirs in zip(deltas, final.logprobs):  # two rows of one batch: equal up to rounding
        assert {t: (lp.rank, lp.decoded_token) for t, lp in mine.items()} == {
            t: (lp.rank, lp.decoded_token) for t, lp in theirs.items()
        }
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-5 for t in mine)


def test_too_many_logprobs_are_refused(folder):
    llm = make_llm(folder)
    for field in ("logprobs", "prompt_logprobs"):
        params = SamplingParams(max_tokens=2, **{field: MAX_LOGPROBS + 1})
        with pytest.raises(ValueError, match=f"{field}.*{MAX_LOGPROBS + 1}.*{MAX_LOGPROBS}"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("cap, asked", [(30, 30), (-1, 100)])
def test_max_logprobs_raises_the_cap_as_vllms_engine_argument(folder, cap, asked):
    """``LLM(max_logprobs=...)``, vLLM's engine argument (20 by default, -1 for no cap): a
    request may ask for that many, and gets them; the engine-level check follows it too."""
    llm = LLM(folder, device="cpu", max_model_len=64, block_size=4, max_logprobs=cap)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=asked, prompt_logprobs=asked)
    [out] = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    assert all(asked <= len(entry) <= asked + 1 for entry in out.outputs[0].logprobs)
    assert all(asked <= len(entry) <= asked + 1 for entry in out.prompt_logprobs[1:])
    llm.engine.add_request("direct", PROMPTS[0], params)  # LLMEngine.add_request checks it the same way
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    if cap != -1:
        with pytest.raises(ValueError, match=f"logprobs={cap + 1}, more than this engine's max_logprobs {cap}"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(logprobs=cap + 1), use_tqdm=False)


def test_minus_one_asks_for_the_whole_vocabulary(folder):
    """As vLLM: ``logprobs=-1`` (and ``prompt_logprobs=-1``) is every token of the
    vocabulary, which the default cap of 20 refuses and ``max_logprobs=-1`` allows."""
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 512 tokens\), more than this engine's max_logprobs 20"):
        make_llm(folder).generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    llm = make_llm(folder, max_logprobs=-1)
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    vocab = llm.spec.vocab_size
    for entry in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert len(entry) == vocab and sorted(x.rank for x in entry.values()) == list(range(1, vocab + 1))
        assert math.isclose(sum(math.exp(x.logprob) for x in entry.values()), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("bad, error", [(-2, ValueError), (True, TypeError), (1.5, TypeError)])
def test_max_logprobs_is_checked_at_start_up(folder, bad, error):
    with pytest.raises(error, match=f"max_logprobs must be an int.*{bad}"):
        LLM(folder, device="cpu", max_model_len=64, block_size=4, max_logprobs=bad)


def test_a_batch_that_asks_no_logprobs_computes_none(folder, monkeypatch):
    """NOTE 1 of ``sample/logprobs.py``: no log_softmax, no top-k, no prompt logits."""
    import tinyvllm.sample.logprobs as module

    calls = []
    real = module.compute_logprobs
    monkeypatch.setattr(module, "compute_logprobs", lambda logits: calls.append(logits.shape) or real(logits))
    llm = make_llm(folder)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=3), use_tqdm=False)
    assert calls == []
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, logprobs=0), SamplingParams(max_tokens=3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert calls and all(shape[0] == 1 for shape in calls)  # only the row that asked
    assert [o.outputs[0].logprobs is None for o in outs] == [True, False, True]
    assert all(len(entry) == 1 for entry in outs[1].outputs[0].logprobs)  # logprobs=0: the chosen token alone
