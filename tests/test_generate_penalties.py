"""The engine with penalties, bad words and allowed token ids, end to end on the tiny
models: greedy tokens equal a reference loop that runs transformers' model step by step
(float32, the whole sequence each step) and applies vLLM's rules to its logits by hand;
prefix caching, chunked prefill and preemption must not change them."""

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sample.bad_words import tokenize_bad_words

NEW_TOKENS = 10
PREFIX = [(37 * i + 11) % 500 + 5 for i in range(12)]
PROMPTS = [PREFIX + [300, 301, 302], PREFIX + [77, 78, 79, 80, 81], [401, 402, 403], PREFIX[:7], [9, 9, 9, 9]]
PENALTIES = [  # (presence, frequency, repetition), one per prompt
    (1.0, 0.0, 1.0),
    (0.0, 0.7, 1.0),
    (0.0, 0.0, 1.8),
    (-0.5, 0.4, 1.3),
    (0.0, 0.0, 1.0),  # no penalty: the batch mixes rows with and without
]
CONFIGS = {
    "prefix_caching": dict(block_size=4, max_model_len=64),
    "chunked_prefill": dict(block_size=4, max_model_len=64, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, max_model_len=32, num_gpu_blocks_override=10, max_num_seqs=4),
}


def reference(model, prompt, presence=0.0, frequency=0.0, repetition=1.0, bad_words=(), allowed=None, n=NEW_TOKENS):
    """Greedy tokens from transformers' logits with vLLM's rules applied by hand, in the
    sampler's order: allowed tokens, bad words (their prefix must end the output), then
    repetition over prompt and output, frequency per output occurrence, presence once."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()  # [V]
        if allowed is not None:
            kept = torch.full_like(logits, float("-inf"))
            kept[list(allowed)] = logits[list(allowed)]
            logits = kept
        for word in bad_words:
            prefix = list(word[:-1])
            if len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
                logits[word[-1]] = float("-inf")
        for tok in set(prompt) | set(out):
            logits[tok] = logits[tok] / repetition if logits[tok] > 0 else logits[tok] * repetition
        for tok in set(out):
            logits[tok] -= frequency * out.count(tok)
            logits[tok] -= presence
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return {
        family: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        for family, folder in tiny_model_dirs.items()
    }


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_with_penalties_matches_the_reference_loop(tiny_model_dirs, hf_models, family, config):
    llm = LLM(str(tiny_model_dirs[family]), device="cpu", attention_backend="reference", **CONFIGS[config])
    params = [greedy(presence_penalty=p, frequency_penalty=f, repetition_penalty=r) for p, f, r in PENALTIES]
    tokens = generate(llm, PROMPTS, params)
    model = hf_models[family]
    for prompt, (p, f, r), got in zip(PROMPTS, PENALTIES, tokens):
        assert got == reference(model, prompt, p, f, r), (prompt, p, f, r)
        if (p, f, r) != (0.0, 0.0, 1.0):  # the penalty really changed something
            assert got != reference(model, prompt), (prompt, p, f, r)
    if config == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool did not force a preemption"
    llm.engine.model_runner.input_batch.check_invariants()


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, block_size=4, attention_backend="reference")


def contains(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(seq)]) == seq for i in range(len(tokens) - len(seq) + 1))


def test_a_bad_word_bans_the_token_greedy_would_pick(qwen3, hf_models):
    tok = qwen3.get_tokenizer()
    prompt = tok("import os\nfor i in range").input_ids
    [plain] = generate(qwen3, [prompt], greedy())
    word = tok.decode([plain[0]]).strip()
    seqs = tokenize_bad_words(tok, [word])
    assert word and (plain[0],) in seqs, (word, seqs)  # the word's spaced form is greedy's first token
    [banned] = generate(qwen3, [prompt], greedy(bad_words=[word]))
    assert banned[0] != plain[0]
    assert not any(contains(banned, seq) for seq in seqs)
    assert banned == reference(hf_models["qwen3"], prompt, bad_words=seqs)


def test_a_two_token_bad_word_bans_its_second_token_after_its_first(qwen3, hf_models):
    tok = qwen3.get_tokenizer()
    prompt = tok("def main(self):").input_ids
    [plain] = generate(qwen3, [prompt], greedy())
    for a, b in zip(plain, plain[1:]):  # a pair greedy emits that is also a two-token word
        word = tok.decode([a, b]).strip()
        seqs = tokenize_bad_words(tok, [word]) if word else ()
        if (a, b) in seqs:
            break
    else:
        pytest.fail(f"no consecutive pair of {plain} tokenizes back to itself")
    [banned] = generate(qwen3, [prompt], greedy(bad_words=[word]))
    assert banned != plain
    assert not any(contains(banned, seq) for seq in seqs), (word, seqs, banned)
    assert banned == reference(hf_models["qwen3"], prompt, bad_words=seqs)


def test_allowed_token_ids_restrict_every_sampled_token(qwen3, hf_models):
    allowed = tuple(range(200, 230))
    greedy_tokens = generate(qwen3, PROMPTS[:3], greedy(allowed_token_ids=allowed))
    for prompt, got in zip(PROMPTS, greedy_tokens):
        assert got == reference(hf_models["qwen3"], prompt, allowed=allowed)
    drawn = generate(qwen3, PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True, allowed_token_ids=allowed))
    assert all(t in allowed for tokens in drawn + greedy_tokens for t in tokens)
    assert len({t for tokens in drawn for t in tokens}) > 3  # random rows really drew


def test_bad_words_need_the_engine_tokenizer_and_are_checked_before_queueing(qwen3):
    engine = LLMEngine(qwen3.engine.scheduler, qwen3.engine.model_executor, tokenizer=None, vocab_size=512)
    with pytest.raises(ValueError, match="bad_words.*tokenizer"):
        engine.add_request("x", [1, 2], greedy(bad_words=["w"]))
    assert not engine.has_unfinished_requests()
